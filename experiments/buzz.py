"""Experiments behind ``docs/results/buzz.md``: BUZZ against H2O, StreamingLLM, a local window and the full cache.

Every table in the document comes from one of these commands (results append to a JSONL file, rows already there
are skipped, so a run can be resumed; ``report`` turns the file into the markdown tables and plots)::

    python -m experiments.buzz ppl        # Table 3: WikiText-2 perplexity, fed token by token
    python -m experiments.buzz sweep      # Theorem 3.1: T/w at a fixed average cache size
    python -m experiments.buzz ablations  # Fig. 8: no local max, swapped strides, current scores
    python -m experiments.buzz summary    # Table 2 style: summary ROUGE against the full cache
    python -m experiments.buzz docqa      # Fig. 6 style: 10-document QA, answer at positions 0, 4, 9
    python -m experiments.buzz overhead   # per-step cost vs streaming (cache-op loop, SmolLM2 decode)
    python -m experiments.buzz report     # markdown tables + docs/results/buzz_*.png

Cache sizes are per layer and KV head. Every run records what the first layer stored after each forward (after its
eviction): ``avg`` and ``max`` of that. ``buzz`` rows are given a target *average* (``budget=C``, the paper's
notion of cache budget) or a target *peak* (``budget=C, budget_kind=peak``: ``k + w + T <= C``); the fixed-size
baselines keep ``C`` tokens at every step, so their average and peak are both ``C``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch.nn import functional as F

import kvcompress
from kvcompress.core.contract import AttentionStats
from kvcompress.core.layer import CompressedLayer
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model
from kvcompress.results import append_row, done_keys, read_rows

ROOT = Path(__file__).resolve().parents[1]  # the repository
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "docs" / "results" / "buzz_results.jsonl"
PLOTS = ROOT / "docs" / "results"
MODEL = "smollm2-135m"

# --- method configurations -----------------------------------------------------------------------------------


def method_params(label: str, size: int) -> tuple[str, dict[str, object]]:
    """Registry method and parameters of a row label at cache size ``size``."""
    table: dict[str, tuple[str, dict[str, object]]] = {
        "full": ("full", {}),
        "buzz": ("buzz", {"budget": size, "budget_kind": "average"}),
        "buzz-peak": ("buzz", {"budget": size, "budget_kind": "peak"}),
        "buzz-logn": ("buzz", {"budget": size, "budget_kind": "average", "log_n": True}),
        "buzz-logn-peak": ("buzz", {"budget": size, "budget_kind": "peak", "log_n": True}),
        "buzz-no-local-max": ("buzz", {"budget": size, "budget_kind": "average", "local_max": False}),
        "buzz-swapped-strides": ("buzz", {"budget": size, "budget_kind": "average", "swap_strides": True}),
        "buzz-current-score": ("buzz", {"budget": size, "budget_kind": "average", "score_mode": "current"}),
        "h2o": ("h2o", {"budget": size}),
        "streaming": ("streaming", {"budget": size}),
        "window": ("window", {"budget": size}),
    }
    if label.startswith("buzz-tw"):  # buzz-tw2.5: T/w = 2.5 at a target average size
        return "buzz", {"budget": size, "budget_kind": "average", "tw_ratio": float(label[len("buzz-tw") :])}
    return table[label]


def describe(method: str, params: dict[str, object]) -> str:
    """``k/w/T/s`` of a buzz configuration, empty otherwise."""
    if method != "buzz":
        return ""
    k, w, t, s = kvcompress.make_config(method, **params).resolved()
    return f"k={k} w={w} T={t} s={s}"


# --- model and data ---------------------------------------------------------------------------------------------


def load():
    torch.set_num_threads(1)
    model, tokenizer = load_model(MODEL)
    return model, tokenizer


def wikitext_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of WikiText-2 test, rows joined into one stream (spec A20)."""
    text = (DATA / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    ids = tokenizer(text[: tokens * 8], add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"not enough text for {tokens} tokens")
    return ids[:, :tokens]


def essay_texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted((DATA / "paul_graham_essays").glob("*.txt"))]


# --- perplexity -----------------------------------------------------------------------------------------------


@torch.no_grad()
def stream_run(model, ids: torch.Tensor, method: str, params: dict[str, object], chunk: int) -> dict:
    """Teacher-forced NLL of a stream fed ``chunk`` tokens per forward; stored length after every forward."""
    cache = kvcompress.cache_for(model, method, **params)
    length = ids.shape[1]
    losses, stored = [], []
    start_time = time.process_time()
    for start in range(0, length - 1, chunk):
        stop = min(start + chunk, length - 1)
        logits = model(input_ids=ids[:, start:stop], **cache_argument(model, cache), use_cache=True).logits[0]
        losses.append(F.cross_entropy(logits.float(), ids[0, start + 1 : stop + 1], reduction="none"))
        stored.append(cache.tokens_stored()[0])
    nll = torch.cat(losses)
    return {
        "ppl": math.exp(float(nll.mean())),
        "avg": sum(stored) / len(stored),
        "max": max(stored),
        "cpu_s": time.process_time() - start_time,
    }


def run_ppl(
    experiment: str, labels: Sequence[str], sizes: Sequence[int], tokens: int, chunk: int, out: Path = RESULTS
) -> None:
    model, tokenizer = load()
    ids = wikitext_ids(tokenizer, tokens)
    done = done_keys(out)
    jobs = [("full", 0)] if "full" in labels else []
    jobs += [(label, size) for size in sizes for label in labels if label != "full"]
    for label, size in jobs:
        key = json.dumps([experiment, label, size, tokens, chunk])
        if key in done:
            continue
        method, params = method_params(label, size)
        row = stream_run(model, ids, method, params, chunk)
        row.update(key=key, experiment=experiment, label=label, size=size, tokens=tokens, chunk=chunk)
        row["config"] = describe(method, params)
        append_row(row, out)
        print(json.dumps(row), flush=True)


# --- summary fidelity -------------------------------------------------------------------------------------------


def summary_prompts(tokenizer, count: int, passage_tokens: int) -> list[torch.Tensor]:
    prompts = []
    for text in essay_texts()[:count]:
        words = " ".join(text.split())
        ids = tokenizer(words, add_special_tokens=False).input_ids[:passage_tokens]
        passage = tokenizer.decode(ids)
        message = f"Summarize the following text in three sentences.\n\n{passage}"
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(chat, add_special_tokens=False, return_tensors="pt").input_ids)
    return prompts


@torch.no_grad()
def generate_with(model, tokenizer, ids: torch.Tensor, method: str, params: dict, new_tokens: int) -> tuple[str, dict]:
    cache = kvcompress.cache_for(model, method, **params)
    stored: list[int] = []
    cache.compressed_layers[0].observers.append(lambda layer: stored.append(layer.stored_length()))
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **cache_argument(model, cache),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return text, {"avg": sum(stored) / len(stored), "max": max(stored), "first": stored[0]}


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = {name: 100 * value.fmeasure for name, value in scorer.score(reference, prediction).items()}
    scores["mean"] = (scores["rouge1"] * scores["rouge2"] * scores["rougeL"]) ** (1 / 3)
    return scores


def run_summary(
    labels: Sequence[str],
    percents: Sequence[int],
    count: int,
    passage_tokens: int,
    new_tokens: int,
    out: Path = RESULTS,
) -> None:
    model, tokenizer = load()
    done = done_keys(out)
    prompts = summary_prompts(tokenizer, count, passage_tokens)
    for index, ids in enumerate(prompts):
        ref_key = json.dumps(["summary", "full", 0, index, passage_tokens, new_tokens])
        rows = {row["key"]: row for row in read_rows(out)}
        if ref_key not in rows:
            start = time.process_time()
            text, lengths = generate_with(model, tokenizer, ids, "full", {}, new_tokens)
            row = dict(key=ref_key, experiment="summary", label="full", percent=100, sample=index, text=text)
            row.update(lengths, prompt=ids.shape[1], cpu_s=time.process_time() - start)
            append_row(row, out)
            rows[ref_key] = row
        reference = rows[ref_key]
        for percent in percents:
            size = max(1, round(percent / 100 * reference["avg"]))
            for label in labels:
                key = json.dumps(["summary", label, percent, index, passage_tokens, new_tokens])
                if key in done:
                    continue
                method, params = method_params(label, size)
                start = time.process_time()
                text, lengths = generate_with(model, tokenizer, ids, method, params, new_tokens)
                row = dict(key=key, experiment="summary", label=label, percent=percent, sample=index, size=size)
                row.update(lengths, text=text, cpu_s=time.process_time() - start, full_avg=reference["avg"])
                row.update(rouge_scores(text, reference["text"]))
                append_row(row, out)
                print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)


# --- 10-document QA ---------------------------------------------------------------------------------------------

NAMES = (
    "Alder",
    "Birch",
    "Cedar",
    "Dahlia",
    "Elm",
    "Fern",
    "Gorse",
    "Hazel",
    "Iris",
    "Juniper",
    "Laurel",
    "Maple",
    "Nettle",
    "Olive",
    "Poppy",
    "Rowan",
    "Sorrel",
    "Tansy",
    "Violet",
    "Willow",
)


def docqa_samples(tokenizer, count: int, doc_tokens: int, seed: int = 0) -> list[dict]:
    """Synthetic lost-in-the-middle prompts: 10 documents (essay sentences + one code fact each); the question
    asks for the code stated in the gold document. The context and the question are tokenised apart."""
    rng = random.Random(seed)
    sentences = [s.strip() + "." for text in essay_texts() for s in " ".join(text.split()).split(". ") if 40 < len(s)]
    samples = []
    for index in range(count):
        names = rng.sample(NAMES, 10)
        codes = [str(rng.randint(1000, 9999)) for _ in names]
        docs = []
        for slot, (name, code) in enumerate(zip(names, codes, strict=True)):
            filler, total = [], 0
            while total < doc_tokens:
                sentence = rng.choice(sentences)
                filler.append(sentence)
                total += len(tokenizer(" " + sentence, add_special_tokens=False).input_ids)
            cut = rng.randint(1, len(filler))
            body = " ".join(filler[:cut] + [f"The access code of project {name} is {code}."] + filler[cut:])
            docs.append(f"Document [{slot + 1}] {body}")
        samples.append({"index": index, "names": names, "codes": codes, "docs": docs})
    return samples


def docqa_prompt(tokenizer, sample: dict, position: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    name, code = sample["names"][position], sample["codes"][position]
    context = "Read the documents and answer the question.\n\n" + "\n\n".join(sample["docs"])
    question = f"Question: what is the access code of project {name}?"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + "\n\n" + question}], tokenize=False, add_generation_prompt=True
    )
    chat += f"The access code of project {name} is"
    cut = chat.index(context) + len(context)
    encode = lambda text: tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids  # noqa: E731
    return encode(chat[:cut]), encode(chat[cut:]), code


@torch.no_grad()
def docqa_answer(model, tokenizer, context, question, method, params, new_tokens: int) -> tuple[str, int]:
    """Prefill the documents (one pass; the cache evicts after it), then feed the question and decode."""
    cache = kvcompress.cache_for(model, method, **params)
    prefill(model, context, cache)
    stored = cache.tokens_stored()[0]
    prompt = torch.cat([context, question], dim=1)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        **cache_argument(model, cache),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True), stored


def run_docqa(
    labels: Sequence[str],
    percent: int,
    count: int,
    doc_tokens: int,
    positions: Sequence[int] = (0, 4, 9),
    out: Path = RESULTS,
) -> None:
    model, tokenizer = load()
    done = done_keys(out)
    for sample in docqa_samples(tokenizer, count, doc_tokens):
        for position in positions:
            context, question, code = docqa_prompt(tokenizer, sample, position)
            size = max(1, round(percent / 100 * context.shape[1]))
            for label in labels:
                key = json.dumps(["docqa", label, percent, sample["index"], position, doc_tokens])
                if key in done:
                    continue
                method, params = method_params(label, size)
                start = time.process_time()
                text, stored = docqa_answer(model, tokenizer, context, question, method, params, 8)
                row = dict(key=key, experiment="docqa", label=label, percent=percent, sample=sample["index"])
                row.update(position=position, size=size, context=context.shape[1], stored_after_docs=stored)
                row.update(text=text, code=code, em=float(code in text), cpu_s=time.process_time() - start)
                append_row(row, out)
                print(json.dumps(row), flush=True)


# --- per-step overhead -------------------------------------------------------------------------------------------


def _summary(samples: list[float], evicted: list[bool]) -> dict[str, float]:
    """Robust per-step costs on a shared machine: medians of eviction and non-eviction steps, and their mix
    weighted by how often a step evicts (the amortised cost; a plain mean is dominated by scheduling spikes)."""

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2] if values else 0.0

    evict = [t for t, e in zip(samples, evicted, strict=True) if e]
    keep = [t for t, e in zip(samples, evicted, strict=True) if not e]
    share = len(evict) / len(samples)
    return {
        "median_us": 1e6 * median(samples),
        "evict_us": 1e6 * median(evict),
        "no_evict_us": 1e6 * median(keep),
        "amortised_us": 1e6 * (share * median(evict) + (1 - share) * median(keep)),
        "evictions": len(evict),
        "steps": len(samples),
    }


@torch.no_grad()
def cache_op_times(method: str, params: dict, batch: int, heads: int, dim: int, size: int, steps: int) -> dict:
    """One ``CompressedLayer`` filled with ``size`` tokens, then ``steps`` single-token updates + evictions, each
    timed (``update`` + ``after_attention`` with synthetic received-attention statistics, as ``bench.cache_op``)."""
    generator = torch.Generator().manual_seed(0)
    policy = kvcompress.make_config(method, **params).policy(0)
    layer = CompressedLayer(policy)
    fill = torch.randn(batch, heads, size, dim, generator=generator)
    layer.update(fill, fill.clone())
    wants = policy.stats.received
    received = torch.rand(batch, heads, 1, 4 * size + 8, generator=generator)
    if wants:
        layer.after_attention(AttentionStats(query_count=size, received=received[..., :size]))
    else:
        layer.after_attention(None)
    pool = torch.randn(16, batch, heads, 1, dim, generator=generator)
    samples, evicted = [], []
    for i in range(steps):
        length = layer.stored_length() + 1
        stats = AttentionStats(query_count=1, received=received[..., :length]) if wants else None
        start = time.perf_counter()
        layer.update(pool[i % 16], pool[i % 16])
        layer.after_attention(stats)
        samples.append(time.perf_counter() - start)
        evicted.append(layer.stored_length() < length)
    return _summary(samples, evicted)


@torch.no_grad()
def decode_times(model, method: str, params: dict, context: int, steps: int) -> dict:
    """SmolLM2 decode step time at a logical context (chunked prefill first), every step timed."""
    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab, (1, context + steps), generator=torch.Generator().manual_seed(0))
    cache = kvcompress.cache_for(model, method, **params)
    prefill(model, ids[:, :context], cache, chunk_size=256)
    samples, stored, evicted = [], [], []
    for i in range(context, context + steps):
        before = cache.tokens_stored()[0]
        start = time.perf_counter()
        model(input_ids=ids[:, i : i + 1], **cache_argument(model, cache), use_cache=True)
        samples.append(time.perf_counter() - start)
        stored.append(cache.tokens_stored()[0])
        evicted.append(stored[-1] <= before)
    return {**_summary(samples, evicted), "avg_stored": sum(stored) / len(stored), "max_stored": max(stored)}


def run_overhead(size: int, paper_shape: bool = False, out: Path = RESULTS) -> None:
    """Per-step cost of buzz vs streaming (and h2o) at the same size: a cache-op loop and SmolLM2 decode steps."""
    torch.set_num_threads(1)
    labels = ("streaming", "h2o", "buzz", "buzz-peak")
    cycle = 0
    for label in labels:
        method, params = method_params(label, size)
        if method == "buzz":
            k, w, t, s = kvcompress.make_config(method, **params).resolved()
            cycle = max(cycle, t - w + 1)
    steps = 2 * cycle  # at least one full BUZZ eviction cycle for every configuration
    for shape in ((1, 3, 64), (8, 32, 128)) if paper_shape else ((1, 3, 64),):
        for label in labels:
            key = json.dumps(["cache-op", label, size, shape, steps])
            if key in done_keys(out):
                continue
            method, params = method_params(label, size)
            row = cache_op_times(method, params, *shape, size=size, steps=steps)
            row.update(key=key, experiment="cache-op", label=label, size=size, shape=shape)
            append_row(row, out)
            print(json.dumps(row), flush=True)
    model, _ = load()
    steps = cycle + 16  # one eviction cycle of the larger buzz configuration
    for label in labels:
        key = json.dumps(["decode", label, size, 1024, steps])
        if key in done_keys(out):
            continue
        method, params = method_params(label, size)
        row = decode_times(model, method, params, 1024, steps)
        row.update(key=key, experiment="decode", label=label, size=size, context=1024)
        append_row(row, out)
        print(json.dumps(row), flush=True)


def overhead_table(rows: list[dict]) -> str:
    out = []
    for experiment in ("cache-op", "decode"):
        items = [r for r in rows if r["experiment"] == experiment]
        for group in sorted({json.dumps(r.get("shape")) for r in items}):
            chosen = [r for r in items if json.dumps(r.get("shape")) == group]
            base = {r["size"]: r for r in chosen if r["label"] == "streaming"}
            for r in chosen:
                ref = base.get(r["size"])
                ratio = f"{r['amortised_us'] / ref['amortised_us']:.2f}" if ref else "—"
                where = f"B,H,d = {tuple(r['shape'])}" if r.get("shape") else "SmolLM2, context 1024"
                unit = 1 if experiment == "cache-op" else 1000
                cells = [
                    f"{r[name] / unit:.0f}" if r[name] else "—" for name in ("no_evict_us", "evict_us", "amortised_us")
                ]
                out.append((experiment, where, r["label"], r["size"], f"{r['evictions']}/{r['steps']}", *cells, ratio))
    header = (
        "bench",
        "setup",
        "method",
        "C",
        "evicting steps",
        "median, no eviction",
        "median, eviction",
        "amortised",
        "amortised × streaming",
    )
    return markdown(header, out) + "\n\n(cache-op in µs per update, decode in ms per step)"


# --- report ---------------------------------------------------------------------------------------------------


def markdown(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ppl_table(rows: list[dict], experiment: str) -> str:
    rows = [r for r in rows if r["experiment"] == experiment]
    rows.sort(key=lambda r: (r["size"], r["chunk"], r["label"]))
    return markdown(
        ("size C", "method", "config", "chunk", "avg stored", "max stored", "PPL", "CPU s"),
        (
            (
                r["size"] or "—",
                r["label"],
                r["config"],
                r["chunk"],
                f"{r['avg']:.1f}",
                r["max"],
                f"{r['ppl']:.3f}",
                f"{r['cpu_s']:.0f}",
            )
            for r in rows
        ),
    )


def summary_table(rows: list[dict]) -> str:
    rows = [r for r in rows if r["experiment"] == "summary" and r["label"] != "full"]
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["percent"], r["label"]), []).append(r)
    out = []
    for (percent, label), items in sorted(groups.items()):
        mean = lambda name, items=items: sum(i[name] for i in items) / len(items)  # noqa: E731
        out.append(
            (
                f"{percent} %",
                label,
                len(items),
                f"{mean('size'):.0f}",
                f"{mean('avg'):.0f}",
                f"{mean('max'):.0f}",
                f"{mean('rouge1'):.1f}",
                f"{mean('rouge2'):.1f}",
                f"{mean('rougeL'):.1f}",
                f"**{mean('mean'):.1f}**",
            )
        )
    header = ("budget", "method", "n", "C", "avg stored", "max stored", "R-1", "R-2", "R-L", "mean ROUGE")
    return markdown(header, out)


def docqa_table(rows: list[dict]) -> str:
    rows = [r for r in rows if r["experiment"] == "docqa"]
    labels = sorted({r["label"] for r in rows}, key=lambda x: (x != "full", x))
    out = []
    for percent in sorted({r["percent"] for r in rows}):
        for label in labels:
            items = [r for r in rows if r["label"] == label and r["percent"] == percent]
            if not items:
                continue
            cells = []
            for position in (0, 4, 9):
                hits = [r["em"] for r in items if r["position"] == position]
                cells.append(f"{100 * sum(hits) / len(hits):.0f} ({len(hits)})" if hits else "—")
            average = 100 * sum(r["em"] for r in items) / len(items)
            stored = sum(r["stored_after_docs"] for r in items) / len(items)
            size = sum(r["size"] for r in items) / len(items)
            out.append((f"{percent} %", label, f"{size:.0f}", f"{stored:.0f}", *cells, f"**{average:.0f}**"))
    header = ("budget", "method", "C", "stored after docs", "EM pos 0 (n)", "EM pos 4 (n)", "EM pos 9 (n)", "EM avg")
    return markdown(header, out)


def plots(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ppl = [r for r in rows if r["experiment"] in ("ppl", "ppl-large") and r["chunk"] == 4]
    if ppl:
        fig, ax = plt.subplots(figsize=(6, 4))
        full = [r["ppl"] for r in ppl if r["label"] == "full"]
        for label in sorted({r["label"] for r in ppl} - {"full"}):
            items = sorted((r for r in ppl if r["label"] == label), key=lambda r: r["avg"])
            ax.plot([r["avg"] for r in items], [r["ppl"] for r in items], "o-", label=label)
        if full:
            ax.axhline(full[0], color="k", ls=":", label="full")
        ax.set_xlabel("average stored tokens per layer and head")
        ax.set_ylabel("WikiText-2 perplexity (log scale)")
        ax.set_yscale("log")
        ax.set_title("SmolLM2-135M, WikiText-2, 4 tokens per forward", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(PLOTS / "buzz_ppl.png", dpi=120)
        plt.close(fig)
    summary = [r for r in rows if r["experiment"] == "summary" and r["label"] != "full"]
    if summary:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label in sorted({r["label"] for r in summary}):
            percents = sorted({r["percent"] for r in summary if r["label"] == label})
            means = [
                sum(r["mean"] for r in summary if r["label"] == label and r["percent"] == p)
                / len([r for r in summary if r["label"] == label and r["percent"] == p])
                for p in percents
            ]
            ax.plot(percents, means, "o-", label=label)
        ax.set_xlabel("budget C, % of the full cache's average length")
        ax.set_ylabel("mean ROUGE vs full-cache output")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(PLOTS / "buzz_summary.png", dpi=120)
        plt.close(fig)
    sweep = sorted(
        (r for r in rows if r["experiment"] == "sweep"),
        key=lambda r: float(r["config"].split("T=")[1].split()[0]) / float(r["config"].split("w=")[1].split()[0]),
    )
    if sweep:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ratios = [
            float(r["config"].split("T=")[1].split()[0]) / float(r["config"].split("w=")[1].split()[0]) for r in sweep
        ]
        ax.plot(ratios, [r["ppl"] for r in sweep], "o-")
        ax.axvline(13 / 3, color="k", ls=":", label="Theorem 3.1 (4.33)")
        ax.set_xlabel("T / w (s = 5)")
        ax.set_ylabel("perplexity")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(PLOTS / "buzz_tw_sweep.png", dpi=120)
        plt.close(fig)


def report(out: Path = RESULTS) -> None:
    rows = read_rows(out)
    for title, experiment in (
        ("ppl", "ppl"),
        ("sweep", "sweep"),
        ("ablations", "ablations"),
        ("ppl-large", "ppl-large"),
    ):
        if any(r["experiment"] == experiment for r in rows):
            print(f"\n### {title}\n\n{ppl_table(rows, experiment)}")
    if any(r["experiment"] == "summary" for r in rows):
        print(f"\n### summary\n\n{summary_table(rows)}")
    if any(r["experiment"] == "docqa" for r in rows):
        print(f"\n### docqa\n\n{docqa_table(rows)}")
    if any(r["experiment"] in ("cache-op", "decode") for r in rows):
        print(f"\n### overhead\n\n{overhead_table(rows)}")
    plots(rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.buzz", description=__doc__.split("\n")[0])
    parser.add_argument(
        "experiment", choices=("ppl", "ppl-large", "sweep", "ablations", "summary", "docqa", "overhead", "report")
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSONL results file")
    parser.add_argument("--tokens", type=int, default=800, help="perplexity: WikiText-2 tokens in the stream")
    parser.add_argument("--chunk", type=int, default=1, help="perplexity: tokens per forward (1 = token by token)")
    parser.add_argument("--sizes", default=None, help="perplexity: cache sizes, comma-separated")
    parser.add_argument("--methods", default=None, help="row labels, comma-separated")
    parser.add_argument("--samples", type=int, default=8, help="summary/docqa: number of samples")
    parser.add_argument("--paper-shape", action="store_true", help="overhead: also batch 8, 32 heads, dim 128")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else None
    methods = args.methods.split(",") if args.methods else None
    if args.experiment == "ppl":
        default = "full,buzz,buzz-peak,buzz-logn,h2o,streaming,window"
        run_ppl("ppl", methods or default.split(","), sizes or [50, 100], args.tokens, args.chunk, args.out)
    elif args.experiment == "ppl-large":
        default = "buzz,buzz-peak,buzz-logn,h2o,streaming"
        run_ppl("ppl-large", methods or default.split(","), sizes or [200], args.tokens, args.chunk, args.out)
    elif args.experiment == "sweep":
        default = "buzz-tw1.5,buzz-tw2.5,buzz-tw3.5,buzz-tw4.333,buzz-tw5.5,buzz-tw6.5"
        run_ppl("sweep", methods or default.split(","), sizes or [100], args.tokens, args.chunk, args.out)
    elif args.experiment == "ablations":
        default = "buzz-no-local-max,buzz-swapped-strides,buzz-current-score"
        run_ppl("ablations", methods or default.split(","), sizes or [50], args.tokens, args.chunk, args.out)
    elif args.experiment == "summary":
        default = "buzz,buzz-peak,buzz-logn,h2o,streaming"
        run_summary(methods or default.split(","), sizes or [20, 40], args.samples, 400, 48, args.out)
    elif args.experiment == "docqa":
        default = "full,buzz,buzz-peak,h2o,streaming"
        run_docqa(methods or default.split(","), (sizes or [25])[0], args.samples, 60, out=args.out)
    elif args.experiment == "overhead":
        run_overhead((sizes or [64])[0], args.paper_shape, args.out)
    else:
        report(args.out)


if __name__ == "__main__":
    main()
