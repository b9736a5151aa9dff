"""Experiments behind ``docs/results/cascade.md``: Cascading KV Cache against the sink cache on SmolLM2-135M.

Every table in the document comes from one of these commands (per-token losses are saved under ``--out``, default
``runs/cascade``; configurations already there are skipped, so a run can be resumed; ``report`` turns them into
the markdown tables and ``docs/results/cascade_*.png``)::

    python -m experiments.cascade stream-ppl   # streaming ppl, 8 Gutenberg streams, |C| 256/512, N 1/2/4
    python -m experiments.cascade restart      # paper Fig. 3: burn-in, then re-read text 2|C| back
    python -m experiments.cascade ablation     # reduction, base, token selection, eager_fill (restart)
    python -m experiments.cascade stream-ablation  # the same ablations on streaming ppl
    python -m experiments.cascade passkey      # key beyond the sink window, inside the cascade span
    python -m experiments.cascade cache-op     # paper Tab. 4 setup: one cache update, ratios
    python -m experiments.cascade decode       # decode step time at 2K vs 16K, the two interleaved
    python -m experiments.cascade report       # markdown tables + plots
    python -m experiments.cascade all          # every run behind the page, cheapest first

The sink cache is the cascade structure with ``N = 1`` (``budget = S + |C|``), which the tests show equal, token for
token, to our ``streaming`` method with ``budget = S + |C| - 1`` (that one evicts after attending, so it attends
to one token more than it keeps). All runs use ``S = 4`` sinks, the v1 fill rule (``eager_fill=False``) unless a row
says otherwise, and the exact prefill (``prefill="exact"``: identical to feeding tokens one at a time; the chunk
size only batches the MLPs). Streams are fed as a batch (one sequence per stream, no padding).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn import functional as F

import kvcompress
from kvcompress.bench import cache_op
from kvcompress.bench.common import Timing, environment, time_calls
from kvcompress.bench.sink_references import CircularSinkCache, ConcatSinkCache
from kvcompress.core.contract import AttentionStats
from kvcompress.eval.data import gutenberg_books
from kvcompress.eval.tasks.passkey import ANSWER_PREFIX, FILLER, INTRO, NEEDLE, QUESTION
from kvcompress.generation import cache_argument, positions_from_mask, prefill
from kvcompress.methods.cascade.layer import CascadeLayer
from kvcompress.models import load_model

ROOT = Path(__file__).resolve().parents[1]  # the repository
OUT = ROOT / "runs" / "cascade"
PLOTS = ROOT / "docs" / "results"
PERF = PLOTS / "cascade_perf"  # bench outputs (cache-op, decode) for docs/results/cascade.md
MODEL = "smollm2-135m"
SINKS = 4


def load(model_name: str = MODEL):
    torch.set_num_threads(1)
    model, tokenizer = load_model(model_name)
    return model, tokenizer


def config_of(capacity: int, cascades: int, **params) -> dict[str, object]:
    return {"budget": SINKS + capacity, "sinks": SINKS, "cascades": cascades, **params}


def label(params: dict[str, object]) -> str:
    extra = [f"{k}={v}" for k, v in sorted(params.items()) if k not in ("budget", "sinks", "cascades")]
    return "_".join([f"C{params['budget'] - params['sinks']}", f"N{params['cascades']}", *extra])


def streams(tokenizer, count: int, tokens: int) -> torch.Tensor:
    """``count`` streams of ``tokens`` tokens from the Gutenberg books: each book from 10 % of its text, then the
    first books again from 55 %; every stream starts at a paragraph."""
    books = gutenberg_books()
    rows = []
    for i in range(count):
        book = books[i % len(books)].text
        offset = book.find("\n\n", int(len(book) * (0.10 if i < len(books) else 0.55))) + 2
        ids = tokenizer(book[offset : offset + tokens * 8], return_tensors="pt").input_ids[0]
        if ids.numel() < tokens:
            raise ValueError(f"stream {i} has only {ids.numel()} tokens")
        rows.append(ids[:tokens])
    return torch.stack(rows)


@torch.no_grad()
def batched_nll(model, ids: torch.Tensor, cache, chunk: int, start: int = 0) -> torch.Tensor:
    """Per-token loss ``[B, T - 1]`` of ``ids`` ``[B, T]`` fed ``chunk`` tokens at a time (entry ``t``: ``x[t+1]``);
    positions before ``start`` are fed but their losses are not computed (NaN)."""
    batch, length = ids.shape
    losses = torch.full((batch, length - 1), float("nan"))
    for first in range(0, length - 1, chunk):
        stop = min(first + chunk, length - 1)
        keep = max(0, min(stop, length - 1) - max(first, start))
        out = model(
            input_ids=ids[:, first:stop], **cache_argument(model, cache), use_cache=True, logits_to_keep=keep or 1
        )
        if keep:
            logits = out.logits[:, -keep:].float()
            targets = ids[:, stop - keep + 1 : stop + 1]
            losses[:, stop - keep : stop] = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return losses


def _save(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, path)


def run_configs(kind: str, configs: list[dict], ids: torch.Tensor, out: Path, chunk: int, start: int = 0) -> None:
    model, _ = load()
    for params in configs:
        path = out / kind / f"{label(params)}.pt"
        if path.exists():
            continue
        cache = kvcompress.cache_for(model, "cascade", **params)
        began = time.perf_counter()
        losses = batched_nll(model, ids, cache, chunk, start)
        seconds = time.perf_counter() - began
        _save(path, {"params": params, "losses": losses, "seconds": seconds, "chunk": chunk, "ids_shape": ids.shape})
        print(f"{kind} {label(params)}: ppl {math.exp(float(losses.nanmean())):.3f} ({seconds:.0f} s)", flush=True)


def replay_ids(base: torch.Tensor, capacity: int) -> tuple[torch.Tensor, int]:
    """Paper Fig. 3: a burn-in of ``4 |C|`` tokens (the v1 cascade is full after ~``(2^N - 1) |C| / N``), then the
    ``|C|`` tokens that lie ``2 |C|`` back are read again. Returns the ids and where the replay starts."""
    burn = 4 * capacity
    replay = base[:, burn - 2 * capacity : burn - capacity]
    return torch.cat([base[:, :burn], replay], 1), burn


def cmd_stream_ppl(args) -> None:
    model, tokenizer = load()
    ids = streams(tokenizer, args.streams, args.tokens)
    del model
    configs = [config_of(c, n) for c in args.capacities for n in args.cascades]
    run_configs("stream", configs, ids, args.out, args.chunk)


def cmd_restart(args, configs: list[dict] | None = None, kind: str = "restart") -> None:
    _, tokenizer = load()
    for capacity in args.capacities:
        base = streams(tokenizer, args.streams, 4 * capacity)
        ids, burn = replay_ids(base, capacity)
        chosen = configs or [config_of(capacity, n) for n in args.cascades]
        chosen = [p for p in chosen if p["budget"] - p["sinks"] == capacity]
        run_configs(kind, chosen, ids, args.out, args.chunk, start=burn - 2 * capacity)  # burn-in tail + replay


def ablation_configs(capacity: int, cascades: int) -> list[dict]:
    return [
        config_of(capacity, 1),
        config_of(capacity, cascades),
        config_of(capacity, cascades, select_tokens=False),
        config_of(capacity, cascades, eager_fill=True),
        config_of(capacity, cascades, reduction="median"),
        config_of(capacity, cascades, reduction="max"),
        config_of(capacity, cascades, base=3),
        config_of(capacity, cascades, base=4),
    ]


def cmd_ablation(args) -> None:
    args.capacities = [args.capacity]
    cmd_restart(args, ablation_configs(args.capacity, args.ablation_cascades))  # same task, shared baselines


def cmd_stream_ablation(args) -> None:
    """The ablations on streaming ppl: the same streams as ``stream-ppl``, cut to ``--tokens`` (the baselines are
    the ``stream-ppl`` runs of the sink cache and the default cascade, truncated: a streaming cache is causal, so
    the first ``T`` losses of a longer run are those of a ``T``-token run)."""
    model, tokenizer = load()
    ids = streams(tokenizer, args.streams, args.tokens)
    del model
    configs = ablation_configs(args.capacity, args.ablation_cascades)[2:]  # without the two shared baselines
    run_configs("stream_ablation", configs, ids, args.out, args.chunk)


def cmd_all(args) -> None:
    """Every run behind ``docs/results/cascade.md``, in one process, cheapest first (each step skips the
    configurations already saved, so this resumes)."""
    steps = [
        "cache-op",
        ["decode", "--out", str(PERF)],
        ["passkey", "--cascades", "1,2,4"],
        ["restart", "--capacities", "128,256,512", "--cascades", "1,4"],
        ["ablation", "--capacity", "128"],
        ["stream-ppl", "--capacities", "256,512", "--cascades", "1,2,4"],
    ]
    for step in steps:
        print(f"=== {step if isinstance(step, str) else ' '.join(step)}", flush=True)
        if step == "cache-op":  # paper Tab. 4 setup: the references, our streaming, cascade N = 4 and N = 1
            if not (PERF / "cache_op.json").exists():
                cache_op.main(["--methods", "streaming,cascade,cascade N=1", "--threads", "1", "--out", str(PERF)])
        elif step[0] == "decode":
            if not (PERF / "decode.json").exists():
                main(step)
        else:
            main([*step, "--out", str(args.out)])


def passkey_prompts(tokenizer, args) -> tuple[list[torch.Tensor], list[str], list[int]]:
    """The passkey prompts (ending in the answer prefix), their keys and how many tokens back each needle lies."""
    generator = torch.Generator().manual_seed(0)
    filler_ids = tokenizer(" " + FILLER, add_special_tokens=False).input_ids
    prompts, keys, distances = [], [], []
    for i in range(args.samples):
        key = str(int(torch.randint(10000, 100000, (1,), generator=generator)))
        back = args.min_back + (args.max_back - args.min_back) * i // max(1, args.samples - 1)
        before = max(0, (args.length - back) // len(filler_ids))
        after = max(0, back // len(filler_ids))
        text = INTRO + " " + FILLER * before + " " + NEEDLE.format(key=key) + (" " + FILLER) * after
        text += "\n" + QUESTION + "\n" + ANSWER_PREFIX
        ids = tokenizer(text, return_tensors="pt").input_ids
        needle_at = len(tokenizer(INTRO + " " + FILLER * before, add_special_tokens=False).input_ids)
        prompts.append(ids[0])
        keys.append(key)
        distances.append(ids.shape[1] - needle_at)
    return prompts, keys, distances


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(row.numel() for row in rows)
    batch = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(rows):
        batch[i, length - row.numel() :] = row
        mask[i, length - row.numel() :] = 1
    return batch, mask


@torch.no_grad()
def key_nll(model, prompts: list[torch.Tensor], key_ids: torch.Tensor, cache) -> list[float]:
    """Teacher-forced mean NLL per key token (``key_ids`` ``[B, K]``) after each prompt went through ``cache``: a
    graded retrieval score where a small model's exact answers are all wrong."""
    batch, mask = left_padded(prompts)
    first = prefill(model, batch, cache, attention_mask=mask, chunk_size=64)
    full_mask = torch.cat([mask, torch.ones_like(key_ids)], 1)
    positions = positions_from_mask(full_mask)[:, -key_ids.shape[1] : -1]
    out = model(
        input_ids=key_ids[:, :-1],
        attention_mask=full_mask[:, :-1],
        position_ids=positions,
        **cache_argument(model, cache),
    )
    logits = torch.cat([first[:, None], out.logits], 1).float()
    return F.cross_entropy(logits.transpose(1, 2), key_ids, reduction="none").mean(1).tolist()


def cmd_passkey(args) -> None:
    """Exact match of 7 greedy tokens and the key's teacher-forced NLL, key 350-800 tokens back in ~900."""
    model, tokenizer = load()
    path = args.out / "passkey.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    prompts, keys, distances = passkey_prompts(tokenizer, args)
    key_ids = torch.stack([torch.tensor(tokenizer(" " + key, add_special_tokens=False).input_ids) for key in keys])
    batch, mask = left_padded(prompts)
    methods = {"full": ("full", {})}
    for n in args.cascades:
        methods[label(config_of(args.capacity, n))] = ("cascade", config_of(args.capacity, n))
    for name, (method, params) in methods.items():
        record = done.get(name, {})
        began = time.perf_counter()
        if "hits" not in record:
            cache = kvcompress.cache_for(model, method, **params)
            with torch.no_grad():
                out = model.generate(
                    batch, attention_mask=mask, **cache_argument(model, cache), max_new_tokens=7, do_sample=False
                )
            answers = [tokenizer.decode(row[batch.shape[1] :], skip_special_tokens=True) for row in out]
            record.update(answers=answers, hits=[key in a for key, a in zip(keys, answers, strict=True)])
        if "key_nll" not in record:
            record["key_nll"] = key_nll(model, prompts, key_ids, kvcompress.cache_for(model, method, **params))
        record.update(params=params, keys=keys, distance=distances, seconds=time.perf_counter() - began)
        done[name] = record
        nll = sum(record["key_nll"]) / len(keys)
        print(f"passkey {name}: {sum(record['hits'])}/{len(keys)}, key NLL {nll:.3f}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(done, indent=1))


# --- performance --------------------------------------------------------------------------------------------------


def cmd_cache_op(args) -> None:
    """Paper Tab. 4 setup (batch 8, 32 heads, dim 128, S = 4, |C| = 1024, fp32): one cache update per token.

    Reports the median wall time per update and the process CPU time per update (on a shared, overloaded machine
    wall times mostly measure waiting; CPU time is what the update costs).

    Our layers are driven as the bench's ``cache-op`` drives the others: ``update`` + ``after_attention(stats)``
    (for the cascade the statistics are post-softmax rows over its ``S + |C|`` slots, so N = 4 includes the EMA
    with its head reduction; N = 1 never reads scores). References from ``kvcompress.bench.cache_op``."""
    torch.set_num_threads(1)
    batch, heads, dim, window = args.batch, args.heads, args.head_dim, args.window
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(batch, heads, 16, dim, generator=generator)
    rows, cpu_ms = {}, {}
    with torch.inference_mode():
        for name in ("concat sink (reference)", "circular sink (reference)", "cascade N=1", "cascade N=4"):
            fill = torch.randn(batch, heads, SINKS + window, dim, generator=generator)
            if name.startswith("cascade"):
                cascades = int(name[-1])
                config = kvcompress.make_config("cascade", **config_of(window, cascades))
                layer = CascadeLayer(config.policy(0), 1.0 / (10000 ** (torch.arange(0, dim, 2) / dim)))
                layer.update(fill, fill.clone())
                layer.after_attention(None)
                stats = AttentionStats(1, received=torch.randn(batch, heads, 1, SINKS + window).softmax(-1))

                def step(i, layer=layer, stats=stats):
                    layer.update(pool[:, :, i % 16 : i % 16 + 1], pool[:, :, i % 16 : i % 16 + 1])
                    layer.after_attention(stats)
            else:
                cache = (ConcatSinkCache if name.startswith("concat") else CircularSinkCache)(SINKS, window)
                cache.update(fill, fill.clone())

                def step(i, cache=cache):
                    cache.update(pool[:, :, i % 16 : i % 16 + 1], pool[:, :, i % 16 : i % 16 + 1])

            tokens = args.tokens if not name.startswith("concat") else min(args.tokens, 16)  # ~0.1-1 s each
            cpu = time.process_time()
            rows[name] = time_calls(step, tokens, args.warmup).median * 1e3
            cpu_ms[name] = (time.process_time() - cpu) / (tokens + args.warmup) * 1e3
            print(f"{name}: {rows[name]:.3f} ms median wall, {cpu_ms[name]:.3f} ms CPU", flush=True)
    record = {"median_ms": rows, "cpu_ms": cpu_ms, "setup": vars(args) | {"out": str(args.out)}, **environment(1)}
    (args.out / "cache_op.json").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_op.json").write_text(json.dumps(record, indent=1, default=str))


def cmd_decode(args) -> None:
    """Decode step time of ``cascade`` at 2K and at 16K logical context (batch 1), interleaved.

    One cache per context is brought to its length with the chunked prefill (the later official variant; decode
    steps are single tokens, identical in both modes), then single-token steps alternate between the two caches
    (``--steps`` rounds), so a change in machine load hits both contexts alike; the ratio of the medians (CPU time
    and wall time) is the result."""
    model, _ = load()
    ids = torch.randint(
        100, 40000, (1, max(args.contexts) + args.steps + 2), generator=torch.Generator().manual_seed(0)
    )
    result = {}
    for method, cascades in (("cascade", 4), ("cascade N=1", 1)):
        params = config_of(args.window, cascades, prefill="chunked")
        caches = {context: kvcompress.cache_for(model, "cascade", **params) for context in args.contexts}
        wall = {context: [] for context in args.contexts}
        cpu = {context: [] for context in args.contexts}
        with torch.inference_mode():
            for context, cache in caches.items():
                prefill(model, ids[:, :context], cache, chunk_size=512)
            for i in range(args.steps + 2):
                for context, cache in caches.items():
                    token = ids[:, context + i : context + i + 1]
                    cpu_start, start = time.process_time(), time.perf_counter()
                    model(input_ids=token, **cache_argument(model, cache), use_cache=True)
                    if i >= 2:  # two warm-up rounds
                        wall[context].append(time.perf_counter() - start)
                        cpu[context].append(time.process_time() - cpu_start)
        timings = {context: Timing.of(wall[context], cpu[context]) for context in args.contexts}
        result[method] = {
            str(context): {"wall_ms": t.median * 1e3, "cpu_ms": t.cpu_median * 1e3, "steps": args.steps}
            for context, t in timings.items()
        }
        first, last = min(args.contexts), max(args.contexts)
        ratio = timings[last].cpu_median / timings[first].cpu_median
        print(f"decode {method}: CPU {result[method]} ({last} / {first}: {ratio:.3f}x)", flush=True)
    (args.out / "decode.json").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(result, indent=1))


# --- report -------------------------------------------------------------------------------------------------------


def ppl(losses: torch.Tensor) -> float:
    return math.exp(float(losses[~losses.isnan()].mean()))


def paired_bootstrap(diff: torch.Tensor, block: int = 200, samples: int = 2000, seed: int = 0) -> tuple[float, ...]:
    """Relative ppl change ``exp(mean d) - 1`` of paired per-token loss differences ``d`` ``[B, T]`` (NaN = not
    scored) and its 95 % CI from a block bootstrap: blocks of ``block`` consecutive tokens of one stream are
    resampled with replacement (tokens within a block are not independent)."""
    sums, counts = [], []
    for row in diff:
        row = row[~row.isnan()]
        for first in range(0, row.numel(), block):
            part = row[first : first + block]
            sums.append(float(part.sum()))
            counts.append(part.numel())
    sums, counts = torch.tensor(sums, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)
    point = math.exp(float(sums.sum() / counts.sum())) - 1
    pick = torch.randint(0, len(sums), (samples, len(sums)), generator=torch.Generator().manual_seed(seed))
    stats = (sums[pick].sum(1) / counts[pick].sum(1)).exp() - 1
    low, high = torch.quantile(stats, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return point, low, high


def _records(out: Path, kind: str) -> dict[str, dict]:
    return {p.stem: torch.load(p, weights_only=True) for p in sorted((out / kind).glob("*.pt"))}


def _scored(record: dict, replay: bool) -> torch.Tensor:
    """The losses a table compares: all, or (restart task) those of the re-read tokens after the burn-in."""
    if not replay:
        return record["losses"]
    capacity = record["params"]["budget"] - record["params"]["sinks"]
    return record["losses"][:, 4 * capacity :]


def _compare_table(records: dict[str, dict], describe, replay: bool = False) -> list[str]:
    tail = " burn-in ppl (last 2|C|) |" if replay else ""
    lines = [
        f"| |C| | config | ppl | vs sink (N=1) [95 % CI] | per-stream ppl | streams won |{tail} s |",
        "|---|---|---|---|---|---|---|" + ("---|" if replay else ""),
    ]
    for name, record in records.items():
        params = record["params"]
        capacity = params["budget"] - params["sinks"]
        sink = records.get(label(config_of(capacity, 1)))
        losses = _scored(record, replay)
        per_stream = " / ".join(f"{ppl(row):.2f}" for row in losses)
        versus, won = "—", "—"
        if sink is not None and name != label(config_of(capacity, 1)):
            reference = _scored(sink, replay)
            point, low, high = paired_bootstrap(losses - reference)
            versus = f"{100 * point:+.2f} % [{100 * low:+.2f}, {100 * high:+.2f}]"
            wins = sum(ppl(a) < ppl(b) for a, b in zip(losses, reference, strict=True))
            won = f"{wins}/{losses.shape[0]}"
        burn = f" {ppl(record['losses'][:, : 4 * capacity - 1]):.3f} |" if replay else ""
        lines.append(
            f"| {capacity} | {describe(params)} | {ppl(losses):.3f} | {versus} | {per_stream} | {won} |{burn}"
            f" {'—' if record['seconds'] is None else format(record['seconds'], '.0f')} |"
        )
    return lines


def _describe(params: dict) -> str:
    if params["cascades"] == 1:
        return "sink cache (N=1)"
    extra = [f"{k}={v}" for k, v in sorted(params.items()) if k not in ("budget", "sinks", "cascades")]
    return f"cascade N={params['cascades']}" + (f", {', '.join(extra)}" if extra else "")


def cmd_report(args) -> None:
    out = args.out
    for kind, title in (
        ("stream", "Streaming perplexity"),
        ("restart", "Restart (Fig. 3): ppl on the re-read |C| tokens"),
    ):
        records = _records(out, kind)
        if not records:
            continue
        records = dict(sorted(records.items(), key=lambda kv: (kv[1]["params"]["budget"], kv[0])))
        print(f"### {title}\n")
        print("\n".join(_compare_table(records, _describe, replay=kind == "restart")) + "\n")
    ablations = _records(out, "stream_ablation")
    stream = _records(out, "stream")
    if ablations:
        first = next(iter(ablations.values()))
        capacity = first["params"]["budget"] - first["params"]["sinks"]
        rows, length = first["losses"].shape  # the first streams of stream-ppl (same books, offsets and tokens)
        cascades = first["params"]["cascades"]
        records = {}
        for params in (config_of(capacity, 1), config_of(capacity, cascades)):
            base = stream.get(label(params))
            if base is not None:  # the stream-ppl run, truncated to the ablation's length (causal: identical)
                records[label(params)] = base | {"losses": base["losses"][:rows, :length], "seconds": None}
        records.update(ablations)
        print(f"### Streaming perplexity ablations ({rows} streams, their first {length + 1} tokens)\n")
        print("\n".join(_compare_table(records, _describe)) + "\n")
    passkey = out / "passkey.json"
    if passkey.exists():
        data = json.loads(passkey.read_text())
        print("### Passkey\n\n| cache | found | key NLL per token | key distance from the end (tokens) | answers |")
        print("|---|---|---|---|---|")
        for name, row in data.items():
            answers = "; ".join(a.strip().replace("|", "/")[:12] for a in row["answers"])
            distances = f"{min(row['distance'])}–{max(row['distance'])}"
            nll = f"{sum(row['key_nll']) / len(row['key_nll']):.3f}" if "key_nll" in row else "—"
            print(f"| {name} | {sum(row['hits'])}/{len(row['hits'])} | {nll} | {distances} | {answers} |")
        print()
    for name in ("cache_op.json", "decode.json"):
        if (out / name).exists():
            print(f"### {name}\n\n```\n{(out / name).read_text()}\n```\n")
    _plots(out)


def _plots(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _records(out, "stream")
    if records:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, capacity in zip(axes, (256, 512), strict=True):
            sink = records.get(label(config_of(capacity, 1)))
            if sink is None:
                continue
            for n in (2, 4):
                record = records.get(label(config_of(capacity, n)))
                if record is None:
                    continue
                diff = (record["losses"] - sink["losses"]).mean(0)
                running = diff.cumsum(0) / torch.arange(1, diff.numel() + 1)
                ax.plot(running.numpy(), label=f"N={n}")
            ax.axhline(0, color="grey", lw=0.5)
            ax.set_title(f"|C| = {capacity}: running mean NLL difference vs sink cache")
            ax.set_xlabel("token")
            ax.legend()
        axes[0].set_ylabel("nats / token (negative = cascade better)")
        fig.tight_layout()
        fig.savefig(PLOTS / "cascade_stream.png", dpi=100)
        plt.close(fig)
    records = _records(out, "restart")
    if records:
        fig, ax = plt.subplots(figsize=(6, 4))
        by_n: dict[int, list[tuple[int, float]]] = {}
        for record in records.values():
            params = record["params"]
            by_n.setdefault(params["cascades"], []).append((params["budget"] - params["sinks"], ppl(record["losses"])))
        for n, points in sorted(by_n.items()):
            points.sort()
            name = "sink (N=1)" if n == 1 else f"N={n}"
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("|C|")
        ax.set_ylabel("ppl on the re-read tokens")
        ax.set_title("Restart test (paper Fig. 3), SmolLM2-135M")
        ax.legend()
        fig.tight_layout()
        fig.savefig(PLOTS / "cascade_restart.png", dpi=100)
        plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    prog = "python -m experiments.cascade"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    names = ("stream-ppl", "restart", "ablation", "stream-ablation", "passkey", "cache-op", "decode", "report", "all")
    for name in names:
        command = sub.add_parser(name)
        command.add_argument("--out", type=Path, default=OUT)
        command.add_argument("--streams", type=int, default=8)
        command.add_argument("--chunk", type=int, default=64)
        command.add_argument("--cascades", type=ints, default=[1, 2, 4])
        if name == "stream-ppl":
            command.add_argument("--tokens", type=int, default=4000)
            command.add_argument("--capacities", type=ints, default=[256, 512])
        if name == "restart":
            command.add_argument("--capacities", type=ints, default=[128, 256, 512])
        if name in ("ablation", "stream-ablation"):
            command.add_argument("--capacity", type=int, default=256)
            command.add_argument("--ablation-cascades", type=int, default=4)
        if name == "stream-ablation":
            command.add_argument("--tokens", type=int, default=2000)
        if name == "passkey":
            command.add_argument("--capacity", type=int, default=256)
            command.add_argument("--samples", type=int, default=8)
            command.add_argument("--length", type=int, default=900)
            command.add_argument("--min-back", type=int, default=350)
            command.add_argument("--max-back", type=int, default=800)
        if name == "cache-op":
            command.add_argument("--batch", type=int, default=8)
            command.add_argument("--heads", type=int, default=32)
            command.add_argument("--head-dim", type=int, default=128)
            command.add_argument("--window", type=int, default=1024)
            command.add_argument("--tokens", type=int, default=512)
            command.add_argument("--warmup", type=int, default=16)
        if name == "decode":
            command.add_argument("--window", type=int, default=508)
            command.add_argument("--contexts", type=ints, default=[2048, 16384])
            command.add_argument("--steps", type=int, default=48)
    args = parser.parse_args(argv)
    handler = {
        "stream-ppl": cmd_stream_ppl,
        "restart": cmd_restart,
        "ablation": cmd_ablation,
        "stream-ablation": cmd_stream_ablation,
        "all": cmd_all,
        "passkey": cmd_passkey,
        "cache-op": cmd_cache_op,
        "decode": cmd_decode,
        "report": cmd_report,
    }[args.command]
    handler(args)


if __name__ == "__main__":
    main()
