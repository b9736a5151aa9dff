"""Command-line plumbing shared by the benchmarks that run a model (``decode``, ``prefill``): the common options,
running the benchmark with them, and what happens to the rows afterwards (table printed; JSON, markdown and plot
written under ``--out``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvcompress.bench.common import environment
from kvcompress.bench.table import partial_writer, save_outputs

Row = dict[str, object]


def model_bench_parser(name: str, doc: str, methods: Sequence[str]) -> argparse.ArgumentParser:
    """A parser with ``--model``, ``--methods`` and ``--budget``; the caller adds its own options, then
    ``add_run_options`` (or ``run_model_bench``, which adds them)."""
    parser = argparse.ArgumentParser(prog=f"python -m kvcompress.bench.{name}", description=doc.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name, local path or HF id")
    parser.add_argument("--methods", default=",".join(methods), help="comma-separated method names")
    parser.add_argument("--budget", type=int, default=512, help="tokens per layer and KV head (bounded methods)")
    return parser


def add_run_options(parser: argparse.ArgumentParser, name: str) -> None:
    """Add ``--threads``, ``--seed`` and ``--out`` (the folder for the ``name`` benchmark's files) to ``parser``."""
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help=f"folder for {name}.json/.md/.png (+ partial .jsonl)")


def method_names(text: str) -> list[str]:
    """The items of a comma-separated option, empty ones skipped: ``"full,,h2o,"`` gives ``["full", "h2o"]``."""
    return [m for m in text.split(",") if m]


def int_list(text: str) -> list[int]:
    """The integers of a comma-separated option, empty items skipped: ``"1024,2048,"`` gives ``[1024, 2048]``."""
    return [int(item) for item in method_names(text)]


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


def run_model_bench(
    name: str,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    run: Callable[..., list[Row]],
    options: Callable[[argparse.Namespace], dict[str, object]],
    table: Callable[[Sequence[Row]], str],
    plot_options: Sequence[str] = (),
) -> None:
    """The rest of the ``name`` benchmark's ``main`` once its own options are on ``parser`` (``model_bench_parser``).

    Adds the run options, parses ``argv`` (``None``: the command line) and calls ``run`` with the model, the
    methods, ``budget``, ``threads``, ``seed``, ``on_row`` (writing partial results under ``--out``) and the
    benchmark's own keyword arguments, ``options(args)``. Then ``publish``es the rows: ``table(rows)`` is the
    markdown table, and ``kvcompress.bench.plots.plot_<name>`` draws them with the model, the machine and the
    parsed options named in ``plot_options`` as keyword arguments.
    """
    add_run_options(parser, name)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = run(
        args.model,
        method_names(args.methods),
        budget=args.budget,
        threads=args.threads,
        seed=args.seed,
        on_row=partial_writer(args.out, name),
        **options(args),
    )

    def plot(path: Path, machine: str) -> None:
        from kvcompress.bench import plots  # matplotlib only when a plot is written

        extra = {key: getattr(args, key) for key in plot_options}
        getattr(plots, f"plot_{name}")(rows, path, model=args.model, machine=machine, **extra)

    publish(name, args, rows, table(rows), plot)
