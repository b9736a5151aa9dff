"""Experiments behind ``docs/results/less.md``: LESS against its sparse policy (Baseline), the policy with the same
extra memory (Baseline+) and the full cache, on SmolLM2-135M and WikiText-2 test.

Every table in the document comes from one of these commands (results append to a JSONL file; rows already there
are skipped, so a run can be resumed; ``report`` turns the file into markdown tables and plots)::

    python -m experiments.less ppl --policy h2o --budgets 24 50 102 --kernels DIR [--mode masked|decode]
    python -m experiments.less training DIR [DIR ...]   # per-layer MSE, cost, kernel size
    python -m experiments.less ship DIR NAME             # fp16 copy into the package (kernels=NAME)
    python -m experiments.less report                   # markdown tables + docs/results/less_*.png

Protocol: ``--windows`` windows of ``--window`` tokens (default 16 x 512) evenly spaced over WikiText-2 test (never
used for training), token-level perplexity of every next token of each window. Budgets are tokens per layer and KV
head, given as shares of the 512-token window (5 / 10 / 20 % = 24 / 50 / 102 for H2O's even split; spec A4).
Two ways to run a configuration:

- ``masked``: one parallel forward per window with every layer in the masked form (``kvcompress.methods.less.masked``):
  each layer simulates its base policy on its own queries and keys (generation rule) and LESS adds the evicted
  tokens' low-rank term. This is the paper's Table 2 style evaluation.
- ``decode``: the real compressed cache, token 0 as the prompt and every later token fed alone (Algorithm 1):
  what ``model.generate`` does. By construction it equals ``masked`` up to float rounding, which this checks.

Rows: ``full``; ``baseline`` (the policy at budget B); ``baseline+`` (B + R/2 = B + 4 tokens per KV head, the memory
of LESS's state H); ``less`` (B + the state, kernels trained at the budget recorded in ``train_budget``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import kvcompress
from kvcompress.eval.data import wikitext_test
from kvcompress.generation import cache_argument
from kvcompress.methods.full import FullConfig
from kvcompress.methods.h2o import H2OConfig
from kvcompress.methods.less import LessConfig, baseline_plus
from kvcompress.methods.less.kernels import SHIPPED, layer_file, load_kernels, load_layer, read_meta
from kvcompress.methods.less.masked import masked_forward, masked_run
from kvcompress.methods.streaming import StreamingConfig
from kvcompress.models import load_model
from kvcompress.results import append_row, done_keys, read_rows

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "docs" / "results" / "less_results.jsonl"
PLOTS = ROOT / "docs" / "results"
MODEL = "smollm2-135m"


# --- data and configurations ---------------------------------------------------------------------------------


def wikitext_windows(tokenizer: Any, count: int, window: int) -> torch.Tensor:
    """``count`` windows ``[count, window]`` evenly spaced over the WikiText-2 test split."""
    ids = tokenizer(wikitext_test(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    last = ids.numel() - window
    starts = [round(i * last / max(1, count - 1)) for i in range(count)]
    return torch.stack([ids[s : s + window] for s in starts])


def policy_config(policy: str, budget: int):
    """The sparse policy at ``budget``: ``h2o`` (50/50 split) or ``lambda`` (4 sinks + recent, original positions)."""
    if policy == "h2o":
        return H2OConfig(budget=budget)
    if policy == "lambda":
        return StreamingConfig(budget=budget, sinks=4, position_mode="original")
    raise ValueError(f"policy must be h2o or lambda, got {policy!r}")


def row_config(variant: str, policy: str, budget: int, kernels: Any = None, rank: int = 8):
    base = policy_config(policy, budget)
    if variant == "full":
        return FullConfig()
    if variant == "baseline":
        return base
    if variant == "baseline+":
        return baseline_plus(base, rank)
    if variant == "less":
        return LessConfig(base=base, kernels=kernels)
    raise ValueError(f"unknown variant {variant!r}")


# --- scoring ---------------------------------------------------------------------------------------------------


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` negative log-likelihood of every next token."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")


@torch.no_grad()
def masked_nll(model, ids: torch.Tensor, config, batch: int = 16) -> torch.Tensor:
    layers = model.config.num_hidden_layers
    parts = []
    for start in range(0, ids.shape[0], batch):
        chunk = ids[start : start + batch]
        parts.append(_nll(masked_forward(model, chunk, masked_run(config, layers)), chunk))
    return torch.cat(parts)


@torch.no_grad()
def decode_nll(model, ids: torch.Tensor, config, batch: int = 16) -> torch.Tensor:
    parts = []
    for start in range(0, ids.shape[0], batch):
        chunk = ids[start : start + batch]
        cache = kvcompress.cache_for(model, config)
        logits = [model(chunk[:, t : t + 1], **cache_argument(model, cache)).logits for t in range(chunk.shape[1] - 1)]
        parts.append(_nll(torch.cat(logits + [logits[-1]], dim=1), chunk))
    return torch.cat(parts)


def kernel_label(path: str | None) -> str | None:
    """A kernel set's name in results: its directory name (or the shipped set's name)."""
    return Path(path).name if path else None


def _series_of(row: dict) -> tuple[int, str | None]:
    return row["train_budget"], kernel_label(row["kernels"])


def _less_series(rows: list[dict]) -> list[tuple[int, str | None]]:
    """The (training budget, kernel set) pairs of the LESS rows, each one line in tables and plots."""
    return sorted({_series_of(r) for r in rows if r["variant"] == "less"})


def run_ppl(
    policy: str,
    budgets: Sequence[int],
    kernels: Sequence[str],
    modes: Sequence[str],
    variants: Sequence[str],
    windows: int,
    window: int,
    out: Path,
    allow_missing: bool = False,
) -> None:
    model, tokenizer = load_model(MODEL)
    ids = wikitext_windows(tokenizer, windows, window)
    done = done_keys(out)
    loaded = {path: load_kernels(path, allow_missing=allow_missing) for path in kernels}
    jobs: list[tuple[str, int, str | None]] = []
    for budget in budgets:
        for variant in variants:
            if variant == "less":
                jobs += [(variant, budget, path) for path in kernels]
            elif variant != "full" or budget == budgets[0]:
                jobs.append((variant, budget, None))
    for mode in modes:
        for variant, budget, path in jobs:
            kernel_set = loaded.get(path) if path else None
            train_budget = kernel_set.meta.get("base", {}).get("budget") if kernel_set else None
            missing = kernel_set.meta.get("missing_layers", []) if kernel_set else []
            key = json.dumps([policy, variant, budget if variant != "full" else 0, train_budget, len(missing), mode,
                              windows, window, kernel_label(path)])  # fmt: skip
            if key in done:
                continue
            config = row_config(variant, policy, budget, kernel_set)
            started = time.perf_counter()
            nll = (masked_nll if mode == "masked" else decode_nll)(model, ids, config)
            seconds = time.perf_counter() - started
            after = nll[:, budget:]  # next-token losses of rows that have lost tokens (row >= budget + 1)
            record = {
                "key": key,
                "model": MODEL,
                "policy": policy,
                "variant": variant,
                "budget": budget if variant != "full" else None,
                "train_budget": train_budget,
                "kernels": path,
                "missing_layers": missing,
                "mode": mode,
                "windows": windows,
                "window": window,
                "tokens": nll.numel(),
                "ppl": math.exp(float(nll.mean())),
                "ppl_after_eviction": math.exp(float(after.mean())),
                "seconds": seconds,
            }
            append_row(record, out)
            print(f"{policy} {variant} B={budget} train={train_budget} {mode}: ppl {record['ppl']:.4f} "
                  f"({record['ppl_after_eviction']:.4f} after eviction) {seconds:.0f} s", flush=True)  # fmt: skip


# --- training summary --------------------------------------------------------------------------------------------


REFERENCES = ("baseline_val_mse", "baseline_plus_val_mse")


def training_summary(directories: Sequence[str], plots: Path = PLOTS) -> str:
    """Markdown: per kernel set its settings, cost, size and wins; one table of every layer's held-out error
    relative to Baseline and Baseline+ for all sets side by side; plus a plot."""
    lines, columns, curves = [], {}, {}
    for directory in directories:
        meta, records = _trained_layers(directory)
        if not records:
            continue
        name = Path(directory).name
        lines += [_set_summary(name, meta, records), ""]
        columns[name] = {i: " / ".join(f"{r['best_val_mse'] / r[ref] - 1:+.0%}" for ref in REFERENCES)
                         for i, r in records.items()}  # fmt: skip
        curves[name] = records
    if not columns:
        return ""
    lines += [
        "Held-out MSE of the attention block's output after `W_O`, LESS relative to Baseline / to Baseline+:",
        "",
        "| layer | " + " | ".join(f"`{name}`" for name in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    layers = sorted({i for column in columns.values() for i in column})
    lines += [f"| {i} | " + " | ".join(column.get(i, "–") for column in columns.values()) + " |" for i in layers]
    _plot_mse(curves, plots / "less_layer_mse.png")
    return "\n".join(lines + [""])


def _trained_layers(directory: str) -> tuple[dict, dict[int, dict]]:
    """A kernel directory's settings and the training record of each finished layer."""
    meta = read_meta(directory)
    records = {}
    for i in range(meta["num_layers"]):
        if layer_file(directory, i).is_file():
            kernels, records[i] = load_layer(directory, i)
            records[i]["parameters"] = sum(p.numel() for p in kernels.state_dict().values())
    return meta, records


def _set_summary(name: str, meta: dict, records: dict[int, dict]) -> str:
    """One paragraph: settings, cost, size and how many layers beat Baseline / Baseline+."""
    train, base = meta["training"], meta["base"]
    times = [r["time_s"] for r in records.values()]
    params = sum(r["parameters"] for r in records.values()) / len(records)
    beat_base = sum(r["best_val_mse"] < r["baseline_val_mse"] for r in records.values())
    beat_plus = sum(r["best_val_mse"] < r["baseline_plus_val_mse"] for r in records.values())
    last = sum(r["best_epoch"] == train["epochs"] for r in records.values())
    return (
        f"**`{name}`** ({base['name']} at {base['budget']} tokens): {len(records)}/{meta['num_layers']} layers; "
        f"{train['windows']} windows x {train['window']} tokens ({next(iter(records.values()))['train_tokens']} "
        f"training tokens per layer), {train['epochs']} epochs, R = {meta['rank']}, R' = {meta['hidden']}; "
        f"{statistics.median(times):.0f} s per layer (median; min {min(times):.0f}, max {max(times):.0f}; 1 thread, "
        f"shared 2-core machine); {params:,.0f} parameters per layer, "
        f"{params * meta['num_layers'] * 2 / 2**20:.1f} MiB in fp16 for all layers. LESS < Baseline in "
        f"{beat_base}/{len(records)} layers, < Baseline+ in {beat_plus}/{len(records)}; the best epoch was the last "
        f"in {last}/{len(records)}."
    )


def _plot_mse(curves: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    drawn = set()  # sets trained for the same policy and budget share one Baseline+ curve
    for label, records in curves.items():
        label = label.removeprefix("smollm2-135m-")
        layers = sorted(records)
        base = [records[i]["baseline_val_mse"] for i in layers]
        plus = tuple(round(records[i]["baseline_plus_val_mse"] / b, 6) for i, b in zip(layers, base, strict=True))
        if plus not in drawn:
            drawn.add(plus)
            ax.plot(layers, plus, "s--", alpha=0.6, label=f"Baseline+ ({label})")
        ax.plot(layers, [records[i]["best_val_mse"] / b for i, b in zip(layers, base, strict=True)], "o-",
                label=f"LESS ({label})")  # fmt: skip
    ax.axhline(1.0, color="gray", lw=1, label="Baseline")
    ax.set_xlabel("layer")
    ax.set_ylabel("validation MSE / Baseline MSE")
    ax.set_title("Attention-block output error after W_O, SmolLM2-135M")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- report ------------------------------------------------------------------------------------------------------


def report(path: Path = RESULTS) -> str:
    rows = read_rows(path)
    out = []
    for windows in sorted({r["windows"] for r in rows}, reverse=True):
        out += _report_windows([r for r in rows if r["windows"] == windows])
    return "\n".join(out)


def _report_windows(rows: list[dict]) -> list[str]:
    out = []
    for mode in ("masked", "decode"):
        for policy in ("h2o", "lambda"):
            chosen = [r for r in rows if r["mode"] == mode and r["policy"] == policy]
            if not chosen:
                continue
            full = next((r for r in rows if r["mode"] == mode and r["variant"] == "full"
                         and r["windows"] == chosen[0]["windows"]), None)  # fmt: skip
            budgets = sorted({r["budget"] for r in chosen if r["budget"] is not None})
            header = "| row | " + " | ".join(f"B = {b}" for b in budgets) + " |"
            out += [f"**{policy}, {mode} form** (token perplexity, {chosen[0]['windows']} x {chosen[0]['window']})", ""]
            out += [header, "|---" * (len(budgets) + 1) + "|"]
            if full:
                out.append("| Full cache | " + " | ".join(f"{full['ppl']:.3f}" for _ in budgets) + " |")
            labels = [("baseline", None, "Baseline"), ("baseline+", None, "Baseline+ (+4 tokens)")]
            labels += [("less", series, f"LESS ({series[0]}, `{series[1]}`)") for series in _less_series(chosen)]
            for variant, series, label in labels:
                cells = []
                for b in budgets:
                    match = [r for r in chosen if r["variant"] == variant and r["budget"] == b
                             and (series is None or _series_of(r) == series)]  # fmt: skip
                    if match:
                        note = "*" if match[-1]["missing_layers"] else ""
                        cells.append(f"{match[-1]['ppl']:.3f}{note}")
                    else:
                        cells.append("–")
                out.append(f"| {label} | " + " | ".join(cells) + " |")
            out.append("")
            if full:
                out += _gap_lines(chosen, full, budgets)
    return out


def _gap_lines(rows: list[dict], full: dict, budgets: list[int]) -> list[str]:
    lines = []
    for b in budgets:
        get = {r["variant"]: r for r in rows if r["budget"] == b and r["variant"] != "less"}
        for r in (r for r in rows if r["budget"] == b and r["variant"] == "less"):
            if "baseline" not in get:
                continue
            base, plus, less = get["baseline"]["ppl"], get.get("baseline+", {}).get("ppl"), r["ppl"]
            gap = (base - less) / (base - full["ppl"])
            partial = f", {len(r['missing_layers'])} layers untrained" if r["missing_layers"] else ""
            name = f"LESS({r['train_budget']}, `{kernel_label(r['kernels'])}`{partial})"
            text = f"- B = {b}, {name}: closes {gap:.1%} of the Baseline-to-full gap"
            if plus is not None:
                text += f", {(plus - less) / (plus - full['ppl']):.1%} of the Baseline+-to-full gap"
                text += "; LESS < Baseline+ < Baseline: " + ("yes" if less < plus < base else "no")
            lines.append(text)
    return lines + [""] if lines else []


def plot_ppl(path: Path = RESULTS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(path)
    rows = [r for r in rows if r["mode"] == "masked" and r["policy"] == "h2o"]
    if not rows:
        return
    most = max(r["windows"] for r in rows)  # the main table; smaller runs are the masked-vs-decode checks
    rows = [r for r in rows if r["windows"] == most and not r["missing_layers"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    full = next((r for r in rows if r["variant"] == "full"), None)
    series = [("baseline", None), ("baseline+", None)]
    series += [("less", pair) for pair in _less_series(rows)]
    for variant, pair in series:
        pts = sorted((r["budget"], r["ppl"]) for r in rows if r["variant"] == variant
                     and (pair is None or _series_of(r) == pair))  # fmt: skip
        if pts:
            label = {"baseline": "H2O (Baseline)", "baseline+": "H2O + 4 tokens (Baseline+)"}.get(
                variant, f"LESS (trained at {pair and pair[0]}, {pair and str(pair[1]).removeprefix('smollm2-135m-')})"
            )
            ax.plot(*zip(*pts, strict=True), "o-", label=label)
    if full:
        ax.axhline(full["ppl"], color="gray", ls="--", label="full cache")
    ax.set_xlabel("tokens kept per KV head (of 512)")
    ax.set_ylabel("WikiText-2 test token perplexity")
    ax.set_title("SmolLM2-135M, masked form")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path.parent / "less_ppl.png", dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.less")
    sub = parser.add_subparsers(dest="command", required=True)
    ppl = sub.add_parser("ppl", help="WikiText-2 test perplexity of full / baseline / baseline+ / less")
    ppl.add_argument("--policy", default="h2o", choices=("h2o", "lambda"))
    ppl.add_argument("--budgets", type=int, nargs="+", default=[24, 50, 102])
    ppl.add_argument("--kernels", nargs="*", default=[], help="trained kernel directories (one LESS row each)")
    ppl.add_argument("--variants", nargs="+", default=["full", "baseline", "baseline+", "less"])
    ppl.add_argument("--mode", nargs="+", default=["masked"], choices=("masked", "decode"))
    ppl.add_argument("--windows", type=int, default=16)
    ppl.add_argument("--window", type=int, default=512)
    ppl.add_argument("--allow-missing", action="store_true", help="untrained layers get psi = 0 (marked *)")
    ppl.add_argument("--out", type=Path, default=RESULTS)
    ppl.add_argument("--threads", type=int, default=1)
    training = sub.add_parser("training", help="per-layer MSE, cost and size of trained kernels")
    training.add_argument("directories", nargs="+")
    training.add_argument("--write", type=Path, default=None, help="replace the block between the report markers")
    ship = sub.add_parser("ship", help="copy trained kernels (fp16) into the package as a named set")
    ship.add_argument("directory")
    ship.add_argument("name")
    rep = sub.add_parser("report", help="markdown tables and plots from the results file")
    rep.add_argument("--results", type=Path, default=RESULTS)
    rep.add_argument("--write", type=Path, default=None, help="replace the block between the report markers here")
    args = parser.parse_args(argv)
    if args.command == "ppl":
        torch.set_num_threads(args.threads)
        run_ppl(args.policy, args.budgets, args.kernels, args.mode, args.variants, args.windows, args.window,
                args.out, args.allow_missing)  # fmt: skip
    elif args.command == "training":
        text = training_summary(args.directories, args.write.parent if args.write else PLOTS)
        print(text)
        if args.write is not None:
            write_block(args.write, "training", text)
    elif args.command == "ship":
        target = load_kernels(args.directory).save(SHIPPED / args.name, dtype=torch.float16)
        size = sum(p.stat().st_size for p in target.iterdir())
        print(f"{target}: {size / 2**20:.1f} MiB; use LessConfig(kernels={args.name!r})")
    else:
        plot_ppl(args.results)
        text = report(args.results)
        print(text)
        if args.write is not None:
            write_block(args.write, "ppl", text)


def write_block(path: Path, name: str, text: str) -> None:
    """Replace the text between ``<!-- less:NAME -->`` and ``<!-- /less:NAME -->`` in ``path``."""
    start, end = f"<!-- less:{name} -->", f"<!-- /less:{name} -->"
    doc = path.read_text()
    if start not in doc or end not in doc:
        raise ValueError(f"{path} has no {start} ... {end} block")
    head, rest = doc.split(start, 1)
    path.write_text(head + start + "\n" + text.strip() + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    main()
