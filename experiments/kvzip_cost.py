"""A one-shot method's prefill and compression against a full prefill, CPU time, interleaved in one process.

    python -m experiments.kvzip_cost --tokens 1024 --reps 3
    python -m experiments.kvzip_cost --model DIR --random-weights --device cuda --dtype bfloat16 --tokens 8192 \
        --methods kvzip:ratio=0.5 --block-mib 64 512
    python -m experiments.kvzip_cost --tokens 1024 --reps 3 --methods keydiff:ratio=0.5 snapkv:ratio=0.5
    python -m experiments.kvzip_cost --tokens 1024 --reps 5 --attention
    python -m experiments.kvzip_cost --tokens 1024 --reps 5 --attention --block-mib 8 1

A book shipped with the package (its first ``--tokens`` tokens) is prefilled into a full cache and into each of
``--methods`` (``method:key=value,...`` each; default KVzip at ratio 0.5, pair level and head level) in turn,
``--reps`` times, one torch thread, under ``torch.no_grad`` as ``generate`` runs, in one forward (``prefill``'s
default); prints each run's wall and CPU seconds (after one untimed full prefill) and each method's ratio of the CPU
medians. On a CUDA device each run ends with ``torch.cuda.synchronize()`` and the ratio is of the wall-time medians
(the host's CPU time is not the device's); ``--random-weights`` takes a folder holding the model's ``config.json``
and its tokenizer (KVzip's reconstruction prompt is tokenized), the weights drawn at random (a run's time depends on
the shapes, not the weights). Without ``--attention``, several ``--block-mib`` sizes time each KVzip spec once per
size (``kvcompress.methods.kvzip.reconstruct.BLOCK_BYTES``, ``GPU_BLOCK_BYTES`` on a GPU).

``--attention`` instead times the attention alone, summed over the layers, on the model's own activations: each
layer's reconstruction inputs are recorded during one KVzip prefill (its queries, the stored context's keys and
values, its own keys and values), then, interleaved ``--reps`` times, the prefill's attention of that layer (PyTorch's
fused kernel, causal over the context: the queries' last ``tokens`` rows against the context) and the
reconstruction's attention with its scores (``score_chunk``; the last layer scores only, as in the forward); prints
the CPU-time medians and a full prefill's for scale. ``--block-mib`` times the reconstruction's attention at each
of these sizes of its block of logits (``kvcompress.methods.kvzip.reconstruct.BLOCK_BYTES``, in MiB), in turn.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import types

import torch
from transformers import AutoTokenizer

import kvcompress
import kvcompress.methods.kvzip as kvzip_method
import kvcompress.methods.kvzip.reconstruct as reconstruct
from kvcompress.bench.common import load_bench_model
from kvcompress.eval.data import gutenberg_books
from kvcompress.generation import prefill
from kvcompress.methods.kvzip.reconstruct import score_chunk
from kvcompress.models import load_model
from kvcompress.params import parse_method_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--attention", action="store_true", help="time the attention alone, summed over layers")
    parser.add_argument(
        "--block-mib",
        type=float,
        nargs="+",
        default=[reconstruct.BLOCK_BYTES / 2**20],
        help="the reconstruction's block of logits, MiB (several: each timed in turn)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--random-weights", action="store_true", help="--model: a folder with config and tokenizer")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["kvzip:ratio=0.5", "kvzip:ratio=0.5,level=head"],
        help="method specs (method:key=value,...)",
    )
    args = parser.parse_args()
    try:
        specs = {spec: parse_method_spec(spec) for spec in args.methods}
    except ValueError as error:
        parser.error(f"--methods: {error}")
    if args.attention and args.device != "cpu":
        parser.error(f"--attention: times PyTorch's CPU attention kernel, so needs --device cpu, got {args.device!r}")
    torch.set_num_threads(1)
    if args.random_weights:
        model, _ = load_bench_model(args.model, args.device, args.dtype, random_weights=True)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        model, tokenizer = load_model(args.model, args.dtype)
        model = model.to(args.device)
    text = " ".join(" ".join(book.text.split()) for book in gutenberg_books()[1:]).split()
    ids = tokenizer(" ".join(text[: args.tokens]), return_tensors="pt").input_ids[:, : args.tokens].to(model.device)
    if ids.shape[1] < args.tokens:
        parser.error(f"--tokens: the shipped books give {ids.shape[1]} tokens, got {args.tokens}")
    cuda = model.device.type == "cuda"

    def run(method: str, block: float | None = None, **params: object) -> tuple[float, float]:
        cache = kvcompress.cache_for(model, method, **params)
        setattr(reconstruct, block_name, int((block or default_block) * 2**20))
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            prefill(model, ids, cache)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - wall, time.process_time() - cpu

    block_name = "BLOCK_BYTES" if model.device.type == "cpu" else "GPU_BLOCK_BYTES"  # (query_block's)
    default_block = getattr(reconstruct, block_name) / 2**20
    if args.attention:
        attention(model, ids, args.reps, run, args.block_mib)
        return
    jobs: dict[str, tuple[str, float | None, dict]] = {"full": ("full", None, {})}
    for spec, (method, params) in specs.items():
        blocks = args.block_mib if method == "kvzip" and len(args.block_mib) > 1 else [None]
        for block in blocks:
            jobs[spec + ("" if block is None else f" ({block:g} MiB blocks)")] = (method, block, params)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in jobs}
    run("full")  # warm-up, not counted (the first forward of a process is slower)
    try:
        for _ in range(args.reps):
            for name, (method, block, params) in jobs.items():
                runs[name].append(run(method, block, **params))
    finally:
        setattr(reconstruct, block_name, int(default_block * 2**20))
    for name, times in runs.items():
        print(name, "wall", [round(w, 3) for w, _ in times], "cpu", [round(c, 3) for _, c in times])
    clock = 0 if cuda else 1  # on a GPU the wall time (each run synchronised); on a CPU the CPU time
    full = statistics.median(t[clock] for t in runs["full"])
    for name in list(jobs)[1:]:
        ratio = statistics.median(t[clock] for t in runs[name]) / full
        print(f"{ids.shape[1]} tokens: {name} / full, {'wall' if cuda else 'CPU'} time medians: {ratio:.2f}")


def attention(model, ids: torch.Tensor, reps: int, run, blocks: list[float]) -> None:
    """The prefill's and the reconstruction's attention, summed over the layers (see the module docstring)."""
    recorded = []

    def record(policy, query, key, value, own_key, own_value, scaling, attend=True):
        state = (policy.scoring, query, key, value, own_key, own_value, scaling, attend)
        recorded.append(tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in state))
        return score_chunk(policy, query, key, value, own_key, own_value, scaling, attend)

    kvzip_method.score_chunk = record
    try:
        run("kvzip", ratio=0.5)
    finally:
        kvzip_method.score_chunk = score_chunk
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    tokens = ids.shape[1]

    def prefill_attention() -> None:
        for _, query, key, value, *_ in recorded:
            scale = query.shape[-1] ** -0.5
            flash(query[:, :, -tokens:], key, value, 0.0, True, scale=scale)

    def reconstruction_attention(block: float) -> None:
        reconstruct.BLOCK_BYTES = int(block * 2**20)
        for scoring, query, key, value, own_key, own_value, scaling, attend in recorded:
            policy = types.SimpleNamespace(scoring=scoring, scores=torch.zeros(*key.shape[:3]))
            score_chunk(policy, query, key, value, own_key, own_value, scaling, attend)

    default = reconstruct.BLOCK_BYTES
    jobs = {"prefill attention": prefill_attention}
    for block in blocks:
        name = "reconstruction attention" + ("" if len(blocks) == 1 else f", {block:g} MiB blocks")
        jobs[name] = functools.partial(reconstruction_attention, block)
    times: dict[str, list[float]] = {"full prefill": [], **{name: [] for name in jobs}}
    try:
        for rep in range(reps):
            times["full prefill"].append(run("full")[1])
            for name, job in list(jobs.items())[:: 1 if rep % 2 == 0 else -1]:  # alternating which goes first
                cpu = time.process_time()
                with torch.no_grad():
                    job()
                times[name].append(time.process_time() - cpu)
    finally:
        reconstruct.BLOCK_BYTES = default
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"{tokens} tokens, {len(recorded)} layer calls, CPU s medians of {reps}:",
        {k: round(v, 3) for k, v in medians.items()},
    )
    full, own = medians["full prefill"], medians["prefill attention"]
    print(f"attention share of a full prefill f = {own / full:.3f}")
    for name in list(jobs)[1:]:
        print(f"{name}: {medians[name] / own:.2f}x the prefill's, {medians[name] / full:.3f} of a full prefill")


if __name__ == "__main__":
    main()
