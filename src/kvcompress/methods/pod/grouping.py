"""PoD layer grouping (Algorithm 1 of arXiv:2412.02252) and the arithmetic of the KV memory it saves.

Input: a per-head inter-layer similarity ``sim[h, a, b]`` in ``[0, 1]`` (``1 - JS``, from
``kvcompress.train.pod_calibrate``). Algorithm 1 walks the layers bottom-up per head: layer 0 opens the first block;
layer ``l`` joins the current block iff ``sim[h, l, m] >= delta`` for **every** member ``m`` (complete linkage), else
opens a new one. The cache needs ``starts[l][h]``: the lowest layer of the block holding layer ``l`` for head ``h``.

Savings (keys only; values are stored in every layer), ``B`` = number of (layer, KV head) pairs that keep their
distant keys, ``D = max(0, n - n_sink - n_recent)``::

    saving(n) = (L * H_kv - B) * D / (2 * L * H_kv * n)        saving(inf) = (1 - B / (L * H_kv)) / 2

With per-query-head grouping under GQA a KV head keeps its distant keys at layer ``l`` iff ``l`` starts a block for
*any* of its query heads (how ``B`` is counted). ``python -m kvcompress.train.pod_blocks`` prints a file's blocks.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from kvcompress.files import damaged, load_json, load_tensors, require_keys

Starts = tuple[tuple[int, ...], ...]  # [layer][head] -> lowest layer of the head's block


def group_layers(sim: torch.Tensor, delta: float) -> list[list[list[int]]]:
    """Algorithm 1 on ``sim`` ``[H, L, L]`` (``m < l`` read): per head, its blocks of consecutive layers."""
    sim = torch.as_tensor(sim, dtype=torch.float64)
    if sim.dim() != 3 or sim.shape[1] != sim.shape[2]:
        raise ValueError(f"sim must have shape [heads, layers, layers]; got {tuple(sim.shape)}")
    heads, layers, _ = sim.shape
    result = []
    for h in range(heads):
        blocks = [[0]]
        for layer in range(1, layers):
            current = blocks[-1]
            if all(float(sim[h, layer, member]) >= delta for member in current):
                current.append(layer)
            else:
                blocks.append([layer])
        result.append(blocks)
    return result


def block_starts(blocks: Sequence[Sequence[Sequence[int]]]) -> Starts:
    """``starts[l][h]`` from per-head block lists."""
    per_head = [{layer: block[0] for block in head_blocks for layer in block} for head_blocks in blocks]
    return tuple(tuple(head[layer] for head in per_head) for layer in range(len(per_head[0])))


def uniform_starts(layers: int, heads: int, block_size: int) -> Starts:
    """Blocks of ``block_size`` consecutive layers for every head (no calibration; 1 = every layer dense)."""
    return tuple(tuple((layer // block_size) * block_size for _ in range(heads)) for layer in range(layers))


def check_starts(starts: Starts, layers: int | None = None) -> None:
    """Raise ``ValueError`` unless every ``starts[l][h]`` is a layer ``<= l`` that starts its own block."""
    if not starts or not starts[0]:
        raise ValueError("starts must be a non-empty [layer][head] table of block-start layers")
    heads = len(starts[0])
    if layers is not None and len(starts) != layers:
        raise ValueError(f"starts has {len(starts)} layers but the model has {layers}")
    for layer, row in enumerate(starts):
        if len(row) != heads:
            raise ValueError(f"starts[{layer}] has {len(row)} heads, starts[0] has {heads}")
        for h, start in enumerate(row):
            if not isinstance(start, int) or not 0 <= start <= layer or starts[start][h] != start:
                raise ValueError(
                    f"starts[{layer}][{h}] = {start!r} must be a layer in [0, {layer}] that starts its own block"
                )


def split_by_kind(starts: Starts, kinds: Sequence[object]) -> Starts:
    """``starts`` with every block split by layer kind (``kinds[l]``: sliding window or ``None``), each part
    sharing from its first layer (the choice: ``config``)."""

    def new_start(layer: int, head: int) -> int:
        start = starts[layer][head]
        return next(m for m in range(start, layer + 1) if kinds[m] == kinds[layer] and starts[m][head] == start)

    return tuple(tuple(new_start(layer, head) for head in range(len(row))) for layer, row in enumerate(starts))


def kv_key_rows(starts: Starts, kv_heads: int | None = None) -> int:
    """``B``: how many (layer, KV head) pairs keep their distant keys (GQA rule for per-query-head starts)."""
    heads = len(starts[0])
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"heads in starts ({heads}) must be a multiple of kv_heads ({kv_heads})")
    groups = heads // kv_heads
    return sum(layer in row[g * groups : (g + 1) * groups] for layer, row in enumerate(starts) for g in range(kv_heads))


def kv_saving(
    starts: Starts, n: int | None, n_sink: int, n_recent: int, kv_heads: int | None = None
) -> tuple[float, float]:
    """``(saving(n), saving(inf))``: the fraction of dense KV bytes saved at length ``n`` (``nan`` for ``None``)
    and asymptotically; ``kv_heads`` is needed when ``starts`` is per query head."""
    total = len(starts) * (len(starts[0]) if kv_heads is None else kv_heads)
    kept = kv_key_rows(starts, kv_heads)
    asymptotic = 0.5 * (1 - kept / total)
    if n is None:
        return math.nan, asymptotic
    distant = max(0, n - n_sink - n_recent)
    return (total - kept) * distant / (2 * total * n), asymptotic


def head_similarity(sim_file: dict, grouping: str) -> torch.Tensor:
    """The similarity tensor to group on: per query head, or averaged over the query heads of each KV head."""
    sim = torch.as_tensor(sim_file["sim"], dtype=torch.float64)  # [H_q, L, L]
    if grouping == "query_head":
        return sim
    if grouping != "kv_head":
        raise ValueError(f"grouping must be kv_head or query_head; got {grouping!r}")
    kv_heads = int(sim_file.get("kv_heads", sim.shape[0]))
    return sim.view(kv_heads, sim.shape[0] // kv_heads, *sim.shape[1:]).mean(dim=1)


def delta_for_saving(sim: torch.Tensor, target: float, kv_heads: int | None = None) -> float:
    """The largest ``delta`` whose grouping saves at least ``target`` (``saving(inf)``): every similarity value is
    tried (the grouping changes only there, not monotonically)."""
    if not 0 <= target < 0.5:
        raise ValueError(f"target_saving must be in [0, 0.5) (keys only: at most half the KV bytes); got {target!r}")
    values = sorted(set(torch.as_tensor(sim, dtype=torch.float64).flatten().tolist()), reverse=True)
    for delta in [math.inf, *values]:
        starts = block_starts(group_layers(sim, delta))
        if kv_saving(starts, None, 0, 0, kv_heads)[1] >= target - 1e-12:
            return delta
    raise ValueError(f"no delta reaches a saving of {target}")


def load_similarity(path: str | os.PathLike[str]) -> dict:
    """Read a ``pod-calibrate`` file (``.pt`` or ``.json``): ``sim`` ``[H_q, L, L]``, ``kv_heads``, ``meta``."""
    path = Path(path).expanduser()
    return _load_similarity(str(path), path.stat().st_mtime)


_SIMILARITY = ("a PoD similarity file", "write one with `kvcompress train pod-calibrate --out FILE`")


@functools.lru_cache(maxsize=8)
def _load_similarity(path: str, mtime: float) -> dict:
    json = path.endswith(".json")
    data = require_keys((load_json if json else load_tensors)(path, *_SIMILARITY), ("sim",), path, *_SIMILARITY)
    try:
        sim = data["sim"] = torch.as_tensor(data["sim"], dtype=torch.float64 if json else None)
    except (TypeError, ValueError, RuntimeError) as error:
        raise damaged(Path(path), *_SIMILARITY, f"sim is not a [heads, layers, layers] array: {error}") from None
    if sim.dim() != 3 or sim.shape[1] != sim.shape[2] or sim.shape[0] == 0:
        raise damaged(Path(path), *_SIMILARITY, f"sim has shape {list(sim.shape)}, not [heads, layers, layers]")
    if bad := int((~torch.isfinite(sim)).sum()):
        raise damaged(Path(path), *_SIMILARITY, f"{bad} of {sim.numel()} similarities are NaN or infinite")
    return data


def starts_from_similarity(
    sim_file: dict, delta: float | None, target_saving: float | None, grouping: str = "kv_head"
) -> Starts:
    """Algorithm 1 on a calibration file, at threshold ``delta`` or at the ``delta`` reaching ``target_saving``."""
    sim = head_similarity(sim_file, grouping)
    kv_heads = int(sim_file.get("kv_heads", sim.shape[0]))
    if target_saving is not None:
        delta = delta_for_saving(sim, target_saving, kv_heads if grouping == "query_head" else None)
    return block_starts(group_layers(sim, delta))


def format_blocks(blocks: list[list[list[int]]]) -> list[str]:
    """One line per head: ``[0][1-3][4]...``."""
    return ["".join(f"[{b[0]}]" if len(b) == 1 else f"[{b[0]}-{b[-1]}]" for b in head_blocks) for head_blocks in blocks]
