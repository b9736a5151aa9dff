"""Ragged storage of per-head budgets on SmolLM2 (``docs/results/frontier.md``, "Memory of per-head budgets"):
bytes held against the full cache, the process's peak memory, and a decoding step against a ``DynamicCache``
holding the same total tokens.

    python -m experiments.ragged memory --tokens 2048
    python -m experiments.ragged decode --tokens 2048 --pairs 32
    python -m experiments.ragged memory --tokens 16384 --methods none full snapkv-adakv duo kvzip kvzip-head --no-slots
    python -m experiments.ragged memory --tokens 4096 --chunk 512 --methods full compactor-adakv --no-slots
    python -m experiments.ragged decode-ab --tokens 2048 --pairs 40
    MALLOC_MMAP_THRESHOLD_=65536 python -m experiments.ragged phases snapkv-adakv --tokens 8192

The prompt is the first ``--tokens`` tokens of the shipped books (``kvcompress.eval.data.gutenberg_books()``, in
order, joined by blank lines), one sequence, float32, one torch thread, ``torch.no_grad``.

``memory`` runs each method in a fresh process (so ``ru_maxrss`` is that method's peak): the model loaded, the
prompt prefilled in one forward through ``kvcompress.generation.prefill`` at ratio 0.5, then 8 greedy decoding
steps; it reports ``nbytes()`` over the full cache's key and value bytes (layers x KV heads x tokens x 2 x head dim
x 4 bytes), the held slack, and the peak RSS beside the same run with the full cache (``full``).

The process's memory is read from ``/proc/self/status`` as well, in a process per method run with
``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every buffer of 64 KiB or more on its own and unmaps it when
freed, so the resident memory follows the live tensors) and with the pages mapped once the model is loaded locked in
memory (``mlockall(MCL_CURRENT)``: the weights' and libraries' file-backed pages are then not dropped and read back
under memory pressure, which would move the resident memory by up to the weights' size): ``base`` the resident
memory once the model is loaded and has run a 16-token forward; ``peak`` ``VmHWM`` (the high-water mark of the
resident memory) over the prefill, the compression and 8 decoding steps; ``held`` the resident memory after them.
``none`` runs the same one-forward prompt with no cache at all (``use_cache=False``, ``logits_to_keep=1``): its
``peak - base`` is the forward's own activations, so a method's peak attributable to its cache is ``(peak - base) -
(peak - base of none)``, reported over the full cache's bytes.

``decode`` prefills once per method, then times interleaved pairs of one decoding step: ours (its ragged layers),
then a ``DynamicCache`` prefilled with as many tokens per head as our layers hold on average per head (cropped back
after each step, as ``kvcompress.bench.speed`` does); medians of the per-pair CPU-time ratios with their 10th and
90th percentiles.

``phases`` runs one method's one-forward prefill (``none``: no cache, ``full``, or a method's name) in this process
and reports, per decoder layer, the peak resident memory above base of its attention (from the attention module's
call to the MLP's) and of its MLP (to the next layer's attention), ``VmHWM`` reset at each boundary: where in the
forward a method's memory goes beyond the forward's own.

``decode-ab`` compares the pool's decoding step (``RaggedPool._step``) with the step before it (``previous_step``
below: the general ``_attend_rows`` path of kvcompress at commit 0dbfe85, views made per step), in one process: the
compressed cache is forked once per variant, and each round runs one step through each fork and one through the
``DynamicCache``, in rotating order; medians of the per-round CPU-time ratios with their 10th and 90th percentiles,
and the largest difference between the two variants' logits.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys

import torch
from transformers import DynamicCache

import kvcompress
import kvcompress.core.ragged as ragged_storage
from kvcompress.bench.pairs import timed, timed_pairs, use_attention
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.eval.data import gutenberg_books
from kvcompress.generation import cache_argument, prefill
from kvcompress.machine import machine_description
from kvcompress.methods.duo.patterns import ratio_for
from kvcompress.models import load_model

METHODS = {
    "snapkv-adakv": ("snapkv", {"ratio": 0.5, "allocation": "adakv"}),
    # the same stored as KIVI codes (core/ragged_quantized.py; KIVI's group 32 and residual 128)
    "snapkv-adakv-kv8": ("snapkv", {"ratio": 0.5, "allocation": "adakv", "kv_bits": 8}),
    "snapkv-adakv-kv4": ("snapkv", {"ratio": 0.5, "allocation": "adakv", "kv_bits": 4}),
    "expected_attention-adakv": ("expected_attention", {"ratio": 0.5, "allocation": "adakv"}),
    "kvzip": ("kvzip", {"ratio": 0.5}),
    "kvzip-layer": ("kvzip", {"ratio": 0.5, "allocation": "layer"}),
    # DuoAttention at ratio 0.5: the fewest streaming heads (kvpress's head_compression_ratio) that keep at most
    # half of the prompt's pairs, with the shipped pattern's sizes (128 sinks, 256 recent); set per prompt length
    "duo": ("duo", {}),
    # KVzip's context-independent head level: the shipped head scores, duo's split and window (128 sinks, 256
    # recent), at most half of the prompt's pairs kept (its ratio is the kept share: kvzip/head.py)
    "kvzip-head": ("kvzip", {"ratio": 0.5, "level": "head"}),
    # Compactor with per-head budgets: prefilled in chunks (``--chunk``), it scores each attention chunk as it comes in
    "compactor-adakv": ("compactor", {"ratio": 0.5, "allocation": "adakv"}),
}
DUO_WINDOW = 128 + 256


def prompt_ids(tokenizer, tokens: int) -> torch.Tensor:
    text = "\n\n".join(book.text for book in gutenberg_books())
    ids = tokenizer(text[: tokens * 8], return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise ValueError(f"--tokens {tokens}: the books give only {ids.shape[1]} tokens")
    return ids


def full_kv_bytes(model, tokens: int) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * config.num_key_value_heads * tokens * 2 * head_dim * 4


def compressed(model, ids: torch.Tensor, name: str, ragged: bool = True, chunk: int | None = None):
    method, params = METHODS[name]
    if method == "duo":
        pairs = model.config.num_hidden_layers * model.config.num_key_value_heads
        share = ratio_for(0.5, ids.shape[1], 128, 256, pairs)
        params = {**params, "head_compression_ratio": share}
    cache = kvcompress.cache_for(model, method, ragged=ragged, **params)
    prefill(model, ids, cache, chunk_size=chunk)
    return cache


def status_mb(field: str) -> float | None:
    """A field of ``/proc/self/status`` in MB (Linux): ``VmRSS`` now, ``VmHWM`` its high-water mark."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def lock_mapped_pages() -> bool:
    """Lock the pages mapped now (the weights, the libraries' code) in memory (Linux ``mlockall(MCL_CURRENT)``):
    under memory pressure the kernel would otherwise drop file-backed pages and read them back later, so the
    resident memory would move by up to the weights' size whatever the cache holds. Buffers allocated later are not
    locked (and, with no swap, not reclaimed). False where it is refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.mlockall(1) == 0  # MCL_CURRENT
    except (OSError, AttributeError):
        return False


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current resident memory (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def memory_one(name: str, tokens: int, ragged: bool, chunk: int | None = None) -> dict:
    """One method's bytes and peak RSS (this process: run it alone)."""
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    ids = prompt_ids(tokenizer, tokens)
    with torch.no_grad():
        model(input_ids=ids[:, :16], use_cache=False, logits_to_keep=1)  # warm-up: kernels and allocator
        locked = lock_mapped_pages()
        base = status_mb("VmRSS")
        reset_peak()
        if name == "none":  # the forward alone: no cache
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            peak = status_mb("VmHWM")
            return {
                "method": name,
                "tokens": tokens,
                "locked": locked,
                "base_mb": base,
                "peak_mb": peak,
                "peak_above_base_mb": peak - base,
            }
        if name == "full":
            cache = kvcompress.cache_for(model, "full")
            prefill(model, ids, cache, chunk_size=chunk)
        else:
            cache = compressed(model, ids, name, ragged, chunk)
        # the prefill's peak (compression included), then the decoding steps' own peak from the memory held now
        prefill_peak, compressed_rss = status_mb("VmHWM"), status_mb("VmRSS")
        reset_peak()
        row = {"method": name, "ragged": ragged, "tokens": tokens, "nbytes": cache.nbytes()}
        layers = cache.compressed_layers
        # (layer, head, token) kept: a ragged layer counts them on the host (its ``valid`` is a padded copy)
        row["kept_pairs"] = sum(
            layer.stored_tokens() if getattr(layer, "ragged", False) else int(layer.valid.sum()) for layer in layers
        )
        row["allocated_nbytes"] = sum(layer.allocated_nbytes() for layer in layers)
        token = ids[:, -1:]
        for _ in range(8):
            logits = model(input_ids=token, **cache_argument(model, cache), use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
    full = full_kv_bytes(model, tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row.update(full_nbytes=full, ratio=row["nbytes"] / full, peak_rss_mb=peak, rss_mb=current_rss_mb())
    high, held = status_mb("VmHWM"), status_mb("VmRSS")
    high = max(high, prefill_peak)
    row.update(base_mb=base, peak_mb=high, peak_above_base_mb=high - base, held_above_base_mb=held - base, chunk=chunk)
    row.update(
        prefill_peak_above_base_mb=prefill_peak - base,
        compressed_above_base_mb=compressed_rss - base,
        decode_peak_above_base_mb=status_mb("VmHWM") - base,
    )
    row["locked"] = locked
    if name in ("duo", "kvzip-head"):
        layers = cache.compressed_layers
        if name == "duo":
            row["streaming_heads"] = int(sum(layer.policy.streaming.sum() for layer in layers))
        else:  # (a streaming head keeps its sinks and window, plus the 8 decoded tokens)
            row["streaming_heads"] = sum(int((layer.valid.sum(-1) < tokens).sum()) for layer in layers)
        row["kept_pairs_share"] = row["kept_pairs"] / (len(layers) * model.config.num_key_value_heads * tokens)
    return row


def phases(name: str, tokens: int) -> dict:
    """Per decoder layer, the peak resident memory above base of its attention and of its MLP (see the module
    docstring); run with ``MALLOC_MMAP_THRESHOLD_=65536`` as ``memory`` does."""
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    ids = prompt_ids(tokenizer, tokens)
    peaks: list[tuple[str, float]] = []
    current = {"label": "embedding"}

    def boundary(label: str):
        def hook(*_):
            peaks.append((current["label"], round(status_mb("VmHWM") - base, 1)))
            reset_peak()
            current["label"] = label

        return hook

    with torch.no_grad():
        model(input_ids=ids[:, :16], use_cache=False, logits_to_keep=1)
        lock_mapped_pages()
        hooks = []
        for index, layer in enumerate(model.model.layers):
            hooks.append(layer.self_attn.register_forward_pre_hook(boundary(f"attention {index}")))
            hooks.append(layer.mlp.register_forward_pre_hook(boundary(f"mlp {index}")))
        hooks.append(model.model.norm.register_forward_pre_hook(boundary("final norm and head")))
        base = status_mb("VmRSS")
        reset_peak()
        if name == "none":
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        elif name == "full":
            prefill(model, ids, kvcompress.cache_for(model, "full"))
        else:
            compressed(model, ids, name)
        boundary("end")()
        for hook in hooks:
            hook.remove()
    return {"method": name, "tokens": tokens, "peaks_above_base_mb": peaks}


def current_rss_mb() -> float | None:
    """The process's resident memory now (Linux), after the decoding steps."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def memory(args) -> None:
    names = args.methods or ["full", *METHODS]
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    activations = None
    print(json.dumps({"machine": machine_description(1)}), flush=True)
    for name in names:
        layouts = [True] if name in ("full", "none") or args.no_slots else [True, False]
        for ragged in layouts:
            command = [sys.executable, "-m", "experiments.ragged", "memory-one", name, "--tokens", str(args.tokens)]
            command += [] if ragged else ["--slots"]
            command += ["--chunk", str(args.chunk)] if args.chunk else []
            result = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
            row = json.loads(result.stdout.strip().splitlines()[-1])
            if name == "none":
                activations = row["peak_above_base_mb"]
            elif activations is not None:  # the peak attributable to the cache, over the full cache's bytes
                cache_peak = row["peak_above_base_mb"] - activations
                row.update(cache_peak_mb=cache_peak, cache_peak_ratio=cache_peak * 2**20 / row["full_nbytes"])
                row["held_ratio"] = row["held_above_base_mb"] * 2**20 / row["full_nbytes"]
            print(json.dumps(row), flush=True)


def steps(model, ids: torch.Tensor, start: int, cache, dynamic: DynamicCache, per_head: int):
    """Our step, the DynamicCache's step, and the crop that keeps the DynamicCache at ``per_head`` tokens."""

    def token(i: int) -> torch.Tensor:
        return ids[:, start + i : start + i + 1]

    def ours(i: int):
        return model(input_ids=token(i), **cache_argument(model, cache), use_cache=True)

    def theirs(i: int):
        return model(input_ids=token(i), **cache_argument(model, dynamic), use_cache=True)

    def crop() -> None:
        dynamic.crop(per_head - dynamic.get_seq_length())

    return ours, theirs, crop


def decode(args) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    ids = prompt_ids(tokenizer, args.tokens + args.pairs + 4)
    prompt = ids[:, : args.tokens]
    print(json.dumps({"machine": machine_description(1)}))
    with torch.no_grad():
        for name in args.methods or list(METHODS):
            cache = compressed(model, prompt, name)
            layers = cache.compressed_layers
            kept = sum(int(layer.valid.sum()) for layer in layers)
            per_head = round(kept / (len(layers) * model.config.num_key_value_heads))
            dynamic = DynamicCache(config=model.config)
            use_attention(model, "sdpa")
            model(input_ids=ids[:, :per_head], **cache_argument(model, dynamic), use_cache=True, logits_to_keep=1)

            ours, theirs, crop = steps(model, ids, args.tokens, cache, dynamic, per_head)
            result = timed_pairs(model, ours, theirs, args.pairs, warmup=2, after_theirs=crop)
            print(json.dumps({"method": name, "tokens": args.tokens, "dynamic_tokens_per_head": per_head, **result}))


def previous_step(pool, query: torch.Tensor, scale: float, plain: bool, first: int) -> torch.Tensor:
    """The pool's decoding step at commit 0dbfe85 (the reference of ``decode-ab``): a step's views made per step, the
    segment maximum from a ``-inf`` buffer, the dtype conversions called unconditionally."""
    batch, q_heads, count, dim = query.shape
    groups = q_heads // pool.heads
    rows = query.reshape(batch, pool.heads, groups, count, dim).transpose(2, 3).reshape(pool.rows, groups, dim)
    used = pool.used
    owner = pool.owner[:used]
    block_rows = rows.index_select(0, owner)
    logits = torch.baddbmm(pool.bias[:used], block_rows, pool.keys[:used].transpose(1, 2), alpha=scale)
    width = logits.shape[1]
    top = logits.amax(dim=-1)
    segment = torch.full((pool.rows, width), float("-inf"), device=pool.device)
    segment.scatter_reduce_(0, owner[:, None].expand(used, width), top, "amax")
    shift = segment.index_select(0, owner)
    weights = logits.sub_(shift[..., None]).exp_()
    norm = torch.zeros(pool.rows, width, device=pool.device).index_add_(0, owner, weights.sum(dim=-1))
    parts = torch.bmm(weights.to(pool.values.dtype), pool.values[:used])
    output = torch.zeros(pool.rows, width, parts.shape[-1], dtype=parts.dtype, device=pool.device)
    output.index_add_(0, owner, parts)
    output = output.div_(norm[..., None].to(output.dtype))
    return output.view(batch, pool.heads, count, groups, -1).transpose(2, 3).reshape(batch, q_heads, count, -1)


def decode_ab(args) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    ids = prompt_ids(tokenizer, args.tokens + args.pairs + 8)
    print(json.dumps({"machine": machine_description(1)}))
    with torch.no_grad():
        cache = compressed(model, ids[:, : args.tokens], "snapkv-adakv")
        layers = cache.compressed_layers
        per_head = round(sum(int(layer.valid.sum()) for layer in layers) / (len(layers) * layers[0].pool.heads))
        current, previous = cache.fork(), cache.fork()
        for layer in previous.compressed_layers:
            layer.pool.attend = lambda *a, pool=layer.pool: previous_step(pool, *a)
        dynamic = DynamicCache(config=model.config)
        use_attention(model, "sdpa")
        model(input_ids=ids[:, :per_head], **cache_argument(model, dynamic), use_cache=True, logits_to_keep=1)
        times = {"current": [], "previous": [], "dynamic": []}
        largest = 0.0
        for i in range(2 + args.pairs):
            token = ids[:, args.tokens + i : args.tokens + i + 1]
            logits = {}
            sides = [("current", current), ("previous", previous), ("dynamic", dynamic)]
            for name, side in sides[i % 3 :] + sides[: i % 3]:
                use_attention(model, "sdpa" if name == "dynamic" else ATTENTION_NAME)

                def run(side=side, name=name, token=token, logits=logits):
                    logits[name] = model(input_ids=token, **cache_argument(model, side), use_cache=True).logits

                elapsed = timed(run)[1]
                if name == "dynamic":
                    dynamic.crop(per_head - dynamic.get_seq_length())
                if i >= 2:
                    times[name].append(elapsed)
            largest = max(largest, float((logits["current"] - logits["previous"]).abs().max()))

        def ratio(a: str, b: str) -> dict:
            values = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
            return {
                "median": statistics.median(values),
                "p10": values[round(0.1 * (len(values) - 1))],
                "p90": values[round(0.9 * (len(values) - 1))],
            }

        print(
            json.dumps(
                {
                    "tokens": args.tokens,
                    "rounds": args.pairs,
                    "dynamic_tokens_per_head": per_head,
                    "current/dynamic": ratio("current", "dynamic"),
                    "previous/dynamic": ratio("previous", "dynamic"),
                    "current/previous": ratio("current", "previous"),
                    "ms": {name: statistics.median(values) * 1e3 for name, values in times.items()},
                    "largest_logit_difference": largest,
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["memory", "memory-one", "decode", "decode-ab", "phases"])
    parser.add_argument("name", nargs="?")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--methods", nargs="*")
    parser.add_argument("--slots", action="store_true", help="memory-one: the slot layout (ragged=False)")
    parser.add_argument("--no-slots", action="store_true", help="memory: the ragged layout only")
    parser.add_argument("--chunk", type=int, help="memory: prefill in chunks of this many tokens (default: one)")
    parser.add_argument("--block", type=int, help="decode: force this block size (default: the pool's rule)")
    args = parser.parse_args()
    if args.block:
        ragged_storage.block_size = lambda counts: args.block
    if args.command == "memory-one":
        print(json.dumps(memory_one(args.name, args.tokens, not args.slots, args.chunk)))
    elif args.command == "memory":
        memory(args)
    elif args.command == "decode-ab":
        decode_ab(args)
    elif args.command == "phases":
        print(json.dumps(phases(args.name, args.tokens)))
    else:
        decode(args)


if __name__ == "__main__":
    main()
