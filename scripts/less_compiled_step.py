"""Whether ``torch.compile`` makes LESS's own part of a decoding step cheaper, inside real decoding steps.

LESS's step is its base policy's plus a dozen small operations per layer: φ of the query (two products, two GELUs)
and the softmax over the stored keys and the state's rows (``kvcompress.methods.less.low_rank_slots``). Fused by a
compiler they would be fewer calls. This decodes two LESS caches in turns after the same prompt: one as built, one
whose ``phi_features`` and ``low_rank_slots_attention`` (the library's own functions) run compiled by inductor
(``--backend``); each step's process CPU time is recorded (1 torch thread) and the median of the per-step ratios
compiled / eager is printed with its 10th and 90th percentiles, beside the logits' largest difference. Then each
part is called again in a loop of its own on the last step's inputs (everything warm in the caches), compiled and
eager, and the median time of one call is printed: what a compiled call costs with nothing cold.

    python scripts/less_compiled_step.py [--prompt 2048] [--budget 512] [--steps 100] [--backend inductor]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvcompress
import kvcompress.methods.less.policy as policy_module
from kvcompress.bench.common import random_prompt, set_threads
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model

PARTS = ("phi_features", "low_rank_slots_attention")
EAGER = {name: getattr(policy_module, name) for name in PARTS}


LAST_ARGS: dict[str, tuple] = {}  # each part's inputs at its last call (``use``)


def use(compiled: dict[str, object] | None) -> None:
    """Make LESS's policy call the compiled parts (``None``: the eager ones), recording each part's last inputs."""
    for name in PARTS:
        setattr(policy_module, name, recorded(name, EAGER[name] if compiled is None else compiled[name]))


def recorded(name: str, part):
    def call(*args):
        LAST_ARGS[name] = args
        return part(*args)

    return call


def warm_call_us(part, args: tuple, calls: int = 2000) -> float:
    """Median microseconds of one call of ``part(*args)`` repeated in a loop (warm caches)."""
    for _ in range(100):
        part(*args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        part(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    set_threads(1)
    model, _ = load_model(args.model)
    kvcompress.prepare_model(model)
    model.set_attn_implementation(ATTENTION_NAME)
    compiled = {name: torch.compile(EAGER[name], backend=args.backend, dynamic=False) for name in PARTS}
    ids = random_prompt(model, args.prompt + args.steps + 4, 0)
    sides = {"eager": None, "compiled": compiled}
    caches, logits, ratios = {}, {}, []
    with torch.inference_mode():
        for side, parts in sides.items():
            use(parts)
            caches[side] = kvcompress.cache_for(model, "less", budget=args.budget)
            prefill(model, ids[:, : args.prompt], caches[side], chunk_size=512)
            start = time.perf_counter()
            for t in range(args.prompt, args.prompt + 4):  # the state filled; the compiled side compiles here
                model(input_ids=ids[:, t : t + 1], **cache_argument(model, caches[side]))
            print(f"{side}: first 4 steps {time.perf_counter() - start:.1f} s")
        for step in range(args.steps):
            t = args.prompt + 4 + step
            times = {}
            for side in ("eager", "compiled") if step % 2 == 0 else ("compiled", "eager"):
                use(sides[side])
                start = time.process_time()
                logits[side] = model(input_ids=ids[:, t : t + 1], **cache_argument(model, caches[side])).logits
                times[side] = time.process_time() - start
            ratios.append(times["compiled"] / times["eager"])
        use(None)
    deciles = statistics.quantiles(ratios, n=10)
    difference = (logits["compiled"] - logits["eager"]).abs().max().item()
    print(f"{args.model}, prompt {args.prompt}, budget {args.budget}, {args.steps} steps, 1 torch thread")
    print(f"step CPU time, compiled / eager: median {statistics.median(ratios):.3f} (p10 {deciles[0]:.3f}, ", end="")
    print(f"p90 {deciles[-1]:.3f}); largest logit difference {difference:.2e}")
    with torch.inference_mode():
        for name in PARTS:
            eager, fused = (warm_call_us(part, LAST_ARGS[name]) for part in (EAGER[name], compiled[name]))
            print(f"{name}, one call in a warm loop: eager {eager:.1f} us, compiled {fused:.1f} us")


if __name__ == "__main__":
    main()
