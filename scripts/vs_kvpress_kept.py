"""The kvpress side of the kept-set comparison of the one-shot scorers and allocations (docs/results/frontier.md).
Runs in the kvpress environment (scripts/vs_kvpress_env.sh).

    /work/kvpress-venv/bin/python scripts/vs_kvpress_kept.py runs/frontier/samples.json runs/frontier/kvpress.jsonl

Reads the samples written by ``python -m experiments.compare samples`` (token ids of contexts with their chat header,
the local model directory) and for every sample x press prefills the context under ``with press(model)`` the way
kvpress's pipeline does (``model.model(input_ids=context_ids, past_key_values=cache)``; KVzip's press then runs its
reconstruction when the block ends) at ``compression_ratio`` 0.5, and writes the kept context indices of every layer
and KV head: for presses that gather (scorers, PyramidKV) by matching the cache's keys to a full prefill's keys (a
gather copies them exactly); for presses that only mask (AdaKV, KVzip) from the indices they mask
(``module.masked_key_indices``). CompactorPress's random sketch is made the one kvcompress draws by seeding PyTorch's
generator before each layer (``seed_layers``). One JSON row per (sample, press). It never imports kvcompress.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

RATIO = 0.5


def presses(kvpress):
    """Name -> a fresh press at compression_ratio 0.5 (kvpress's defaults otherwise)."""
    return {
        "KeyDiffPress": lambda: kvpress.KeyDiffPress(compression_ratio=RATIO),
        "ExpectedAttentionPress": lambda: kvpress.ExpectedAttentionPress(compression_ratio=RATIO),
        "AdaKVPress(ExpectedAttentionPress)": lambda: kvpress.AdaKVPress(
            kvpress.ExpectedAttentionPress(compression_ratio=RATIO)
        ),
        "SnapKVPress": lambda: kvpress.SnapKVPress(compression_ratio=RATIO),
        "AdaKVPress(SnapKVPress)": lambda: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=RATIO)),
        "PyramidKVPress": lambda: kvpress.PyramidKVPress(compression_ratio=RATIO),
        "KVzipPress": lambda: kvpress.KVzipPress(compression_ratio=RATIO),
        "KVzipPress(layerwise=True)": lambda: kvpress.KVzipPress(compression_ratio=RATIO, layerwise=True),
        "CompactorPress": lambda: kvpress.CompactorPress(compression_ratio=RATIO),
        "AdaKVPress(CompactorPress)": lambda: kvpress.AdaKVPress(kvpress.CompactorPress(compression_ratio=RATIO)),
    }


def seed_layers(model, seed: int) -> list:
    """Forward pre-hooks seeding PyTorch's global generator with ``seed + i`` before layer ``i``'s attention, so
    CompactorPress's Gaussian sketch (drawn from it in the press's hook) is the one kvcompress's ``compactor`` draws
    for layer ``i`` (``torch.randn(H_kv, d, k)`` from a generator seeded ``seed + i``); nothing else in a forward
    draws random numbers."""
    handles = []
    for index, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_pre_hook(partial(reseed, seed + index)))
    return handles


def reseed(seed: int, *_) -> None:
    torch.manual_seed(seed)  # (a pre-hook returning something would replace the module's inputs)


def kept_by_keys(cache, full: list[torch.Tensor]) -> list[list[list[int]]]:
    """``[layer][head]`` indices of the full prefill's keys that the compressed cache holds."""
    kept = []
    for index, reference in enumerate(full):
        keys = cache.layers[index].keys[0]  # [H, n, d]
        match = (keys[:, :, None, :] == reference[0][:, None, :, :]).all(-1)  # [H, n, L]
        if not bool(match.any(-1).all()):
            raise RuntimeError(f"layer {index}: a kept key matches no key of the full prefill")
        kept.append([sorted(row.tolist()) for row in match.float().argmax(-1)])
    return kept


def kept_by_masks(model, length: int) -> list[list[list[int]]]:
    """``[layer][head]`` indices a masking press left unmasked (and the masks removed for the next run)."""
    kept = []
    heads = model.config.num_key_value_heads
    for layer in model.model.layers:
        module = layer.self_attn
        masked = getattr(module, "masked_key_indices", None)
        hidden = [set() for _ in range(heads)]
        if masked is not None:
            for _, head, position in zip(*(t.tolist() for t in masked), strict=True):
                hidden[head].add(position)
            module.masked_key_indices = None
        kept.append([[t for t in range(length) if t not in hidden[h]] for h in range(heads)])
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("samples", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--presses", default=None, help="comma-separated press names (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="CompactorPress's sketch seed (see seed_layers)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    spec = json.loads(args.samples.read_text())
    model_dir = spec["model_dir"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # KVzip's prefix: the chat header before the context, found as KVzipPress finds it (recorded for the other side)
    marker, separator = "dummy context", "\n" + "#" * len("dummy context")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker + separator}], add_generation_prompt=True, tokenize=False
    )
    prefix = len(tokenizer.encode(text.split(separator)[0].split(marker)[0], add_special_tokens=False))
    wanted = None if args.presses is None else set(args.presses.split(","))
    env = {"kvpress": "0.5.5", "transformers": transformers.__version__, "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as handle, torch.no_grad():
        for sample in spec["samples"]:
            context = torch.tensor([sample["context_ids"]])
            full = DynamicCache()
            model.model(input_ids=context, past_key_values=full)
            full_keys = [layer.keys.clone() for layer in full.layers]
            for name, make in presses(kvpress).items():
                if wanted is not None and name not in wanted:
                    continue
                cache = DynamicCache()
                handles = seed_layers(model, args.seed) if "Compactor" in name else []
                with make()(model):
                    model.model(input_ids=context, past_key_values=cache)
                for hook in handles:
                    hook.remove()
                masking = name.startswith(("AdaKV", "KVzip"))
                kept = kept_by_masks(model, context.shape[1]) if masking else kept_by_keys(cache, full_keys)
                row = {"sample": sample["id"], "press": name, "ratio": RATIO, "context_tokens": context.shape[1]}
                row |= {"kvzip_prefix": prefix, "kept": kept, "env": env}
                handle.write(json.dumps(row) + "\n")
                handle.flush()
                print(f"{sample['id']} {name}: {sum(map(len, kept[0]))} kept in layer 0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
