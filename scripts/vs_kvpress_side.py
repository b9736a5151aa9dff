"""The kvpress side of the side-by-side comparison (docs/vs-kvpress.md). Runs in the kvpress environment.

    /work/kvpress-venv/bin/python scripts/vs_kvpress_side.py runs/vs-kvpress/samples.json runs/vs-kvpress/kvpress.jsonl

Reads the samples and budgets written by ``python -m experiments.compare samples`` (token ids, answers, the local
model directory), and for every sample x press x budget: prefills the context under ``with press(model)`` the
way ``KVPressTextGenerationPipeline._forward`` does (``model.model(input_ids=context_ids, past_key_values=cache)``,
one forward, compression in the layers' forward hooks), records the CPU and wall time of that prefill, the kept
context indices of every layer and KV head, then answers with the pipeline's own ``generate_answer`` (question fed
at its original positions after the compressed context, greedy decoding). One JSON row per evaluation, appended;
a rerun skips the rows already written. It never imports kvcompress: kvpress 0.5.5 pins transformers < 5.3.

Budget -> kvpress ratio: kvpress keeps ``int(k_len * (1 - compression_ratio))`` context tokens; we pass
``compression_ratio = 1 - (budget + 0.5) / k_len`` so that the truncation lands on ``budget`` exactly (a plain
``1 - budget / k_len`` can land on ``budget - 1`` by floating-point rounding). The kept count is checked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# Press name -> (class name in kvpress, constructor keywords other than compression_ratio, attention implementation)
PRESSES = {
    "StreamingLLMPress": ("StreamingLLMPress", {}, "sdpa"),
    "SnapKVPress": ("SnapKVPress", {}, "sdpa"),
    "TOVAPress": ("TOVAPress", {}, "sdpa"),
    "KnormPress": ("KnormPress", {}, "sdpa"),
    "ObservedAttentionPress": ("ObservedAttentionPress", {}, "eager"),  # needs the attention weights
}


def kvpress_ratio(budget: int, context_tokens: int) -> float:
    """The compression_ratio that makes kvpress keep exactly ``budget`` of ``context_tokens`` tokens."""
    if not 1 <= budget < context_tokens:
        raise ValueError(f"budget must be in [1, context_tokens - 1] = [1, {context_tokens - 1}], got {budget}")
    return 1.0 - (budget + 0.5) / context_tokens


def read_done(path: Path) -> set[str]:
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            done.add(json.dumps([row["sample"], row["method"], row["budget"]]))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("samples", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--presses", default=",".join(PRESSES), help="comma-separated; 'full' is always run")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import kvpress
    import transformers
    from kvpress.utils import compute_n_kept
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    spec = json.loads(args.samples.read_text())
    model_dir = spec["model_dir"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    models = {
        impl: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=impl).eval()
        for impl in ("sdpa", "eager")
    }
    pipes = {impl: pipeline("kv-press-text-generation", model=m, tokenizer=tokenizer) for impl, m in models.items()}
    presses = [p for p in args.presses.split(",") if p]
    for name in presses:
        if name not in PRESSES:
            raise ValueError(f"--presses must be drawn from {', '.join(PRESSES)}; got {name!r}")
    done = read_done(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {
        "kvpress": getattr(kvpress, "__version__", "0.5.5"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    jobs = [(s, "full", None) for s in spec["samples"]]
    jobs += [(s, p, b) for s in spec["samples"] for b in spec["budgets"] for p in presses]
    todo = [j for j in jobs if json.dumps([j[0]["id"], j[1], j[2]]) not in done]
    print(f"{len(jobs)} evaluations, {len(jobs) - len(todo)} already in {args.out}", flush=True)
    with args.out.open("a") as handle:
        for number, (sample, name, budget) in enumerate(todo, 1):
            context = torch.tensor([sample["context_ids"]])
            question = torch.tensor([sample["question_ids"]])
            k_len = context.shape[1]
            impl = "sdpa" if name == "full" else PRESSES[name][2]
            model, pipe = models[impl], pipes[impl]
            kept: dict[int, list[list[int]]] = {}
            press, ratio = None, None
            if name != "full":
                ratio = kvpress_ratio(budget, k_len)
                class_name, kwargs, _ = PRESSES[name]
                press = getattr(kvpress, class_name)(compression_ratio=ratio, **kwargs)
                score = press.score  # record what ScorerPress.compress keeps: the top n_kept scores

                def recording_score(module, hidden_states, keys, *rest, _score=score, _ratio=ratio, _kept=kept):
                    scores = _score(module, hidden_states, keys, *rest)
                    n_kept = compute_n_kept(keys.shape[2], _ratio)
                    top = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
                    _kept[module.layer_idx] = top[0].tolist()
                    return scores

                press.score = recording_score
            cache = DynamicCache()
            cpu, wall = time.process_time(), time.perf_counter()
            with torch.no_grad():
                if press is None:
                    model.model(input_ids=context, past_key_values=cache)
                else:
                    with press(model):
                        model.model(input_ids=context, past_key_values=cache)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            stored = [cache.get_seq_length(i) for i in range(len(cache))]
            if press is not None and set(stored) != {budget}:
                raise RuntimeError(f"{name} kept {sorted(set(stored))} tokens, expected the budget {budget}")
            with torch.no_grad():
                text = pipe.generate_answer(
                    question_ids=question,
                    cache=cache,
                    context_length=k_len,
                    max_new_tokens=sample["max_new_tokens"],
                )
            row = {
                "side": "kvpress",
                "sample": sample["id"],
                "method": name,
                "budget": budget,
                "compression_ratio": ratio,
                "context_tokens": k_len,
                "stored": stored[0],
                "prefill_cpu_s": round(cpu, 4),
                "prefill_wall_s": round(wall, 4),
                "prediction": text,
                "kept": [kept[i] for i in sorted(kept)] if kept else None,
                "env": env,
            }
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            print(f"[{number}/{len(todo)}] {sample['id']} {name} {budget}: {text!r} cpu {cpu:.2f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
