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
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

import kvcompress
from kvcompress.bench.common import load_bench_model, random_prompt, set_threads, touch_weights
from kvcompress.bench.model_cli import int_list, method_names, publish
from kvcompress.bench.speed import RATIO_COLUMNS, bench_params, dynamic_prefill, timed_pairs
from kvcompress.bench.table import markdown_table, partial_writer
from kvcompress.decode_graph import GRAPHED_METHODS, DecodeGraph
from kvcompress.generation import cache_argument, prefill

logger = logging.getLogger(__name__)
Row = dict[str, object]
METHODS = ("window", "h2o", "tova", "knorm", "random")


def graph_rows(
    model: PreTrainedModel, method: str, prompt: int, budget: int, steps: int, chunk: int, seed: int, capture: str
) -> list[Row]:
    """The ``graphed`` and ``eager`` rows of ``method`` after a ``prompt``-token prefill."""
    rows = []
    for mode in ("graphed", "eager"):
        ids = random_prompt(model, prompt + 2 * steps + 16, seed)
        cache = kvcompress.cache_for(model, method, **bench_params(method, budget))
        prefill(model, ids[:, :prompt], cache, chunk_size=chunk)
        graph = DecodeGraph(model, cache, capture if mode == "graphed" else None)
        held = max(cache.tokens_stored())
        dynamic = DynamicCache(config=model.config)
        dynamic_prefill(model, ids[:, :held], dynamic, chunk)
        kvcompress.prepare_model(model)

        def ours(_: int, graph=graph, cache=cache, ids=ids) -> torch.Tensor:
            seen = cache.get_seq_length()
            position = torch.full((ids.shape[0], 1), seen, device=model.device)
            return graph(ids[:, seen : seen + 1], position)

        def theirs(i: int, dynamic=dynamic, ids=ids) -> torch.Tensor:
            return model(
                input_ids=ids[:, prompt + i : prompt + i + 1], **cache_argument(model, dynamic), use_cache=True
            )

        for _ in range(8):  # reach the capture (a few steps until the cache's step repeats)
            if mode == "eager" or graph.replay is not None:
                break
            ours(0)
        if mode == "graphed" and graph.replay is None:
            raise RuntimeError(f"{method}: the decoding step was not captured")
        result = timed_pairs(
            model, ours, theirs, steps, after_theirs=lambda d=dynamic, h=held: d.crop(h - d.get_seq_length())
        )
        rows.append(
            {
                "section": "graph",
                "method": method,
                "mode": mode,
                "prompt": prompt,
                "budget": budget,
                "stored_tokens": held,
                **result,
            }
        )
        del graph, cache, dynamic
        gc.collect()
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.bench.graph_decode", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name, local path or HF id")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"among {', '.join(sorted(GRAPHED_METHODS))}")
    parser.add_argument("--budget", type=int, default=512, help="tokens per layer and KV head")
    parser.add_argument("--prompts", default="2048,8192", help="prompt lengths")
    parser.add_argument("--steps", type=int, default=24, help="timed decode pairs per row")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="where the model runs")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--capture", default="cuda", choices=("cuda", "trace"), help="trace: make_fx, any device")
    parser.add_argument("--random-weights", action="store_true", help="--model: a folder with a config.json")
    parser.add_argument("--out", type=Path, default=None, help="folder for graph_decode.json/.md (+ partial .jsonl)")
    args = parser.parse_args(argv)
    unknown = sorted(set(method_names(args.methods)) - GRAPHED_METHODS)
    if unknown:
        parser.error(
            f"--methods: {', '.join(unknown)} cannot be replayed; allowed: {', '.join(sorted(GRAPHED_METHODS))}"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    set_threads(args.threads)
    model, _ = load_bench_model(args.model, args.device, args.dtype, args.random_weights)
    touch_weights(model)
    kvcompress.prepare_model(model)
    on_row, rows = partial_writer(args.out, "graph_decode"), []
    with torch.inference_mode():
        for prompt in int_list(args.prompts):
            for method in method_names(args.methods):
                for row in graph_rows(
                    model, method, prompt, args.budget, args.steps, args.chunk, args.seed, args.capture
                ):
                    logger.info("%s", {k: row[k] for k in ("method", "mode", "prompt", "cpu_ratio", "wall_ratio")})
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    columns = (
        ("method", "method", ""),
        ("mode", "ours", ""),
        ("prompt", "prompt", "d"),
        ("stored_tokens", "tokens held", "d"),
    )
    publish("graph_decode", args, rows, markdown_table(rows, (*columns, *RATIO_COLUMNS)), lambda path, machine: None)


if __name__ == "__main__":
    main()
