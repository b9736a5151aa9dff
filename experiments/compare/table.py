"""The comparison's tables: accuracy and prefill+compress time per method and budget, and kept-set agreement."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from experiments.compare.agreement import compare_kept
from experiments.compare.ours import COUNTERPARTS, OURS_FILE
from experiments.compare.samples import SAMPLES_FILE, read_samples
from kvcompress.eval.tasks.niah import string_match_all
from kvcompress.results import read_rows

KVPRESS_FILE = "kvpress.jsonl"
REPORT_FILE = "report.md"
SNAPKV_WINDOW, SNAPKV_KERNEL = 64, 5  # kvpress SnapKVPress defaults, matched by our label's parameters


def _budget_text(budget: int | None) -> str:
    return "no limit" if budget is None else str(budget)


def build_tables(out_dir: str | Path) -> str:
    """The markdown report of ``out_dir`` (samples, both sides' rows)."""
    out_dir = Path(out_dir)
    spec = read_samples(out_dir)
    answers = {s["id"]: s["answers"] for s in spec["samples"]}
    context = {s["id"]: len(s["context_ids"]) for s in spec["samples"]}
    token_ids = {s["id"]: s["context_ids"] for s in spec["samples"]}
    theirs = {(r["sample"], r["method"], r["budget"]): r for r in read_rows(out_dir / KVPRESS_FILE)}
    ours = {(r["sample"], r["method"], r["budget"]): r for r in read_rows(out_dir / OURS_FILE)}
    budgets: list[int | None] = [None, *spec["budgets"]]
    lines = [
        f"Samples: {len(spec['samples'])} niah `{spec['subtask']}` samples (seed {spec['seed']}, prompt length "
        f"{spec['length']}, contexts {min(context.values())}-{max(context.values())} tokens), model "
        f"`{spec['model']}`; budgets {', '.join(map(str, spec['budgets']))} context tokens per layer and KV head.",
        "",
        "### Accuracy and prefill+compress time",
        "",
        "| ours | kvpress | budget | n | accuracy ours | accuracy kvpress | same answer | "
        "prefill+compress CPU s ours (median) | kvpress (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    agreement_lines = [
        "### Kept-set agreement (context indices kept after the prefill, per layer and KV head)",
        "",
        "| ours | kvpress | budget | n | mean Jaccard | min Jaccard | identical (layer, head) sets | "
        "differing indices | of them same-token swaps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    snap_edge: dict[int | None, list[int]] = defaultdict(lambda: [0, 0])
    for label, press in COUNTERPARTS.items():
        for budget in budgets:
            if (label == "full") != (budget is None):
                continue
            ids = [s for s in answers if (s, label, budget) in ours and (s, press, budget) in theirs]
            if not ids:
                continue
            a = [ours[(s, label, budget)] for s in ids]
            b = [theirs[(s, press, budget)] for s in ids]
            acc_a = statistics.mean(string_match_all(r["prediction"], answers[r["sample"]]) for r in a)
            acc_b = statistics.mean(string_match_all(r["prediction"], answers[r["sample"]]) for r in b)
            same = sum(x["prediction"].strip() == y["prediction"].strip() for x, y in zip(a, b, strict=True))
            cpu_a = statistics.median(r["prefill_cpu_s"] for r in a)
            cpu_b = statistics.median(r["prefill_cpu_s"] for r in b)
            lines.append(
                f"| `{label}` | {press} | {_budget_text(budget)} | {len(ids)} | {acc_a:.2f} | {acc_b:.2f} | "
                f"{same}/{len(ids)} | {cpu_a:.2f} | {cpu_b:.2f} |"
            )
            if budget is None:
                continue
            results = [compare_kept(x["kept"], y["kept"], token_ids[s]) for x, y, s in zip(a, b, ids, strict=True)]
            exact = sum(r.exact for r in results)
            pairs = sum(r.pairs for r in results)
            mean = statistics.mean(r.mean_jaccard for r in results)
            differing = sum(len(r.differing) for r in results)
            swaps = sum(r.same_token_swaps for r in results)
            agreement_lines.append(
                f"| `{label}` | {press} | {budget} | {len(ids)} | {mean:.4f} | "
                f"{min(r.min_jaccard for r in results):.4f} | {exact}/{pairs} ({exact / pairs:.1%}) | {differing} | "
                f"{swaps} |"
            )
            if press == "SnapKVPress":
                for r, s in zip(results, ids, strict=True):
                    start = context[s] - SNAPKV_WINDOW
                    edge = range(start - SNAPKV_KERNEL // 2, start)
                    snap_edge[budget][0] += sum(i in edge for i in r.differing)
                    snap_edge[budget][1] += len(r.differing)
    lines += ["", *agreement_lines]
    if snap_edge:
        lines += [
            "",
            f"### SnapKV: where the kept sets differ (window {SNAPKV_WINDOW}, kernel {SNAPKV_KERNEL})",
            "",
            f"| budget | indices kept by one side only | of them within the {SNAPKV_KERNEL // 2} tokens before the "
            "window |",
            "|---|---|---|",
        ]
        for budget, (edge, total) in snap_edge.items():
            share = f"{edge / total:.1%}" if total else "-"
            lines.append(f"| {budget} | {total} | {edge} ({share}) |")
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, doc_data: str | Path | None = None) -> Path:
    """Write ``<out_dir>/report.md``; with ``doc_data``, also copy it there with the rows minus kept sets."""
    out_dir = Path(out_dir)
    text = build_tables(out_dir)
    path = out_dir / REPORT_FILE
    path.write_text(text)
    if doc_data is not None:
        target = Path(doc_data)
        target.mkdir(parents=True, exist_ok=True)
        (target / REPORT_FILE).write_text(text)
        (target / SAMPLES_FILE).write_text((out_dir / SAMPLES_FILE).read_text())
        for name in (KVPRESS_FILE, OURS_FILE):
            rows = [{k: v for k, v in r.items() if k != "kept"} for r in read_rows(out_dir / name)]
            (target / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
