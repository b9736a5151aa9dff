"""Quantized storage (issue 49) against transformers' ``QuantizedCache`` and the full-precision cache
(docs/results/quantization.md; the decoding step is ``python -m kvcompress.bench.speed`` with method specs).

    python -m experiments.quantization vs-transformers [--prompt 512] [--steps 64]   # needs optimum-quanto

``vs-transformers``: SmolLM2-135M, a prompt from a shipped book in one forward then ``--steps`` tokens of the book
fed one at a time (teacher forcing), through (a) ``DynamicCache``, (b) transformers' ``QuantizedCache`` on the quanto
backend with KIVI's axes (keys per channel: ``axis_key=-1``, values per token: ``axis_value=0``), (c) kvcompress's
``full`` at the same bits, group and residual. Prints the largest and mean absolute logit difference of each pair
and how often the top-1 tokens agree.

    python -m experiments.quantization decode-ab --against REV [--method h2o:kv_bits=4] [--steps 40]

``decode-ab``: the decoding step's attention from the codes (``quantized_one_query`` of
``core/quantized_attention.py``) and its reading of single slots (``QuantizedSlotBuffers.read_at`` of
``core/quantized_slots.py``: LESS's victims) as of git revision ``REV`` against the working tree's, in one process:
three caches (a ``DynamicCache`` holding the same tokens, the method read with ``REV``'s functions, the method read
with these) step through the same tokens after a 1,024-token
prompt of random ids, in rotating order, one torch thread, each step's thread CPU time recorded; prints the medians
(10th-90th percentiles) of the per-step ratios. For comparing two versions on a loaded machine, where runs in
separate processes see different loads.

    python -m experiments.quantization decode-paths [--method less:kv_bits=4] [--steps 40]

``decode-paths``: one process, the same tokens after a 1,024-token prompt of random ids, budget 512, in rotating
order, one torch thread, each step's thread CPU time: a ``DynamicCache`` holding the same tokens, the method at 16
bits (the spec without its ``kv_bits``), the quantized method attending over the dequantized view (its layer's
``codes_readable`` made false) and from the codes (as it runs). Prints the medians (10th-90th percentiles) of the
per-step ratios over the ``DynamicCache`` and of codes over view, the load average before and after, and the bytes
held at 16 bits and quantized.

    python -m experiments.quantization compress-ppl [--model smollm2-135m] [--methods M,...] [--ratio 0.5]
        [--context 1024] [--continuation 256] [--samples 2]

``compress-ppl``: perplexity for methods that compress once after a prompt (SnapKV, KVzip), which ``stream-ppl``
(the cache evicting after every 16-token forward) does not fit: sample ``i`` is ``--context`` + ``--continuation``
tokens of shipped book ``i`` from a third of its text on; the context is prefilled in one forward and compressed
(``--ratio`` kept, for every method but ``full``; KVzip runs its reconstruction passes then), then the continuation
is scored in one forward through the compressed cache, which no longer evicts (one-shot methods append after their
compression). The first continuation token is scored from the context's last logits. Prints, per method, the
perplexity of each sample's continuation, the mean NLL over all of them and the KV bytes held after the
compression (× the ``full`` row's, when there is one).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvcompress
from kvcompress.eval.data import gutenberg_books
from kvcompress.generation import cache_argument
from kvcompress.models import load_model


def book_ids(tokenizer, length: int) -> torch.Tensor:
    text = gutenberg_books()[1].text
    ids = tokenizer(text[len(text) // 3 :], return_tensors="pt", add_special_tokens=False).input_ids
    return ids[:, :length]


def forced_logits(model, ids: torch.Tensor, cache, prompt: int) -> torch.Tensor:
    with torch.no_grad():
        out = [model(ids[:, :prompt], **cache_argument(model, cache), use_cache=True).logits[:, -1]]
        for step in range(prompt, ids.shape[1]):
            out.append(model(ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True).logits[:, -1])
    return torch.stack(out, 1).float()


def vs_transformers(prompt: int, steps: int, bits: int, group: int, residual: int) -> None:
    from transformers.cache_utils import QuantizedCache  # the quanto backend imports optimum-quanto

    model, tokenizer = load_model("smollm2-135m")
    ids = book_ids(tokenizer, prompt + steps)
    model.set_attn_implementation("sdpa")
    exact = forced_logits(model, ids, DynamicCache(config=model.config), prompt)
    hf = QuantizedCache(
        "quanto", model.config, nbits=bits, axis_key=-1, axis_value=0, q_group_size=group, residual_length=residual
    )
    theirs = forced_logits(model, ids, hf, prompt)
    ours_cache = kvcompress.cache_for(model, "full", kv_bits=bits, kv_group=group, kv_residual=residual)
    ours = forced_logits(model, ids, ours_cache, prompt)
    print(f"SmolLM2-135M, prompt {prompt} + {steps} forced steps, {bits} bits, group {group}, residual {residual}")
    print("| pair | max abs logit diff | mean abs logit diff | top-1 agreement |")
    print("|---|---|---|---|")
    for name, a, b in (
        ("transformers QuantizedCache (quanto) vs DynamicCache", theirs, exact),
        ("kvcompress full kv_bits vs DynamicCache", ours, exact),
        ("kvcompress vs transformers QuantizedCache", ours, theirs),
    ):
        diff = (a - b).abs()
        agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        print(f"| {name} | {float(diff.max()):.3f} | {float(diff.mean()):.4f} | {agree:.3f} |")


def module_at(revision: str, name: str):
    """The repository's module ``kvcompress.core.<name>`` as of git ``revision``, written to a temporary file and
    imported under another name."""
    path = f"src/kvcompress/core/{name}.py"
    source = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True, check=True).stdout
    folder = Path(tempfile.mkdtemp())
    file = folder / f"{name}_{revision}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def function_at(revision: str):
    """``quantized_one_query`` as of git ``revision`` (``module_at``)."""
    return module_at(revision, "quantized_attention").quantized_one_query


def timed_steps(model, ids, prompt: int, steps: int, caches: dict, held: int, crop: bool, before) -> dict:
    """Decoding steps of each cache in ``caches`` (name: cache, prefilled with ``prompt`` tokens of ``ids``) and of a
    ``DynamicCache`` prefilled with ``held`` tokens (``"dynamic"``, cropped back to them after each step when
    ``crop``), in turns whose order rotates every step; ``before(name)`` runs before each cache's step. The CPU time
    of every step but the first two, per name."""
    from kvcompress.bench.pairs import use_attention
    from kvcompress.bench.speed import dynamic_prefill
    from kvcompress.core.attention import ATTENTION_NAME

    dynamic = DynamicCache(config=model.config)
    dynamic_prefill(model, ids[:, :held], dynamic, 512)
    sides = ["dynamic", *caches]
    times: dict[str, list[float]] = {side: [] for side in sides}
    for step in range(steps + 2):
        turn = step % len(sides)
        for side in sides[turn:] + sides[:turn]:
            use_attention(model, "sdpa" if side == "dynamic" else ATTENTION_NAME)
            if side != "dynamic":
                before(side)
            token = ids[:, prompt + step : prompt + step + 1]
            start = time.thread_time()
            with torch.no_grad():
                model(token, **cache_argument(model, dynamic if side == "dynamic" else caches[side]), use_cache=True)
            if step >= 2:
                times[side].append(time.thread_time() - start)
            if side == "dynamic" and crop:
                dynamic.crop(held - dynamic.get_seq_length())
    return times


def ratio_text(times: dict, a: str, b: str) -> str:
    """Median and 10th-90th percentile of the per-step CPU-time ratios of ``a`` over ``b``."""
    values = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
    tenth = values[len(values) // 10], values[(9 * len(values)) // 10]
    return f"{statistics.median(values):.3f} ({tenth[0]:.3f}-{tenth[1]:.3f})"


def decode_ab(revision: str, method: str, steps: int, prompt: int = 1024, budget: int = 512) -> None:
    from kvcompress.bench.common import bench_cache, random_prompt, set_threads
    from kvcompress.core import quantized_layer, quantized_slots
    from kvcompress.generation import prefill

    set_threads(1)
    slots_class = quantized_slots.QuantizedSlotBuffers
    then_read_at = module_at(revision, "quantized_slots").QuantizedSlotBuffers.read_at
    if "targets" not in inspect.signature(then_read_at).parameters:  # (before it took the attention's targets)
        then_read_at = lambda slots, index, width, targets=None, read=then_read_at: read(slots, index, width)  # noqa: E731
    reads = {
        "then": (function_at(revision), then_read_at),
        "now": (quantized_layer.quantized_one_query, slots_class.read_at),
    }
    model, _ = load_model("smollm2-135m")
    ids = random_prompt(model, prompt + steps + 2, 0)
    caches = {}
    for side in reads:
        caches[side] = bench_cache(model, method, budget)
        prefill(model, ids[:, :prompt], caches[side], chunk_size=512)
    held = max(caches["now"].tokens_stored())

    def read_as(side: str) -> None:
        quantized_layer.quantized_one_query, slots_class.read_at = reads[side]

    times = timed_steps(model, ids, prompt, steps, caches, held, not method.startswith("full"), read_as)
    read_as("now")
    print(f"{method}, {held} tokens held, {steps} steps; medians of per-step CPU-time ratios (p10-p90)")
    print(
        f"{revision} x DynamicCache {ratio_text(times, 'then', 'dynamic')}, working tree x DynamicCache "
        f"{ratio_text(times, 'now', 'dynamic')}, {revision} x working tree {ratio_text(times, 'then', 'now')}"
    )


def decode_paths(method: str, steps: int, prompt: int = 1024, budget: int = 512) -> None:
    from kvcompress.bench.common import bench_cache, random_prompt, set_threads
    from kvcompress.generation import prefill

    set_threads(1)
    load = os.getloadavg()[0]
    model, _ = load_model("smollm2-135m")
    ids = random_prompt(model, prompt + steps + 2, 0)
    plain = ";".join(part for part in method.replace(":", ";", 1).split(";") if not part.startswith("kv_bits="))
    specs = {"16-bit": plain.replace(";", ":", 1), "view": method, "codes": method}
    caches = {}
    for side, spec in specs.items():
        caches[side] = bench_cache(model, spec, budget)
        prefill(model, ids[:, :prompt], caches[side], chunk_size=512)
    layer_class = type(caches["codes"].layers[0])
    readable = layer_class.codes_readable
    held = max(caches["codes"].tokens_stored())

    def read_as(side: str) -> None:
        layer_class.codes_readable = (lambda self: False) if side == "view" else readable

    times = timed_steps(model, ids, prompt, steps, caches, held, not method.startswith("full"), read_as)
    layer_class.codes_readable = readable
    print(f"{method} ({layer_class.__name__}), {held} tokens held, {steps} steps; medians of per-step CPU-time ratios")
    print(", ".join(f"{side} {specs[side]} x DynamicCache {ratio_text(times, side, 'dynamic')}" for side in specs))
    bytes_16, bytes_q = caches["16-bit"].nbytes(), caches["codes"].nbytes()
    print(
        f"codes x view {ratio_text(times, 'codes', 'view')}; bytes {bytes_16} at 16 bits, {bytes_q} quantized "
        f"({bytes_q / bytes_16:.3f}x); load average {load:.2f} before, {os.getloadavg()[0]:.2f} after"
    )


def sample_ids(tokenizer, index: int, length: int) -> torch.Tensor:
    books = gutenberg_books()
    text = books[index % len(books)].text
    ids = tokenizer(text[len(text) // 3 :], return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < length:
        raise ValueError(f"book {index % len(books)} holds {ids.shape[1]} tokens from a third on; need {length}")
    return ids[:, :length]


def compress_ppl(
    model_name: str, methods: list[str], ratio: float, context: int, continuation: int, samples: int
) -> None:
    from kvcompress.eval.configs import parse_method
    from kvcompress.generation import prefill

    model, tokenizer = load_model(model_name)
    streams = [sample_ids(tokenizer, index, context + continuation) for index in range(samples)]
    rows = []
    for spec in methods:
        name, params = parse_method(spec.replace(";", ","))  # (several parameters: "kvzip:ragged=false;kv_bits=4")
        if name != "full":
            params.setdefault("ratio", ratio)
        losses, nbytes = [], []
        for ids in streams:
            cache = kvcompress.cache_for(model, name, **params)
            with torch.no_grad():
                first = prefill(model, ids[:, :context], cache)
                nbytes.append(cache.nbytes())
                rest = model(ids[:, context:-1], **cache_argument(model, cache), use_cache=True).logits[0]
            logits = torch.cat([first, rest]).float()
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, context:], reduction="none"))
        rows.append((spec, params, losses, statistics.median(nbytes)))
        print(spec, [round(float(x.mean().exp()), 2) for x in losses], flush=True)
    full = next((held for spec, _, _, held in rows if spec == "full"), None)
    print(f"{model_name}, context {context} compressed to {ratio:.0%} (all but full), continuation {continuation}")
    print("| method | kept | bits | " + " | ".join(f"ppl sample {i}" for i in range(samples)), end="")
    print(" | mean nll | KV MiB | bytes × full |")
    print("|---" * (samples + 6) + "|")
    for spec, params, losses, held in rows:
        name = spec.split(":")[0]
        kept = "all" if name == "full" else f"{params['ratio']:g}"
        bits = params.get("kv_bits", 16)
        ppl = " | ".join(f"{float(x.mean().exp()):.2f}" for x in losses)
        nll = float(torch.cat(losses).mean())
        times = f"{held / full:.2f}" if full else "-"
        print(f"| {spec} | {kept} | {bits} | {ppl} | {nll:.4f} | {held / 2**20:.2f} | {times} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("vs-transformers", "decode-ab", "decode-paths", "compress-ppl"))
    parser.add_argument("--model", default="smollm2-135m", help="compress-ppl: the model")
    parser.add_argument("--methods", default="full,snapkv,snapkv:kv_bits=8,snapkv:kv_bits=4", help="compress-ppl")
    parser.add_argument("--ratio", type=float, default=0.5, help="compress-ppl: share of the context kept")
    parser.add_argument("--context", type=int, default=1024, help="compress-ppl: context tokens")
    parser.add_argument("--continuation", type=int, default=256, help="compress-ppl: tokens scored")
    parser.add_argument("--samples", type=int, default=2, help="compress-ppl: books")
    parser.add_argument("--against", default="cc88a8d", help="decode-ab: the git revision compared")
    parser.add_argument("--method", default="h2o:kv_bits=4", help="decode-ab, decode-paths: a method spec (budget 512)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--residual", type=int, default=128)
    args = parser.parse_args()
    if args.what == "compress-ppl":
        methods = [spec for spec in args.methods.split(",") if spec]
        compress_ppl(args.model, methods, args.ratio, args.context, args.continuation, args.samples)
        return
    if args.what == "decode-ab":
        decode_ab(args.against, args.method, args.steps)
        return
    if args.what == "decode-paths":
        decode_paths(args.method, args.steps)
        return
    vs_transformers(args.prompt, args.steps, args.bits, args.group, args.residual)


if __name__ == "__main__":
    main()
