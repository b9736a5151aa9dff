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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvcompress.vllm.carry import CarryStep, LayerCarry, Replay
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
    request: str | None = None  # its request id, under which the layer keeps the origin of its front slots


@dataclass
class SnapKVReplay:
    """A request recomputed after a preemption whose first run had selected (``kvcompress.vllm.carry``): its key,
    the ids of its recomputed blocks, the re-selection due where its first run stopped (if any) and the query rows
    of the recompute that join the next observation window (if any)."""

    request: str
    key: int
    blocks: torch.Tensor
    select: SelectRow | None
    stash: StashRow | None
    carried: Replay | None = None  # the carry's record of this step of the recompute


@dataclass
class SnapKVStep:
    """The block SnapKV work of one step, shared by all layers (built once by the metadata builder)."""

    policy: SnapKVBlocks
    layout: KeyLayout
    stash: list[StashRow]
    select: list[SelectRow]
    prefill_select: list[SelectRow]  # selections at the end of a prefill step (after the kernel)
    # A step that passes the prompt's end (a recompute after a preemption): the prompt's selection after the kernel,
    # voted by the window queries up to the prompt's end (``cross_stash``), unless the request is replayed.
    cross: list[SelectRow] = field(default_factory=list)
    cross_stash: list[StashRow] = field(default_factory=list)
    replays: list[SnapKVReplay] = field(default_factory=list)
    recomputing: list[Replay] = field(default_factory=list)  # recompute steps before the first run's count
    carry: CarryStep | None = None


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


def run_step(
    step: SnapKVStep, stash: ObservationStash, query, kv_cache, scale: float, carry: LayerCarry | None = None
) -> None:
    """One layer's share of ``step`` before its attention: park the state of departing requests
    (``kvcompress.vllm.carry``), select in the requests that reached a selection, then stash window queries.

    Selecting first: a step's own query may open the next observation window, never the one being used.
    """
    if carry is not None and step.carry is not None:
        _park(step, stash, carry)
    for row in step.select:
        window_queries = stash.pop(row.key)
        front = stash.front_scores.pop(row.key, None)
        prior = front[1] if front is not None and front[0] == row.context else None
        if window_queries is not None:
            select_blocks(step.policy, step.layout, row, window_queries, kv_cache, scale, prior, carry)
    for row in step.stash:
        stash.add(row, query)


def _park(step: SnapKVStep, stash: ObservationStash, carry: LayerCarry) -> None:
    """Before this step can reuse their keys: park departing requests, give returning ones their state back."""
    for departure in step.carry.departures:
        carry.parked[departure.request] = {
            "origin": carry.origin.pop(departure.request, None),
            "queries": stash.queries.pop(departure.key, None),
        }
        stash.front_scores.pop(departure.key, None)
    for request, key in step.carry.returned:
        parked = carry.parked.pop(request, None)
        if parked is not None:
            if parked["origin"] is not None:
                carry.origin[request] = parked["origin"]
            if parked["queries"] is not None:
                stash.queries[key] = parked["queries"]
    carry.drop(step.carry)


def run_prefill_step(
    step: SnapKVStep, stash: ObservationStash, query, kv_cache, scale: float, carry: LayerCarry | None = None
) -> None:
    """One layer's share of ``step`` after its attention: the prefill selections (``SnapKVBlocks``), voted by the
    last ``window`` queries stashed so far (kept for the prompt's final selection); the prompt's selection in a
    step that passes the prompt's end; the origin blocks a recompute step completed, copied into their slots; the
    replays of recomputed requests."""
    for row in step.prefill_select:
        window_queries = stash.queries.get(row.key)
        if window_queries is not None:
            scores = select_blocks(step.policy, step.layout, row, window_queries, kv_cache, scale, None, carry)
            if scores is not None:
                stash.front_scores[row.key] = (row.context, scores)
    for row in step.cross_stash:
        stash.add(row, query)
    for row in step.cross:
        window_queries = stash.pop(row.key)
        if window_queries is not None:
            select_blocks(step.policy, step.layout, row, window_queries, kv_cache, scale, None, carry)
    for recompute in step.recomputing:
        parked = carry.parked.get(recompute.request) if carry is not None else None
        if parked is not None and parked["origin"] is not None:
            carry.restore_front(kv_cache, parked["origin"], recompute, step.policy.block_size)
    for replay in step.replays:
        _replay(step, replay, stash, query, kv_cache, scale, carry)


def _replay(step: SnapKVStep, replay: SnapKVReplay, stash: ObservationStash, query, kv_cache, scale, carry) -> None:
    """The last step of a recompute: the first run's front blocks and window queries back (``restore_replay``),
    then what the first run's next step would have done: a re-selection due there, the queries joining the window."""
    if not restore_replay(step, replay, stash, kv_cache, carry):
        return
    if replay.select is not None:
        window_queries = stash.pop(replay.key)
        if window_queries is not None:
            select_blocks(step.policy, step.layout, replay.select, window_queries, kv_cache, scale, None, carry)
    if replay.stash is not None:
        stash.add(replay.stash, query)


def restore_replay(
    step: SnapKVStep, replay: SnapKVReplay, stash: ObservationStash, kv_cache, carry: LayerCarry | None
) -> bool:
    """Give a recomputed request the front blocks and window queries its first run had (``kvcompress.vllm.carry``):
    the origin blocks this last step of the recompute completed into their slots (those completed by earlier steps
    were copied then), the slots' origin, the observation-window queries (``False``: nothing was parked)."""
    parked = carry.parked.pop(replay.request, None) if carry is not None else None
    if parked is None:
        return False
    if parked["origin"] is not None:
        carry.restore_front(kv_cache, parked["origin"], replay.carried, step.policy.block_size)
        carry.origin[replay.request] = parked["origin"]
    stash.front_scores.pop(replay.key, None)
    if parked["queries"] is not None:
        stash.queries[replay.key] = parked["queries"]
    else:
        stash.queries.pop(replay.key, None)
    return True


def select_blocks(
    policy: SnapKVBlocks,
    layout: KeyLayout,
    row: SelectRow,
    queries,
    kv_cache,
    scale: float,
    prior=None,
    carry: LayerCarry | None = None,
) -> torch.Tensor | None:
    """Move each KV head's best candidate blocks to the front of the request's blocks (see the module docstring).

    The candidates are the kept blocks before ``hi_after``; ``prior`` (``[H_kv, front]``), the scores the front
    blocks got in the prefill selection that ended where this one starts (same window): then only the front
    blocks compete, by those scores. Returns the chosen blocks' scores ``[H_kv, lo]``, in block order (``None``
    if there is nothing to choose). With ``carry``, the logical block each front slot now holds is recorded under
    ``row.request`` (``kvcompress.vllm.carry``).
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
    if carry is not None and row.request is not None:  # logical blocks of the kept tokens, per head, then chosen
        num_kv_heads = kv_cache.shape[1]
        logical = torch.cat(
            [
                carry.origin_of(row.request, num_kv_heads, front, chosen.device),
                torch.arange(before, len(row.blocks), device=chosen.device).expand(num_kv_heads, -1),
            ],
            dim=1,
        )
        carry.origin[row.request] = logical.gather(1, chosen)
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
