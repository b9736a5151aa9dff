"""Kept sets of the one-shot scorers and budget allocations against kvpress's presses (docs/results/frontier.md).

Reads ``<out>/samples.json`` (``python -m experiments.compare samples``) and ``<out>/kvpress-kept.jsonl``
(``scripts/vs_kvpress_kept.py`` in the kvpress environment; or another file of its rows, ``kept``), prefills each
context into the kvcompress method that corresponds to each press (at ratio 0.5, the press's settings), and prints
per press the share of kvpress's kept tokens kvcompress keeps too, per layer and KV head (mean and minimum over
layers, heads and samples), with the Jaccard index, the (layer, head) pairs kept identically, the share of the
context's pairs kept and the bytes kvcompress's cache holds (``nbytes()``) over the full context's; writes the rows
to ``<out>/frontier.json`` (``<out>/<stem of kept>.frontier.json`` for another ``kept``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import kvcompress
from experiments.compare.agreement import compare_kept
from kvcompress.generation import prefill
from kvcompress.models import load_model

SNAPKV = {"preset": "kvpress"}
# kvpress press -> (kvcompress method, parameters at ratio 0.5)
COUNTERPARTS = {
    "KeyDiffPress": ("keydiff", {}),
    "ExpectedAttentionPress": ("expected_attention", {}),
    "AdaKVPress(ExpectedAttentionPress)": ("expected_attention", {"allocation": "adakv"}),
    "SnapKVPress": ("snapkv", SNAPKV),
    "AdaKVPress(SnapKVPress)": ("snapkv", {**SNAPKV, "allocation": "adakv"}),
    "PyramidKVPress": ("snapkv", {**SNAPKV, "allocation": "pyramid"}),
    "KVzipPress": ("kvzip", {}),
    "KVzipPress(layerwise=True)": ("kvzip", {"allocation": "layer"}),
    "CompactorPress": ("compactor", {}),
    "AdaKVPress(CompactorPress)": ("compactor", {"allocation": "adakv"}),
}


def our_kept(model, method: str, params: dict, context: list[int]) -> tuple[list[list[list[int]]], float]:
    """The kept sets ``[layer][head]`` and the bytes the cache holds (``nbytes()``) over the full context's."""
    cache = kvcompress.cache_for(model, method, ratio=0.5, **params)
    prefill(model, torch.tensor([context]), cache)
    layers = cache.compressed_layers
    keys = [layer.keys for layer in layers]  # (a ragged layer has no slot buffers: its padded copy's shape)
    full = sum(len(context) * 2 * k.shape[1] * k.shape[3] * k.element_size() for k in keys)
    kept = [
        [sorted(t for t, v in zip(ts, vs, strict=True) if v) for ts, vs in zip(*row, strict=True)]
        for row in ((layer.token_idx[0].tolist(), layer.valid[0].tolist()) for layer in layers)
    ]
    return kept, cache.nbytes() / full


def run_frontier(out: str | Path, threads: int = 1, kept: str = "kvpress-kept.jsonl") -> str:
    torch.set_num_threads(threads)
    out = Path(out)
    spec = json.loads((out / "samples.json").read_text())
    rows = [json.loads(line) for line in (out / kept).read_text().splitlines() if line]
    model, _ = load_model(spec["model"])
    contexts = {s["id"]: s["context_ids"] for s in spec["samples"]}
    results = {}
    for row in rows:
        method, params = COUNTERPARTS[row["press"]]
        if method == "kvzip":
            params = {**params, "prefix": row["kvzip_prefix"]}
        ours, held = our_kept(model, method, params, contexts[row["sample"]])
        theirs = row["kept"]
        shares = [
            len(set(a) & set(b)) / len(b) if b else 1.0
            for layer_a, layer_b in zip(ours, theirs, strict=True)
            for a, b in zip(layer_a, layer_b, strict=True)
        ]
        agreement = compare_kept(ours, theirs)
        entry = results.setdefault(
            row["press"], {"method": method, "params": params, "shares": [], "jaccards": [], "held": []}
        )
        entry["held"].append(held)
        entry.setdefault("kept", []).append(
            sum(map(len, sum(theirs, []))) / (len(theirs) * len(theirs[0]) * len(contexts[row["sample"]]))
        )
        entry["shares"] += shares
        entry["jaccards"] += [j for layer in agreement.jaccards for j in layer]
        entry.setdefault("exact", 0)
        entry["exact"] += agreement.exact
        entry["pairs"] = entry.get("pairs", 0) + agreement.pairs
    name = "frontier.json" if kept == "kvpress-kept.jsonl" else f"{Path(kept).stem}.frontier.json"
    (out / name).write_text(json.dumps(results))
    lines = [
        "| kvpress press | kvcompress | kvpress's kept tokens kept too, mean (min) per layer and head "
        "| Jaccard, mean | (layer, head) pairs identical | pairs kept | bytes held (`nbytes()`) |",
        "|---|---|---|---|---|---|---|",
    ]
    samples = len({row["sample"] for row in rows})
    lines.insert(0, f"{samples} sample(s), {len(rows)} (sample, press) rows\n")
    for press, entry in results.items():
        shares, jaccards = entry["shares"], entry["jaccards"]
        settings = ", ".join(f"{k}={v!r}" for k, v in entry["params"].items() if k != "prefix")
        lines.append(
            f"| `{press}` | `{entry['method']}` {settings} | {100 * sum(shares) / len(shares):.1f} % "
            f"({100 * min(shares):.1f} %) | {sum(jaccards) / len(jaccards):.3f} | {entry['exact']} / {entry['pairs']} "
            f"| {_mean(entry['kept']):.3f} | {_mean(entry['held']):.3f} |"
        )
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
