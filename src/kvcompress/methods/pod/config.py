"""PoD, Proximal tokens over Distant tokens (Ma et al., 2024, arXiv:2412.02252): distant-token attention shared
across layers, proximal tokens exact.

Each query attends to *proximal* tokens (the first ``n_sink`` and the ``n_recent`` most recent, itself included)
with its layer's own logits, and to *distant* tokens (those between) with the logits of the lowest layer of its
block: consecutive layers of similar attention (measured offline, grouped by Algorithm 1, ``grouping``) form a
block per head. Values are always the layer's own, so distant keys are kept only at block-start layers, where
attention is exactly dense. The two parts are joined exactly: one softmax over the mixed logits, or the paper's
gate ``g = sigmoid(LSE_P - LSE_D)`` (Eq. 4), chosen by ``combine``.

As in the paper: attention within a block (Eq. 3-4), its efficient inference's cache layout and decoding, the τ
gate. Choices where the paper is silent or ambiguous:

- v1 (``query_source="block_start"``, default, Eq. 3 of the first version): distant logits are the block start's
  query times its keys; v2 (``"own"``, the revised paper): this layer's query times the block start's keys.
- Groups per KV head by default (``grouping="kv_head"``, similarity averaged over its query heads): only then does
  every layer of a block drop a KV head's distant keys. ``"query_head"`` is the paper's literal per-head reading; a
  KV head then keeps its distant keys at a layer that starts a block for any of its query heads.
- Token groups by RoPE position (left padding not counted): ``j`` is proximal for query ``i`` iff ``pos_j <
  n_sink`` or ``pos_i - pos_j < n_recent``. After each forward a non-start KV head keeps the keys of its sinks and
  last ``n_recent`` tokens: stored bytes ``L*H*n*d + L*H*min(n, n_s+n_r)*d + B*(n - n_s - n_r)*d``.
- τ gate: at non-start query heads, a row with distant tokens whose ``g >= tau`` attends to its proximal tokens
  only; rows skipped / rows eligible are counted (``pod_stats``).
- Composition with token selection (PoD + SnapKV, the paper's Table 1; how is not stated): ``base`` (any method
  config) selects tokens at each KV head's block-start layer, the block's other layers keeping the same tokens (a
  kept distant token: its key at the block start, its value everywhere), so the savings multiply as in Table 4.
- Computation: a non-start layer reads the block start's query and keys held for one forward (copied only where
  the block start evicts in it); layers whose query heads all start a block, and forwards with no distant token,
  run plain SDPA; else an explicit softmax in query chunks where statistics, ``tau`` or ``combine="lse"`` ask for
  it, fused attention calls joined by Eq. 4 otherwise (``attention``), all equal to the mixed softmax (tests).
  Decoding one token per forward without padding (default ``combine``, no ``tau``), the proximal keys live in a
  ring written in place (``ring``; its copy of its entries' values counted as metadata), each decoding token one
  position past the previous one (what ``generate`` gives). The saving reproduced is memory: the paper's compute
  saving (reusing the block start's softmax) was tried on the CPU and not kept, as multiplying the reused
  probabilities by each layer's values cost what the fused calls did.
- Positions: ``original`` only (keys keep their RoPE positions; distant tokens stay addressable, as in the paper).
- Default grouping (no ``similarity``, ``starts`` or ``block_size``): the calibration shipped for the model
  (``kvcompress/data/pod``, matched by layer count; SmolLM2-135M: ``python -m kvcompress.train.pod_calibrate
  --samples 16 --length 1024``, Gutenberg tokens) grouped by Algorithm 1 at ``delta``; ``similarity`` also takes a
  shipped name (``"smollm2-135m"``).
- Sliding-window layers of hybrid models (Gemma-3's; none in the paper) store at most their window and share only
  within their kind: each block is split by kind, each part (still a complete-linkage block) sharing from its first
  layer (``grouping.split_by_kind``), as a sliding layer keeps no key older than its window (it cannot lend distant
  keys to a global layer), a global layer's keys would be read at slots a sliding layer no longer has, and two
  sliding layers keep the same tokens. On a sliding layer a token is distant only between ``n_recent`` and the
  window (the paper's ``n_recent``, 4080, exceeds Gemma-3's windows: exact).
- Budgets (``ratio`` or ``budget``, in KV bytes, ``budget``): PoD alone saves at most half the bytes (keys only),
  so a request composes with SnapKV (Table 1), window 32, once after the prompt, keeping per layer and KV head the
  tokens that the block layout's share of stored keys and the proximal window allow (``n_recent`` then defaults to
  64, not the paper's 4080 for 32K contexts); ``budget_report(cache)`` gives the achieved bytes.
- Quantized storage (``kv_bits`` below 16, ``quantized``): slot values and block-start keys in KIVI codes, the
  proximal keys exact, PoD's attention over the dequantized view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcompress.core.checks import check_budget, check_path, check_ratio, ints, number, one_of, param
from kvcompress.core.contract import MethodConfig, Policy, StatsRequest
from kvcompress.files import shipped_json
from kvcompress.methods.oneshot import check_ratio_or_budget
from kvcompress.methods.pod.attention import pod_attention
from kvcompress.methods.pod.budget import default_similarity
from kvcompress.methods.pod.grouping import (
    check_starts,
    kv_key_rows,
    load_similarity,
    split_by_kind,
    starts_from_similarity,
    uniform_starts,
)
from kvcompress.methods.pod.layer import PoDLayer
from kvcompress.methods.pod.quantized import PoDQuantizedLayer
from kvcompress.methods.snapkv import SnapKVConfig


class PoDPolicy(Policy):
    """PoD attention (``attend``) plus, when composed, the base method's token selection shared along blocks."""

    position_mode = "original"
    per_head = True

    def __init__(self, config: PoDConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.base = config.base.policy(layer_idx) if config.base is not None else None
        if self.base is not None:
            self.stats = self.base.stats
            self.one_shot = self.base.one_shot
            self.latest_stats_only = self.base.latest_stats_only

    def init_state(self, layer, keys):
        return {} if self.base is None else self.base.init_state(layer, keys)

    def observe(self, layer, stats):
        if self.base is not None:
            self.base.observe(layer, stats)

    def select(self, layer):
        return None if self.base is None else layer.block_selection(self.base)

    def attend(self, layer, query, key, value, mask, scaling):
        # a one-shot base (SnapKV) that already compressed needs no statistics: decoding takes the fused path
        request = self.stats if self.wants_stats(layer) else StatsRequest()
        return pod_attention(layer, query, mask, scaling, self.config, request)


@dataclass(frozen=True)
class PoDConfig(MethodConfig):
    """PoD. Blocks: one of ``similarity`` (+ ``delta`` or ``target_saving``), ``starts`` or ``block_size``, or none
    (the grouping shipped for the model); ``ratio``/``budget`` (KV bytes) compose with SnapKV to meet them."""

    similarity: str | None = None  # pod-calibrate file (per-head 1-JS layer similarity) to run Algorithm 1 on
    delta: float = 0.5  # Algorithm 1 threshold: a layer joins a block if sim >= delta with every member (paper 0.5)
    target_saving: float | None = param(None, number(0, 0.5, "[)"))  # or: the largest delta with saving(inf) >= this
    starts: tuple[tuple[int, ...], ...] | None = None  # explicit block starts [layer][KV or query head]
    block_size: int | None = param(None, ints(1))  # uniform blocks of this many layers, no calibration (1 = dense)
    grouping: str = one_of("kv_head", "query_head")  # per KV head (default, saves keys under GQA) or paper's literal
    n_sink: int = param(16, ints(0))  # n_s: first tokens always proximal (paper 16)
    n_recent: int | None = param(None, ints(1))  # n_r: newest tokens (query included); None: paper 4080, 64 at a budget
    ratio: float | None = param(None, check_ratio)  # KV bytes kept, as a fraction of the full cache's (via SnapKV)
    budget: int | None = param(None, check_budget)  # or: KV bytes per layer and KV head in full tokens (key + value)
    query_source: str = one_of("block_start", "own")  # distant logits: v1 (paper Eq. 3) or v2 query
    tau: float | None = param(None, number(0, 1))  # None: off; non-start heads drop distant keys at proximal mass >= it
    combine: str = one_of("softmax", "lse")  # one softmax over mixed logits or Eq. 4 gate; equal
    base: MethodConfig | None = field(default=None, compare=True)  # token-selection method composed with PoD

    name = "pod"
    paper = "https://arxiv.org/abs/2412.02252"
    policy_class = PoDPolicy

    def validate(self) -> None:
        if sum(x is not None for x in (self.similarity, self.starts, self.block_size)) > 1:
            raise ValueError("pod takes exactly one of similarity (a pod-calibrate file), starts or block_size")
        if self.similarity is not None and shipped_json("pod", str(self.similarity)) is None:
            check_path(self.similarity, "similarity", "file", "a similarity file from `kvcompress train pod-calibrate`")
            load_similarity(self.similarity)  # read now (once per file): a bad file is refused before a model loads
        if self.starts is not None:
            object.__setattr__(self, "starts", tuple(tuple(int(s) for s in row) for row in self.starts))
            check_starts(self.starts)
        if self.budgeted:
            if self.base is not None:
                raise ValueError("pod takes ratio/budget or base, not both (a budget composes with SnapKV itself)")
            check_ratio_or_budget(self.name, self.ratio, self.budget)
            object.__setattr__(self, "base", SnapKVConfig(ratio=1.0, window=32))  # kept count: budget.py
        if self.n_recent is None:
            object.__setattr__(self, "n_recent", 64 if self.budgeted else 4080)
        if self.base is not None:
            if not isinstance(self.base, MethodConfig) or isinstance(self.base, PoDConfig):
                raise ValueError(f"base must be a token-selection method config (e.g. SnapKVConfig); got {self.base!r}")
            if self.base.policy(0).position_mode != "original":
                raise ValueError("base must keep original positions (position_mode='original') to compose with pod")
            if self.grouping != "kv_head":
                raise ValueError("composition with a base method needs grouping='kv_head' (blocks per KV head)")

    @property
    def budgeted(self) -> bool:
        """Whether a ratio or budget was given (its SnapKV keeps the count ``budget`` plans)."""
        return self.ratio is not None or self.budget is not None

    def layer_class(self) -> type[PoDLayer]:
        return PoDLayer if self.kv_bits == 16 else PoDQuantizedLayer

    def connect(self, layers: list[PoDLayer]) -> None:
        """Each layer's block starts ``[head]``: ``starts``, uniform blocks or Algorithm 1's, split by layer kind."""
        starts = self.starts
        if starts is None and self.block_size is not None:
            starts = uniform_starts(len(layers), 1, self.block_size)
        elif starts is None:
            source = self.similarity if self.similarity is not None else default_similarity(len(layers))
            sim_file = load_similarity(shipped_json("pod", str(source)) or source)
            starts = starts_from_similarity(sim_file, self.delta, self.target_saving, self.grouping)
        check_starts(starts, len(layers))
        starts = split_by_kind(starts, [layer.sliding_window for layer in layers])
        for index, layer in enumerate(layers):
            layer.connect_block(layers, index, starts[index])
            layer.key_share = kv_key_rows(starts) / (len(starts) * len(starts[0]))
