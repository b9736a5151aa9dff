"""Count the operations each method adds to a decoding step, beside transformers' ``DynamicCache``.

On a GPU a decoding step of a small model is launch-bound: every operation is a kernel launch of ~10 us whatever
its size, so the number of operations a cache adds per layer predicts its cost there (docs/results/performance.md,
section 0b) and can be followed on a machine without a GPU. For each method: prefill the prompt in chunks, decode
a few tokens, then count the ATen operations of one more decoding step of the whole model (views excluded: they
launch nothing) and subtract the count of the same step on a ``DynamicCache``; host reads (``.item()``, ``bool``)
are counted apart. A ``.tolist()`` of a CPU tensor dispatches no operation, so such reads are not counted here;
``tests/gpu`` sees every read on a GPU.

    python scripts/count_decode_ops.py [--methods window,streaming,h2o] [--prompt 1024] [--budget 512] [--by-op]
    python scripts/count_decode_ops.py --methods "" --spec snapkv:allocation=adakv,ratio=0.5 --by-op
    python scripts/count_decode_ops.py --prefill --methods full --spec keydiff:ratio=0.5 --by-op

``--prefill`` counts a whole prompt's ``prefill`` in one forward instead (a one-shot method's compression, KVzip's
reconstruction included), against the same prompt's forward into a ``DynamicCache``: on a GPU, where a small model's
prefill is a few fused kernels a layer, what a compression adds is mostly its launches.

``--spec`` (repeatable) names a method with its parameters as the CLI does (``method:key=value,...``); a spec
without ``budget`` or ``ratio`` gets ``--budget``.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import kvcompress
from kvcompress.bench.common import random_prompt, set_threads
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model
from kvcompress.params import parse_method_spec

METHODS = "window,streaming,h2o,tova,scissorhands,random,knorm,snapkv,buzz,cascade,less,pod,full"
READS = {"_local_scalar_dense", "is_nonzero", "item"}


class Count(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it: ``ops`` the ones that compute (a kernel each on a GPU),
    ``views`` the ones that only make a view (no kernel, but host time: on a launch-bound GPU step both count)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step_ops(model, ids: torch.Tensor, cache, attention: str) -> Count:
    model.set_attn_implementation(attention)
    with Count() as count:
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    return count


def decoding_step_ops(model, ids: torch.Tensor, cache, args) -> Count:
    """The operations of one decoding step of ``cache`` after ``args.prompt`` tokens prefilled in chunks and three
    decoding steps (past the first steps' one-off work)."""
    prefill(model, ids[:, : args.prompt], cache, chunk_size=args.chunk)
    for token in range(args.prompt, args.prompt + 3):
        model(input_ids=ids[:, token : token + 1], **cache_argument(model, cache), use_cache=True)
    return step_ops(model, ids[:, args.prompt + 3 : args.prompt + 4], cache, ATTENTION_NAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens before the counted step")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--by-op", action="store_true", help="also list each method's added ops by name, per layer")
    parser.add_argument("--spec", action="append", default=[], help="a method with parameters (method:key=value,...)")
    parser.add_argument("--prefill", action="store_true", help="count a whole prompt's prefill, not a decoding step")
    args = parser.parse_args()
    set_threads(1)
    model, _ = load_model(args.model)
    kvcompress.prepare_model(model)
    layers = model.config.get_text_config().num_hidden_layers
    ids = random_prompt(model, args.prompt + 8, 0)
    with torch.inference_mode():
        dynamic = DynamicCache(config=model.config)
        model.set_attn_implementation("sdpa")
        if args.prefill:
            baseline = step_ops(model, ids[:, : args.prompt], dynamic, "sdpa")
        else:
            model(input_ids=ids[:, : args.budget], **cache_argument(model, dynamic), use_cache=True, logits_to_keep=1)
            baseline = step_ops(model, ids[:, args.prompt : args.prompt + 1], dynamic, "sdpa")
        base_ops, base_views = sum(baseline.ops.values()), baseline.views
        counted = f"prefill of {args.prompt} tokens" if args.prefill else "decoding step"
        print(f"DynamicCache: {base_ops} ops and {base_views} views per {counted} ({layers} layers)")
        print(
            f"{'method':14s} {'ops/step':>9s} {'ops added/layer':>16s} {'views added/layer':>18s} {'host reads':>11s}"
        )
        specs = [name for name in args.methods.split(",") if name] + args.spec
        for spec in specs:
            method, params = parse_method_spec(spec)
            if method != "full" and "budget" not in params and "ratio" not in params:
                params["budget"] = args.budget
            cache = kvcompress.cache_for(model, method, **params)
            method = spec
            model.set_attn_implementation(ATTENTION_NAME)
            if args.prefill:
                with Count() as count:
                    prefill(model, ids[:, : args.prompt], cache)
            else:
                count = decoding_step_ops(model, ids, cache, args)
            ops = sum(count.ops.values())
            added, views = (ops - base_ops) / layers, (count.views - base_views) / layers
            reads = sum(count.ops[name] for name in READS)
            print(f"{method:14s} {ops:9d} {added:16.1f} {views:18.1f} {reads:11d}")
            if args.by_op:
                extra = {name: n / layers for name, n in (count.ops - baseline.ops).items()}  # (counts of more)
                fewer = {name: -n / layers for name, n in (baseline.ops - count.ops).items()}
                listed = sorted({**extra, **fewer}.items(), key=lambda item: -abs(item[1]))
                print("    " + ", ".join(f"{name} {per_layer:+.1f}" for name, per_layer in listed))


if __name__ == "__main__":
    main()
