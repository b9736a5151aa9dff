"""Experiments behind ``docs/results/nacl.md``: NaCl against one-shot baselines on retrieval tasks, and its ablations.

Every table in the document comes from one of these commands (rows append to a JSONL file; rows already there are
skipped, so a run can be resumed; ``report`` turns the file into markdown tables and plots)::

    python -m experiments.nacl main --samples 10       # passkey, niah, docqa; 10/20/30 %; aware + agnostic
    python -m experiments.nacl ablation --samples 10 --modes aware \\
        --out docs/results/nacl_ablation_results.jsonl            # Table 3 analog at 20 %
    python -m experiments.nacl report                  # markdown tables + docs/results/nacl_*.png
    python -m experiments.nacl check --samples 1       # replay == ordinary chunked prefill
    python -m experiments.nacl overhead --length 4096  # NaCl's share of a prefill's time

Samples are ``kvcompress.eval``'s (``passkey``; ``niah``'s RULER ``single`` and ``multikey`` needles over the
essays; ``docqa``'s 10 documents with the answer document at position ``i mod 10``: one answer each) with their
prompts and both modes (``aware``: the question is inside the compressed prompt; ``agnostic``: the context is
compressed before the question arrives). Scoring is teacher-forced so that
a 135M model gives a graded signal: after the compressed prefill the rest of the prompt and the gold answer are
fed in one forward; ``nll`` is the mean negative log-likelihood per answer token and ``accuracy`` is 1 when greedy
decoding would write exactly the gold answer (argmax = gold at every answer token).

Shared prefill. Every method here except the greedy ablation is one-shot: the prefill is exact and the method
compresses each layer once from that layer's prefill queries, keys and values. So each prompt is prefilled *once*
(capturing every layer's post-RoPE ``Q``, ``K``, ``V``), and each configuration's cache is built by replaying the
library's own attention function (``kvcompress.core.attention.kvcompress_attention``: statistics, ``attend``,
``after_attention`` and the method's ``select``) layer by layer on the captured tensors, with the attention
*output* (unused: the prefill's hidden states are the captured ones) replaced by zeros. The query-agnostic
context is a prefix of the query-aware prompt, so its tensors are a prefix of the same capture (causal
attention). ``generate`` then decodes through the compressed cache as usual. ``check`` verifies on a few
samples that this gives the same kept tokens and answers as the ordinary chunked prefill.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

import kvcompress
from kvcompress.core.attention import kvcompress_attention, register_attention
from kvcompress.core.selection import ratio_budget
from kvcompress.eval.configs import EvalConfig
from kvcompress.eval.tasks import make_task
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model
from kvcompress.results import done_keys, read_rows

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "docs" / "results" / "nacl_results.jsonl"
ABLATION_RESULTS = ROOT / "docs" / "results" / "nacl_ablation_results.jsonl"
PLOTS = ROOT / "docs" / "results"
MODEL = "smollm2-135m"
CAPTURE = "kvcompress_nacl_capture"

RATIOS = (0.1, 0.2, 0.3)
GREEDY_SAMPLES = 3  # per task
SEEDS = (0, 1, 2)
TASKS = {  # one answer each (teacher-forced)
    "passkey": {},
    "niah": {"subtasks": ("single", "multikey")},
    "docqa": {},  # 10 documents, the answer document at position i mod 10 for sample i
}
BASELINES = ("h2o_oneshot", "tova_oneshot", "scissorhands_oneshot", "streaming_oneshot", "snapkv")
ABLATIONS = {  # Table 3 row -> NaCl parameters
    "nacl": {},
    "− proxy-token eviction (all random)": {"random_share": 1.0},
    "− random eviction (all top-k)": {"random_share": 0.0},
    "− probability sampling (uniform)": {"sampling": "uniform"},
    "− global eviction (greedy, every 64 tokens)": {"eviction": "greedy"},
    "− head-wise eviction (shared by heads)": {"head_wise": False},
    "proxy = the question only (not in Table 3)": {"proxy_tokens": "question"},
}


# --- shared prefill ------------------------------------------------------------------------------------------


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    module._nacl_capture = (query.detach(), key.detach(), value.detach(), scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


@torch.no_grad()
def capture_prefill(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """One exact prefill of ``input_ids`` (batch 1); each layer's post-RoPE queries, keys, values and scaling."""
    register_attention(CAPTURE, _capture_attention, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(CAPTURE)
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        modules = [m for m in model.modules() if hasattr(m, "_nacl_capture")]
        captured = [m._nacl_capture for m in modules]
        for m in modules:
            del m._nacl_capture
    finally:
        kvcompress.prepare_model(model)
    return captured


@torch.no_grad()
def replay(cache, captured, length: int) -> None:
    """Fill ``cache`` with the first ``length`` tokens of a capture through kvcompress' attention function."""
    positions = torch.arange(length)[None]
    for layer, (query, key, value, scaling) in zip(cache.layers, captured, strict=True):
        keys, values = layer.update(key[:, :, :length], value[:, :, :length])
        kvcompress_attention(None, query[:, :, :length], keys, values, None, scaling, position_ids=positions)


class SharedPrefill:
    """A task's ``fill`` that, within ``active(ids, captured)``, replays the capture into a one-shot cache."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.captured = None
        self.replayed = 0

    def prefill(self, model, input_ids, cache, attention_mask=None, chunk_size=None):
        length = input_ids.shape[1]
        one_shot = all(layer.policy.one_shot for layer in cache.compressed_layers)
        if (
            self.ids is None
            or not one_shot
            or attention_mask is not None
            or length > self.ids.shape[1]
            or not torch.equal(self.ids[:, :length], input_ids)
        ):
            return prefill(model, input_ids, cache, attention_mask=attention_mask, chunk_size=chunk_size)
        replay(cache, self.captured, length)
        self.replayed += 1
        return None

    @contextmanager
    def active(self, ids: torch.Tensor, captured) -> Iterator[None]:
        self.ids, self.captured = ids, captured
        try:
            yield
        finally:
            self.ids = self.captured = None


# --- configurations -----------------------------------------------------------------------------------------


def main_configs(ratios: Sequence[float] = RATIOS, seeds: Sequence[int] = SEEDS) -> list[tuple[str, float, EvalConfig]]:
    """(row label, ratio, config) of the main comparison."""
    configs = [("full", 1.0, EvalConfig("full"))]
    for ratio in ratios:
        configs += [("nacl", ratio, EvalConfig("nacl", (("seed", s),), ratio)) for s in seeds]
        configs += [(name, ratio, EvalConfig(name, (), ratio)) for name in BASELINES]
    return configs


def ablation_configs(
    prompt_tokens: int, question_tokens: int, greedy: bool = True, ratio: float = 0.2, seeds: Sequence[int] = SEEDS
):
    """(row label, ratio, config) of the Table 3 analog; greedy needs the budget in tokens of this prompt, the
    question-proxy variant the question's length (its tokens inside the compressed prompt)."""
    configs = []
    for label, params in ABLATIONS.items():
        if params.get("eviction") == "greedy" and not greedy:
            continue
        if params.get("proxy_tokens") == "question":
            params = {"proxy_tokens": question_tokens}
        deterministic = params.get("random_share") == 0.0
        for seed in seeds[:1] if deterministic else seeds:
            extra = dict(params, seed=seed)
            budget: float | int = ratio
            if params.get("eviction") == "greedy":
                budget = int(ratio_budget(torch.tensor(prompt_tokens), ratio))
            configs.append((label, ratio, EvalConfig("nacl", tuple(sorted(extra.items())), budget)))
    return configs


# --- running ------------------------------------------------------------------------------------------------


def row_key(experiment: str, task: str, sample: str, mode: str, label: str, config: EvalConfig) -> str:
    return json.dumps([experiment, task, sample, mode, label, config.key()])


def answer_ids(tokenizer, sample) -> torch.Tensor:
    """``[1, A]`` ids of the gold answer as the model would write it after the answer prefix (" 1234567")."""
    gold = sample.inputs.get("key") or sample.inputs.get("answer") or sample.inputs["answers"][0]
    return torch.tensor([tokenizer(" " + gold, add_special_tokens=False)["input_ids"]])


@torch.no_grad()
def score_answer(model, cache, prompt: torch.Tensor, answer: torch.Tensor) -> dict[str, float]:
    """Teacher-forced answer through ``cache`` (which holds the start of ``prompt``): mean NLL per answer token,
    and accuracy = 1 if greedy decoding would write exactly the gold answer (argmax = gold at every token)."""
    seen = cache.get_seq_length()
    rest = torch.cat([prompt[:, seen:], answer], dim=1)
    logits = model(input_ids=rest, **cache_argument(model, cache), use_cache=True).logits[0, -answer.shape[1] - 1 : -1]
    nll = torch.nn.functional.cross_entropy(logits.float(), answer[0])
    return {"accuracy": float((logits.argmax(-1) == answer[0]).all()), "nll": float(nll)}


def compress_copy(model, uncompressed: dict, captured, length: int, mode: str, config: EvalConfig):
    """A baseline's cache at ``config``'s ratio from one replay at ratio 1 (its statistics do not depend on the
    ratio): the replayed cache is copied and each layer runs the method's ``select`` with the wanted config."""
    key = (mode, config.method, config.params)
    if key not in uncompressed:
        base = kvcompress.make_config(config.method, **dict(config.param_dict, ratio=1.0))
        cache = kvcompress.cache_for(model, base)
        replay(cache, captured, length)
        uncompressed[key] = cache
    cache = copy.deepcopy(uncompressed[key])
    cache.config = kvcompress.make_config(config.method, **config.cache_params())
    for index, layer in enumerate(cache.compressed_layers):
        layer.policy = cache.config.policy(index)
        selection = layer.policy.select(layer)
        if selection is not None:
            layer.apply(selection)
    return cache


def run(experiment: str, samples: int, length: int, modes: Sequence[str], out: Path, limit_tasks=None) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model(MODEL)
    kvcompress.prepare_model(model)
    done = done_keys(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tasks = {k: v for k, v in TASKS.items() if limit_tasks is None or k in limit_tasks}
    with out.open("a") as sink:
        for task_name, task_params in tasks.items():
            size = {"doc_tokens": max(8, round(90 * length / 1024))} if task_name == "docqa" else {"length": length}
            task = make_task(task_name, model, tokenizer, seed=0, modes=tuple(modes), **size, **task_params)
            for number, sample in enumerate(task.build_samples(samples)):
                prompt = torch.cat([sample.inputs["context_ids"], sample.inputs["question_ids"]], dim=1)
                gold = answer_ids(tokenizer, sample)
                greedy = number < GREEDY_SAMPLES  # the greedy ablation needs a real prefill per seed: fewer samples
                lengths = {"aware": prompt.shape[1] - 1, "agnostic": sample.inputs["context_ids"].shape[1]}
                work = []
                for mode in modes:
                    question = sample.inputs["question_ids"].shape[1] - 1 if mode == "aware" else 1
                    configs = (
                        main_configs() if experiment == "main" else ablation_configs(lengths[mode], question, greedy)
                    )
                    for label, ratio, config in configs:
                        key = row_key(experiment, task_name, sample.id, mode, label, config)
                        if key not in done:
                            work.append((mode, label, ratio, config, key))
                if not work:
                    continue
                start = time.perf_counter()
                captured = capture_prefill(model, prompt[:, :-1])
                capture_s = time.perf_counter() - start
                uncompressed: dict[tuple, object] = {}  # (mode, method, params) -> cache replayed at ratio 1
                for mode, label, ratio, config, key in work:
                    begin = time.perf_counter()
                    cache = task.new_cache(config)
                    if config.method in BASELINES:
                        cache = compress_copy(model, uncompressed, captured, lengths[mode], mode, config)
                    elif config.method == "full" or all(layer.policy.one_shot for layer in cache.compressed_layers):
                        replay(cache, captured, lengths[mode])  # full: the capture's exact keys and values
                    else:  # greedy ablation: the real chunked prefill, evicting after every chunk
                        prefill(model, prompt[:, : lengths[mode]], cache, chunk_size=64)
                    compressed = cache.tokens_stored()
                    scores = score_answer(model, cache, prompt, gold)
                    row = {
                        "key": key,
                        "experiment": experiment,
                        "task": task_name,
                        "sample": sample.id,
                        "mode": mode,
                        "row_label": label,
                        "ratio": ratio,
                        "method": config.method,
                        "params": config.param_dict,
                        "budget": config.budget,
                        "scores": scores,
                        "compressed_tokens": lengths[mode],
                        "stored_after_prefill": compressed[0],
                        "time_s": round(time.perf_counter() - begin, 3),
                        "capture_s": round(capture_s, 3),
                        "info": sample.info,
                    }
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                logger.info("%s %s: %d rows in %.0f s", task_name, sample.id, len(work), time.perf_counter() - start)
                del captured


def overhead(length: int) -> None:
    """Share of a NaCl prefill (one pass and chunks of 512) spent in NaCl's own work: buffering proxy queries,
    proxy scores, selection (the policy's ``torch.profiler`` labels). A ratio of two timings of the same run, so it
    holds up on a loaded machine."""
    torch.set_num_threads(1)
    model, _ = load_model(MODEL)
    ids = torch.randint(100, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    labels = {phase: f"kvcompress.nacl.{phase}" for phase in ("buffer", "scores", "select")}
    for chunk in (None, 512):
        cache = kvcompress.cache_for(model, "nacl", ratio=0.2)
        begin = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            prefill(model, ids, cache, chunk_size=chunk)
        total = time.perf_counter() - begin
        cpu_us = {event.key: event.cpu_time_total for event in profile.key_averages()}
        spent = {name: cpu_us.get(label, 0.0) / 1e6 for name, label in labels.items()}
        own = sum(spent.values())
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in spent.items())
        print(
            f"{length} tokens, chunk {chunk}: prefill {total:.1f} s (profiled), NaCl's own work {own:.1f} s "
            f"({100 * own / total:.1f} %): {parts}"
        )


def check(samples: int, length: int) -> None:
    """Shared-prefill replay vs the ordinary chunked prefill: same kept tokens (per layer/head), same answers."""
    torch.set_num_threads(1)
    model, tokenizer = load_model(MODEL)
    shared = SharedPrefill()
    task = make_task("niah", model, tokenizer, seed=0, length=length, modes=("aware",), subtasks=("single",))
    task.fill = shared.prefill  # replays while shared is active, the real prefill otherwise
    configs = [("nacl", 0.2, EvalConfig("nacl", (("seed", 0),), 0.2))] + [
        (name, 0.2, EvalConfig(name, (), 0.2)) for name in BASELINES
    ]
    for sample in task.build_samples(samples):
        prompt = torch.cat([sample.inputs["context_ids"], sample.inputs["question_ids"]], dim=1)
        captured = capture_prefill(model, prompt[:, :-1])
        for label, _, config in configs:
            real = task.new_cache(config)
            prefill(model, prompt[:, :-1], real, chunk_size=64)
            fast = task.new_cache(config)
            with shared.active(prompt[:, :-1], captured):
                shared.prefill(model, prompt[:, :-1], fast, chunk_size=64)
            same = sum(
                torch.equal(a.token_idx, b.token_idx)
                for a, b in zip(real.compressed_layers, fast.compressed_layers, strict=True)
            )
            diff = max(
                float((a.keys - b.keys).abs().max())
                for a, b in zip(real.compressed_layers, fast.compressed_layers, strict=True)
                if a.keys.shape == b.keys.shape
            )
            with shared.active(prompt[:, :-1], captured):
                fast_answer = task.evaluate(sample, config, task.new_cache(config), "aware").extra["prediction"]
            real_answer = task.evaluate(sample, config, task.new_cache(config), "aware").extra["prediction"]
            print(
                f"{sample.id} {label}: identical kept sets in {same}/{len(real.compressed_layers)} layers, "
                f"max |dK| {diff:.2e}, answers equal: {fast_answer == real_answer} ({fast_answer!r})"
            )


# --- report -------------------------------------------------------------------------------------------------


SCALE = {"accuracy": 100, "nll": 1}
YLABEL = {"accuracy": "answer accuracy (%)", "nll": "answer NLL per token (lower = better)"}
METRIC = ["accuracy"]  # the metric the tables and plots show (report sets it)


def headline(row: dict) -> float:
    return float(row["scores"][METRIC[0]])


def seed_of(row: dict) -> int:
    return int(row["params"].get("seed", 0))


def cell(rows: list[dict]) -> tuple[float, float | None, int]:
    """Mean score over samples, per seed; returns (mean over seeds, std over seeds or None, samples)."""
    per_seed: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        per_seed[seed_of(row)].append(headline(row))
    means = [statistics.fmean(v) for v in per_seed.values()]
    spread = statistics.stdev(means) if len(means) > 1 else None
    return statistics.fmean(means), spread, len(next(iter(per_seed.values())))


def fmt(mean: float, spread: float | None) -> str:
    scale, digits = (100, 1) if METRIC[0] == "accuracy" else (1, 2)
    return f"{scale * mean:.{digits}f}" + ("" if spread is None else f" ± {scale * spread:.{digits}f}")


def main_tables(rows: list[dict]) -> str:
    rows = [r for r in rows if r["experiment"] == "main"]
    lines = []
    order = ["full", "nacl", *BASELINES]
    for mode in ("aware", "agnostic"):
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in rows:
            if r["mode"] == mode:
                groups[(r["task"], r["row_label"], r["ratio"])].append(r)
                groups[("mean", r["row_label"], r["ratio"])].append(r)
        tasks = sorted({t for t, _, _ in groups if t != "mean"}) + ["mean"]
        lines.append(f"\n**{mode}**, {YLABEL[METRIC[0]]}; NaCl: mean ± std over {len(SEEDS)} seeds\n")
        header = "| method | " + " | ".join(f"{t} {int(100 * r)}%" for t in tasks for r in RATIOS) + " |"
        lines += [header, "|" + " --- |" * (1 + len(tasks) * len(RATIOS))]
        for label in order:
            cells = []
            for task in tasks:
                for ratio in RATIOS:
                    key = (task, label, 1.0 if label == "full" else ratio)
                    cells.append(fmt(*cell(groups[key])[:2]) if groups.get(key) else "–")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        n = {t: cell(groups[(t, "full", 1.0)])[2] for t in tasks if groups.get((t, "full", 1.0))}
        lines.append("\nSamples per cell: " + ", ".join(f"{t} {c}" for t, c in n.items() if t != "mean"))
    return "\n".join(lines)


def ablation_table(rows: list[dict]) -> str:
    rows = [r for r in rows if r["experiment"] == "ablation"]
    lines = []
    full_rows = [r for r in read_rows(RESULTS) if r["experiment"] == "main" and r["row_label"] == "full"]
    for mode in ("aware", "agnostic"):
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in rows:
            if r["mode"] == mode:
                groups[(r["task"], r["row_label"])].append(r)
                groups[("mean", r["row_label"])].append(r)
        if not groups:
            continue
        tasks = sorted({t for t, _ in groups if t != "mean"}) + ["mean"]
        base = {t: cell(groups[(t, "nacl")])[0] for t in tasks if groups.get((t, "nacl"))}
        lines.append(f"\n**{mode}**, 20 % budget, {YLABEL[METRIC[0]]} (mean ± std over seeds; Δ vs NaCl)\n")
        lines += ["| variant | " + " | ".join(tasks) + " |", "|" + " --- |" * (1 + len(tasks))]
        for label in ABLATIONS:
            cells = []
            for task in tasks:
                if not groups.get((task, label)):
                    cells.append("–")
                    continue
                mean, spread, _ = cell(groups[(task, label)])
                delta = "" if label == "nacl" else f" ({SCALE[METRIC[0]] * (mean - base[task]):+.2f})"
                cells.append(fmt(mean, spread) + delta)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        full = [r for r in full_rows if r["mode"] == mode]
        if full:
            per_task = {t: statistics.fmean(headline(r) for r in full if r["task"] == t) for t in tasks if t != "mean"}
            per_task["mean"] = statistics.fmean(headline(r) for r in full)
            lines.append("| full cache | " + " | ".join(fmt(per_task[t], None) for t in tasks) + " |")
    return "\n".join(lines)


def plots(rows: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    main = [r for r in rows if r["experiment"] == "main"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, ("aware", "agnostic"), strict=True):
        for label in ["nacl", *BASELINES]:
            means, errs = [], []
            for ratio in RATIOS:
                sel = [r for r in main if r["mode"] == mode and r["row_label"] == label and r["ratio"] == ratio]
                mean, spread, _ = cell(sel) if sel else (math.nan, None, 0)
                means.append(SCALE[METRIC[0]] * mean)
                errs.append(0 if spread is None else SCALE[METRIC[0]] * spread)
            ax.errorbar([100 * r for r in RATIOS], means, yerr=errs, marker="o", capsize=3, label=label)
        full = [headline(r) for r in main if r["mode"] == mode and r["row_label"] == "full"]
        if full:
            ax.axhline(SCALE[METRIC[0]] * statistics.fmean(full), color="k", linestyle="--", label="full cache")
        ax.set_title(f"query-{mode}: " + " + ".join(sorted({r["task"] for r in main})))
        ax.set_xlabel("KV budget (% of prompt)")
        ax.set_xticks([100 * r for r in RATIOS])
    axes[0].set_ylabel(YLABEL[METRIC[0]])
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path = PLOTS / f"nacl_budget_{METRIC[0]}.png"
    fig.savefig(path, dpi=110)
    made.append(path)
    ablation = [r for r in rows if r["experiment"] == "ablation"]
    if ablation:
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = list(ABLATIONS)
        width = 0.38
        for offset, mode in ((-width / 2, "aware"), (width / 2, "agnostic")):
            vals, errs = [], []
            for label in labels:
                sel = [r for r in ablation if r["mode"] == mode and r["row_label"] == label]
                mean, spread, _ = cell(sel) if sel else (math.nan, None, 0)
                vals.append(SCALE[METRIC[0]] * mean)
                errs.append(0 if spread is None else SCALE[METRIC[0]] * spread)
            ax.bar([i + offset for i in range(len(labels))], vals, width, yerr=errs, capsize=3, label=mode)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([label.split(" (")[0] for label in labels], rotation=15, fontsize=8)
        ax.set_ylabel(YLABEL[METRIC[0]] + " (" + " + ".join(sorted({r["task"] for r in ablation})) + ")")
        ax.set_title("Table 3 analog at 20 % budget, SmolLM2-135M")
        ax.legend()
        fig.tight_layout()
        path = PLOTS / f"nacl_ablation_{METRIC[0]}.png"
        fig.savefig(path, dpi=110)
        made.append(path)
    return made


def report(path: Path) -> None:
    rows = read_rows(path) + (read_rows(ABLATION_RESULTS) if ABLATION_RESULTS.exists() else [])
    for metric in ("accuracy", "nll"):
        METRIC[0] = metric
        print(f"## main: {metric}\n" + main_tables(rows))
        print(f"\n## ablation: {metric}\n" + ablation_table(rows))
        for made in plots(rows):
            print(f"wrote {made.relative_to(ROOT)}")
    cpu = sum(r["time_s"] for r in rows) + sum(
        {(r["experiment"], r["task"], r["sample"]): r["capture_s"] for r in rows}.values()
    )
    print(f"\nrows: {len(rows)}; summed evaluation time {cpu / 60:.1f} min (captures included)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.nacl", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("main", "ablation", "report", "check", "overhead"))
    parser.add_argument("--samples", type=int, default=10, help="samples per task")
    parser.add_argument("--length", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument("--modes", default="aware,agnostic")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.command == "report":
        report(args.out)
    elif args.command == "check":
        check(args.samples, args.length)
    elif args.command == "overhead":
        overhead(args.length)
    else:
        run(args.command, args.samples, args.length, args.modes.split(","), args.out, args.tasks.split(","))


if __name__ == "__main__":
    main()
