"""Command-line plumbing shared by the benchmarks that run a model (``decode``, ``prefill``): the common options
and what happens to the rows afterwards (table printed; JSON, markdown and plot written under ``--out``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvcompress.bench.common import environment
from kvcompress.bench.table import save_outputs


def model_bench_parser(name: str, doc: str, methods: Sequence[str]) -> argparse.ArgumentParser:
    """A parser with ``--model``, ``--methods`` and ``--budget``; the caller adds its own options, then
    ``add_run_options``."""
    parser = argparse.ArgumentParser(prog=f"python -m kvcompress.bench.{name}", description=doc.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name, local path or HF id")
    parser.add_argument("--methods", default=",".join(methods), help="comma-separated method names")
    parser.add_argument("--budget", type=int, default=512, help="tokens per layer and KV head (bounded methods)")
    return parser


def add_run_options(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help=f"folder for {name}.json/.md/.png (+ partial .jsonl)")


def method_names(text: str) -> list[str]:
    return [m for m in text.split(",") if m]


def publish(
    name: str,
    args: argparse.Namespace,
    rows: Sequence[Mapping[str, object]],
    table: str,
    plot: Callable[[Path, str], None],
) -> None:
    """Print the table with the machine it ran on; with ``--out`` also save rows, table and ``plot(path, machine)``."""
    meta = {"benchmark": name, **{k: str(v) for k, v in vars(args).items() if k != "out"}, **environment(args.threads)}
    print(f"{name}: {args.model}, budget {args.budget}; {meta['machine']}\n")
    print(table)
    if args.out is not None:
        save_outputs(args.out, name, rows, meta, table)
        plot(args.out / f"{name}.png", str(meta["machine"]))
