"""The speed benchmark with named fast paths switched off: what each one buys, measured the benchmark's way.

Issue 50: "a micro-optimisation stays only if a benchmark shows it buys >= 3 % on the step it targets". Each fast
path below has a slower general path beside it that gives the same result; ``--off`` replaces the fast one by the
general one (by patching the library in this process only: nothing is written), then runs
``python -m kvcompress.bench.speed`` with the remaining arguments. Run it with and without ``--off`` in turns and
compare the ratios (docs/core-lines.md has the figures and commands).

    python scripts/fast_path_toggles.py --off joint-eviction -- --sections decode --prompts 2048 --steps 24 \
        --methods h2o,less

Fast paths (the step they target):

- ``pod-ring``: PoD's proximal keys in a ring while decoding (decode; off: the packed keys, trimmed per step);
- ``joint-eviction``: a decoding step's evictions of every layer at once (decode: h2o, tova, scissorhands, knorm, less);
- ``less-staged-folds``: LESS's folds of a forward done together at its end (decode: less);
- ``less-slots``: LESS's decoding step as one softmax over the stored keys and the state's rows (decode: less;
  off: the softmax with its log-normaliser and Eq. 3's mix, the general path);
- ``less-native-gelu``: φ and ψ's GELU on PyTorch's own kernel through a transposed view, not oneDNN's (decode: less);
- ``causal-bias``: one additive causal mask per prompt chunk for every layer (prefill);
- ``pod-stream-masks``: PoD's masks built once per forward while the layers hold the stream as it came (prefill);
- ``slot-deferred-writes``: a decoding step's bookkeeping writes a slot layer leaves until something reads them
  (decode: every slot method; off: the victim's slot marked free at once, the new token's rank, validity and
  default RoPE position written at once).
"""

from __future__ import annotations

import argparse
import sys

import torch.nn.functional as F

import kvcompress.core.attention as attention
import kvcompress.core.cache as cache
import kvcompress.core.layer as core_layer
import kvcompress.core.slots as slots
import kvcompress.methods.less.kernels as kernels
import kvcompress.methods.less.layer as layer
import kvcompress.methods.less.policy as policy
import kvcompress.methods.pod.attention as pod
from kvcompress.bench.speed import main as speed


def joint_eviction() -> None:
    cache.connect_joint_evictions = lambda layers: None


def pod_ring() -> None:
    pod.ring_plan = lambda *args, **kwargs: None


def less_staged_folds() -> None:
    layer.stage = lambda less_layer, *staged: layer.fold(less_layer.forward_pass, [(less_layer, *staged)])  # at once


def less_slots() -> None:
    def attend(self, cache_layer, query, key, value, mask, scaling):  # LessPolicy.attend without its decoding branch
        if self.kernels is None:
            self.layer_kernels(query.shape[1], key.shape[1], key.shape[-1], query.device)
        if not cache_layer.folded:
            return None
        request = self.request
        output, stats = policy.attention_with_stats(query, key, value, mask, scaling, request, rows_see_keys=True)
        features = policy.phi_features(query, *self.weights.phi)
        state = policy.head_matmul(policy.grouped(features, key.shape[1]).flatten(2, 3), cache_layer.low_rank)
        state = state.view(*features.shape[:3], -1)
        mixed = policy.mix_low_rank(stats.lse, output.float(), state[..., :-1], state[..., -1])
        return mixed.to(query.dtype), stats if self.stats.any else None

    policy.LessPolicy.attend = attend


def less_native_gelu() -> None:
    kernels._gelu = F.gelu  # the contiguous products: oneDNN's kernel on a CPU


def causal_bias() -> None:
    attention.causal_bias = lambda *args, **kwargs: None  # SDPA then takes the boolean causal mask in every layer


def pod_stream_masks() -> None:
    pod.stream_biases = lambda *args, **kwargs: None  # every layer builds its own masks


def slot_deferred_writes() -> None:
    write_range, write_at, evict = (
        slots.SlotBuffers.write_range,
        slots.SlotBuffers.write_at,
        core_layer.CompressedLayer.evict,
    )

    def write_range_at_once(self, start, keys, values, seen, state, no_padding=False):
        write_range(self, start, keys, values, seen, state, False)

    def write_at_at_once(self, slots_, keys, values, seen, state, reused_real=False):
        write_at(self, slots_, keys, values, seen, state, False)

    def evict_at_once(self, victims):
        evict(self, victims)
        if self._stale:
            self._settle()

    slots.SlotBuffers.write_range = write_range_at_once
    slots.SlotBuffers.write_at = write_at_at_once
    core_layer.CompressedLayer.evict = evict_at_once


FAST_PATHS = {
    "pod-ring": pod_ring,
    "joint-eviction": joint_eviction,
    "less-staged-folds": less_staged_folds,
    "less-slots": less_slots,
    "less-native-gelu": less_native_gelu,
    "causal-bias": causal_bias,
    "pod-stream-masks": pod_stream_masks,
    "slot-deferred-writes": slot_deferred_writes,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--off", default="", help=f"comma-separated among {', '.join(FAST_PATHS)} (none: as shipped)")
    parser.add_argument("speed_args", nargs=argparse.REMAINDER, help="-- then kvcompress.bench.speed's arguments")
    args = parser.parse_args()
    for name in filter(None, args.off.split(",")):
        if name not in FAST_PATHS:
            parser.exit(2, f"--off: unknown fast path {name!r}; choose among {', '.join(FAST_PATHS)}\n")
        FAST_PATHS[name]()
    speed([a for a in args.speed_args if a != "--"] or None)


if __name__ == "__main__":
    sys.exit(main())
