"""PoD Algorithm 1 from the command line: layer blocks and KV savings from a calibration similarity file.

``python -m kvcompress.train.pod_blocks --similarity FILE --delta 0.5 --target-saving 0.3``
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvcompress.methods.pod.grouping import (
    block_starts,
    delta_for_saving,
    format_blocks,
    group_layers,
    head_similarity,
    kv_saving,
    load_similarity,
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PoD Algorithm 1: blocks and KV savings from a similarity file.")
    parser.add_argument("--similarity", required=True, help="file written by kvcompress.train.pod_calibrate")
    parser.add_argument("--delta", type=float, nargs="*", default=[0.5], help="thresholds to group at")
    parser.add_argument("--target-saving", type=float, nargs="*", default=[], help="asymptotic savings to reach")
    parser.add_argument("--grouping", choices=("kv_head", "query_head"), default="kv_head")
    parser.add_argument("--n", type=int, default=1024, help="sequence length for saving(n)")
    parser.add_argument("--n-sink", type=int, default=16)
    parser.add_argument("--n-recent", type=int, default=128)
    args = parser.parse_args(argv)
    sim_file = load_similarity(args.similarity)
    sim = head_similarity(sim_file, args.grouping)
    kv_heads = int(sim_file.get("kv_heads", sim.shape[0]))
    runs = [(d, None) for d in args.delta] + [(None, t) for t in args.target_saving]
    for delta, target in runs:
        if target is not None:
            delta = delta_for_saving(sim, target, kv_heads if args.grouping == "query_head" else None)
        blocks = group_layers(sim, delta)
        starts = block_starts(blocks)
        at_n, asymptotic = kv_saving(starts, args.n, args.n_sink, args.n_recent, kv_heads)
        label = f"delta={delta:.4f}" + (f" (target saving {target})" if target is not None else "")
        print(f"{label}: blocks per head {[len(b) for b in blocks]}")
        for h, line in enumerate(format_blocks(blocks)):
            print(f"  head {h}: {line}")
        print(f"  saving(n={args.n}, {args.n_sink}+{args.n_recent}) = {at_n:.1%}   saving(inf) = {asymptotic:.1%}")


if __name__ == "__main__":
    main()
