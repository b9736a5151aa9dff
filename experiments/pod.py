"""Experiments behind ``docs/results/pod.md``: PoD on SmolLM2-135M (CPU), training-free and after adaptation.

Every table in the document comes from one of these commands. Results append to
``docs/results/pod_results.jsonl``; rows already there are skipped, so a run can be resumed::

    python -m experiments.pod similarity   # heat map, blocks per delta, saving vs delta (+ JSON copy)
    python -m experiments.pod ppl          # WikiText-2 test NLL/perplexity (windows of 512 tokens)
    python -m experiments.pod ppl-gutenberg  # the same on held-out windows of the training books
    python -m experiments.pod tau          # tau sweep: distant rows skipped vs perplexity
    python -m experiments.pod passkey      # passkey retrieval at 512 tokens
    python -m experiments.pod niah         # RULER-style needle tasks at 512 tokens
    python -m experiments.pod report       # markdown tables + docs/results/pod_*.png

Setting (all runs): n = 512-token contexts, n_sink = 16, n_recent = 64 (the paper's 4096-of-32K proximal share is
1/8; 80 of 512 is 16 %), grouping per KV head on the Gutenberg calibration file, v1 (block-start query and key).
``weights``: ``base`` (the model as shipped), ``adapted`` (after ``pod-adapt`` with PoD attention, delta = 0.5) or
``control`` (the same training with dense attention). Perplexity: NLL of the last 256 tokens of each window (every
one of them has at least 176 distant tokens); PoD and the dense model are teacher-forced in one forward (tests
check that equals decoding); eviction baselines are fed 16 tokens per forward so that they really evict (a query
sees at most budget + 15 keys: a small advantage to them).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn import functional as F

import kvcompress
from kvcompress.eval.data import wikitext_test
from kvcompress.eval.tasks import make_task
from kvcompress.generation import cache_argument
from kvcompress.methods.pod.grouping import (
    block_starts,
    format_blocks,
    group_layers,
    head_similarity,
    kv_saving,
    load_similarity,
    starts_from_similarity,
)
from kvcompress.methods.pod.layer import pod_stats
from kvcompress.methods.snapkv import SnapKVConfig
from kvcompress.models import load_model, model_info
from kvcompress.results import append_row, read_rows
from kvcompress.train.pod_adapt import AdaptConfig, load_adapted
from kvcompress.train.pod_calibrate import default_output, default_training_files, save_similarity, token_windows

ROOT = Path(__file__).resolve().parents[1]  # the repository
DATA = ROOT.parent / "shared" / "data"
DOCS = ROOT / "docs" / "results"
RESULTS = DOCS / "pod_results.jsonl"
LOGS = DOCS / "pod_adapt_logs"  # copies of the adaptation runs' training logs
MODEL = "smollm2-135m"
LENGTH, NS, NR, SCORED = 512, 16, 64, 256
STREAM_CHUNK = 16  # eviction baselines: tokens per forward (a query sees at most budget + 15 keys)
POD_RUNS = Path.home() / ".cache" / "kvcompress" / "pod"
WEIGHTS = {
    "adapted": POD_RUNS / "adapt-d05" / "final.pt",  # 32 steps x 512 tokens, PoD delta = 0.5
    "control": POD_RUNS / "control" / "final.pt",  # the same with dense attention
    "adapted-100k": POD_RUNS / "adapt-d05-100k" / "final.pt",  # 200 steps x 512 tokens
    "control-100k": POD_RUNS / "control-100k" / "final.pt",
}
TRAINED_WINDOWS = 200  # the adaptation runs read the first 200 windows of randperm(seed 0): never evaluated on
DELTAS = (0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
TAUS = (0.95, 0.9, 0.8, 0.7, 0.5, 0.0)


def similarity_file() -> Path:
    return default_output(MODEL)


def pod(delta: float, **extra: object) -> tuple[str, dict[str, object]]:
    return "pod", {"similarity": str(similarity_file()), "delta": delta, "n_sink": NS, "n_recent": NR, **extra}


def equal_budget(delta: float = 0.5) -> int:
    """Tokens per layer and KV head a full-precision eviction cache stores for PoD(delta)'s bytes at n = 512."""
    starts = starts_from_similarity(load_similarity(similarity_file()), delta, None)
    return round(LENGTH * (1 - kv_saving(starts, LENGTH, NS, NR)[0]))


def configs(name: str) -> dict[str, tuple[str, dict[str, object], str]]:
    """Row label -> (method, params, feed) of an experiment; feed is ``forward`` (one pass) or ``stream``."""
    eq = equal_budget(0.5)
    table: dict[str, tuple[str, dict[str, object], str]] = {"dense": ("full", {}, "forward")}
    for delta in DELTAS:
        table[f"pod-d{delta}"] = (*pod(delta), "forward")
    table["pod-v2-d0.5"] = (*pod(0.5, query_source="own"), "forward")
    table["pod-d0.5-tau0"] = (*pod(0.5, tau=0.0), "forward")  # proximal-only at non-start heads
    table["streaming-mask-80"] = ("streaming", {"budget": NS + NR, "sinks": NS, "position_mode": "original"}, "stream")
    table["streaming-80"] = ("streaming", {"budget": NS + NR, "sinks": NS}, "stream")
    table[f"streaming-{eq}"] = ("streaming", {"budget": eq, "sinks": NS}, "stream")
    table[f"h2o-{eq}"] = ("h2o", {"budget": eq}, "stream")
    if name == "tau":
        table = {f"pod-d0.5-tau{t}": (*pod(0.5, tau=t), "forward") for t in TAUS}
        table["pod-d0.5"] = (*pod(0.5), "forward")
    if name in ("passkey", "niah"):
        table = {k: v for k, v in table.items() if not k.startswith("pod-d0.3") and k != "pod-d0.8"}
        table["snapkv-128"] = ("snapkv", {"budget": 128, "window": 32}, "forward")
        table["pod-d0.5+snapkv-128"] = (*pod(0.5, base=SnapKVConfig(budget=128, window=32)), "forward")
    return table


def load(weights: str = "base"):
    torch.set_num_threads(1)
    model, tokenizer = load_model(MODEL)
    if weights != "base":
        load_adapted(model, WEIGHTS[weights])
    return model, tokenizer, model_info(model)["kv_bytes_per_token"]


def wikitext_windows(tokenizer, count: int) -> torch.Tensor:
    """``count`` windows of 512 tokens spread evenly over WikiText-2 test."""
    ids = tokenizer(wikitext_test(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    total = ids.numel() // LENGTH
    picks = torch.linspace(0, total - 1, count).round().long()
    return ids[: total * LENGTH].view(total, LENGTH)[picks]


def gutenberg_windows(tokenizer, count: int) -> torch.Tensor:
    """``count`` 512-token windows of the training books (in-domain) that no adaptation run trained on: the runs
    read windows in the order ``randperm(N, seed 0)`` (``pod_adapt``, seed 0, batch 1) and none read more than
    ``TRAINED_WINDOWS``; the held-out ones are picked evenly among the rest."""
    windows = token_windows(tokenizer, default_training_files(), LENGTH)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(AdaptConfig().seed))
    held = sorted(set(range(len(windows))) - set(order[:TRAINED_WINDOWS].tolist()))
    picks = torch.linspace(0, len(held) - 1, count).round().long()
    return windows[torch.tensor(held)[picks]]


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, method: str, params: dict, feed: str) -> tuple[torch.Tensor, object]:
    """NLL of the last ``SCORED`` tokens of one window ``[n]``; the cache after it."""
    cache = kvcompress.cache_for(model, method, **params)
    if feed == "forward":
        logits = model(input_ids=ids[None], **cache_argument(model, cache), use_cache=True).logits[0]
    else:
        parts = [
            model(input_ids=ids[None, s : s + STREAM_CHUNK], **cache_argument(model, cache), use_cache=True).logits[0]
            for s in range(0, LENGTH, STREAM_CHUNK)
        ]
        logits = torch.cat(parts)
    targets = ids[LENGTH - SCORED :]
    return F.cross_entropy(logits[LENGTH - SCORED - 1 : -1].float(), targets, reduction="none"), cache


def run_ppl(experiment: str, labels: Sequence[str] | None, weights: Sequence[str], windows: int) -> None:
    done = {(r["experiment"], r["label"], r["weights"], r["sample"]) for r in read_rows(RESULTS)}
    table = configs("ppl" if experiment == "ppl-gutenberg" else experiment)
    for weight in weights:
        model, tokenizer, per_token = load(weight)
        data = (gutenberg_windows if experiment == "ppl-gutenberg" else wikitext_windows)(tokenizer, windows)
        for label in labels or table:
            method, params, feed = table[label]
            for index, window in enumerate(data):
                if (experiment, label, weight, index) in done:
                    continue
                start = time.perf_counter()
                nll, cache = window_nll(model, window, method, params, feed)
                row = {
                    "experiment": experiment,
                    "label": label,
                    "weights": weight,
                    "sample": index,
                    "nll": float(nll.mean()),
                    "top1": None,
                    "kv_bytes": cache.nbytes(),
                    "dense_bytes": cache.tokens_seen() * per_token,
                    "time_s": round(time.perf_counter() - start, 2),
                }
                if method == "pod":
                    row["gate"] = pod_stats(cache)
                append_row(row, RESULTS)
                print(f"{experiment} {weight} {label} #{index}: nll {row['nll']:.3f} ({row['time_s']} s)", flush=True)


def run_task(task_name: str, labels: Sequence[str] | None, weights: Sequence[str], samples: int) -> None:
    done = {(r["experiment"], r["label"], r["weights"], r["sample"]) for r in read_rows(RESULTS)}
    table = configs(task_name)
    for weight in weights:
        model, tokenizer, per_token = load(weight)
        params = {"length": LENGTH, "chunk_size": 64, "modes": ("aware",)}
        task = make_task(task_name, model, tokenizer, seed=0, **params)
        items = task.build_samples(samples)
        for label in labels or table:
            method, method_params, _ = table[label]
            for index, sample in enumerate(items):
                if (task_name, label, weight, index) in done:
                    continue
                cache = kvcompress.cache_for(model, method, **method_params)
                start = time.perf_counter()
                result = task.evaluate(sample, None, cache, "aware")
                row = {
                    "experiment": task_name,
                    "label": label,
                    "weights": weight,
                    "sample": index,
                    "score": next(iter(result.scores.values())),
                    "kv_bytes": cache.nbytes(),
                    "dense_bytes": cache.tokens_seen() * per_token,
                    "info": sample.info,
                    "prediction": result.extra.get("prediction"),
                    "time_s": round(time.perf_counter() - start, 2),
                }
                append_row(row, RESULTS)
                print(f"{task_name} {weight} {label} #{index}: {row['score']} ({row['time_s']} s)", flush=True)


# --- similarity and grouping ------------------------------------------------------------------------------------
def run_similarity() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load_similarity(similarity_file())
    save_similarity(data, DOCS / "pod_similarity_smollm2.pt.tmp", DOCS / "pod_similarity_smollm2.json")
    (DOCS / "pod_similarity_smollm2.pt.tmp").unlink()
    sim = head_similarity(data, "kv_head")
    fig, axes = plt.subplots(1, sim.shape[0], figsize=(5 * sim.shape[0], 4.5))
    for g, ax in enumerate(axes):
        image = ax.imshow(sim[g].numpy(), vmin=0, vmax=1, cmap="viridis", origin="lower")
        ax.set_title(f"KV head {g} (1 - JS, mean of 3 query heads)", fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes, shrink=0.8)
    fig.suptitle(
        f"SmolLM2-135M inter-layer attention similarity ({data['meta']['samples']} x "
        f"{data['meta']['length']} Gutenberg tokens, last {data['meta']['last_queries']} queries)"
    )
    fig.savefig(DOCS / "pod_similarity.png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    grid = [round(0.05 * i, 2) for i in range(4, 20)]
    curves = {"kv_head": [], "query_head": []}
    for grouping in curves:
        s = head_similarity(data, grouping)
        for delta in grid:
            starts = block_starts(group_layers(s, delta))
            curves[grouping].append(kv_saving(starts, LENGTH, NS, NR, kv_heads=data["kv_heads"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(grid, [100 * c[1] for c in curves["kv_head"]], "o-", label="per KV head, saving(inf)")
    ax.plot(grid, [100 * c[0] for c in curves["kv_head"]], "s--", label="per KV head, saving(n=512, 16+64)")
    ax.plot(grid, [100 * c[1] for c in curves["query_head"]], "^:", label="per query head (GQA rule), saving(inf)")
    ax.set_xlabel("delta")
    ax.set_ylabel("KV-cache saving (%)")
    ax.set_title("SmolLM2-135M: PoD KV saving vs threshold delta")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(DOCS / "pod_saving.png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    print("| delta | blocks per KV head | saving(n=512) | saving(inf) | per-query-head saving(inf), GQA rule |")
    print("|---|---|---|---|---|")
    for delta in DELTAS:
        blocks = group_layers(sim, delta)
        at_n, inf = kv_saving(block_starts(blocks), LENGTH, NS, NR)
        qh = kv_saving(block_starts(group_layers(head_similarity(data, "query_head"), delta)), None, 0, 0, 3)[1]
        print(f"| {delta} | {', '.join(str(len(b)) for b in blocks)} | {at_n:.1%} | {inf:.1%} | {qh:.1%} |")
    for delta in (0.7, 0.6, 0.5, 0.4):
        print(f"\ndelta = {delta}:")
        for g, line in enumerate(format_blocks(group_layers(sim, delta))):
            print(f"- KV head {g}: `{line}`")


# --- report --------------------------------------------------------------------------------------------------------
def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def report() -> None:
    rows = read_rows(RESULTS)
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["experiment"], row["weights"], row["label"]), []).append(row)
    for experiment in ("ppl", "ppl-gutenberg", "tau", "passkey", "niah"):
        keys = [k for k in groups if k[0] == experiment]
        if not keys:
            continue
        print(f"\n### {experiment}\n")
        if experiment in ("ppl", "ppl-gutenberg", "tau"):
            print("| weights | config | windows | KV bytes vs dense | NLL | PPL | distant rows skipped |")
            print("|---|---|---|---|---|---|---|")
        else:
            print("| weights | config | samples | KV bytes vs dense | score |")
            print("|---|---|---|---|---|")
        for key in keys:
            group = groups[key]
            kept = _mean([r["kv_bytes"] / r["dense_bytes"] for r in group])
            if experiment in ("ppl", "ppl-gutenberg", "tau"):
                nll = _mean([r["nll"] for r in group])
                gates = [r["gate"] for r in group if r.get("gate")]
                eligible = sum(g["eligible"] for g in gates)
                skipped = f"{sum(g['skipped'] for g in gates) / eligible:.1%}" if eligible else "-"
                print(
                    f"| {key[1]} | {key[2]} | {len(group)} | {kept:.1%} | {nll:.3f} | {math.exp(nll):.2f} | {skipped} |"
                )
            else:
                score = _mean([r["score"] for r in group])
                print(f"| {key[1]} | {key[2]} | {len(group)} | {kept:.1%} | {score:.2f} |")
    _plot_tau(groups)
    _plot_training()
    if (DOCS / "pod.md").exists():
        write_doc_tables()


DOC_TABLES = {  # marker in docs/results/pod.md -> which rows (experiment, weights, label) it shows
    "ppl-base": lambda e, w, label: e == "ppl" and w == "base",
    "passkey-base": lambda e, w, label: e == "passkey" and w == "base",
    "tau": lambda e, w, label: (
        e in ("tau", "ppl") and w in ("base", "adapted") and (label == "pod-d0.5" or label.startswith("pod-d0.5-tau"))
    ),
    "adapt": lambda e, w, label: (
        e in ("ppl", "passkey") and w != "base" or (e in ("ppl", "passkey") and label in ("dense", "pod-d0.5"))
    ),
    "gutenberg": lambda e, w, label: e == "ppl-gutenberg",
    "niah": lambda e, w, label: e == "niah",
}


TASK_NAMES = {"ppl": "wikitext", "tau": "wikitext", "ppl-gutenberg": "gutenberg (held-out)"}


def doc_table(rows: list[dict], keep) -> str:
    """One markdown table of mean scores per (experiment, weights, label) for the rows ``keep`` selects."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        if keep(row["experiment"], row["weights"], row["label"]):
            groups.setdefault((row["experiment"], row["weights"], row["label"]), []).append(row)
    groups = dict(
        sorted(groups.items(), key=lambda item: (item[0][0] != "ppl", item[0][0], item[0][1] != "base", item[0][1]))
    )
    lines = [
        "| task | weights | config | samples | KV bytes vs dense | NLL | PPL | score | distant rows skipped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (experiment, weight, label), group in groups.items():
        kept = _mean([r["kv_bytes"] / r["dense_bytes"] for r in group])
        nll = _mean([r["nll"] for r in group]) if "nll" in group[0] else math.nan
        score = _mean([r["score"] for r in group]) if "score" in group[0] else math.nan
        gates = [r["gate"] for r in group if r.get("gate")]
        eligible = sum(g["eligible"] for g in gates)
        skipped = f"{sum(g['skipped'] for g in gates) / eligible:.1%}" if eligible else "-"
        task = TASK_NAMES.get(experiment, experiment)
        cells = [
            task,
            weight,
            label,
            str(len(group)),
            f"{kept:.1%}",
            "-" if math.isnan(nll) else f"{nll:.3f}",
            "-" if math.isnan(nll) else f"{math.exp(nll):.2f}",
            "-" if math.isnan(score) else f"{score:.2f}",
            skipped,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_doc_tables(path: Path = DOCS / "pod.md") -> None:
    """Rewrite the tables between ``<!-- table:NAME -->`` and ``<!-- /table -->`` markers of the results page."""
    text = path.read_text()
    rows = read_rows(RESULTS)
    for name, spec in DOC_TABLES.items():
        pattern = re.compile(rf"(<!-- table:{name} -->\n)(?:(?!<!-- ).*?\n)??(<!-- /table -->)", re.S)
        text = pattern.sub(lambda m, spec=spec: m.group(1) + doc_table(rows, spec) + "\n" + m.group(2), text)
    path.write_text(text)


def _plot_tau(groups) -> None:
    points = []
    for (experiment, weights, label), group in groups.items():
        if experiment not in ("tau", "ppl") or not label.startswith("pod-d0.5") or "v2" in label:
            continue
        if experiment == "ppl" and label not in ("pod-d0.5", "pod-d0.5-tau0"):
            continue
        gates = [r["gate"] for r in group]
        eligible = sum(g["eligible"] for g in gates)
        fraction = sum(g["skipped"] for g in gates) / eligible if eligible else 0.0
        points.append((weights, fraction, math.exp(_mean([r["nll"] for r in group]))))
    if not points:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for weights in sorted({p[0] for p in points}):
        xs = sorted((p[1], p[2]) for p in points if p[0] == weights)
        ax.plot([100 * x for x, _ in xs], [y for _, y in xs], "o-", label=f"PoD delta=0.5, {weights} weights")
    ax.set_xlabel("distant-token rows skipped at non-start heads (%)")
    ax.set_ylabel("WikiText-2 perplexity (last 256 of 512)")
    ax.set_title("SmolLM2-135M: tau gate, compute skipped vs perplexity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(DOCS / "pod_tau.png", dpi=90, bbox_inches="tight")
    plt.close(fig)


def _plot_training() -> None:
    """Training loss of each run (mean of 10 steps: batch 1, windows differ a lot) and, for each PoD run and its
    control (same windows in the same order), the per-step difference PoD − control: the PoD-specific gap.

    Each run's ``log.jsonl`` is copied next to the results (``pod_adapt_logs/NAME.jsonl``), so the plot can be redrawn
    after the run folders (outside the repository) are gone."""
    LOGS.mkdir(exist_ok=True)
    for name, path in WEIGHTS.items():
        if (path.parent / "log.jsonl").exists():
            shutil.copyfile(path.parent / "log.jsonl", LOGS / f"{name}.jsonl")
    logs = {name: LOGS / f"{name}.jsonl" for name in WEIGHTS}
    if not any(p.exists() for p in logs.values()):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values: list[float]) -> list[float]:
        return [_mean(values[max(0, i - 9) : i + 1]) for i in range(len(values))]

    losses = {}
    for name, path in logs.items():
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            losses[name] = {r["tokens"]: r["loss"] for r in records}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for name, curve in losses.items():
        tokens = sorted(curve)
        left.plot(tokens, smooth([curve[t] for t in tokens]), label=name)
    for pod_run, control_run in (("adapted", "control"), ("adapted-100k", "control-100k")):
        if pod_run in losses and control_run in losses:
            tokens = sorted(set(losses[pod_run]) & set(losses[control_run]))
            gap = [losses[pod_run][t] - losses[control_run][t] for t in tokens]
            right.plot(tokens, smooth(gap), label=f"{pod_run} − {control_run}")
    left.set_ylabel("training loss (nats, mean of 10 steps)")
    left.set_title("SmolLM2-135M on Gutenberg: PoD delta=0.5 runs vs dense controls", fontsize=10)
    right.set_ylabel("PoD loss − control loss, same windows (nats)")
    right.set_title("PoD-specific gap during training (mean of 10 steps)", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(DOCS / "pod_adapt_loss.png", dpi=90, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PoD experiments on SmolLM2-135M (docs/results/pod.md).")
    parser.add_argument(
        "experiment", choices=("similarity", "ppl", "ppl-gutenberg", "tau", "passkey", "niah", "report")
    )
    parser.add_argument("--labels", nargs="*", default=None, help="row labels (default: all of the experiment)")
    parser.add_argument("--weights", nargs="*", default=["base"], choices=("base", *WEIGHTS))
    parser.add_argument("--samples", type=int, default=8, help="windows (ppl, tau) or task samples")
    args = parser.parse_args(argv)
    if args.experiment == "similarity":
        run_similarity()
    elif args.experiment in ("ppl", "ppl-gutenberg", "tau"):
        run_ppl(args.experiment, args.labels, args.weights, args.samples)
    elif args.experiment in ("passkey", "niah"):
        run_task(args.experiment, args.labels, args.weights, args.samples)
    else:
        report()


if __name__ == "__main__":
    main()
