"""Plots of benchmark rows (matplotlib, Agg backend): units on the axes, a legend, model and machine in the title."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Row = dict[str, object]


def _by(rows: Sequence[Row], key: str) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(str(row[key]), []).append(row)
    return groups


def _save(fig: plt.Figure, path: str | Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (PNG at 110 dpi) and close it; returns ``path`` as a ``Path``."""
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_DECODE_METRICS = {
    "cpu_ms": ("median CPU time per decode step (ms)", "decode step CPU time"),
    "step_ms": ("median wall time per decode step (ms)", "decode step wall time"),
}


def plot_decode(
    rows: Sequence[Row], path: str | Path, *, model: str, machine: str, budget: int, metric: str = "cpu_ms"
) -> Path:
    """Decode step time (left; ``metric`` ``cpu_ms`` or ``step_ms``) and stored KV (right) vs context, log-x."""
    ylabel, title = _DECODE_METRICS[metric]
    fig, (ax_time, ax_kv) = plt.subplots(1, 2, figsize=(13, 5.2))
    for method, group in _by(rows, "method").items():
        group = sorted(group, key=lambda r: r["context"])
        contexts = [r["context"] for r in group]
        style = {"linewidth": 2.4, "color": "black"} if method in ("full", "DynamicCache (sdpa)") else {}
        if method == "DynamicCache (sdpa)":
            style = {"linewidth": 1.6, "color": "grey", "linestyle": "--"}
        ax_time.plot(contexts, [r[metric] for r in group], marker="o", label=method, **style)
        ax_kv.plot(contexts, [r["kv_mib"] for r in group], marker="o", label=method, **style)
    for ax in (ax_time, ax_kv):
        ax.set_xscale("log", base=2)
        contexts = sorted({r["context"] for r in rows})
        ax.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
        ax.set_xlabel("logical context length (tokens, log scale)")
        ax.grid(True, alpha=0.3)
    ax_time.set_ylabel(ylabel)
    ax_time.set_ylim(bottom=0)
    ax_time.set_title(title)
    ax_kv.set_ylabel("stored keys + values, all layers (MiB)")
    ax_kv.set_yscale("log")
    ax_kv.set_title("stored KV cache")
    ax_time.legend(fontsize=8, title=f"bounded methods: budget {budget}", loc="upper left")
    fig.suptitle(f"decode vs context — {model}, {machine}", fontsize=10)
    return _save(fig, path)


def plot_prefill(rows: Sequence[Row], path: str | Path, *, model: str, machine: str) -> Path:
    """Grouped bars: prefill CPU (else wall) time and peak RSS above start per method, one pass vs chunked."""
    prompts = sorted({r["prompt"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    labels = [f"{m}\n{p // 1024}K" if p % 1024 == 0 else f"{m}\n{p}" for p in prompts for m in methods]
    index = {(r["method"], r["prompt"], r["mode"]): r for r in rows}
    cpu = all(r.get("cpu_s") is not None for r in rows)
    time_key, time_label = ("cpu_s", "prefill CPU time (s)") if cpu else ("time_s", "prefill wall time (s)")
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(modes)
    for ax, key, ylabel in (
        (axes[0], time_key, time_label),
        (axes[1], "peak_extra_mib", "peak RSS above start of prefill (MiB)"),
    ):
        for k, mode in enumerate(modes):
            values = [index.get((m, p, mode), {}).get(key, 0) for p in prompts for m in methods]
            positions = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(values))]
            ax.bar(positions, values, width, label=mode)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_xlabel("method / prompt length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("prefill CPU time" if cpu else "prefill wall time")
    axes[1].set_title("peak memory")
    fig.suptitle(f"prefill one pass vs chunked — {model}, {machine}", fontsize=10)
    return _save(fig, path)


def plot_cache_op(rows: Sequence[Row], path: str | Path, *, setup: str, machine: str) -> Path:
    """Horizontal bars: median µs per cache update (process CPU time where recorded, else wall time)."""
    rows = list(rows)
    names = [str(r["cache"]) for r in rows]
    cpu = all(r.get("cpu_us") is not None for r in rows)
    medians = [float(r["cpu_us" if cpu else "median_us"]) for r in rows]
    colors = ["tab:grey" if r["kind"] != "kvcompress" else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.8))
    ax.barh(range(len(rows)), medians, color=colors)
    ax.set_yticks(range(len(rows)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xscale("log")
    kind = "CPU time" if cpu else "wall time"
    ax.set_xlabel(f"median {kind} per cache update (µs, log scale)")
    ax.grid(True, axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color="tab:blue", label="kvcompress"), Patch(color="tab:grey", label="references")],
        fontsize=8,
        loc="upper right",
    )
    ax.set_title(f"cache-op — {setup}\n{machine}", fontsize=10)
    return _save(fig, path)
