"""Worker side of block SnapKV: keep the observation-window queries, then score, select and move prompt blocks.

During the prompt's prefill steps each attention layer keeps the last ``window`` queries of every request
(``ObservationStash``). In the request's first decode step, before that step's attention, each layer:

1. reads the prompt's keys back from its paged KV cache;
2. computes SnapKV's votes: softmax attention of the window queries over the prompt (causal inside the window),
   summed over the window, averaged over the query heads of each KV head, max-pooled over ``kernel`` tokens;
3. scores each block before the observation window by the sum of its votes and keeps, per KV head, the
   ``selected_blocks(prompt_len)`` best ones;
4. copies them, in their original order, into the request's first ``selected_blocks(prompt_len)`` blocks (whole
   ``[block, head]`` slabs of keys and values, so the kernel's layout does not matter for the copy).

The metadata builder then drops the blocks between the selected ones and the observation window from what the
kernel reads, and the scheduler frees them (``SnapKVBlocks``). During a prompt prefilled in several steps the same
work runs at the end of each step, after its attention (``run_prefill_step``): the last ``window`` queries so far
vote, each KV head keeps ``budget_blocks - 1`` blocks at the front, and the blocks holding the last ``window``
tokens stay; the prompt's selection then starts from what is kept, by the scores of the prompt's last step when it
selected (so a prompt prefilled in one step keeps exactly the blocks of one selection over the whole prompt).
A re-selection (``reselect_blocks``) is the same
work at a block boundary during decoding, over the kept tokens (the selected blocks, then the blocks written
since): the window is the last generated queries, kept from the decode steps just before the boundary. Max
pooling runs over the kept tokens in order, so it may pool across the gap left by evicted blocks. Keys were
rotated before caching, so a moved block keeps its original positions. Keys are read back through
``kvcompress.vllm.layout.KeyLayout``, learnt at start-up from vLLM's own cache writer for the layer's ISA, so
every CPU layout is read exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompress.vllm.layout import KeyLayout
from kvcompress.vllm.policies import SnapKVBlocks


@dataclass
class StashRow:
    """A prefilling request in this step: its key block id, query rows ``[start, end)`` and cached context."""

    key: int
    start: int
    end: int
    context: int


@dataclass
class SelectRow:
    """A request selecting in this step: its key block id, cached tokens, evicted range before and after.

    ``blocks`` are the ids of its logical blocks ``[0, ceil(context / block_size))``; blocks ``[front, hi_before)``
    are evicted already, ``[lo, hi_after)`` will be (``lo <= front``: the front blocks each KV head keeps).
    """

    key: int
    context: int
    lo: int
    hi_before: int
    hi_after: int
    blocks: torch.Tensor
    front: int


@dataclass
class SnapKVStep:
    """The block SnapKV work of one step, shared by all layers (built once by the metadata builder)."""

    policy: SnapKVBlocks
    layout: KeyLayout
    stash: list[StashRow]
    select: list[SelectRow]
    prefill_select: list[SelectRow]  # selections at the end of a prefill step (after the kernel)


class ObservationStash:
    """One layer's last ``window`` prefill queries per request, keyed by the request's first block id."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.queries: dict[int, torch.Tensor] = {}
        # By request: (tokens cached, [H_kv, front] scores of the front blocks) of its last prefill selection.
        self.front_scores: dict[int, tuple[int, torch.Tensor]] = {}

    def add(self, row: StashRow, query: torch.Tensor) -> None:
        chunk = query[max(row.start, row.end - self.window) : row.end]
        if row.context == 0:
            self.front_scores.pop(row.key, None)
        previous = self.queries.get(row.key) if row.context > 0 else None
        if previous is not None:
            chunk = torch.cat([previous, chunk])[-self.window :]
        self.queries[row.key] = chunk.clone()

    def pop(self, key: int) -> torch.Tensor | None:
        return self.queries.pop(key, None)


def run_step(step: SnapKVStep, stash: ObservationStash, query, kv_cache, scale: float) -> None:
    """One layer's share of ``step`` before its attention: select in the requests that reached a selection, then
    stash window queries.

    Selecting first: a step's own query may open the next observation window, never the one being used.
    """
    for row in step.select:
        window_queries = stash.pop(row.key)
        front = stash.front_scores.pop(row.key, None)
        prior = front[1] if front is not None and front[0] == row.context else None
        if window_queries is not None:
            select_blocks(step.policy, step.layout, row, window_queries, kv_cache, scale, prior)
    for row in step.stash:
        stash.add(row, query)


def run_prefill_step(step: SnapKVStep, stash: ObservationStash, kv_cache, scale: float) -> None:
    """One layer's share of ``step`` after its attention: the prefill selections (``SnapKVBlocks``), voted by the
    last ``window`` queries stashed so far (kept for the prompt's final selection)."""
    for row in step.prefill_select:
        window_queries = stash.queries.get(row.key)
        if window_queries is not None:
            scores = select_blocks(step.policy, step.layout, row, window_queries, kv_cache, scale)
            if scores is not None:
                stash.front_scores[row.key] = (row.context, scores)


def select_blocks(
    policy: SnapKVBlocks, layout: KeyLayout, row: SelectRow, queries, kv_cache, scale: float, prior=None
) -> torch.Tensor | None:
    """Move each KV head's best candidate blocks to the front of the request's blocks (see the module docstring).

    The candidates are the kept blocks before ``hi_after``; ``prior`` (``[H_kv, front]``), the scores the front
    blocks got in the prefill selection that ended where this one starts (same window): then only the front
    blocks compete, by those scores. Returns the chosen blocks' scores ``[H_kv, lo]``, in block order (``None``
    if there is nothing to choose).
    """
    lo, front, before, after = row.lo, row.front, row.hi_before, row.hi_after
    candidates = min(front, after) + max(after - before, 0)  # the kept blocks before ``hi_after``
    if candidates <= lo:
        return None
    kept = torch.cat([row.blocks[:front], row.blocks[before:]])  # the tokens attended to so far, in order
    if prior is not None:
        scores = prior
    else:
        keys = layout.read(kv_cache, kept, row.context - (before - front) * policy.block_size)
        votes = _votes(queries, keys, scale, policy.config.kernel)
        scores = _block_scores(votes, policy.block_size)[:, :candidates]
    chosen = scores.topk(lo, dim=1).indices.sort(dim=1).values  # [H_kv, lo]
    heads = torch.arange(kv_cache.shape[1]).unsqueeze(1)
    sources = kept[chosen]
    targets = row.blocks[:lo].unsqueeze(0).expand_as(sources)
    kv_cache[targets, heads] = kv_cache[sources, heads]
    return scores.gather(1, chosen)


def _votes(queries: torch.Tensor, keys: torch.Tensor, scale: float, kernel: int) -> torch.Tensor:
    """SnapKV's pooled votes ``[H_kv, prompt_len]`` of the window ``queries`` ``[w, H, D]`` over ``keys``."""
    window, num_q_heads, head_size = queries.shape
    num_kv_heads, prompt_len, _ = keys.shape
    grouped = queries.float().permute(1, 0, 2).reshape(num_kv_heads, num_q_heads // num_kv_heads, window, head_size)
    logits = torch.einsum("kgqd,kpd->kgqp", grouped, keys) * scale
    query_pos = torch.arange(prompt_len - window, prompt_len).unsqueeze(1)
    logits.masked_fill_(torch.arange(prompt_len).unsqueeze(0) > query_pos, float("-inf"))
    votes = logits.softmax(dim=-1).sum(dim=2).mean(dim=1)
    if kernel > 1:
        votes = F.max_pool1d(votes.unsqueeze(1), kernel, 1, kernel // 2).squeeze(1)
    return votes


def _block_scores(votes: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sum of the votes of each block: ``[H_kv, ceil(prompt_len / block_size)]``."""
    padding = -votes.shape[1] % block_size
    return F.pad(votes, (0, padding)).view(votes.shape[0], -1, block_size).sum(dim=2)
