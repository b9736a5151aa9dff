"""Run an evaluation task over methods and budgets into a resumable JSONL file.

    python -m kvcompress.eval.runner passkey --methods full,window,h2o --budgets 64,128,256 \\
        --samples 10 --seed 0 --out runs/passkey --param length=1024

``run_eval`` writes ``<out_dir>/<task>.jsonl``: one ``{"kind": "environment", ...}`` row per invocation
(package versions, torch threads, CPU, date) and one ``{"kind": "result", ...}`` row per sample x mode x method x
budget. A rerun with the same arguments skips the rows already present (same task, model, seed, task
parameters, sample, mode, method, parameters and budget), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kvcompress.eval.configs import expand_configs
from kvcompress.eval.data import data_root
from kvcompress.eval.tasks import TASKS, make_task, run_task
from kvcompress.eval.tasks.base import Task
from kvcompress.machine import cpu_name, versions
from kvcompress.models import load_model
from kvcompress.results import ResultsFile, read_rows  # noqa: F401 (read_rows: also read from here)

logger = logging.getLogger(__name__)

DEFAULT_METHODS = ("full", "window", "streaming", "h2o", "tova", "scissorhands", "snapkv", "random", "knorm")
DEFAULT_BUDGETS = (64, 128, 256)


def results_path(out_dir: str | os.PathLike[str], task: str) -> Path:
    return Path(out_dir) / f"{task}.jsonl"


def row_key(row: dict[str, Any]) -> str:
    """What makes two result rows the same evaluation."""
    fields = ("task", "model", "seed", "task_params", "sample", "mode", "method", "params", "budget")
    return json.dumps([row.get(f) for f in fields], sort_keys=True)


def result_key(row: dict[str, Any]) -> str | None:
    """``row_key`` of a result row; ``None`` for other rows (environment rows)."""
    return row_key(row) if row.get("kind", "result") == "result" else None


def environment() -> dict[str, Any]:
    """Versions, threads, CPU and date, as written in the environment row."""
    return {
        "kind": "environment",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **versions(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }


def _load(model: str | tuple[Any, Any]) -> tuple[str, Any, Any]:
    if isinstance(model, tuple):
        loaded, tokenizer = model
        return getattr(loaded.config, "_name_or_path", "") or type(loaded).__name__, loaded, tokenizer
    loaded, tokenizer = load_model(model)
    return model, loaded, tokenizer


def run_eval(
    task: str,
    model_name: str | tuple[Any, Any] = "smollm2-135m",
    methods: Sequence[str] = DEFAULT_METHODS,
    budgets: Sequence[int | float | str] = DEFAULT_BUDGETS,
    samples: int = 10,
    seed: int = 0,
    out_dir: str | os.PathLike[str] = "runs",
    progress: bool = True,
    **task_params: Any,
) -> Path:
    """Evaluate ``task`` for every method x budget on ``samples`` samples; return the JSONL path.

    ``model_name`` is a registry name, path or Hub id for ``kvcompress.models.load_model`` (or an already loaded
    ``(model, tokenizer)`` pair). ``methods`` are ``"name"`` or ``"name:key=value,..."`` strings, ``budgets``
    ints (tokens kept per layer and KV head) or floats in (0, 1) (a prompt ratio, for methods with ``ratio``).
    ``task_params`` go to the task (e.g. ``length=1024``, ``chunk_size=32``). Rows already in the file are
    skipped. The torch thread count is left as the caller set it (the command line sets ``--threads``).
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an integer >= 1, got {samples!r}")
    configs = expand_configs(methods, budgets)
    if not configs:  # nothing to run is a mistake, not a finished run
        raise ValueError(
            f"methods {list(methods)} x budgets {list(budgets)} give no evaluation (give at least one method; a ratio "
            "budget applies only to methods with a ratio)"
        )
    name, model, tokenizer = _load(model_name)
    evaluation: Task = make_task(task, model, tokenizer, seed=seed, **task_params)
    items = evaluation.build_samples(samples)

    path = results_path(out_dir, task)
    results = ResultsFile(path, result_key)  # other runs may append to it meanwhile: neither writes a row twice
    common = {"model": name, "seed": seed, "task_params": evaluation.record_params()}

    def is_done(identity: dict[str, Any]) -> bool:
        return results.done(row_key({**identity, **common}))

    total = len(items) * len(evaluation.modes) * len(configs)
    already = sum(
        is_done(
            {"task": task, "sample": s.id, "mode": m, "method": c.method, "params": c.param_dict, "budget": c.budget}
        )
        for s in items
        for m in evaluation.modes
        for c in configs
    )
    logger.info("%s: %d evaluations, %d already in %s", task, total, already, path)
    if already < total:
        results.append(environment())
    rows = run_task(evaluation, configs, items, skip=is_done)
    if progress and not sys.stderr.isatty():  # a log or CI: one plain line per evaluation, not a redrawn bar
        start = time.monotonic()
        for done, row in enumerate(rows, start=already + 1):
            results.append({"kind": "result", **common, **row})
            elapsed = time.monotonic() - start
            left = elapsed / (done - already) * (total - done)
            scores = " ".join(f"{k} {v:.2f}" for k, v in row["scores"].items())
            print(
                f"{task} {done}/{total}: {row['sample']} {row['label']} budget {row['budget']} {scores} "
                f"({elapsed:.0f} s, ~{left:.0f} s left)",
                file=sys.stderr,
                flush=True,
            )
    elif progress:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, transient=False) as bar:
            job = bar.add_task(task, total=total, completed=already)
            for row in rows:
                results.append({"kind": "result", **common, **row})
                bar.update(job, advance=1, description=f"{task} {row['sample']} {row['label']} {row['budget']}")
    else:
        for row in rows:
            results.append({"kind": "result", **common, **row})
    return path


def parse_task_params(items: Sequence[str]) -> dict[str, Any]:
    """``["length=1024", "modes=agnostic+aware"]`` -> ``{"length": 1024, "modes": ("agnostic", "aware")}``.

    Values are JSON when they parse as JSON, ``+``-separated lists become tuples, anything else stays a string.
    """
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param takes key=value, got {item!r}")

        def convert(text: str) -> Any:
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return text

        params[key.strip()] = tuple(convert(v) for v in value.split("+")) if "+" in value else convert(value)
    return params


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.eval.runner", description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated; name[:k=v;...]")
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--data", default=None, help="data folder (else $KVCOMPRESS_DATA, else the books shipped with the package)"
    )
    parser.add_argument("--param", action="append", default=[], help="task parameter key=value (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    params = parse_task_params(args.param)
    if args.data is not None and "data" in TASKS[args.task].defaults:
        params["data"] = str(data_root(args.data))  # a missing folder fails here, before the model loads
    # Method parameters are separated by ';' on the command line, since ',' separates methods.
    methods = [m.replace(";", ",") for m in _split(args.methods)]
    for option, given in (("--methods", methods), ("--budgets", _split(args.budgets))):
        if not given:
            parser.error(f"{option} {getattr(args, option[2:])!r} names nothing to run; give a comma-separated list")
    path = run_eval(args.task, args.model, methods, _split(args.budgets), args.samples, args.seed, args.out, **params)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
