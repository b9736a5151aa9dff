"""Compactor (Chari & Van Durme, 2025, arXiv:2507.08143; kvpress 0.5.5's ``CompactorPress``): approximate
statistical leverage of the keys blended with non-causal chunked attention, once after the prompt.

Each KV head scores its prompt tokens by two z-scored terms, ``blending * leverage + attention``:

- **Leverage** (kvpress ``LeverageScorePress``): the head's un-rotated (pre-RoPE) keys ``K`` ``[S, d]`` are centred
  over the tokens and sketched from the right by a Gaussian ``Phi`` ``[d, k]`` (entries ``N(0, 1/k)``,
  ``k = sketch_dimension``), ``X = (K - mean K) Phi``; the score of token ``i`` is ``x_i^T (X^T X + j I)^-1 x_i``
  through the Cholesky factor ``L`` of the symmetrised Gram matrix with jitter ``j = 0.01`` (raised tenfold, up to
  five tries, while the factorisation fails), as kvpress factors it; computed as ``|L^-1 x_i|^2`` (one triangular
  solve, never negative; kvpress solves with both factors and clamps at 0). Outlying keys score high.
- **Non-causal attention** (kvpress ``NonCausalAttnPress``): the prompt is cut into chunks of ``chunk_size`` tokens;
  within a chunk every query attends to every key (future ones too), ``softmax(q . k)`` over the chunk's keys (the
  logits unscaled, as kvpress writes them), rotated queries and keys; each key's attention is summed over the
  chunk's queries, averaged over the query heads of its KV head, multiplied by its value's L2 norm and smoothed by a
  width-3 average (``avg_pool1d``, zeros beyond the ends counted).

Each term is z-scored over all KV heads and tokens of a layer (mean and unbiased standard deviation, the deviation
at least ``1e-6``), as kvpress does. The first ``sink_size_start`` and last ``sink_size_end`` prompt tokens are left
out of both terms (the centring, the Gram matrix, the chunks and the z-scores are over the tokens between them) and
always kept. Defaults are kvpress's: ``sink_size_start=8, sink_size_end=4, chunk_size=256, sketch_dimension=48``,
``blending`` = the removed fraction of the prompt.

Choices where the sources leave room:

- The sketch: kvpress draws a fresh ``Phi`` from PyTorch's global generator at every call (one per sequence of the
  batch, in the key dtype), so its selection changes from run to run. Here layer ``i``'s sketch is fixed:
  ``torch.randn(H_kv, d, k, generator=torch.Generator().manual_seed(seed + i)) * (1 / sqrt(k))`` drawn once on the
  CPU in float32 (then moved to the model's device), the same for every sequence and every prompt; ``seed``
  defaults to 0. kvpress run after ``torch.manual_seed(seed + i)`` before layer ``i``'s attention draws the same
  matrix for a batch of one float32 sequence.
- The keys: kvpress recomputes the pre-RoPE keys from the layer's input; here the stored keys are turned back by
  their RoPE position (exact up to float rounding; a model without RoPE takes its keys as they are). The queries
  are the model's own rotated queries of the prompt. A prompt in one forward is scored from that forward's queries.
  A prompt fed in chunks (``kvcompress.generation.prefill``) scores each attention chunk as soon as its tokens are
  all in and it cannot hold one of the last ``sink_size_end`` tokens (its end at most ``sink_size_end`` tokens
  before the newest), and drops the queries no chunk still needs: a layer holds at most a chunk, the end sinks and
  one forward's queries, not the prompt's (``H_q / H_kv`` times its keys' bytes). A chunk's attention needs its own
  queries and keys only, so its scores are the same, to float rounding, whenever it is taken; with quantized storage
  (``kv_bits``) the keys are read as that forward's attention read them (its newest tokens not yet quantized).
  Leverage and attention run in float32.
- The last chunk, shorter than ``chunk_size``, is padded with zero queries and keys, as kvpress pads it: its real
  queries' softmax counts the padding keys with logit 0 (kvpress's ``-1e-9`` fill), and its padding queries, whose
  logits are all 0, spread ``1 / chunk_size`` over every key of the chunk; both kept, as kvpress computes them.
- ``blending`` left unset (None) is the removed fraction of the layer's uniform budget: ``1 - ratio``, or
  ``1 - min(budget, n) / n`` for a token budget and a sequence of ``n`` prompt tokens (kvpress: its
  ``compression_ratio``).
- Batches: each sequence is scored on its own real tokens (left padding never enters a mean, a chunk or a
  z-score), one pass per sequence once per prompt; a sequence whose prompt holds only sinks keeps them.
- One-shot, like kvpress (which supports prefill only): the prompt is compressed once after its prefill and
  decoding appends. Budget: ``ratio`` keeps ``max(1, floor(ratio * n))`` of a sequence's ``n`` prompt tokens per
  layer and KV head, sinks included (or a token ``budget``); ``allocation`` shares it among layers (``pyramid``) or
  heads (``adakv``), see ``kvcompress.methods.allocation``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompress.core.checks import MAX_SEED, ints, number, param
from kvcompress.core.contract import Policy
from kvcompress.core.rope import counts_from, rotate_by
from kvcompress.methods.allocation import ScorerConfig, allocated_keep
from kvcompress.methods.oneshot import kept_per_sequence

JITTER = 1e-2  # the Gram matrix's first jitter (kvpress's)
JITTER_TRIES = 5


def sketch_matrix(seed: int, heads: int, dim: int, sketch: int) -> torch.Tensor:
    """The fixed right sketch ``[heads, dim, sketch]`` (float32, CPU) of the layer whose seed is ``seed``."""
    generator = torch.Generator(device="cpu").manual_seed(seed)  # the same numbers whatever the model's device
    return torch.randn(heads, dim, sketch, generator=generator, device="cpu") * (1 / math.sqrt(sketch))


def cholesky_with_jitter(gram: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of ``gram + j I``, ``j`` from ``JITTER`` raised tenfold while the factorisation fails."""
    identity = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    jitter = JITTER
    for _ in range(JITTER_TRIES):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * identity, upper=False)
        if bool((info == 0).all()):  # once per layer and prompt: a host read is fine here
            return factor
        jitter *= 10
    raise RuntimeError(f"compactor: Cholesky factorisation of the sketched keys failed after {JITTER_TRIES} tries")


def leverage_scores(keys: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """``[H, S]`` approximate leverage of un-rotated keys ``[H, S, d]`` under the right sketch ``[H, d, k]``."""
    centred = keys - keys.mean(dim=-2, keepdim=True)
    sketched = (centred @ sketch).float()  # [H, S, k]
    transposed = sketched.transpose(-2, -1)
    gram = transposed @ sketched
    factor = cholesky_with_jitter(0.5 * (gram + gram.transpose(-2, -1)))
    # x^T (L L^T)^-1 x = |L^-1 x|^2: one triangular solve (kvpress solves with both factors and clamps at 0)
    solved = torch.linalg.solve_triangular(factor, transposed, upper=False)  # L^-1 X^T, [H, k, S]
    return solved.square().sum(-2)


LOGIT_FLOOR = 60.0  # logits further than this below their row's maximum are raised to it before the softmax
# chunks taken together while their float32 logits stay within these many (at least one chunk): 4 MiB on CPU, within
# a core's cache; 128 MiB elsewhere, a few kernel launches per layer however long the prompt
CPU_BLOCK_LOGITS, BLOCK_LOGITS = 1 << 20, 1 << 25


def noncausal_attention(queries: torch.Tensor, keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[H, S]``: per key of ``keys`` ``[H, S, d]``, the attention it receives from its chunk's queries
    ``[H, G, S, d]`` (the ``G`` query heads of each KV head), averaged over the ``G`` heads; every query sees every
    key of its chunk, the last chunk zero-padded as kvpress pads it.

    The ``G`` query heads of a KV head are one ``[G * chunk, chunk]`` product against their shared keys (no repeated
    keys), all heads together, as many chunks at a time as keep their float32 logits within ``CPU_BLOCK_LOGITS``
    floats on CPU (one chunk of 256 tokens for a small model: the logits, softmax and sums stay in the processor's
    cache) or ``BLOCK_LOGITS`` elsewhere. Two shortcuts, exact to float32 rounding: logits more than ``LOGIT_FLOOR``
    (60) below their row's maximum are raised to that floor before the softmax (their probability, at most ``e^-60``
    of the row's largest, vanishes beside it either way, and exponentials that small would be subnormal floats, many
    times slower on CPUs); and the last chunk's padding queries, whose logits are all 0 (zero queries), each give
    every key of the chunk ``1 / chunk_size``, added as that constant rather than computed. The padding keys get logit
    0 (zero keys; kvpress writes ``-1e-9``, the same float32 probabilities)."""
    heads, groups, length, dim = queries.shape
    received = torch.empty(heads, length, dtype=torch.float32, device=keys.device)
    whole = length // chunk  # full chunks; then the rest, padded
    budget = CPU_BLOCK_LOGITS if keys.device.type == "cpu" else BLOCK_LOGITS
    per = max(1, budget // (heads * groups * chunk * chunk))
    for first in range(0, whole, per):  # a few blocks once per layer and prompt
        count = min(per, whole - first)
        start, end = first * chunk, (first + count) * chunk
        block = received_in_chunks(
            queries[:, :, start:end].unflatten(2, (count, chunk)), keys[:, start:end].unflatten(1, (count, chunk))
        )
        received[:, start:end] = block.flatten(1)
    start = whole * chunk
    if start < length:  # the last chunk: zero keys as its padding, and its padding queries' constant
        width = length - start
        padded = torch.cat([keys[:, start:], keys.new_zeros(heads, chunk - width, dim)], dim=1)
        block = received_in_chunks(queries[:, :, None, start:], padded[:, None])
        received[:, start:] = block[:, 0] + groups * (chunk - width) / chunk
    return received.div_(groups)


def received_in_chunks(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[H, n, w]``: the attention each of the first ``w`` keys of ``n`` chunks (``keys`` ``[H, n, c, d]``, ``c >= w``)
    receives from the chunk's ``queries`` ``[H, G, n, w, d]``, summed over the ``G`` heads and the ``w`` queries."""
    heads, groups, count, width, dim = queries.shape
    rows = queries.transpose(1, 2).reshape(heads, count, groups * width, dim)
    dots = torch.matmul(rows, keys.transpose(-2, -1)).float()  # [H, n, G * w, c]
    torch.maximum(dots, dots.amax(dim=-1, keepdim=True).sub_(LOGIT_FLOOR), out=dots)
    return torch.softmax(dots, dim=-1)[..., :width].sum(dim=-2)


def gathered(index: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``tensors`` ``.index_select(1, index)`` (``index`` non-empty), or a view of it when ``index`` is a run
    ``i, i + 1, ...`` (a sequence's real tokens as a fresh cache holds its prompt, left padding or not: nothing copied;
    two host reads, once per layer and prompt)."""
    first = int(index[0])
    if counts_from(index[None], first):
        return tuple(x.narrow(1, first, index.numel()) for x in tensors)
    return tuple(x.index_select(1, index) for x in tensors)


def scored(parts: list[torch.Tensor]) -> int:
    """Tokens covered by the attention ``parts`` ``[H, n]`` taken so far."""
    return sum(part.shape[1] for part in parts)


def z_scored(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` less their mean over the unbiased standard deviation (at least ``1e-6``; 1 for a single score)."""
    spread = scores.std().clamp_min(1e-6) if scores.numel() > 1 else scores.new_ones(())
    return (scores - scores.mean()) / spread


def attention_scores(received: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[H, S]`` z-scored non-causal attention from the attention each key ``received`` ``[H, S]``
    (``noncausal_attention``) and the values ``[H, S, d]``."""
    scores = received * values.norm(dim=-1)
    scores = F.avg_pool1d(scores[:, None], kernel_size=3, padding=1, stride=1)[:, 0]
    return z_scored(scores)


class CompactorPolicy(Policy):
    one_shot = True
    needs_rope = True

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.sketch: torch.Tensor | None = None
        self.forget_prompt()

    def forget_prompt(self) -> None:
        """Drop what the prompt's forwards left: held queries and the attention of the chunks scored early."""
        # the prompt's rotated queries, [B, H_q, q, d] per forward, stream order from stream index ``query_start``
        self.queries: list[torch.Tensor] = []
        self.query_start = 0
        self.early: list[list[torch.Tensor]] = []  # per sequence: the attention [H, n] of its first chunks, in order

    def attend(self, layer, query, key, value, mask, scaling):
        if layer.seen == layer.new_tokens:  # the first forward of a new or reset cache
            self.forget_prompt()
        if not layer.compressed:
            self.queries.append(query.detach())
            if layer.defer_compression:  # a prompt in several forwards: score the attention chunks this one completed
                self.score_completed_chunks(layer)
        return None

    def held_queries(self) -> torch.Tensor:
        """The queries held ``[B, H_q, q, d]``: position ``t`` holds stream index ``query_start + t``'s."""
        return self.queries[0] if len(self.queries) == 1 else torch.cat(self.queries, dim=2)

    def received(self, queries: torch.Tensor, tokens: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[H, n]``: ``noncausal_attention`` of one sequence's ``keys`` ``[H, n, d]`` (consecutive chunks from a
        chunk's start) and the queries of their stream indices ``tokens`` ``[n]`` among its held ``queries``."""
        (own,) = gathered(tokens - self.query_start, queries)
        return noncausal_attention(own.unflatten(0, (keys.shape[0], -1)), keys, self.config.chunk_size)

    @torch.no_grad()
    def score_completed_chunks(self, layer) -> None:
        """Take the non-causal attention of every chunk of the middle tokens whose tokens are all in and that cannot
        hold one of the last ``sink_size_end`` prompt tokens, then drop the queries no chunk needs any more (host
        reads once per layer and prompt chunk)."""
        config, chunk = self.config, self.config.chunk_size
        valid, token_idx = layer.valid[:, 0], layer.token_idx[:, 0]
        if not self.early:
            self.early = [[] for _ in range(valid.shape[0])]
        queries, keys = self.held_queries(), layer.keys
        needed = []  # per sequence: the first stream index whose queries a chunk still needs
        for b, early in enumerate(self.early):
            slots = valid[b].nonzero().squeeze(-1)  # the real tokens, stream order (nothing evicted yet)
            first = config.sink_size_start + scored(early)  # the first middle token not scored yet
            count = max(0, (slots.numel() - config.sink_size_end - first) // chunk)  # completed chunks
            if count:
                run = slots[first : first + count * chunk]
                (chunk_keys,) = gathered(run, keys[b])
                early.append(self.received(queries[b], token_idx[b, run], chunk_keys))
                first += count * chunk
            needed.append(int(token_idx[b, slots[first]]) if first < slots.numel() else layer.seen)
        drop = min(needed) - self.query_start
        if drop > 0:  # a copy of the rest, so the dropped queries' memory is freed
            self.queries = [queries[:, :, drop:].clone()]
            self.query_start += drop

    def select(self, layer):
        config = self.config
        queries = self.held_queries()
        keys, valid = layer.keys, layer.valid
        batch, heads, width, dim = keys.shape
        if self.sketch is None or self.sketch.device != keys.device:
            drawn = sketch_matrix(config.seed + self.layer_idx, heads, dim, config.sketch_dimension)
            self.sketch = drawn.to(keys.device)
        n_real = valid[:, 0].sum(-1)
        kept = kept_per_sequence(n_real, config.ratio, config.budget)
        scores = torch.zeros(batch, heads, width, dtype=torch.float32, device=keys.device)
        protected = torch.zeros(batch, heads, width, dtype=torch.bool, device=keys.device)
        for b, (n, keep) in enumerate(zip(n_real.tolist(), kept.tolist(), strict=True)):  # once per prompt
            slots = valid[b, 0].nonzero().squeeze(-1)  # the real tokens, stream order (nothing evicted yet)
            left = min(config.sink_size_start, n)
            right = min(config.sink_size_end, n - left)
            protected[b, :, slots[:left]] = True
            protected[b, :, slots[n - right :]] = True
            middle = slots[left : n - right]
            if middle.numel() == 0:
                continue
            blending = config.blending
            if blending is None:  # the removed fraction
                blending = 1 - config.ratio if config.ratio is not None else 1 - keep / n
            scores[b, :, middle] = self.sequence_scores(layer, queries[b], b, middle, blending)
        self.forget_prompt()
        return allocated_keep(self, layer, scores, protected)

    @torch.no_grad()  # the scores only choose what is kept: no gradient passes through that choice
    def sequence_scores(self, layer, queries, b, middle, blending: float) -> torch.Tensor:
        """``[H, S]`` blended scores of one sequence's tokens between the sinks (slots ``middle``)."""
        keys, values = gathered(middle, layer.keys[b], layer.values[b])
        plain = keys
        if layer.inv_freq is not None:
            plain = rotate_by(keys, -layer.rope_pos[b, 0, middle], layer.inv_freq)
        leverage = z_scored(leverage_scores(plain.float(), self.sketch))
        received = list(self.early[b]) if self.early else []  # the first chunks, scored while the prompt came in
        start = scored(received)
        if start < middle.numel():
            received.append(self.received(queries, layer.token_idx[b, 0, middle[start:]], keys[:, start:]))
        attention = attention_scores(torch.cat(received, dim=1), values)
        return blending * leverage + attention


@dataclass(frozen=True)
class CompactorConfig(ScorerConfig):
    """Keys scored by their approximate leverage blended with non-causal chunked attention, once."""

    sink_size_start: int = param(8, ints(0))  # first prompt tokens always kept, left out of the scores
    sink_size_end: int = param(4, ints(0))  # last prompt tokens always kept, left out of the scores
    chunk_size: int = param(256, ints(1))  # tokens per chunk of the non-causal attention
    sketch_dimension: int = param(48, ints(1, 4096))  # columns of the Gaussian sketch of the keys
    blending: float | None = param(None, number(0, 1e6))  # leverage term's weight (None: the removed fraction, kvpress)
    seed: int = param(0, ints(0, MAX_SEED))  # layer i's sketch is drawn from a generator seeded with seed + i

    name = "compactor"
    paper = "https://arxiv.org/abs/2507.08143"
    policy_class = CompactorPolicy
