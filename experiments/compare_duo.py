"""DuoAttention side by side with kvpress 0.5.5's ``DuoAttentionPress`` (``docs/results/frontier.md``, "DuoAttention").

    python -m experiments.compare_duo inputs --out runs/duo --windows 4 --context 1024
    /work/kvpress-venv/bin/python scripts/vs_kvpress_duo.py runs/duo/inputs.json runs/duo/kvpress.json
    python -m experiments.compare_duo compare --out runs/duo

``inputs`` writes what both sides read: the SmolLM2-135M-Instruct model directory, ``--windows`` calibration windows
of 1,024 tokens (the first of the 50 ``duo-calibrate`` windows of the shipped books, spaced the same way), a context of
``--context`` tokens (the shipped books from their start), and the head scores of the pattern shipped for SmolLM2.
``compare`` computes our side (``kvcompress.train.duo_calibrate.head_scores`` over the same windows; ``duo`` at the
same ``head_compression_ratio`` with the shipped pattern, prefilled in one forward) and prints one JSON line: the
largest score difference, whether the split of the scores into streaming heads agrees, and the kept sets per layer
and KV head (identical count, share of kvpress's kept tokens kept too).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

import kvcompress
from kvcompress.eval.data import BOOKS, load_documents
from kvcompress.generation import prefill
from kvcompress.machine import machine_description
from kvcompress.methods.duo.patterns import load_pattern, shipped_path, streaming_heads
from kvcompress.models import load_model
from kvcompress.models.registry import model_cache_dir
from kvcompress.train.duo_calibrate import calibration_windows, head_scores

MODEL, RATIO, Q_LEN = "smollm2-135m", 0.5, 500


def inputs(args) -> None:
    _, tokenizer = load_model(MODEL)
    texts = [doc.text for doc in load_documents(BOOKS)]
    windows = calibration_windows(tokenizer, texts, 50, 1024)[: args.windows]
    context = tokenizer("\n\n".join(texts)[: args.context * 8], add_special_tokens=False).input_ids[: args.context]
    pattern = load_pattern(str(shipped_path(MODEL)))
    spec = {
        "model_dir": str(model_cache_dir(MODEL)),
        "windows": windows.tolist(),
        "q_len": Q_LEN,
        "context_ids": context,
        "pattern_scores": pattern.scores.tolist(),
        "sink_size": pattern.sink_size,
        "recent_size": pattern.recent_size,
        "head_compression_ratio": RATIO,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inputs.json").write_text(json.dumps(spec))
    print(f"wrote {out / 'inputs.json'}")


def compare(args) -> None:
    torch.set_num_threads(1)
    out = Path(args.out)
    spec = json.loads((out / "inputs.json").read_text())
    theirs = json.loads((out / "kvpress.json").read_text())
    model, _ = load_model(MODEL)
    windows = torch.tensor(spec["windows"])
    ours = head_scores(model, windows, spec["q_len"])
    their_scores = np.array(theirs["scores"])
    ratio = spec["head_compression_ratio"]
    same_split = bool((streaming_heads(ours, ratio, None) == streaming_heads(their_scores, ratio, None)).all())
    cache = kvcompress.cache_for(model, "duo", head_compression_ratio=ratio)
    context = torch.tensor([spec["context_ids"]])
    with torch.no_grad():
        prefill(model, context, cache)
    identical, shares, pairs = 0, [], 0
    for layer, their_layer in zip(cache.compressed_layers, theirs["kept"], strict=True):
        token_idx, valid = layer.token_idx[0], layer.valid[0]
        for head, their_kept in enumerate(their_layer):
            mine = set(token_idx[head][valid[head]].tolist())
            identical += mine == set(their_kept)
            shares.append(len(mine & set(their_kept)) / len(their_kept))
            pairs += 1
    streaming = np.array(theirs["streaming"])
    row = {
        "machine": machine_description(1),
        "windows": len(windows),
        "context_tokens": context.shape[1],
        "score_max_abs_diff": float(np.abs(ours - their_scores).max()),
        "score_max_rel_diff": float((np.abs(ours - their_scores) / np.abs(their_scores)).max()),
        "same_streaming_split_at_ratio": same_split,
        "kvpress_streaming_heads": int(streaming.sum()),
        "same_streaming_heads_as_kvpress": bool(
            (np.array([layer.policy.streaming for layer in cache.compressed_layers]) == streaming).all()
        ),
        "kept_identical_pairs": f"{identical} / {pairs}",
        "kept_too_mean": float(np.mean(shares)),
        "kept_too_min": float(np.min(shares)),
        "kvpress_compression_ratio": theirs["compression_ratio"],
        "nbytes_over_full": cache.nbytes() / (2 * 30 * 3 * context.shape[1] * 64 * 4),
        "env_kvpress": theirs["env"],
    }
    print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["inputs", "compare"])
    parser.add_argument("--out", default="runs/duo")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    inputs(args) if args.command == "inputs" else compare(args)


if __name__ == "__main__":
    main()
