"""The ragged decoding step's deferred writes against writing each step at once, interleaved in one process
(``docs/results/frontier.md``, "The decoding step over ragged storage: where it costs"):

    python -m experiments.ragged_variants --rounds 60

The compressed cache (SmolLM2-135M-Instruct, ``--tokens`` of the books, ``--method`` at ratio 0.5) is forked once
per variant; each round runs one decoding step through each variant and one through a ``DynamicCache`` holding as
many tokens per head as the compressed layers hold on average (cropped back after its step), in rotating order.
Process CPU time per step; medians of the per-round ratios with their 10th and 90th percentiles; the variants'
logits are compared at every step. The switch (``DEFER`` in ``core.ragged`` and ``core.ragged_stream``) exists only
at the commit this script was written for: the deferral was removed after this measurement.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

import kvcompress.core.ragged as R
import kvcompress.core.ragged_stream as S
from experiments.ragged import compressed, prompt_ids
from kvcompress.bench.pairs import use_attention
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument
from kvcompress.models import load_model

VARIANTS = {
    "defer": lambda: (setattr(R, "DEFER", True), setattr(S, "DEFER", True)),
    "direct": lambda: (setattr(R, "DEFER", False), setattr(S, "DEFER", False)),
}
BLOCKS: dict[str, int] = {}  # a variant built with this block size (none here)
p = argparse.ArgumentParser()
p.add_argument("--method", default="snapkv-adakv")
p.add_argument("--tokens", type=int, default=2048)
p.add_argument("--rounds", type=int, default=60)
p.add_argument("--variants", nargs="*", default=["defer", "direct"])
a = p.parse_args()
torch.set_num_threads(1)
model, tok = load_model("smollm2-135m")
ids = prompt_ids(tok, a.tokens + a.rounds + 10)
with torch.no_grad():
    base = compressed(model, ids[:, : a.tokens], a.method)
    caches = {}
    for v in a.variants:
        if v in BLOCKS:
            keep = R.block_size
            R.block_size = lambda counts, b=BLOCKS[v]: b
            caches[v] = compressed(model, ids[:, : a.tokens], a.method)
            R.block_size = keep
        else:
            caches[v] = base.fork()
    del base
    layers = caches[a.variants[0]].compressed_layers
    kept = sum(int(layer.valid.sum()) for layer in layers)
    per_head = round(kept / (len(layers) * model.config.num_key_value_heads))
    dyn = DynamicCache(config=model.config)
    use_attention(model, "sdpa")
    model(input_ids=ids[:, :per_head], **cache_argument(model, dyn), use_cache=True, logits_to_keep=1)
    names = [*a.variants, "dynamic"]
    times = {n: [] for n in names}
    logits = {}
    for r in range(a.rounds + 2):
        tokid = ids[:, a.tokens + r : a.tokens + r + 1]
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            if n == "dynamic":
                use_attention(model, "sdpa")
                t = time.process_time()
                model(input_ids=tokid, **cache_argument(model, dyn), use_cache=True)
                dt = time.process_time() - t
                dyn.crop(per_head - dyn.get_seq_length())
            else:
                VARIANTS[n]()
                use_attention(model, ATTENTION_NAME)
                t = time.process_time()
                out = model(input_ids=tokid, **cache_argument(model, caches[n]), use_cache=True)
                dt = time.process_time() - t
                logits[n] = out.logits[0, -1]
            if r >= 2:
                times[n].append(dt)
        vs = [logits[v] for v in a.variants]
        d = max(float((vs[0] - v).abs().max()) for v in vs[1:])
        assert d < 1e-3, d
        maxdiff = max(d, globals().get("maxdiff", 0.0))

    def q(xs, f):
        return sorted(xs)[min(len(xs) - 1, round(f * (len(xs) - 1)))]

    out = {"method": a.method, "tokens": a.tokens, "rounds": a.rounds, "per_head": per_head}
    for n in names:
        out[n + "_ms"] = round(statistics.median(times[n]) * 1e3, 2)
    for n in a.variants:
        rs = [x / y for x, y in zip(times[n], times["dynamic"], strict=True)]
        out[n + "/dyn"] = [round(statistics.median(rs), 3), round(q(rs, 0.1), 3), round(q(rs, 0.9), 3)]
    v0 = a.variants[0]
    for n in a.variants[1:]:
        rs = [x / y for x, y in zip(times[n], times[v0], strict=True)]
        out[n + "/" + v0] = [round(statistics.median(rs), 3), round(q(rs, 0.1), 3), round(q(rs, 0.9), 3)]
    out["max_logit_diff"] = maxdiff
    print(json.dumps(out), flush=True)
