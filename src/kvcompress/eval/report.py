"""Turn evaluation JSONL files into markdown tables and PNG plots.

    python -m kvcompress.eval.report docs/results/runs/baselines --out docs/results/baselines/report

``write_report(run_dir, out_prefix)`` reads every ``*.jsonl`` under ``run_dir`` (or one file), and every
lm-eval ``results_*.json`` below it (``kvcompress.eval.lmeval_results``, tables appended at the end), and writes
``<out_prefix>.md`` plus ``<out_prefix>-<task>[-<mode>]-<plot>.png`` beside it. For every task and mode it gives,
per metric, a table of the mean score per method (rows) and budget (columns) with ``± standard error`` of the
mean over samples and the sample count; then the stored KV cache (tokens per layer and MiB) and the time per
sample. Each task and mode opens with a summary: one line per method and budget with every score, the stored KV
bytes and the time per sample, each beside the full cache's (``summary_table``; ``--summary`` prints it).
``niah`` also gets a per-subtask table. Plots: score against budget per method (the full cache as a horizontal
line; the task's ``plot_metrics`` side by side) and, for ``stream-ppl``, perplexity along the stream.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvcompress.eval.lmeval_results import lmeval_lines, load_lmeval
from kvcompress.eval.runner import row_key
from kvcompress.eval.tasks import TASKS
from kvcompress.results import numbered_rows

LOWER_IS_BETTER = {"ppl", "nll", "answer_nll"}
logger = logging.getLogger(__name__)


RESULT_FIELDS = {"task": str, "method": str, "scores": dict}  # what every table reads from a result row


def load_results(
    run_dir: str | os.PathLike[str], problems: list[str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(results, environments)`` rows of every JSONL file under ``run_dir`` (or of that one file).

    A result row whose key (``runner.row_key``) an earlier row has (two runs that wrote one file) counts once; a line
    that is no JSON object, or a result row without the fields the tables read, is skipped and reported in
    ``problems`` as ``FILE:LINE: what is wrong`` (logged when ``problems`` is ``None``)."""
    path = Path(run_dir)
    files = [path] if path.is_file() else sorted(path.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no .jsonl results in {str(path)!r}")
    if problems is None:
        problems = []
        try:
            return load_results(run_dir, problems)
        finally:
            for problem in problems:
                logger.warning("%s", problem)
    results, environments, seen = [], [], set()
    for file in files:
        for number, row in numbered_rows(file, problems):
            kind = row.get("kind", "result")
            if kind == "environment":
                environments.append(row)
            elif kind == "result" and _well_formed(row, f"{file}:{number}", problems):
                key = row_key(row)
                if key not in seen:
                    seen.add(key)
                    results.append(row)
    return results, environments


def _well_formed(row: dict[str, Any], where: str, problems: list[str]) -> bool:
    wrong = [name for name, kind in RESULT_FIELDS.items() if not isinstance(row.get(name), kind)]
    if "budget" not in row:
        wrong.append("budget")
    if wrong:
        problems.append(f"{where}: a result row without {', '.join(wrong)} (or of the wrong type); skipped")
    return not wrong


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample std / sqrt(n)); ``None`` for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def budget_sort_key(budget: Any) -> tuple[int, float]:
    if budget is None:
        return (0, 0.0)
    return (1, float(budget)) if isinstance(budget, float) and budget < 1 else (2, float(budget))


def budget_name(budget: Any) -> str:
    if budget is None:
        return "no limit"
    if isinstance(budget, float) and budget < 1:
        return f"ratio {budget:g}"
    return str(budget)


def _format(mean: float, se: float | None, n: int | None, digits: int) -> str:
    """``mean ± se (n)``; without ``± se`` when ``se`` is None, without ``(n)`` when ``n`` is None."""
    text = f"{mean:.{digits}f}"
    if se is not None:
        text += f" ± {se:.{digits}f}"
    return text if n is None else f"{text} ({n})"


def _digits(metric: str, values: Iterable[float]) -> int:
    largest = max((abs(v) for v in values), default=0.0)
    if metric in LOWER_IS_BETTER:
        return 2 if largest < 100 else 1
    return 3 if largest <= 1 else 2


def group_rows(results: list[dict[str, Any]]) -> dict[tuple[str, str | None, str], list[dict[str, Any]]]:
    """Results by ``(task, mode, task parameters as JSON)``, in first-seen order: rows run with other task
    parameters (another context length, chunk size, ...) are never averaged together."""
    groups: dict[tuple[str, str | None, str], list[dict[str, Any]]] = defaultdict(list)
    for row in results:
        params = json.dumps(row.get("task_params") or {}, sort_keys=True)
        groups[(row["task"], row.get("mode"), params)].append(row)
    return dict(groups)


def metric_names(rows: list[dict[str, Any]]) -> list[str]:
    """Metrics of a group: the task's declared order when the task is known, else the scores' own order."""
    seen = list(dict.fromkeys(name for row in rows for name in row["scores"]))
    task = TASKS.get(rows[0]["task"])
    if task is not None and task.metrics:
        ordered = [m for m in task.metrics if m in seen]
        return ordered + [m for m in seen if m not in ordered]
    return seen


def _cells(rows, value) -> tuple[list[str], list[Any], dict[tuple[str, Any], list[float]]]:
    labels = list(dict.fromkeys(row.get("label", row["method"]) for row in rows))
    budgets = sorted({row["budget"] for row in rows}, key=budget_sort_key)
    cells: dict[tuple[str, Any], list[float]] = defaultdict(list)
    for row in rows:
        v = value(row)
        if v is not None:
            cells[(row.get("label", row["method"]), row["budget"])].append(v)
    return labels, budgets, cells


def table(rows: list[dict[str, Any]], value, digits: int | None = None, metric: str = "", errors: bool = True) -> str:
    """Markdown table: one line per method label, one column per budget, ``mean ± se (n)`` in each cell
    (``mean (n)`` without ``errors``)."""
    labels, budgets, cells = _cells(rows, value)
    if digits is None:
        digits = _digits(metric, [v for values in cells.values() for v in values])
    lines = [
        "| method | " + " | ".join(budget_name(b) for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    for label in labels:
        entries = []
        for budget in budgets:
            values = cells.get((label, budget))
            if not values:
                entries.append("")
                continue
            mean, se = mean_se(values)
            entries.append(_format(mean, se if errors else None, len(values), digits))
        lines.append(f"| {label} | " + " | ".join(entries) + " |")
    return "\n".join(lines)


def _stored_tokens(row: dict[str, Any]) -> float | None:
    stored = row.get("tokens_stored")
    return float(max(stored)) if stored else None


def _title(task: str, mode: str | None) -> str:
    return task if mode is None else f"{task} ({mode})"


def _machine(environments: list[dict[str, Any]]) -> str:
    if not environments:
        return "unknown machine"
    env = environments[-1]
    threads = env.get("torch_threads")
    return (
        f"{env.get('cpu', '?')}, {env.get('cpu_count', '?')} cores, {threads} torch thread{'s' if threads != 1 else ''}"
    )


def write_report(
    run_dir: str | os.PathLike[str],
    out_prefix: str | os.PathLike[str],
    plots: bool = True,
    digest: list[str] | None = None,
    problems: list[str] | None = None,
) -> Path:
    """Write ``<out_prefix>.md`` (tables) and PNG plots from the results in ``run_dir``; return the markdown path.

    ``digest``, when given, receives the short version as markdown lines: per task and mode its heading,
    parameters, summary table and the paths of its plots. ``problems``, when given, receives the lines skipped
    (``load_results``)."""
    from kvcompress.eval import plots as plotting

    lmeval_rows = load_lmeval(run_dir)
    try:
        results, environments = load_results(run_dir, problems)
    except FileNotFoundError:
        if not lmeval_rows:
            raise
        results, environments = [], []
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    if not results:
        if not lmeval_rows:
            raise ValueError(f"no result rows in {str(run_dir)!r}")
        path = out_prefix.with_suffix(".md")
        path.write_text("\n".join(lmeval_lines(lmeval_rows)), encoding="utf-8")
        return path
    models = sorted({row.get("model", "?") for row in results})
    machine = _machine(environments)
    lines = [
        f"# Evaluation report: {', '.join(models)}",
        "",
        f"Results from `{run_dir}`; machine: {machine}. Cells: mean ± standard error over samples (sample count).",
        "Budgets are tokens kept per layer and KV head; `no limit` is a method without a budget (the full cache).",
        "",
    ]
    if digest is not None:
        digest += lines[:4]
    groups = group_rows(results)
    variants: dict[tuple[str, str | None], int] = defaultdict(int)
    for (task, mode, _params), rows in groups.items():
        variants[(task, mode)] += 1
        variant = variants[(task, mode)]
        heading = _title(task, mode) + (f" [parameter set {variant}]" if variant > 1 else "")
        start = len(lines)
        lines += [f"## {heading}", ""]
        params = rows[0].get("task_params") or {}
        if params:
            shown = ", ".join(f"{k}={v}" for k, v in params.items() if v is not None)
            lines += [f"Task parameters: {shown}; seed {rows[0].get('seed')}.", ""]
        metrics = metric_names(rows)
        lines += [f"**summary** ({SUMMARY_NOTE})", "", summary_table(rows, metrics), ""]
        if digest is not None:
            digest += lines[start:]
        for metric in metrics:
            arrow = "lower is better" if metric in LOWER_IS_BETTER else "higher is better"
            lines += [
                f"**{metric}** ({arrow})",
                "",
                table(rows, lambda r, m=metric: r["scores"].get(m), metric=metric),
                "",
            ]
        subtasks = list(dict.fromkeys(r["info"]["subtask"] for r in rows if "subtask" in (r.get("info") or {})))
        if len(subtasks) > 1:
            lines += [f"**{metrics[0]} by subtask**", "", subtask_table(rows, metrics[0], subtasks), ""]
        lines += [
            "**stored KV tokens per layer** (largest layer, at the end of each sample)",
            "",
            table(rows, _stored_tokens, digits=0, errors=False),
            "",
            "**stored KV MiB** (keys and values, all layers)",
            "",
            table(rows, lambda r: r["kv_bytes"] / 2**20 if "kv_bytes" in r else None, digits=2, errors=False),
            "",
            "**seconds per sample** (wall time on a shared machine: indicative only)",
            "",
            table(rows, lambda r: r.get("time_s"), digits=1, errors=False),
            "",
        ]
        if plots:
            title = f"{heading} — {', '.join(models)} — {machine}"
            stem = f"{out_prefix.name}-{task}" + (f"-{mode}" if mode else "") + (f"-{variant}" if variant > 1 else "")
            for path in plotting.plot_group(rows, plotted_metrics(rows, metrics), out_prefix.parent / stem, title):
                lines += [f"![{path.stem}]({path.name})", ""]
                if digest is not None:
                    digest += [f"plot: {path}", ""]
    if lmeval_rows:
        lines += ["#" + line if line.startswith("#") else line for line in lmeval_lines(lmeval_rows)]
    path = out_prefix.with_suffix(".md")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


SUMMARY_NOTE = (
    "scores: mean ± standard error over the samples; KV MiB: stored keys and values at the end of a sample, mean; "
    "s/sample: wall time, median (min–max), and CPU time, median; × full: ratio of means (KV) or medians (time) "
    "to the full cache's"
)


def plotted_metrics(rows: list[dict[str, Any]], metrics: list[str]) -> list[str]:
    """The metrics drawn against the budget: the task's ``plot_metrics`` present in the rows, else the headline."""
    task = TASKS.get(rows[0]["task"])
    chosen = [m for m in (task.plot_metrics if task is not None else ()) if m in metrics]
    return chosen or metrics[:1]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}" if reference else "–"


def summary_table(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    """Markdown table, one line per method and budget: sample count, every metric (``mean ± se``), stored KV MiB
    and wall / CPU seconds per sample, with the ratio to the full cache (the rows of method ``full``)."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: budget_sort_key(r["budget"])):
        groups[(row.get("label", row["method"]), row["budget"])].append(row)
    full = [r for r in rows if r.get("label", r["method"]) == "full"]  # (not ``full(kv_bits=4)``)
    full_kv = mean_se([r["kv_bytes"] for r in full])[0] if full else None
    full_time = _median([r["time_s"] for r in full]) if full else None
    names = [f"{m} ({'lower' if m in LOWER_IS_BETTER else 'higher'} is better)" for m in metrics]
    lines = [
        "| method | budget | n | " + " | ".join(names) + " | KV MiB | × full | s/sample | CPU s | × full |",
        "|---|---|---|" + "---|" * (len(metrics) + 5),
    ]
    for (label, budget), group in groups.items():
        cells = []
        for metric in metrics:
            values = [r["scores"][metric] for r in group if metric in r["scores"]]
            digits = _digits(metric, [v for r in rows if metric in r["scores"] for v in [r["scores"][metric]]])
            cells.append(_format(*mean_se(values), None, digits) if values else "")
        kv = mean_se([r["kv_bytes"] for r in group])[0]
        times = [r["time_s"] for r in group]
        cpu = [r["cpu_s"] for r in group if "cpu_s" in r]
        wall = f"{_median(times):.2f} ({min(times):.2f}–{max(times):.2f})"
        cells += [f"{kv / 2**20:.2f}", _ratio(kv, full_kv), wall, f"{_median(cpu):.2f}" if cpu else "–"]
        cells.append(_ratio(_median(times), full_time))
        lines.append(f"| {label} | {budget_name(budget)} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def subtask_table(rows: list[dict[str, Any]], metric: str, subtasks: list[str]) -> str:
    """Markdown table of the mean ``metric`` per method and budget (rows) and subtask (columns)."""
    cells: dict[tuple[str, Any, str], list[float]] = defaultdict(list)
    keys: dict[tuple[str, Any], None] = {}
    for row in rows:
        key = (row.get("label", row["method"]), row["budget"])
        keys[key] = None
        cells[(*key, row["info"]["subtask"])].append(row["scores"][metric])
    labels = list(dict.fromkeys(label for label, _ in keys))
    ordered = sorted(keys, key=lambda k: (labels.index(k[0]), budget_sort_key(k[1])))
    lines = ["| method | budget | " + " | ".join(subtasks) + " |", "|---|---|" + "---|" * len(subtasks)]
    for label, budget in ordered:
        entries = []
        for sub in subtasks:
            values = cells.get((label, budget, sub))
            entries.append(f"{sum(values) / len(values):.2f} ({len(values)})" if values else "")
        lines.append(f"| {label} | {budget_name(budget)} | " + " | ".join(entries) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.eval.report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="folder of .jsonl results and/or lm-eval results_*.json (or one file)")
    parser.add_argument("--out", required=True, help="output prefix: writes PREFIX.md and PREFIX-*.png")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--summary", action="store_true", help="print the summary tables and plot paths, then the report's path"
    )
    args = parser.parse_args(argv)
    digest: list[str] = []
    problems: list[str] = []
    path = write_report(args.run_dir, args.out, plots=not args.no_plots, digest=digest, problems=problems)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if args.summary:
        print("\n".join(digest))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
