"""PNG plots of evaluation results (matplotlib, Agg backend): score against budget, perplexity along a stream."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, LogLocator  # noqa: E402

UNITS = {
    "accuracy": "exact-match accuracy",
    "score": "RULER string-match score",
    "ppl": "perplexity",
    "nll": "mean NLL (nats/token)",
    "answer_nll": "answer NLL, teacher-forced (nats/token, lower is better)",
    "rouge1": "ROUGE-1 F vs full cache",
    "rouge2": "ROUGE-2 F vs full cache",
    "rougeL": "ROUGE-L F vs full cache",
}


def _styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    cmap = plt.get_cmap("tab10")
    markers = "osD^vP*Xhp"
    return {label: {"color": cmap(i % 10), "marker": markers[i % len(markers)]} for i, label in enumerate(labels)}


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def plot_score_vs_budget(rows: list[dict[str, Any]], metrics: str | list[str], path: Path, title: str) -> Path:
    """Mean score (± standard error) against the token budget, one line per method, one panel per metric side
    by side; methods without a budget (the full cache) are drawn as horizontal dashed lines. Ratio budgets are
    left out of this plot."""
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    labels = list(dict.fromkeys(r.get("label", r["method"]) for r in rows))
    styles = _styles(labels)
    width = 9 if len(metrics) == 1 else 5 * len(metrics) + 1.5
    fig, axes = plt.subplots(1, len(metrics), figsize=(width, 5), dpi=120, squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        _draw_metric(ax, rows, metric, labels, styles)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="method")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _draw_metric(ax, rows: list[dict[str, Any]], metric: str, labels: list[str], styles) -> None:
    """One panel of ``plot_score_vs_budget``."""
    cells: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if metric in row["scores"]:
            cells[row.get("label", row["method"])][row["budget"]].append(row["scores"][metric])
    budgets = sorted({b for c in cells.values() for b in c if isinstance(b, int)})
    bounded = [label for label in labels if any(isinstance(b, int) for b in cells.get(label, {}))]
    for label in labels:
        points = cells.get(label, {})
        if None in points:
            mean, se = _mean_se(points[None])
            ax.axhline(mean, color="black", linestyle="--", linewidth=1.5, label=f"{label} (no limit)")
            if se:
                ax.axhspan(mean - se, mean + se, color="black", alpha=0.08)
        xs = [b for b in budgets if b in points]
        if not xs:
            continue
        stats = [_mean_se(points[b]) for b in xs]
        # A small horizontal offset per method keeps overlapping lines (e.g. several at 0) visible.
        shift = 2 ** (0.025 * (bounded.index(label) - (len(bounded) - 1) / 2))
        ax.errorbar(
            [x * shift for x in xs],
            [m for m, _ in stats],
            yerr=[s for _, s in stats],
            label=label,
            capsize=3,
            linewidth=1.5,
            markersize=5,
            **styles[label],
        )
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
    ax.set_xlabel("cache budget (tokens kept per layer and KV head)")
    ax.set_ylabel(UNITS.get(metric, metric))
    if metric == "ppl":
        _plain_log_axis(ax)
    elif metric in ("accuracy", "score") or metric.startswith("rouge"):
        ax.set_ylim(-0.05, 1.05)
    ax.grid(True, alpha=0.3)


def running_ppl(rows: list[dict[str, Any]]) -> tuple[list[int], list[float]] | None:
    """Cumulative perplexity along the stream, over all rows' ``extra.nll_bins`` (equal-length streams):
    at the end of bin ``k``, exp(mean NLL of every token predicted so far, all streams together)."""
    bins = [r["extra"]["nll_bins"] for r in rows if r.get("extra", {}).get("nll_bins")]
    if not bins:
        return None
    size = rows[0].get("task_params", {}).get("bin", 1)
    count = min(len(b) for b in bins)
    per_bin = [sum(b[k] for b in bins) / len(bins) for k in range(count)]
    total_tokens = rows[0].get("task_params", {}).get("length", count * size) - 1
    xs, ys, total, seen = [], [], 0.0, 0
    for k, value in enumerate(per_bin):
        width = min(size, total_tokens - k * size) if total_tokens > k * size else size
        total += value * width
        seen += width
        xs.append(seen)
        ys.append(math.exp(total / seen))
    return xs, ys


def plot_stream(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Running perplexity against tokens seen, one panel per budget, one line per method (full in each)."""
    budgets = sorted({r["budget"] for r in rows if isinstance(r["budget"], int)})
    if not budgets or not any(r.get("extra", {}).get("nll_bins") for r in rows):
        return None
    labels = list(dict.fromkeys(r.get("label", r["method"]) for r in rows))
    styles = _styles(labels)
    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4.5), dpi=110, sharey=True, squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        for label in labels:
            chosen = [r for r in rows if r.get("label", r["method"]) == label and r["budget"] in (budget, None)]
            curve = running_ppl(chosen)
            if curve is None:
                continue
            unbounded = all(r["budget"] is None for r in chosen)
            style = {"color": "black", "linestyle": "--"} if unbounded else {"color": styles[label]["color"]}
            ax.plot(*curve, label=label + (" (no limit)" if unbounded else ""), linewidth=1.4, **style)
        ax.set_title(f"budget {budget}", fontsize=9)
        ax.set_xlabel("tokens seen")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("running perplexity (all streams pooled)")
    _plain_log_axis(axes[0][0])
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), fontsize=8, loc="center right", title="method")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def _plain_log_axis(ax) -> None:
    """Log scale with plain-number tick labels (20, 30, 40 rather than 2x10^1)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter(""))


def plot_group(rows: list[dict[str, Any]], metrics: str | list[str], stem: Path, title: str) -> list[Path]:
    """Every plot for one task and mode; returns the PNG paths written (``<stem>-<kind>.png``). ``metrics``: the
    scores drawn against the budget, side by side in one figure."""
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    name = stem.name + f"-{'-'.join(metrics)}-vs-budget.png"
    paths = [plot_score_vs_budget(rows, metrics, stem.with_name(name), title)]
    if rows[0]["task"] == "stream-ppl":
        path = plot_stream(rows, stem.with_name(stem.name + "-running-ppl.png"), title)
        if path is not None:
            paths.append(path)
    return paths
