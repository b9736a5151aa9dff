"""DuoAttention head scores for a model (``kvcompress train duo-calibrate``): which KV heads are retrieval heads.

The score is kvpress 0.5.5's on-the-fly DuoAttention scoring (``duo_attention_on_the_fly``), computed here the
same way: for each calibration text and each layer, the layer's input (the model's hidden states) goes through the
layer's input norm and its query and key projections (and the query and key norms of models that have them); the
mean query and the mean key over the text's tokens are each repeated at positions ``0 .. q_len - 1`` and rotated
by the model's RoPE; the last position's query attends to the ``q_len`` keys (softmax of ``q.k / sqrt(d)`` in
float32); the score of a query head is the area under the cumulated attention (the mean over positions of the
cumulative sum of the weights), averaged over a KV head's query heads and over the texts. A head attending to its
neighbours scores low (a streaming head), one attending far back scores high (a retrieval head).

Why this and not the paper's calibration: DuoAttention (arXiv:2410.10819) optimises a gate per KV head on synthetic
passkey-retrieval contexts of 1K-32K tokens (distillation loss plus an L1 penalty, 2,000 steps on GPUs), which a
CPU cannot do in useful time; kvpress's scoring needs a forward per text and reads the same property (does the
head look at the distant context). Differences from kvpress: the texts are ``--samples`` windows of ``--length``
tokens cut evenly from the books shipped with kvcompress (kvpress: 50 BookSum chapters, whole, sampled with
``random_state=42``, which need a download), and the query and key norms are applied wherever the attention module
has them (kvpress tests the decoder layer's class for them, so it never applies them).

The JSON file written (``kvcompress.methods.duo.patterns``) holds the scores ``[layers][KV heads]``, the sizes the
streaming heads keep (kvpress's on-the-fly defaults: 128 sinks, 256 recent) and how it was made; ``duo`` reads it
with ``pattern=<file>``. The pattern shipped for SmolLM2-135M-Instruct (``kvcompress/data/duo/smollm2-135m.json``):

    kvcompress train duo-calibrate --model smollm2-135m --samples 50 --length 1024 \
        --out src/kvcompress/data/duo/smollm2-135m.json
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvcompress.eval.data import BOOKS, load_documents
from kvcompress.methods.duo.patterns import DuoPattern, write_pattern
from kvcompress.models import load_model

logger = logging.getLogger(__name__)
SINK_SIZE, RECENT_SIZE = 128, 256  # kvpress's sizes for on-the-fly scores


def default_output(model_name: str) -> Path:
    root = Path(os.environ.get("KVCOMPRESS_CACHE", Path.home() / ".cache" / "kvcompress"))
    return root / "duo" / f"{Path(model_name).name.replace('/', '--')}.json"


def calibration_windows(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], samples: int, length: int
) -> torch.Tensor:
    """``[samples, length]`` token windows spaced evenly over the texts joined by EOS."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    total = len(ids) // length
    if total < samples:
        raise ValueError(f"--samples {samples} windows of --length {length} tokens: the texts hold only {total}")
    windows = torch.tensor(ids[: total * length], dtype=torch.long).view(total, length)
    return windows[torch.linspace(0, total - 1, samples).round().long()]


def _project(attention, hidden: torch.Tensor, projection: str, norm: str, head_dim: int) -> torch.Tensor:
    """The mean over tokens of a projection ``[1, 1, heads, d]`` (after the module's per-head norm, if any)."""
    states = getattr(attention, projection)(hidden)
    states = states.view(1, states.shape[1], -1, head_dim)
    if getattr(attention, norm, None) is not None:
        states = getattr(attention, norm)(states)
    return states.mean(dim=1, keepdim=True)


@torch.no_grad()
def head_scores(model: PreTrainedModel, windows: torch.Tensor, q_len: int = 500) -> np.ndarray:
    """``[layers, kv_heads]`` scores of ``model`` over the token ``windows`` ``[N, n]`` (see the module docstring)."""
    config = model.config.get_text_config()
    layers = model.model.layers
    kv_heads = config.num_key_value_heads
    groups = config.num_attention_heads // kv_heads
    device = next(model.parameters()).device
    positions = torch.arange(q_len, device=device)[None]
    scores = torch.zeros(len(layers), kv_heads, dtype=torch.float64)
    for index, window in enumerate(windows):
        logger.info("window %d/%d", index + 1, len(windows))
        hidden_states = model(input_ids=window[None].to(device), output_hidden_states=True, use_cache=False)
        for layer_idx, hidden in enumerate(hidden_states.hidden_states[:-1]):
            layer = layers[layer_idx]
            attention = layer.self_attn
            head_dim = attention.head_dim
            normed = layer.input_layernorm(hidden)
            query = _project(attention, normed, "q_proj", "q_norm", head_dim).repeat(1, q_len, 1, 1).transpose(1, 2)
            key = _project(attention, normed, "k_proj", "k_norm", head_dim).repeat(1, q_len, 1, 1).transpose(1, 2)
            cos, sin = model.model.rotary_emb(normed, positions)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            key = key.repeat_interleave(groups, dim=1)
            weights = (query[:, :, -1:] @ key.transpose(2, 3)) / head_dim**0.5
            weights = weights.softmax(dim=-1, dtype=torch.float32)[0, :, 0]  # [H_q, q_len]
            area = weights.cumsum(dim=1).mean(dim=1).view(kv_heads, groups).mean(dim=1)
            scores[layer_idx] += area.double().cpu() / len(windows)
    return scores.numpy()


def duo_calibrate(
    model_name: str,
    data: str | None = None,
    samples: int = 50,
    length: int = 1024,
    q_len: int = 500,
    out: str | None = None,
    threads: int = 1,
) -> Path:
    if samples < 1 or length < 1 or q_len < 2:
        raise ValueError(f"--samples, --length must be >= 1 and --q-len >= 2; got {samples}, {length}, {q_len}")
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name)
    documents = load_documents(Path(data) if data else BOOKS)
    windows = calibration_windows(tokenizer, [doc.text for doc in documents], samples, length)
    scores = head_scores(model, windows, q_len)
    meta = {
        "model": model_name,
        "calibration": "kvpress 0.5.5 duo_attention_on_the_fly (mean query and key, RoPE, area under cumulated "
        "attention of the last position)",
        "data": "kvcompress shipped books" if not data else str(data),
        "documents": [doc.name for doc in documents],
        "samples": samples,
        "length": length,
        "q_len": q_len,
    }
    pattern = DuoPattern(scores, SINK_SIZE, RECENT_SIZE, meta)
    return write_pattern(pattern, out or default_output(model_name))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="DuoAttention head scores (kvpress's on-the-fly scoring).")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=None, help="a folder of text files (default: the books kvcompress ships)")
    parser.add_argument("--samples", type=int, default=50, help="calibration windows")
    parser.add_argument("--length", type=int, default=1024, help="window length in tokens")
    parser.add_argument("--q-len", type=int, default=500, help="positions the mean query and key are placed at")
    parser.add_argument("--out", default=None, help="output .json (default ~/.cache/kvcompress/duo/MODEL.json)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = duo_calibrate(args.model, args.data, args.samples, args.length, args.q_len, args.out, args.threads)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
