"""Kept sets of ``periodic`` (every ``interval`` decoding steps back to the budget) against kvpress's
``DecodingPress(KeyDiffPress)`` (docs/results/frontier.md).

Reads ``<out>/samples.json`` and ``<out>/kvpress-decoding.jsonl`` (``scripts/vs_kvpress_decoding.py``), feeds each
context the same way (its first ``prompt`` tokens in one forward, the next ``steps`` tokens one forward each, at
their true positions) into ``cache_for(model, "periodic", budget=target, interval=interval)``, and prints per
setting the share of kvpress's kept tokens kvcompress keeps too per layer and KV head, the Jaccard index and the
(layer, head) pairs kept identically, after the last step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import kvcompress
from experiments.compare.agreement import compare_kept
from kvcompress.generation import cache_argument
from kvcompress.models import load_model


@torch.no_grad()
def our_kept(model, row: dict, context: list[int]) -> list[list[list[int]]]:
    cache = kvcompress.cache_for(model, "periodic", budget=row["target"], interval=row["interval"])
    ids = torch.tensor([context[: row["prompt"] + row["steps"]]])
    model(input_ids=ids[:, : row["prompt"]], **cache_argument(model, cache), use_cache=True)
    for step in range(row["prompt"], row["prompt"] + row["steps"]):
        positions = torch.tensor([[step]])
        model(input_ids=ids[:, step : step + 1], position_ids=positions, **cache_argument(model, cache), use_cache=True)
    return [
        [sorted(t for t, v in zip(ts, vs, strict=True) if v) for ts, vs in zip(*row, strict=True)]
        for row in ((layer.token_idx[0].tolist(), layer.valid[0].tolist()) for layer in cache.compressed_layers)
    ]


def run_decoding(out: str | Path, threads: int = 1) -> str:
    torch.set_num_threads(threads)
    out = Path(out)
    spec = json.loads((out / "samples.json").read_text())
    rows = [json.loads(line) for line in (out / "kvpress-decoding.jsonl").read_text().splitlines() if line]
    model, _ = load_model(spec["model"])
    contexts = {s["id"]: s["context_ids"] for s in spec["samples"]}
    shares, jaccards, exact, pairs = [], [], 0, 0
    for row in rows:
        ours, theirs = our_kept(model, row, contexts[row["sample"]]), row["kept"]
        for layer_ours, layer_theirs in zip(ours, theirs, strict=True):
            shares += [len(set(a) & set(b)) / len(b) for a, b in zip(layer_ours, layer_theirs, strict=True)]
        agreement = compare_kept(ours, theirs)
        jaccards += [j for layer in agreement.jaccards for j in layer]
        exact, pairs = exact + agreement.exact, pairs + agreement.pairs
    first = rows[0]
    setting = (
        f"prompt {first['prompt']}, {first['steps']} steps, interval {first['interval']}, budget {first['target']}"
    )
    return "\n".join(
        [
            f"{len(rows)} sample(s), {setting}\n",
            "| kvpress press | kvcompress | kvpress's kept tokens kept too, mean (min) per layer and head "
            "| Jaccard, mean | (layer, head) pairs identical |",
            "|---|---|---|---|---|",
            f"| `DecodingPress(KeyDiffPress)` | `periodic` | {100 * sum(shares) / len(shares):.1f} % "
            f"({100 * min(shares):.1f} %) | {sum(jaccards) / len(jaccards):.3f} | {exact} / {pairs} |",
        ]
    )
