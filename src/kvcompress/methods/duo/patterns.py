"""DuoAttention's head patterns: one score per (layer, KV head), the sink and recent sizes, their files, and the
split into retrieval and streaming heads.

A pattern file is JSON (read as JSON, nothing in it runs)::

    {"format": "kvcompress-duo-pattern", "version": 1,
     "scores": [[...], ...],            # [layers][KV heads]: higher = more a retrieval head
     "sink_size": 128, "recent_size": 256,
     "meta": {"model": ..., "layers": L, "kv_heads": H, "calibration": ..., ...}}

``kvcompress train duo-calibrate`` writes one (``kvcompress.train.duo_calibrate``). The DuoAttention authors'
published patterns (``full_attention_heads.tsv``: one row per layer, one tab-separated gate value per KV head,
with a ``config.json`` beside it giving ``sink_size`` and ``recent_size``) are read too, as kvpress and the
authors' ``load_attn_pattern`` read them: values clipped to ``[0, 1]``.

The split (``streaming_heads``):

- ``head_compression_ratio`` ``r`` (kvpress's ``DuoAttentionPress``): the ``round(r * L * H)`` (layer, KV head)
  pairs of lowest score are streaming heads. Python's ``round`` (halves to even), as kvpress. kvpress orders the
  scores with ``np.argsort``'s default (unstable) sort, which leaves ties unspecified; here equal scores put the
  earlier pair (lower layer, then lower head) first among the streaming heads (a stable sort).
- ``threshold`` ``t`` (the authors' ``sparsify_attention_heads`` with a threshold): a pair is a streaming head when
  its score is below ``t``. The authors add uniform noise in ``[0, 1e-6)`` to break ties first; none is added here
  (a score exactly at ``t`` stays a retrieval head).

Shipped patterns (``kvcompress/data/duo``) are found by their ``meta``'s ``layers`` and ``kv_heads``: one must match
the model, else the error names the calibration command.

The same files, format and split serve KVzip's head-level variant (``kvzip`` with ``level="head"``), whose head
scores come from KVzip's reconstruction (``kvcompress train kvzip-calibrate``): a ``PatternKind`` names each kind's
format string, shipped folder (``kvcompress/data/kvzip``) and calibration command, so a file of one kind is never
read as the other's.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvcompress.files import (
    damaged,
    load_json,
    require_keys,
    shipped_folder,
    shipped_json,
    shipped_json_meta,
    write_atomically,
)

FORMAT = "kvcompress-duo-pattern"
CALIBRATE = "kvcompress train duo-calibrate --model <model> --out <file.json>"
REMEDY = f"write one with `{CALIBRATE}`"


@dataclass(frozen=True)
class PatternKind:
    """One kind of head-score file: its ``format`` string, its shipped folder (``kvcompress/data/<folder>``), the
    method that reads it, what a file is called in errors, and the command that writes one."""

    format: str
    folder: str
    method: str
    what: str
    calibrate: str

    @property
    def remedy(self) -> str:
        return f"write one with `{self.calibrate}`"


DUO = PatternKind(FORMAT, "duo", "duo", "a DuoAttention pattern", CALIBRATE)


@dataclass(frozen=True)
class DuoPattern:
    """Scores ``[layers, kv_heads]`` (higher: more a retrieval head), the streaming heads' sink and recent sizes."""

    scores: np.ndarray
    sink_size: int
    recent_size: int
    meta: dict = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return int(self.scores.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.scores.shape[1])

    def to_json(self, kind: PatternKind = DUO) -> dict:
        return {
            "format": kind.format,
            "version": 1,
            "scores": [[float(value) for value in row] for row in self.scores],
            "sink_size": self.sink_size,
            "recent_size": self.recent_size,
            "meta": {**self.meta, "layers": self.layers, "kv_heads": self.kv_heads},
        }


def write_pattern(pattern: DuoPattern, path: str | os.PathLike[str], kind: PatternKind = DUO) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, json.dumps(pattern.to_json(kind)) + "\n")


def _scores(values, path: Path, what: str, remedy: str = REMEDY) -> np.ndarray:
    try:
        scores = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise damaged(path, what, remedy, f"scores are not a table of numbers ({error})") from None
    if scores.ndim == 1:  # one layer, or a one-layer TSV
        scores = scores[None, :]
    if scores.ndim != 2 or scores.size == 0 or not np.isfinite(scores).all():
        raise damaged(path, what, remedy, "scores must be a non-empty [layers][KV heads] table of finite numbers")
    return scores


def _size(data: dict, key: str, path: Path, what: str, remedy: str = REMEDY) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise damaged(path, what, remedy, f"{key} must be a whole number >= 0, got {value!r}")
    return value


@lru_cache(maxsize=16)
def load_pattern(path: str, kind: PatternKind = DUO) -> DuoPattern:
    """The pattern in ``path``: a JSON file of ``kind``'s format (``duo-calibrate``'s by default), or for ``duo`` the
    authors' ``full_attention_heads.tsv`` (its folder's ``config.json`` gives the sizes). Every failure is a
    ``ValueError`` naming the file."""
    file = Path(path).expanduser()
    what, remedy = kind.what, kind.remedy
    if file.suffix == ".tsv" and kind == DUO:
        try:
            table = np.loadtxt(file, dtype=float, delimiter="\t", ndmin=2)
        except FileNotFoundError:
            raise ValueError(f"{file} ({what}) does not exist; {remedy}") from None
        except (OSError, ValueError) as error:
            raise damaged(file, what, remedy, error) from None
        scores = np.clip(_scores(table, file, what, remedy), 0, 1)  # as the authors' load_attn_pattern and kvpress
        config_file = file.parent / "config.json"
        config = require_keys(
            load_json(config_file, "the DuoAttention pattern's config", "it sits beside full_attention_heads.tsv"),
            ("sink_size", "recent_size"),
            config_file,
            "the DuoAttention pattern's config",
            "it sits beside full_attention_heads.tsv",
        )
        sizes = (
            _size(config, "sink_size", config_file, what, remedy),
            _size(config, "recent_size", config_file, what, remedy),
        )
        return DuoPattern(scores, *sizes, {"source": str(file)})
    data = require_keys(load_json(file, what, remedy), ("scores", "sink_size", "recent_size"), file, what, remedy)
    if data.get("format", kind.format) != kind.format:
        raise damaged(file, what, remedy, f"format is {data.get('format')!r}, not {kind.format!r}")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise damaged(file, what, remedy, "meta must be a JSON object")
    scores = _scores(data["scores"], file, what, remedy)
    sizes = _size(data, "sink_size", file, what, remedy), _size(data, "recent_size", file, what, remedy)
    return DuoPattern(scores, *sizes, meta)


def shipped_path(name: str, kind: PatternKind = DUO) -> Path | None:
    """The file of a shipped pattern of ``kind`` by name (e.g. ``"smollm2-135m"``), or ``None``."""
    return shipped_json(kind.folder, name)


def resolve_path(pattern: str | None, layers: int, kind: PatternKind = DUO) -> Path:
    """The pattern file to use: ``pattern`` (a shipped name or a path), or the one shipped pattern of ``kind`` whose
    model has ``layers`` decoder layers."""
    if pattern is not None:
        return shipped_path(str(pattern), kind) or Path(pattern).expanduser()
    matches = [name for name, meta in shipped_json_meta(kind.folder).items() if meta.get("layers") == layers]
    if len(matches) != 1:
        described = shipped_json_meta(kind.folder).items()
        shipped = ", ".join(f"{n} ({m.get('layers')} layers x {m.get('kv_heads')} KV heads)" for n, m in described)
        raise ValueError(
            f"{kind.method} has no shipped head pattern for a {layers}-layer model (shipped: {shipped or 'none'}); "
            f"calibrate one with `{kind.calibrate}` and pass pattern=<file.json>"
        )
    return shipped_folder(kind.folder) / f"{matches[0]}.json"


def streaming_heads(scores: np.ndarray, head_compression_ratio: float | None, threshold: float | None) -> np.ndarray:
    """Boolean ``[layers, kv_heads]``: True for a streaming head (see the module docstring)."""
    if threshold is not None:
        return scores < threshold
    pruned = round(scores.size * head_compression_ratio)
    mask = np.zeros(scores.size, dtype=bool)
    if pruned > 0:
        mask[np.argsort(scores, axis=None, kind="stable")[:pruned]] = True
    return mask.reshape(scores.shape)


def kept_fraction(streaming: np.ndarray, tokens: int, sink_size: int, recent_size: int) -> float:
    """The share of a ``tokens``-token prompt's (layer, KV head, token) pairs a split keeps."""
    window = min(tokens, sink_size + recent_size)
    share = float(streaming.mean()) if streaming.size else 0.0
    return 1 - share + share * window / tokens if tokens else 1.0


def ratio_for(fraction: float, tokens: int, sink_size: int, recent_size: int, heads: int) -> float:
    """The ``head_compression_ratio`` whose split keeps at most ``fraction`` of a ``tokens``-token prompt's pairs
    (at least, where that many heads cannot be streaming), for ``heads`` (layer, KV head) pairs in all."""
    window = min(tokens, sink_size + recent_size) / tokens
    if window >= 1:
        return 1.0
    needed = math.ceil(heads * (1 - fraction) / (1 - window) - 1e-9)
    return min(1.0, needed / heads)
