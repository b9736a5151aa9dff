"""KVzip (Kim et al., 2025, arXiv:2505.23416; kvpress 0.5.5's ``KVzipPress``): query-agnostic compression by
context reconstruction.

Two levels, as the official code's ``--level`` (``level``): ``"pair"`` (the default, described below) scores every
cached pair of *this* context by reconstructing it and evicts the lowest; ``"head"`` is the paper's
context-independent head-level eviction: one score per (layer, KV head) calibrated once per model, the top heads
keeping every token and the others their sinks and recent window, DuoAttention-style, with no reconstruction at
run time (``kvcompress.methods.kvzip.head`` states its choices; it takes ``pattern``, ``sink_size`` and
``recent_size``, and refuses the pair level's ``allocation``, ``n_sink``, ``chunk_size``, ``prefix`` and
``tokenizer`` when they differ from their defaults, as the pair level refuses the head level's three).

The pair level:

After the context is prefilled, the model is run over a reconstruction prompt, "Repeat the previous context
exactly." followed by the context itself, in chunks; each cached key-value pair is scored by the largest attention
any reconstruction query of its KV head's group pays it (max over the query heads of the group and over the
queries), and the lowest-scoring pairs are evicted. The reconstruction tokens are never written into the cache:
each layer attends over the stored context and the chunk's own keys, which live only while its attention runs
(``kvcompress.methods.kvzip.layer``; the official code's ``update_cache=False``). The score does not depend on
any question, so one compressed context serves every question asked after it.

Use it through ``kvcompress.generation.prefill(model, context_ids, cache)`` (the reconstruction needs the
context's token ids, which ``prefill`` has and a cache does not): the context is compressed before ``prefill``
returns; ``model.generate`` then continues from the compressed cache. A cache fed by ``model.generate`` alone
refuses its second forward (one clear error) rather than silently keeping everything.

Choices, each kvpress's where kvpress decides (the paper's official code is the source kvpress follows):

- Prompts: the first chunk is ``"\\n\\nRepeat the previous context exactly."``, every later one
  ``"\\n\\nRepeat the part of the previous context exactly, starting with"`` and the previous chunk's last 8
  tokens; then the chat template's assistant header (the text ``apply_chat_template`` adds after a user turn; a
  newline for a tokenizer without a template), then the chunk of ``chunk_size`` context tokens (default 2048).
  The tokenizer is the model's own (read from ``model.config.name_or_path``, a local folder for kvcompress's
  registry models) unless ``tokenizer`` names a folder. kvpress skips the chat template's header it finds before
  the context (its tokens score 0 but for the sinks); here ``prefix`` says how many leading tokens to skip (0 by
  default: the ids ``prefill`` gets are the context).
- Score: for the queries of one chunk's reconstruction (the chunk starting at token ``start``), the softmax is over
  the first ``min(n_sink, start)`` cached tokens, that chunk's own context tokens and the reconstruction tokens
  (causal), as kvpress subsamples it (with one chunk and no prefix: the whole context, the model's own attention).
  The logit scale is the model's attention scaling (``1/sqrt(d)`` for every model kvpress supports). Computed in
  float32, a block of queries at a time (about 1 MiB of logits on a CPU, 16 to 256 queries), so the peak is a
  block's logits, not the chunk's (``score_chunk``). With one chunk covering the context, on a CPU, the same
  logits give the scores and the context part of the reconstruction's attention output (one query-key product per
  layer, as the attention alone needs; logits more than 87 below their row's largest count as 87 below it,
  probabilities under ``exp(-87)`` of the row's largest, kept out of float32's slow subnormal range); with several
  chunks, or on a GPU, the attention runs in PyTorch's fused kernels, which return each row's log-normaliser, and
  the scores come from a product over the scored columns alone. Once
  every chunk ran, the first ``n_sink`` tokens score above every probability (kvpress 0.5.5: the largest score
  plus one): never evicted.
- Budget (``allocation``): ``global`` (kvpress's default and the official code's ``--level pair``: non-uniform
  head budgets, still pair-level eviction; the paper's head-level eviction is ``level="head"``): one ranking over
  every layer's every head, ``floor(N * (1 - ratio))`` of the ``N = layers x heads x n`` pairs evicted per sequence;
  ``layer`` (kvpress ``layerwise=True``): each layer evicts ``floor(H * n * (1 - ratio))`` over its ``H`` heads;
  ``uniform``: every layer and head keeps ``max(1, floor(ratio * n))``. A token ``budget`` instead of ``ratio``
  keeps ``min(budget, n)`` per head on average. Ties evict the lower layer, then the older token, then the lower
  head first. kvpress's KVzip+ normalisation (off by default there) is not implemented.
- Memory: kvpress only masks evicted pairs; here they are freed. Under ``global`` and ``layer`` the heads keep
  different counts and each layer moves into ragged storage after the eviction: it holds the sum of its heads'
  counts plus at most one block of slack per head, and ``nbytes()`` reports that (``ragged=False``: one slot buffer
  as wide as the layer's fullest head; see ``kvcompress.methods.allocation``). Before the eviction the cache holds
  the whole context (the reconstruction attends to all of it, as in the paper and kvpress) and nothing more: the
  compression's peak is the full cache plus one chunk's forward (its activations, one layer's chunk keys and
  values, a query block's logits), which grows with ``chunk_size``, not with the context.
- Cost: a reconstruction forward's output is never read, so it stops once its last layer is scored (that layer's
  attention output, output projection and MLP, the final norm and the LM head are not computed; the earlier
  layers' outputs are the next layers' inputs and are). Its linear layers cost what the prefill's do, and its
  attention costs about three times the prefill's (every query over the whole stored context, a square, plus its
  own tokens causally, where the prefill's is one triangle; the scores need every query-key logit of the
  square): with a share ``f`` of a prefill's time in attention, prefill and compression cost about ``2 + 2f``
  prefills (a context of several chunks: the scores' product covers a chunk's columns, the attention's the
  context's).
- Batches: sequences of one length (no padding); each sequence is ranked on its own. Models with sliding-window
  layers (Mistral's, Gemma-3's) are refused when the cache is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.checks import check_budget, check_path, check_ratio, ints, one_of, param
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.core.ragged_layer import RaggedLayer
from kvcompress.methods.duo.patterns import load_pattern, resolve_path, shipped_path
from kvcompress.methods.kvzip.head import CALIBRATE, KIND, KVzipHeadPolicy, head_ranks
from kvcompress.methods.kvzip.layer import KVzipLayer, KVzipQuantizedLayer, KVzipRaggedLayer
from kvcompress.methods.kvzip.reconstruct import STOP, compress_by_reconstruction, score_chunk, stop_forward
from kvcompress.methods.oneshot import check_ratio_or_budget

ALLOCATIONS = ("global", "layer", "uniform")
LEVELS = ("pair", "head")
PAIR_ONLY = ("allocation", "n_sink", "chunk_size", "prefix", "tokenizer")  # the reconstruction's and its ranking's
HEAD_ONLY = ("pattern", "sink_size", "recent_size")


class KVzipPolicy(Policy):
    """Scores while the reconstruction forwards run (``scoring`` set by ``compress_by_reconstruction``). One-shot:
    the layer's own compression after the prompt selects nothing (``select`` keeps all); the eviction is decided
    for all layers together once the reconstruction ran (``KVzipConfig.after_prefill``)."""

    one_shot = True

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.done = False
        self.scoring: tuple[int, int, int, int] | None = None  # (context length, start, end, sinks) of a chunk
        self.scores: torch.Tensor | None = None  # [B, H_kv, context] float32
        self.chunk: tuple[torch.Tensor, torch.Tensor] | None = None  # a reconstruction forward's keys and values
        self.final = False  # the reconstruction forward's last layer (set by ``compress_by_reconstruction``)

    def attend(self, layer, query, key, value, mask, scaling):
        if self.scoring is not None:  # (the layer handed the chunk's own keys and values aside: ``layer``)
            own, self.chunk = self.chunk, None
            if self.final:  # nothing reads this layer's output: once it closes the forward, the forward stops
                layer.forward_pass.at_end(STOP, stop_forward)
            return score_chunk(self, query, key, value, *own, scaling, attend=not self.final), None
        if not self.done and layer.seen > layer.new_tokens and not layer.defer_compression:
            raise ValueError(
                "kvzip compresses the context in kvcompress.generation.prefill(model, context_ids, cache): it needs "
                "the context's token ids to reconstruct it; prefill the context first, then generate"
            )
        return None


@dataclass(frozen=True)
class KVzipConfig(MethodConfig):
    """Pairs scored by the attention the model pays them while it reconstructs the context; once, query-agnostic."""

    ratio: float | None = param(None, check_ratio)  # kept fraction of the context, in (0, 1] (give this or budget)
    budget: int | None = param(None, check_budget)  # or: tokens per layer and KV head (mean: global/layer, level=head)
    level: str = one_of(*LEVELS)  # pair: this context's pairs scored by reconstruction; head: calibrated head scores
    allocation: str = one_of(*ALLOCATIONS)  # pair level: over all layers and heads, a layer's heads, or uniform
    n_sink: int = param(4, ints(0))  # first tokens always kept
    chunk_size: int = param(2048, ints(1))  # context tokens reconstructed per forward
    prefix: int = param(0, ints(0))  # first context tokens not reconstructed (a chat template's header, kvpress)
    tokenizer: str | None = None  # folder of the model's tokenizer (None: the model's name_or_path)
    ragged: bool = True  # global/layer/head: heads store their own counts (False: one slot buffer, the fullest's)
    pattern: str | None = None  # head level: head scores, a shipped name or a kvzip-calibrate file (None: shipped)
    sink_size: int | None = param(None, ints(0))  # head level: first tokens a streaming head keeps (None: the file's)
    recent_size: int | None = param(None, ints(0))  # head level: last prompt tokens a streaming head keeps (None: file)

    name = "kvzip"
    paper = "https://arxiv.org/abs/2505.23416"
    policy_class = KVzipPolicy

    def validate(self) -> None:
        check_ratio_or_budget(self.name, self.ratio, self.budget)
        unused = HEAD_ONLY if self.level == "pair" else PAIR_ONLY
        for name in unused:
            default = type(self).__dataclass_fields__[name].default
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name} is a parameter of kvzip's {'head' if self.level == 'pair' else 'pair'} level, not of "
                    f"level={self.level!r}; got {name}={getattr(self, name)!r} (leave it at {default!r})"
                )
        if self.pattern is not None and shipped_path(str(self.pattern), KIND) is None:
            check_path(self.pattern, "pattern", "file", f"KVzip head scores from `{CALIBRATE}`")
            load_pattern(str(self.pattern), KIND)  # read now: a bad file is refused before a model loads
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be the folder of a tokenizer or None, got {self.tokenizer!r}")

    def kept_share(self, tokens: int) -> float:
        """The kept share of a ``tokens``-token prompt's pairs: ``ratio``, or ``budget / tokens`` (at most 1)."""
        return self.ratio if self.ratio is not None else min(1.0, self.budget / tokens)

    def policy(self, layer_idx: int) -> Policy:
        return KVzipHeadPolicy(self, layer_idx) if self.level == "head" else KVzipPolicy(self, layer_idx)

    def layer_class(self):
        if self.level == "head":  # (duo's layer: no reconstruction forward to hold aside)
            return RaggedLayer if self.ragged else None
        if self.allocation != "uniform" and self.ragged:
            return KVzipRaggedLayer
        return KVzipLayer if self.kv_bits == 16 else KVzipQuantizedLayer

    def connect(self, layers) -> None:
        if self.level == "head":
            self.connect_heads(layers)
            return
        if any(layer.sliding_window is not None for layer in layers):
            raise ValueError(
                "kvzip does not support models with sliding-window layers (the reconstruction would push the context "
                "out of the window; kvpress refuses Gemma-3 too): use another method"
            )

    def connect_heads(self, layers) -> None:
        """Level ``head``: each layer's pairs' ranks among the model's head scores, and the window's sizes."""
        path = resolve_path(self.pattern, len(layers), KIND)
        pattern = load_pattern(str(path), KIND)
        if pattern.layers != len(layers):
            raise ValueError(
                f"kvzip's head scores {path} have {pattern.layers} layers, but the model has {len(layers)}: they "
                f"were calibrated for another model; calibrate this one with `{CALIBRATE}`"
            )
        ranks = head_ranks(pattern.scores)
        sink = pattern.sink_size if self.sink_size is None else self.sink_size
        recent = pattern.recent_size if self.recent_size is None else self.recent_size
        for index, layer in enumerate(layers):
            policy = layer.policy
            policy.ranks, policy.total, policy.pattern_file = ranks[index], ranks.size, str(path)
            policy.sink_size, policy.recent_size = sink, recent

    def after_prefill(self, model, cache, input_ids, attention_mask) -> None:
        if self.level == "pair":  # (the head level compressed once after the prompt, with no further pass)
            compress_by_reconstruction(self, model, cache, input_ids, attention_mask)
