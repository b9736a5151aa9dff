"""``kvcompress leaderboard``: methods × kept ratios on one model and task, as one table and one plot.

    kvcompress leaderboard --model smollm2-135m --task ruler --kept 0.75,0.5,0.25 --samples 22 \\
        --param length=2048 --out runs/leaderboard

The protocol is kvpress's (its RULER leaderboard): the context is compressed before the question is seen
(``agnostic`` mode: the context goes in, is compressed, then the question meets the compressed cache), greedy
answers, RULER's metric. A *kept ratio* is the fraction of the context's tokens the cache keeps (kvpress's
"compression ratio" is one minus it): methods with a ``ratio`` take it directly, the others a budget of
``floor(kept ratio × context tokens)`` per layer and KV head, so every method stores about the same bytes at a
kept ratio (the table shows the bytes each really stored, beside the full cache's).

The results are a resumable JSON-lines file (``<out>/<task>.jsonl``: a rerun adds only what is missing, another
``--kept`` or ``--methods`` adds rows); the leaderboard is written beside it as ``leaderboard.md`` and
``leaderboard.png``, and printed.

Table: one line per method and kept ratio, best first within a ratio: the mean score (×100, as RULER and kvpress
report it) ± its standard error over samples, the sample count, the stored KV bytes at the end of the answer as a
multiple of the full cache's on the same samples, the median wall seconds of the prefill and compression
(``prefill_s``) and the answer's decoding speed (the question's tokens and the answer's, over their wall time). A
per-task table follows for tasks with subtasks (RULER's).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvcompress.eval import kvpress_columns
from kvcompress.eval.configs import EvalConfig, expand_configs
from kvcompress.eval.report import load_results, mean_se, subtask_table
from kvcompress.eval.runner import parse_task_params, run_eval
from kvcompress.eval.tasks import TASKS, make_task
from kvcompress.eval.tasks.qa import QATask
from kvcompress.models import load_model

DEFAULT_METHODS = (
    "full",
    "snapkv",
    "tova_oneshot",
    "h2o_oneshot",
    "streaming_oneshot",
    "knorm",
    "h2o",
    "tova",
    "streaming",
    "window",
    "random",
)
DEFAULT_KEPT = (0.75, 0.5, 0.25)


def parse_kept(text: str) -> list[float]:
    """``"0.75,0.5"`` -> ``[0.75, 0.5]``; each must be a number in (0, 1)."""
    values: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            value = -1.0
        if not 0 < value < 1:
            raise ValueError(f"--kept takes ratios in (0, 1) separated by commas; got {part!r}")
        values.append(value)
    if not values:
        raise ValueError("--kept needs at least one ratio in (0, 1)")
    return values


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def leaderboard_rows(results: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """One entry per (method label, kept ratio): score mean and standard error (×100), n, bytes × full on the same
    samples, median prefill seconds. ``full`` has kept ratio 1. Sorted by kept ratio (high first), then score."""
    full_bytes = {row["sample"]: row["kv_bytes"] for row in results if row.get("label", row["method"]) == "full"}
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for row in results:
        kept = 1.0 if row["budget"] is None else row["budget"]
        if isinstance(kept, float) and kept <= 1:
            groups[(row.get("label", row["method"]), kept)].append(row)
    entries = []
    for (label, kept), rows in groups.items():
        scores = [100 * r["scores"][metric] for r in rows]
        mean, se = mean_se(scores)
        ratios = [r["kv_bytes"] / full_bytes[r["sample"]] for r in rows if full_bytes.get(r["sample"])]
        prefill = [r["prefill_s"] for r in rows if r.get("prefill_s") is not None]
        decoded = [(r["new_tokens"], r["decode_s"]) for r in rows if r.get("decode_s")]
        entries.append(
            {
                "method": label,
                "kept": kept,
                "n": len(rows),
                "score": mean,
                "se": se,
                "bytes_x_full": _median(ratios),
                "prefill_s": _median(prefill),
                "tokens_per_s": sum(n for n, _ in decoded) / sum(t for _, t in decoded) if decoded else None,
            }
        )
    return sorted(entries, key=lambda e: (-e["kept"], -e["score"]))


def leaderboard_table(entries: list[dict[str, Any]]) -> str:
    lines = [
        "| kept | method | score ± se | n | KV bytes × full | prefill + compress s | answer tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        se = "" if e["se"] is None else f" ± {e['se']:.1f}"
        stored = "–" if e["bytes_x_full"] is None else f"{e['bytes_x_full']:.2f}"
        prefill = "–" if e["prefill_s"] is None else f"{e['prefill_s']:.2f}"
        speed = "–" if e["tokens_per_s"] is None else f"{e['tokens_per_s']:.1f}"
        lines.append(
            f"| {e['kept']:g} | {e['method']} | {e['score']:.1f}{se} | {e['n']} | {stored} | {prefill} | {speed} |"
        )
    return "\n".join(lines)


def plot_leaderboard(entries: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Score (± standard error) against the kept ratio, one line per method; the full cache as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    methods = list(dict.fromkeys(e["method"] for e in entries if e["kept"] < 1))
    fig, ax = plt.subplots(figsize=(9, max(5.0, 1.5 + 0.23 * len(methods))), dpi=120)  # room for every legend line
    cmap, markers = plt.get_cmap("tab10"), "osD^vP*Xhp"
    for e in entries:
        if e["kept"] == 1.0:
            ax.axhline(e["score"], color="black", linestyle="--", linewidth=1.5, label=f"{e['method']} (everything)")
    for i, method in enumerate(methods):
        points = sorted((e["kept"], e["score"], e["se"] or 0.0) for e in entries if e["method"] == method)
        ax.errorbar(
            [p[0] for p in points],
            [p[1] for p in points],
            yerr=[p[2] for p in points],
            label=method,
            capsize=3,
            color=cmap(i % 10),
            marker=markers[i % len(markers)],
            linestyle="-" if i < 10 else ":",
        )
    ax.set_xlabel("kept ratio (fraction of the context's tokens stored)")
    ax.set_ylabel("score (×100)")
    ax.set_ylim(-3, 103)
    ax.invert_xaxis()
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def asked_for(
    configs: Sequence[EvalConfig], seed: int, task_params: dict[str, Any]
) -> Callable[[dict[str, Any]], bool]:
    """Which rows of a results file a leaderboard shows: the methods and kept ratios asked for, at the seed and task
    parameters given (a parameter left at its default matches any row), so that earlier runs with other lengths,
    tasks or methods in the same folder stay out of the table."""
    keys = {config.key() for config in configs}
    given = json.loads(json.dumps(task_params))  # tuples as lists, as the rows hold them

    def wanted(row: dict[str, Any]) -> bool:
        key = json.dumps([row["method"], row.get("params", {}), row["budget"]], sort_keys=True)
        recorded = row.get("task_params", {})
        params = all(k not in recorded or recorded[k] == v for k, v in given.items())
        return key in keys and row.get("seed", seed) == seed and params

    return wanted


def write_leaderboard(
    jsonl: Path,
    title: str,
    plot: bool = True,
    select: Callable[[dict[str, Any]], bool] | None = None,
    extra: Sequence[dict[str, Any]] = (),
) -> tuple[Path, str]:
    """Write ``leaderboard.md`` (and ``leaderboard.png``) beside ``jsonl``; return the markdown path and text.
    ``select`` keeps only some rows (``asked_for``); by default every row of the file is shown. ``extra`` rows
    (kvpress's, ``kvpress_columns``) join the table."""
    results, _ = load_results(jsonl)
    if select is not None:
        results = [row for row in results if select(row)]
    results += list(extra)
    if not results:
        raise ValueError(f"{jsonl} holds no results for the methods, kept ratios and task parameters asked for")
    metric = next(iter(results[0]["scores"]))
    entries = leaderboard_rows(results, metric)
    text = f"# {title}\n\n{leaderboard_table(entries)}\n"
    subtasks = list(dict.fromkeys(r["info"]["subtask"] for r in results if "subtask" in r.get("info", {})))
    if subtasks:
        per_task = [{**r, "budget": 1.0 if r["budget"] is None else r["budget"]} for r in results]
        text += "\nPer task (mean score, sample count):\n\n" + subtask_table(per_task, metric, subtasks) + "\n"
    out = jsonl.parent / "leaderboard.md"
    if plot:
        png = plot_leaderboard(entries, jsonl.parent / "leaderboard.png", title)
        text += f"\n![score against kept ratio]({png.name})\n"
    out.write_text(text, encoding="utf-8")
    return out, text


def kvpress_side_rows(args: argparse.Namespace, kept: list[float], params: dict[str, Any], out: Path):
    """Run ``--presses`` in kvpress's environment on this leaderboard's samples; their rows, scored here."""
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    model, tokenizer = load_model(args.model)
    task = make_task(args.task, model, tokenizer, seed=args.seed, **params)
    kvpress_columns.check_kvpress(args.kvpress, presses, task)
    samples = task.build_samples(args.samples)
    spec = out / "kvpress-samples.json"
    kvpress_columns.write_samples(spec, args.model, model, samples, kept, presses)
    side = out / "kvpress.jsonl"
    kvpress_columns.run_side(args.kvpress, spec, side, args.threads)
    wanted = {(p, k) for p in presses for k in kept}
    rows = kvpress_columns.leaderboard_rows(task, samples, side)
    return [r for r in rows if (r["method"].removeprefix(kvpress_columns.PREFIX), r["budget"]) in wanted]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcompress leaderboard", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name, local path or Hub id")
    parser.add_argument("--task", default="ruler", help="a question-answering task (ruler, niah, passkey, docqa)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated; name[:k=v;...]")
    parser.add_argument("--kept", default=",".join(map(str, DEFAULT_KEPT)), help="kept ratios in (0, 1)")
    parser.add_argument("--samples", type=int, default=22)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/leaderboard", help="folder for the results and the leaderboard")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--param", action="append", default=[], help="task parameter key=value (repeatable)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--kvpress", metavar="PYTHON", help="kvpress's environment's python: add kvpress columns on the same ids"
    )
    parser.add_argument(
        "--presses",
        default="KVzipPress,KeyDiffPress,SnapKVPress,AdaKVPress(ExpectedAttentionPress)",
        help="with --kvpress: kvpress press classes, comma-separated (Wrapper(Inner) allowed)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    answering = [name for name, task in TASKS.items() if issubclass(task, QATask)]
    if args.task not in answering:
        raise ValueError(f"--task must be a question-answering task ({', '.join(answering)}); got {args.task!r}")
    kept = parse_kept(args.kept)
    params = {"modes": "agnostic", **parse_task_params(args.param)}
    methods = [m.strip().replace(";", ",") for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods needs at least one method")
    out = Path(args.out) / args.model.replace("/", "_")
    side_rows: list[dict[str, Any]] = []
    if args.kvpress:
        side_rows = kvpress_side_rows(args, kept, params, out)
    path = run_eval(args.task, args.model, methods, kept, args.samples, args.seed, out, **params)
    select = asked_for(expand_configs(methods, kept), args.seed, params)
    title = (
        f"{args.task} on {args.model}: score against kept ratio ({', '.join(f'{k}={v}' for k, v in params.items())})"
    )
    report, text = write_leaderboard(path, title, plot=not args.no_plot, select=select, extra=side_rows)
    print(text)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
