"""``graph_decode``: a compressed cache's decoding step replayed as one CUDA graph, against ``DynamicCache``.

    python -m kvcompress.bench.graph_decode --model DIR --random-weights --device cuda --dtype bfloat16 \\
        [--methods h2o,tova] [--prompts 2048] [--out DIR]

A decoding step of a small model on a GPU is launch-bound (``docs/results/performance.md``, section 0b): each
operation the cache adds costs a kernel launch. ``kvcompress.decode_graph.DecodeGraph`` replays the whole step as a
CUDA graph once the cache is at its budget. For each method and prompt this prints two rows built like ``speed``'s
decode section (budget, chunked prefill, a ``DynamicCache`` holding the same tokens, cropped back after each step,
the two sides interleaved call by call): ``graphed`` (our step replayed) and ``eager`` (our step as ``speed``
times it, in the same process for reference). A call ends with ``torch.cuda.synchronize``, so its wall time is the
device's; ``--capture trace`` replays ``make_fx`` traces instead (any device: a check of the mechanics, not a
speed path).
"""

from __future__ import annotations

import argparse
import gc
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

import kvcompress
from kvcompress.bench.common import bench_cache, load_bench_model, random_prompt, set_threads, touch_weights
from kvcompress.bench.model_cli import int_list, method_names, publish
from kvcompress.bench.pairs import timed_pairs
from kvcompress.bench.speed import RATIO_COLUMNS, dynamic_prefill
from kvcompress.bench.table import markdown_table, partial_writer
from kvcompress.decode_graph import GRAPHED_METHODS, DecodeGraph, greedy_decode
from kvcompress.generation import cache_argument, prefill

logger = logging.getLogger(__name__)
Row = dict[str, object]
METHODS = ("streaming", "window", "h2o", "tova", "knorm", "random", "scissorhands")
Step = Callable[[int], object]


def graph_rows(
    model: PreTrainedModel, method: str, prompt: int, budget: int, steps: int, chunk: int, seed: int, capture: str
) -> list[Row]:
    """``method`` after a ``prompt``-token prefill: our step replayed, and eager, against ``DynamicCache``."""
    rows = []
    for mode in ("graphed", "eager"):
        ids = random_prompt(model, prompt + 2 * steps + 16, seed)
        ours, held = _our_step(model, method, ids, prompt, budget, chunk, capture if mode == "graphed" else None)
        theirs, after = _dynamic_step(model, ids, held, chunk)
        result = timed_pairs(model, ours, theirs, steps, after_theirs=after)
        row = {"section": "graph", "method": method, "mode": mode, "prompt": prompt}
        rows.append({**row, "budget": budget, "stored_tokens": held, **result})
        del ours, theirs, after
        gc.collect()
    return rows


def _our_step(
    model: PreTrainedModel, method: str, ids: torch.Tensor, prompt: int, budget: int, chunk: int, capture: str | None
) -> tuple[Step, int]:
    """A decoding step of ``method`` through ``DecodeGraph`` (``capture=None``: eager), already captured; the tokens
    it holds."""
    cache = bench_cache(model, method, budget)
    prefill(model, ids[:, :prompt], cache, chunk_size=chunk)
    graph = DecodeGraph(model, cache, capture)
    seen = [cache.get_seq_length()]  # counted here: reading the cache's between replays would wait for the device

    def step(_: int) -> torch.Tensor:
        position, seen[0] = seen[0], seen[0] + 1
        return graph(ids[:, position : position + 1], torch.full((ids.shape[0], 1), position, device=model.device))

    for _ in range(8):  # until the cache's step repeats and is captured
        if capture is None or graph.replay is not None:
            break
        step(0)
    if capture is not None and graph.replay is None:
        raise RuntimeError(f"{method}: the decoding step was not captured")
    return step, max(cache.tokens_stored())


def _dynamic_step(model: PreTrainedModel, ids: torch.Tensor, held: int, chunk: int) -> tuple[Step, Callable[[], None]]:
    """An eager ``DynamicCache`` step holding ``held`` tokens (cropped back after each step: ``after``)."""
    dynamic = DynamicCache(config=model.config)
    dynamic_prefill(model, ids[:, :held], dynamic, chunk)
    kvcompress.prepare_model(model)

    def step(i: int) -> object:
        return model(input_ids=ids[:, held + i : held + i + 1], **cache_argument(model, dynamic), use_cache=True)

    return step, lambda: dynamic.crop(held - dynamic.get_seq_length())


def generate_row(
    model: PreTrainedModel, method: str, prompt: int, batch: int, budget: int, new_tokens: int, chunk: int, args
) -> Row:
    """Greedy decoding of ``new_tokens`` after a ``prompt``-token prompt end to end (prefill included): ours through
    ``greedy_decode`` (chunked prefill, steps replayed) against ``model.generate`` with a ``DynamicCache``."""
    ids = random_prompt(model, prompt, args.seed).expand(batch, -1).contiguous()

    def ours(_: int) -> torch.Tensor:
        cache = bench_cache(model, method, budget)
        return greedy_decode(model, cache, ids, new_tokens, chunk_size=chunk, capture=args.capture)

    def theirs(_: int) -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        limits = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
        return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_argument(model, cache), **limits)

    result = timed_pairs(model, ours, theirs, args.rounds)
    row = {"section": "generate", "method": method, "prompt": prompt, "batch": batch, "budget": budget}
    return {**row, "tokens_per_s_ratio": 1 / result["wall_ratio"], **result}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.bench.graph_decode", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name, local path or HF id")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"among {', '.join(sorted(GRAPHED_METHODS))}")
    parser.add_argument("--budget", type=int, default=512, help="tokens per layer and KV head (decode rows)")
    parser.add_argument("--prompts", default="2048,8192", help="prompt lengths (decode rows)")
    parser.add_argument("--steps", type=int, default=24, help="timed decode pairs per row")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--generate-methods", default="streaming,h2o", help="end-to-end rows (empty: none)")
    parser.add_argument("--generate-prompts", default="1024,4096")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--generate-budget", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="timed end-to-end pairs per row")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="where the model runs")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--capture", default="cuda", choices=("cuda", "trace"), help="trace: make_fx, any device")
    parser.add_argument("--random-weights", action="store_true", help="--model: a folder with a config.json")
    parser.add_argument("--out", type=Path, default=None, help="folder for graph_decode.json/.md (+ partial .jsonl)")
    args = parser.parse_args(argv)
    methods, generate_methods = method_names(args.methods), method_names(args.generate_methods)
    unknown = sorted(set(methods + generate_methods) - GRAPHED_METHODS)
    if unknown:
        allowed = ", ".join(sorted(GRAPHED_METHODS))
        parser.error(f"--methods / --generate-methods: {', '.join(unknown)} cannot be replayed; allowed: {allowed}")
    if args.capture == "cuda" and not args.device.startswith("cuda"):
        parser.error(f"--capture cuda needs --device cuda, got --device {args.device} (use --capture trace)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    set_threads(args.threads)
    model, _ = load_bench_model(args.model, args.device, args.dtype, args.random_weights)
    touch_weights(model)
    kvcompress.prepare_model(model)
    jobs: list[Callable[[], list[Row]]] = [
        lambda m=m, p=p: graph_rows(model, m, p, args.budget, args.steps, args.chunk, args.seed, args.capture)
        for p in int_list(args.prompts)
        for m in methods
    ]
    jobs += [
        lambda m=m, p=p, b=b: [generate_row(model, m, p, b, args.generate_budget, args.new_tokens, args.chunk, args)]
        for p in int_list(args.generate_prompts)
        for b in int_list(args.batches)
        for m in generate_methods
    ]
    on_row, rows = partial_writer(args.out, "graph_decode"), []
    with torch.no_grad():  # the mode generate runs in (inference_mode spares small ops more)
        for job in jobs:
            for row in job():
                logger.info("%s", {k: v for k, v in row.items() if k in LOGGED})
                rows.append(row)
                if on_row is not None:
                    on_row(row)
            gc.collect()
    publish("graph_decode", args, rows, graph_tables(rows), lambda path, machine: None)


LOGGED = ("section", "method", "mode", "prompt", "batch", "cpu_ratio", "wall_ratio")


def graph_tables(rows: Sequence[Row]) -> str:
    """The decode rows, then the end-to-end rows."""
    decode = [row for row in rows if row["section"] == "graph"]
    generate = [row for row in rows if row["section"] == "generate"]
    parts = []
    if decode:
        columns = (("method", "method", ""), ("mode", "ours", ""), ("prompt", "prompt", "d"))
        columns += (("stored_tokens", "tokens held", "d"),)
        parts.append(markdown_table(decode, (*columns, *RATIO_COLUMNS)))
    if generate:
        columns = (("method", "method", ""), ("prompt", "prompt", "d"), ("batch", "batch", "d"))
        columns += (("tokens_per_s_ratio", "tokens/s × DynamicCache (wall)", ".2f"),)
        parts.append(markdown_table(generate, (*columns, *RATIO_COLUMNS)))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
