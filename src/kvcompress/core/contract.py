"""The method contract: a frozen config with the paper's defaults that builds one ``Policy`` per layer.

A policy decides what one cache layer keeps; the layer (``core.layer``) stores keys, values, positions and the
policy's per-token state. This module imports nothing else of kvcompress.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import reprlib
import types
import typing
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class StatsRequest:
    """Which attention statistics a policy needs; an empty request means plain SDPA speed."""

    received: bool = False  # attention mass each key receives, summed over this forward's queries
    last_queries: int = 0  # attention rows of the last n queries of this forward
    lse: bool = False  # log-normaliser of every query row over the stored keys (LESS mixes its state in with it)

    @property
    def any(self) -> bool:
        return self.received or self.last_queries > 0 or self.lse


@dataclass
class AttentionStats:
    """Attention statistics of one forward of one layer, over the keys stored before eviction (``G``: query heads
    per KV head, so a policy chooses how to reduce a group)."""

    query_count: int  # queries in this forward
    received: torch.Tensor | None = None  # [B, H_kv, G, L] float32
    last: torch.Tensor | None = None  # [B, H_kv, G, n, L] float32, rows of the last n queries
    last_visible: torch.Tensor | None = None  # [B, H_kv or 1, n, L] bool, keys those rows could attend to (None: all)
    lse: torch.Tensor | None = None  # [B, H_q, q] float32 log-normaliser of each query row


@dataclass
class Keep:
    """A policy's eviction rule: keep, per sequence and KV head, the ``count`` highest-scoring real tokens.

    ``scores`` ``[B, H_kv or 1, W]`` are over the layer's view; ``count`` is an int, or ``[B]`` per-sequence counts
    (one-shot ratios); ``protected`` ``[B, H_kv, W]`` tokens are kept first. The layer evicts the rest, lowest score
    first, the older token first among equals; padding is never kept. Facts that spare work while decoding:
    ``newest_kept``, how many newest real tokens the rule keeps anyway (a protected window, or scores growing with
    recency: the forward's own tokens then need no protection); ``distinct``: no two real tokens share a score."""

    scores: torch.Tensor
    count: int | torch.Tensor
    protected: torch.Tensor | None = None
    newest_kept: int = 0
    distinct: bool = False


@dataclass
class KeepMask:
    """A policy's eviction decision as a mask ``[B, H_kv, W]`` over the layer's view: True = stays."""

    keep: torch.Tensor


@runtime_checkable
class LayerView(Protocol):
    """What a policy may read and call on its layer, whatever the layer's storage (every layer kind implements it).

    Tensors are ``[B, H_kv, W]`` views over the ``W`` slots attention sees this forward (``keys`` and ``values``
    ``[B, H_kv, W, d]``); ``state`` maps the names ``Policy.init_state`` returned to such views (written in place).
    At a decoding step a ``Policy.batchable`` policy reads, through ``core.joint_eviction.StackedLayer``, only
    ``policy``, ``device``, ``seen``, ``seen_step``, ``new_tokens``, ``occupied``, ``view_width``, ``dense``,
    ``ordered``, ``all_valid``, ``rows``, ``token_idx``, ``state``, ``new_index()`` and ``real_count()``. A policy
    reading more (PoD's block peers, LESS's state) names its layer class."""

    policy: Policy
    device: torch.device
    inv_freq: torch.Tensor | None  # the model's RoPE frequencies for this layer (None: not needed, or no RoPE)
    sliding_window: int | None  # the model's window on this layer (None: a global layer)
    seen: int  # tokens seen so far, padding included (the stream index of the next token)
    # ``seen`` as a step computes with it: the int, or a device scalar while bound to a captured step (``core.replay``);
    # arithmetic serves both (not ``torch.arange``: ``core.slots.stream_range``), so no method branches on replay
    seen_step: int | torch.Tensor
    new_tokens: int  # tokens of this forward
    occupied: int  # slots holding a token, the most of any row
    compressed: bool  # a one-shot method has compressed this layer
    more_prompt: bool  # this forward is a prompt chunk that more chunks follow (``CompressedCache.more_prompt``)
    defer_compression: bool  # a one-shot method compresses when the prompt's forwards end, not after this one
    all_valid: bool  # no padding stored: every slot in the view holds a real token
    ordered: bool  # the view is in stream order
    dense: bool  # the view is the occupied slots only, in stream order, the forward's tokens last
    view_width: int  # ``W``: the slots attention sees
    rows: tuple[int, int]  # ``(B, H_kv)``
    token_idx: torch.Tensor  # each slot's token's stream index (``-1``: a free slot)
    rope_pos: torch.Tensor  # each slot's RoPE position (the ``position_ids`` its key was rotated with)
    valid: torch.Tensor  # whether each slot holds a real token (False: padding or free)
    rank: torch.Tensor  # each real token's rank among its sequence's real tokens (``-1``: padding or free)
    keys: torch.Tensor
    values: torch.Tensor
    state: typing.Mapping[str, torch.Tensor]

    def new_index(self) -> torch.Tensor:
        """``[B, H_kv, q]`` positions of this forward's tokens in the views."""

    def real_count(self) -> torch.Tensor:
        """Real tokens per sequence (``[B, 1]``) or per row (``[B, H_kv]``): broadcast against ``[B, H_kv]``."""


class Policy:
    """Per-layer eviction rule. Subclasses override the hooks they need."""

    stats: StatsRequest = StatsRequest()
    position_mode: str = "original"
    per_head: bool = True  # False: all KV heads of a layer keep the same tokens
    one_shot: bool = False  # True: compress once after the prompt, never while decoding
    # True: ``observe`` keeps only the latest forward's statistics (an observation window at the prompt's end), so a
    # one-shot method needs none from prompt chunks that more chunks follow (``CompressedCache.more_prompt``)
    latest_stats_only: bool = False
    # True: at a decoding step ``observe`` and ``select`` work per row on ``state``, ``token_idx`` and scalar
    # bookkeeping only, ``select`` returning ``None`` or a ``Keep`` with an int count (``core.joint_eviction``)
    batchable: bool = False
    # True: ``layer.inv_freq`` holds the model's RoPE frequencies whatever ``position_mode`` (None without RoPE)
    needs_rope: bool = False

    def __init__(self, config: MethodConfig, layer_idx: int) -> None:
        self.config = config
        self.layer_idx = layer_idx
        self.layer_count: int | None = None  # the cache's decoder layers (set by the cache: per-layer budgets)

    def wants_stats(self, layer: LayerView) -> bool:
        """Whether this forward's attention computes ``stats`` (and ``observe`` runs): not once a one-shot method
        compressed, nor for a prompt chunk that more chunks follow when only the latest forward's count."""
        return not self.one_shot or not (layer.compressed or (self.latest_stats_only and layer.more_prompt))

    def init_state(self, layer: LayerView, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token state for the new tokens (each ``[B, H_kv, q, ...]``), stored and moved with them."""
        return {}

    def observe(self, layer: LayerView, stats: AttentionStats | None) -> None:
        """Fold this forward's attention statistics into the per-token state."""

    def select(self, layer: LayerView) -> Keep | KeepMask | None:
        """Return what to keep (usually a ``Keep`` rule: the layer picks the victims), or ``None`` for everything."""
        return None

    def attend(
        self,
        layer: LayerView,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
    ) -> tuple[torch.Tensor, AttentionStats | None] | None:
        """This layer's attention (``[B, H, q, d]`` output and statistics), or ``None`` for the default (SDPA, or the
        exact chunked softmax when ``stats`` asks for statistics)."""
        return None


KV_BITS = (16, 8, 4, 2)
MAX_KV_TOKENS = 2**20  # kv_group and kv_residual count tokens: at most the longest context (core.checks.MAX_TOKENS)
STORAGE_FIELDS = ("kv_bits", "kv_group", "kv_residual")  # every method's; listed after the method's own


def method_fields(config_class: type) -> list[dataclasses.Field]:
    """A config class's fields, its method's own first, then the storage fields every method takes."""
    return sorted(dataclasses.fields(config_class), key=lambda field: field.name in STORAGE_FIELDS)  # (stable)


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method config. ``name`` is the registry key, ``paper`` the reference.

    Every method also takes how its kept tokens are stored (keyword-only, after its own parameters): ``kv_bits``
    (16: the model's dtype; 8, 4 or 2: keys quantized per channel and values per token as in KIVI, arXiv
    2402.02750, ``core.quantized_slots``), ``kv_group`` (tokens per key group and channels per value group) and
    ``kv_residual`` (the newest tokens also kept exact; 0 or a multiple of ``kv_group``)."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    policy_class: ClassVar[type[Policy]] = Policy

    kv_bits: int = dataclasses.field(default=16, kw_only=True)  # 16: model dtype; 8, 4, 2: quantized (KIVI)
    kv_group: int = dataclasses.field(default=32, kw_only=True)  # KIVI's group size G
    kv_residual: int = dataclasses.field(default=128, kw_only=True)  # KIVI's residual length R (exact newest tokens)

    def layer_class(self) -> type[LayerView] | None:
        """The layer class of a method with its own storage (a ``CompressedLayer`` subclass); None: the standard."""
        return None

    def __post_init__(self) -> None:
        check_field_types(self)
        check_storage(self)
        check_declared(self)

    def validate(self) -> None:
        """Cross-field rules, after each field's own check: ``ValueError`` naming the parameter and what is allowed."""

    def policy(self, layer_idx: int) -> Policy:
        return self.policy_class(self, layer_idx)

    def connect(self, layers: list[LayerView]) -> None:
        """Called once with all the cache's layers, for methods whose layers read each other (PoD)."""

    def after_prefill(self, model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Called by ``generation.prefill`` once the prompt is in ``cache`` (KVzip's reconstruction passes)."""


def check_storage(config: MethodConfig) -> None:
    if config.kv_bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, got {config.kv_bits!r}")
    if not 1 <= config.kv_group <= MAX_KV_TOKENS:
        raise ValueError(f"kv_group must be at least 1 and at most {MAX_KV_TOKENS}, got {config.kv_group!r}")
    if not 0 <= config.kv_residual <= MAX_KV_TOKENS or config.kv_residual % config.kv_group:
        raise ValueError(
            f"kv_residual must be 0 or a multiple of kv_group ({config.kv_group}) up to {MAX_KV_TOKENS}, "
            f"got {config.kv_residual!r}"
        )


def check_declared(config: MethodConfig) -> None:
    """Each field's declared check (``core.checks.param``; None passes where it is the default), then ``validate``."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if "check" in field.metadata and not (value is None and field.default is None):
            field.metadata["check"](value, field.name, config)
    config.validate()


def check_field_types(config: MethodConfig) -> None:
    """``ValueError`` unless every field holds its declared type: booleans are ``bool``, integers not booleans or
    floats, floats finite real numbers (integers allowed), tuples may be lists."""
    for name, kind in _field_types(type(config)).items():
        value = getattr(config, name)
        if not _is_a(value, kind):
            try:  # the config's own message states the range
                check_declared(config)
            except Exception as error:  # validate may fail in any way on a value of the wrong type
                if isinstance(error, ValueError) and str(error).startswith(f"{name} "):
                    raise
            raise ValueError(f"{name} must be {_describe(kind)}, got {reprlib.repr(value)}")


@functools.cache
def _field_types(config_class: type) -> dict[str, object]:
    hints = typing.get_type_hints(config_class)
    return {field.name: hints[field.name] for field in dataclasses.fields(config_class)}


def _is_a(value: object, kind: object) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, option) for option in args)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value)
    if origin is tuple and isinstance(value, (tuple, list)):
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is_a(item, args[0]) for item in value)
        return len(value) == len(args) and all(map(_is_a, value, args))
    kind = origin or kind
    return isinstance(value, kind) if isinstance(kind, type) else True


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _describe(kind: object) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_describe(option) for option in typing.get_args(kind))
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "text", type(None): "None"}
    if kind in names:
        return names[kind]
    if typing.get_origin(kind) is tuple:
        return "a list"
    kind = typing.get_origin(kind) or kind
    return "a path" if kind.__name__ == "PathLike" else f"a {getattr(kind, '__name__', kind)}"
