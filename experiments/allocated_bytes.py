"""Stored and allocated KV bytes after a prompt fed in one forward, then after each decoding step (issue 50).

    python -m experiments.allocated_bytes [--model smollm2-135m] [--methods window,h2o,...] [--budget 512]
        [--prompt 2048] [--steps 4]

One line per method: ``cache.nbytes()`` (keys and values stored) and ``cache.allocated_nbytes()`` (as allocated:
stored plus the room the layers keep, ``kvcompress.core.capacity``) after the prompt and after the last step.
"""

from __future__ import annotations

import argparse

import torch

import kvcompress
from kvcompress.generation import cache_argument
from kvcompress.models import load_model


def held(model, method: str, budget: int, prompt: int, steps: int) -> list[tuple[int, int]]:
    """``(stored, allocated)`` KV bytes after the prompt and after each of ``steps`` decoding steps."""
    ids = torch.randint(10, model.config.vocab_size, (1, prompt + steps), generator=torch.Generator().manual_seed(0))
    cache = kvcompress.cache_for(model, method, **({} if method == "full" else {"budget": budget}))
    rows = []
    with torch.no_grad():
        model(input_ids=ids[:, :prompt], **cache_argument(model, cache))
        rows.append((cache.nbytes(), cache.allocated_nbytes()))
        for step in range(steps):
            model(input_ids=ids[:, prompt + step : prompt + step + 1], **cache_argument(model, cache))
            rows.append((cache.nbytes(), cache.allocated_nbytes()))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.allocated_bytes", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="window,h2o,tova,scissorhands,knorm,buzz")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = load_model(args.model)
    for method in args.methods.split(","):
        rows = held(model, method, args.budget, args.prompt, args.steps)
        (stored, allocated), (last_stored, last_allocated) = rows[0], rows[-1]
        print(
            f"{method}: after the prompt {stored / 1e6:.1f} MB stored, {allocated / 1e6:.1f} MB allocated; "
            f"after step {args.steps} {last_stored / 1e6:.1f} MB stored, {last_allocated / 1e6:.1f} MB allocated"
        )


if __name__ == "__main__":
    main()
