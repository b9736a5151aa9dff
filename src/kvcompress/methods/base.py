"""The method contract: a frozen config with the paper's defaults that builds one ``Policy`` per layer.

A policy decides what one cache layer keeps. It never stores keys itself: the layer (``kvcompress.cache``)
owns keys, values, positions and the per-token state the policy asks for, and gathers them all when the
policy returns a ``Selection``. Attention statistics come from ``kvcompress.attention`` as ``AttentionStats``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from kvcompress.cache import CompressedLayer


@dataclass(frozen=True)
class StatsRequest:
    """Which attention statistics a policy needs; an empty request means plain SDPA speed."""

    received: bool = False  # attention mass each key receives, summed over this forward's queries
    last_queries: int = 0  # attention rows of the last n queries of this forward

    @property
    def any(self) -> bool:
        return self.received or self.last_queries > 0


@dataclass
class AttentionStats:
    """Attention statistics of one forward of one layer, over the keys stored before eviction.

    Shapes use ``G`` = query heads per KV head (grouped-query attention), so policies choose how to reduce a group.
    """

    query_count: int  # queries in this forward
    received: torch.Tensor | None = None  # [B, H_kv, G, L] float32
    last: torch.Tensor | None = None  # [B, H_kv, G, n, L] float32, rows of the last n queries
    last_visible: torch.Tensor | None = None  # [B, H_kv or 1, n, L] bool, keys those rows could attend to


@dataclass
class Selection:
    """What a layer keeps: ``indices`` ``[B, H_kv, K]`` into the stored tokens, ascending per row.

    ``valid`` ``[B, H_kv, K]`` marks slots that hold a real token; a sequence with fewer tokens than ``K`` (a
    shorter prompt in a padded batch) fills the rest of its row with invalid slots.
    """

    indices: torch.Tensor
    valid: torch.Tensor | None = None


class Policy:
    """Per-layer eviction rule. Subclasses override the hooks they need."""

    stats: StatsRequest = StatsRequest()
    position_mode: str = "original"
    per_head: bool = True  # False: all KV heads of a layer keep the same tokens
    one_shot: bool = False  # True: compress once after the prompt, never while decoding

    def __init__(self, config: MethodConfig, layer_idx: int) -> None:
        self.config = config
        self.layer_idx = layer_idx

    def init_state(self, layer: CompressedLayer, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token state for the new tokens (each ``[B, H_kv, q, ...]``), stored and gathered with them."""
        return {}

    def observe(self, layer: CompressedLayer, stats: AttentionStats | None) -> None:
        """Fold this forward's attention statistics into the per-token state."""

    def select(self, layer: CompressedLayer) -> Selection | None:
        """Return what to keep, or ``None`` to keep everything."""
        return None

    def attend(
        self,
        layer: CompressedLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
    ) -> tuple[torch.Tensor, AttentionStats | None] | None:
        """Override the attention computation (``[B, H, q, d]`` output and statistics), or ``None`` for the
        default (SDPA, or an exact chunked softmax when ``stats`` asks for statistics). Methods that change the
        attention itself (log-n scaling, a low-rank state, logits shared across layers) implement this."""
        return None


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method config. ``name`` is the registry key, ``paper`` the reference."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    policy_class: ClassVar[type[Policy]] = Policy

    def layer_class(self) -> type[CompressedLayer]:
        """The cache layer type this method stores tokens in (a subclass for special storage layouts)."""
        from kvcompress.cache import CompressedLayer

        return CompressedLayer

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the parameter and its allowed range."""

    def policy(self, layer_idx: int) -> Policy:
        return self.policy_class(self, layer_idx)

    def connect(self, layers: list[CompressedLayer]) -> None:
        """Called once with all the cache's layers, for methods whose layers read each other (PoD)."""


def check_budget(budget: object, name: str = "budget") -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"{name} must be an integer >= 1 (tokens kept per layer and KV head), got {budget!r}")


def check_int_range(value: object, name: str, low: int, high: int | float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        upper = "inf" if high == math.inf else str(high)
        raise ValueError(f"{name} must be an integer in [{low}, {upper}], got {value!r}")


def check_ratio(ratio: object, name: str = "ratio") -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{name} must be a fraction of the prompt in (0, 1], got {ratio!r}")


def check_choice(value: object, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def ratio_budget(n_tokens: torch.Tensor, ratio: float) -> torch.Tensor:
    """Tokens kept for a prompt of ``n_tokens`` at a ratio: ``max(1, floor(ratio * n))`` (kvpress rounds likewise)."""
    return torch.clamp((n_tokens.to(torch.float64) * ratio).floor().long(), min=1)


def keep_top(
    layer: CompressedLayer,
    scores: torch.Tensor,
    keep: torch.Tensor | int,
    protected: torch.Tensor | None = None,
) -> Selection | None:
    """Keep, per sequence and head, the ``keep`` highest-scoring valid tokens; ``protected`` tokens first.

    ``scores`` is ``[B, H_kv or 1, L]``; ``keep`` an int or ``[B]`` counts. Returns ``None`` when no sequence holds
    more valid tokens than it may keep (nothing to evict). Equal scores go to the newer token (a stable sort over
    the reversed stream order), so selections are deterministic.
    """
    valid = layer.valid
    n_valid = valid.sum(-1).amax(1)  # [B]; equal across heads
    keep = torch.as_tensor(keep, device=valid.device).expand_as(n_valid)
    keep = torch.minimum(keep, n_valid)
    if bool((n_valid <= keep).all()) and valid.shape[-1] == int(keep.max()):
        return None
    heads = valid.shape[1]
    scores = scores.to(torch.float64).expand(-1, heads, -1)
    ranked = scores.masked_fill(~valid, -math.inf)
    if protected is not None:
        ranked = ranked.masked_fill(protected & valid, math.inf)
    k = int(keep.max())
    length = ranked.shape[-1]
    newest_first = ranked.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :k]
    order = length - 1 - newest_first  # best first
    slot_ok = torch.arange(k, device=valid.device)[None, None, :] < keep[:, None, None]
    indices, perm = order.sort(dim=-1)
    slot_ok = slot_ok.expand_as(order).gather(-1, perm) & valid.gather(-1, indices)
    return Selection(indices=indices, valid=slot_ok)


def sink_mask(layer: CompressedLayer, sinks: int) -> torch.Tensor:
    """Boolean ``[B, H_kv, L]``: the first ``sinks`` valid tokens of each sequence."""
    valid = layer.valid
    rank = valid.cumsum(-1) - 1
    return valid & (rank < sinks)


def recent_mask(layer: CompressedLayer, recent: int) -> torch.Tensor:
    """Boolean ``[B, H_kv, L]``: the last ``recent`` valid tokens of each sequence."""
    valid = layer.valid
    from_end = valid.flip(-1).cumsum(-1).flip(-1) - 1
    return valid & (from_end < recent)
