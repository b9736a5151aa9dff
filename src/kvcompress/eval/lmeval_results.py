"""lm-evaluation-harness results files (``results_*.json``) as report tables, beside the eval suite's JSONL.

``kvcompress lm-eval ... --output_path DIR`` writes one ``results_<date>.json`` per run under ``DIR``. Each gives
per task the aggregate of every metric and its standard error (lm-eval's own), the sample count, and, for the
``kvcompress`` model, the method, its parameters and the KV bytes stored per request (``config.kvcompress``).
A run of lm-eval's ``hf`` model appears as method ``hf``. Reading needs no lm-eval.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any


def load_lmeval(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One row per (results file, task): ``task, method, budget, model, n, metrics {name: (value, stderr)},
    kv_mib`` (mean stored KV MiB per request, ``None`` for lm-eval's own models)."""
    path = Path(run_dir)
    files = [path] if path.is_file() and path.suffix == ".json" else sorted(path.rglob("results_*.json"))
    rows = []
    for file in files:
        data = json.loads(file.read_text(encoding="utf-8"))
        config = data.get("config", {})
        ours = config.get("kvcompress") or {}
        counts = data.get("n-samples", {})
        for task, scores in data.get("results", {}).items():
            metrics = {
                name: (value, scores.get(name.replace(",", "_stderr,", 1)))
                for name, value in scores.items()
                if isinstance(value, (int, float)) and "," in name and "_stderr," not in name
            }
            mean_bytes = ours.get("kv_bytes_mean")
            rows.append(
                {
                    "task": task,
                    "method": ours.get("method", config.get("model", "?")),
                    "budget": (ours.get("params") or {}).get("budget"),
                    "model": _model_name(config),
                    "n": (counts.get(task) or {}).get("effective"),
                    "metrics": metrics,
                    "kv_mib": mean_bytes / 2**20 if mean_bytes is not None else None,
                }
            )
    return rows


def _model_name(config: dict[str, Any]) -> str:
    args = config.get("model_args")
    if isinstance(args, dict):
        return str(args.get("pretrained", "?"))
    for part in str(args or "").split(","):
        key, _, value = part.partition("=")
        if key.strip() == "pretrained":
            return value.strip()
    return "?"


def lmeval_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: per task and metric, a method x budget table of ``value ± stderr (n)``; then stored KV MiB."""
    lines = ["# lm-evaluation-harness results", "", f"Models: {', '.join(sorted({r['model'] for r in rows}))}.", ""]
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_task[row["task"]].append(row)
    for task, task_rows in by_task.items():
        lines += [f"## {task} (lm-eval)", ""]
        metrics = list(dict.fromkeys(name for row in task_rows for name in row["metrics"]))
        for metric in metrics:
            lines += [f"**{metric}**", "", _table(task_rows, lambda r, m=metric: _cell(r, m)), ""]
        kv = _table(task_rows, lambda r: f"{r['kv_mib']:.3f}" if r["kv_mib"] is not None else "")
        lines += ["**stored KV MiB per request** (mean over every request of the run, at its end)", "", kv, ""]
    return lines


def _cell(row: dict[str, Any], metric: str) -> str:
    if metric not in row["metrics"]:
        return ""
    value, stderr = row["metrics"][metric]
    text = f"{value:.4f}"
    if isinstance(stderr, (int, float)):
        text += f" ± {stderr:.4f}"
    return f"{text} ({row['n']})"


def _table(rows: list[dict[str, Any]], cell) -> str:
    methods = list(dict.fromkeys(row["method"] for row in rows))
    budgets = sorted({row["budget"] for row in rows}, key=lambda b: (b is not None, b or 0))
    cells = {(row["method"], row["budget"]): cell(row) for row in rows}
    names = ["no limit" if b is None else str(b) for b in budgets]
    lines = ["| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(budgets)]
    for method in methods:
        lines.append(f"| {method} | " + " | ".join(cells.get((method, b), "") for b in budgets) + " |")
    return "\n".join(lines)
