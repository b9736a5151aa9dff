"""``python -m experiments.compare {samples,ours,report,frontier,decoding}``: the kvcompress side of
docs/vs-kvpress.md and of docs/results/frontier.md (kept sets of the one-shot scorers and budget allocations, and of
the periodic re-compression while decoding)."""

from __future__ import annotations

import argparse
import sys

from experiments.compare.decoding import run_decoding
from experiments.compare.frontier import run_frontier
from experiments.compare.ours import run_ours
from experiments.compare.samples import write_samples
from experiments.compare.table import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.compare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    samples = sub.add_parser("samples", help="write <out>/samples.json (niah samples as token ids, budgets)")
    samples.add_argument("--out", required=True)
    samples.add_argument("--samples", type=int, default=10)
    samples.add_argument("--length", type=int, default=1024, help="prompt tokens (niah's length)")
    samples.add_argument("--budgets", default="128,256,512")
    samples.add_argument("--seed", type=int, default=0)
    samples.add_argument("--model", default="smollm2-135m")
    ours = sub.add_parser("ours", help="run our methods on <out>/samples.json into <out>/kvcompress.jsonl")
    ours.add_argument("--out", required=True)
    ours.add_argument("--methods", default=None, help="comma-separated labels (default: all; see compare.ours.METHODS)")
    ours.add_argument("--threads", type=int, default=1)
    ours.add_argument("--samples", type=int, default=None, help="only the first N samples (default: all)")
    report = sub.add_parser("report", help="score both sides, compare kept sets, write the tables")
    report.add_argument("--out", required=True)
    report.add_argument("--doc-data", default=None, help="also write the rows without kept sets and the summary here")
    frontier = sub.add_parser("frontier", help="kept sets vs <out>/kvpress-kept.jsonl (scripts/vs_kvpress_kept.py)")
    frontier.add_argument("--out", required=True)
    frontier.add_argument("--threads", type=int, default=1)
    frontier.add_argument("--kept", default="kvpress-kept.jsonl", help="kvpress's rows, a file in --out")
    decoding = sub.add_parser("decoding", help="periodic vs <out>/kvpress-decoding.jsonl (vs_kvpress_decoding.py)")
    decoding.add_argument("--out", required=True)
    decoding.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "samples":
        if args.samples < 1:
            parser.error(f"--samples must be >= 1, got {args.samples}")
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        print(
            write_samples(
                args.out, count=args.samples, length=args.length, budgets=budgets, seed=args.seed, model=args.model
            )
        )
    elif args.command == "ours":
        methods = None if args.methods is None else [m for m in args.methods.split(",") if m]
        print(run_ours(args.out, methods, args.threads, args.samples))
    elif args.command == "decoding":
        print(run_decoding(args.out, args.threads))
    elif args.command == "frontier":
        print(run_frontier(args.out, args.threads, args.kept))
    else:
        print(write_report(args.out, args.doc_data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
