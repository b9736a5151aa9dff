"""Block-granular eviction policies: which KV blocks of a request stop being attended to and are freed.

vLLM keeps one block table per request, shared by all layers and KV heads, so what is evicted must be whole blocks
and the same logical blocks in every layer. Every policy here evicts one contiguous range ``[lo, hi)`` of a
request's logical blocks. The same arithmetic runs in two places:

* the scheduler (``BlockEvictionManager``) frees the blocks of the range, from the number of processed tokens;
* the worker (the attention metadata builder) drops the range from the block table the kernel reads, from the
  number of tokens already in the cache before the step (the context).

The scheduler never frees a block the worker still reads: for the same token count both compute the same range,
and the scheduler's count never runs ahead of the worker's. Positions are untouched: vLLM applies RoPE before
writing keys, so a kept block keeps the positions it was written with (kvcompress's ``position_mode="original"``).
Functions take Python ints (scheduler) or int64 tensors (worker, one entry per request) alike.
"""

from __future__ import annotations

import math

import torch

from kvcompress.vllm.config import BlockPolicyConfig


def _maximum(a, b: int):
    return torch.clamp(a, min=b) if isinstance(a, torch.Tensor) else max(a, b)


def _where(condition, a, b):
    return torch.where(condition, a, b) if isinstance(condition, torch.Tensor) else (a if condition else b)


class BlockPolicy:
    """Keeps everything (``full``). Subclasses evict one range of blocks per request."""

    one_shot = False  # True: the range is decided once, after the prompt, by attention scores in the worker
    scored = False  # True: the worker accumulates attention per block and refills the kept blocks (``h2o``)

    def __init__(self, config: BlockPolicyConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.budget_blocks = config.budget_blocks(block_size)

    def worker_range(self, context, prompt_len):
        """``(lo, hi)``: blocks the kernel skips in a step whose request has ``context`` tokens cached already."""
        return 0, 0

    def scheduler_range(self, processed, prompt_len):
        """``(lo, hi)``: blocks the scheduler may free once ``processed`` tokens are computed and committed."""
        return self.worker_range(processed, prompt_len)

    def peak_blocks(self, step_tokens: int) -> int | None:
        """The most blocks a request holds when a step adds at most ``step_tokens`` (``None``: unbounded)."""
        return None


class StreamingBlocks(BlockPolicy):
    """StreamingLLM at block granularity: ``sink_blocks`` leading blocks + the most recent blocks.

    Maps to kvcompress's ``streaming`` (4 sink tokens + a recent window, budget counting both) with whole blocks:
    the first block holds the attention sinks (and the rest of the first 128 tokens, by default), and the window
    is the last ``budget_blocks - sink_blocks`` blocks, the block being written included, so a decoding request
    holds exactly ``budget_blocks`` blocks. Eviction happens between steps, so a prompt processed in one vLLM
    prefill chunk is attended fully (like kvcompress's ``generate``, which compresses after the forward pass),
    and between chunks when vLLM splits a long prompt (like ``kvcompress.generation.prefill``). Unlike the
    per-token method's default ``position_mode="cache"``, positions are the original ones (vLLM caches rotated
    keys), i.e. kvcompress's ``streaming`` with ``position_mode="original"``.
    """

    def __init__(self, config: BlockPolicyConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        self.sink_blocks = config.sink_blocks if config.method == "streaming" else 0
        self.recent_blocks = self.budget_blocks - self.sink_blocks

    def worker_range(self, context, prompt_len):
        writing_block = context // self.block_size  # the block the next token goes into
        return self.sink_blocks, _maximum(writing_block - self.recent_blocks + 1, self.sink_blocks)

    def leaving_hi(self, context):
        """Scored policies: the end of the blocks that have left the recent window (and were refilled from)."""
        return self.worker_range(context, 0)[1]

    def peak_blocks(self, step_tokens: int) -> int | None:
        # Freed down to the budget before each step (prefill chunk or decode token), then the step's blocks.
        return self.budget_blocks + -(-step_tokens // self.block_size) + 1


class WindowBlocks(StreamingBlocks):
    """The local window at block granularity: the most recent ``budget_blocks`` blocks, no sinks.

    Maps to kvcompress's ``window`` (the ``budget`` most recent tokens, original positions), rounded to blocks:
    the block being written plus the ``budget_blocks - 1`` blocks before it.
    """


class SnapKVBlocks(BlockPolicy):
    """SnapKV at block granularity: after the prompt, keep the top-scored prompt blocks + the window.

    Maps to kvcompress's ``snapkv``: the last ``window`` prompt queries vote for earlier tokens (attention summed
    over the window, averaged over the query heads of each KV head, max-pooled with width ``kernel``), scored
    here per block (the sum of its tokens' votes) instead of per token. The blocks holding the observation window
    (one, or two where the window straddles a block boundary) are kept as they are; each layer and KV head keeps
    its own best blocks among those before the window, as many as the rest of the budget holds, copied in order
    into the request's first blocks (``kvcompress.vllm.snapkv``), so the per-head choice of the per-token method
    survives vLLM's single block table. The blocks in between are freed: the compressed prompt holds exactly
    ``budget_blocks`` blocks, and a prompt of at most ``budget_blocks`` blocks is left whole.

    Decoding then appends without eviction, as in the paper (``reselect_blocks=0``). With ``reselect_blocks=R``
    (not in the paper: SnapKV compresses the prompt only), each time generated tokens have filled ``R`` more blocks
    the same selection runs again at that block boundary: the last ``window`` generated queries vote over every
    kept token, each KV head keeps its best blocks among the selected ones and the blocks written since, and the
    newest blocks (as many as the prompt's window spanned) stay; a request then holds between ``budget_blocks + 1``
    and ``budget_blocks + R`` blocks however long it generates (``budget_blocks + R + 1`` during the step that
    selects, which starts a block before the selection frees any).

    Bounded prefill (not in the paper, which holds the whole prompt): at the end of every prefill step that leaves
    more than ``budget_blocks - 1`` blocks before the blocks holding the last ``window`` cached tokens, the same
    selection runs with the step's last ``window`` queries as a provisional observation window (the queries so
    far, across steps, when the step is shorter): each KV head keeps its ``budget_blocks - 1`` best blocks among
    those, copied to the front, and the blocks holding the last ``window`` tokens stay. A request prefilled in
    steps of ``q`` tokens thus holds at most ``budget_blocks + ceil(q / block_size) + 2`` blocks, not its prompt.
    At the prompt's end the paper's selection keeps ``selected_blocks(prompt_len)`` (``budget_blocks - 1`` or
    ``- 2``) of the kept blocks; when the prompt's last
    step selected (always, for a prompt longer than the budget prefilled in one step), that choice is made by the
    scores of that step's selection, so a prompt prefilled in one step keeps exactly the paper's blocks (the top
    blocks by the window's votes over the whole prompt). With a chunked prefill, blocks evicted after an earlier
    step were voted out by that step's queries, not by the prompt's final window: that is the approximation.

    The evicted blocks are always one contiguous range ``[lo, hi)``: ``lo`` (the selected blocks) is fixed by the
    prompt, ``hi`` moves ``R`` blocks on at each selection, so the scheduler and the worker derive it from token
    counts alone (during the prefill, ``[budget_blocks - 1, prefill_hi(tokens))``, which the final range contains).
    """

    one_shot = True

    def __init__(self, config: BlockPolicyConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        self.reselect = config.reselect_blocks

    def window_start_block(self, prompt_len):
        """The first block holding an observation-window token: blocks before it are the candidates."""
        return _maximum(prompt_len - self.config.window, 0) // self.block_size

    def _window_blocks(self, prompt_len):
        return (prompt_len + self.block_size - 1) // self.block_size - self.window_start_block(prompt_len)

    def selected_blocks(self, prompt_len):
        """Blocks selected per KV head: the budget less the 1-2 blocks the observation window spans."""
        return self.budget_blocks - self._window_blocks(prompt_len)

    def _selections(self, count, prompt_len):
        """How many re-selections have happened once ``count`` tokens are cached, and the end of the evicted range."""
        first_hi = _maximum(self.window_start_block(prompt_len), self.selected_blocks(prompt_len))
        if not self.reselect:
            return 0, first_hi
        base = first_hi + self._window_blocks(prompt_len)  # re-selection k runs at block base + k * R
        done = _maximum(count // self.block_size - base, 0) // self.reselect
        return done, first_hi + done * self.reselect

    @property
    def prefill_front(self) -> int:
        """Blocks each KV head keeps at the front while the prompt is prefilled (``budget_blocks - 1``)."""
        return self.budget_blocks - 1

    def prefill_hi(self, count):
        """End of the range evicted during the prefill once ``count`` tokens are cached: the blocks holding the last
        ``window`` of them stay (so does the prompt's observation window, at the prompt's end)."""
        return _maximum((count - self.config.window) // self.block_size, self.prefill_front)

    def _range(self, count, prompt_len, compressed, prefilled):
        lo = self.selected_blocks(prompt_len)
        hi = self._selections(count, prompt_len)[1]
        return _where(compressed, lo, self.prefill_front), _where(compressed, hi, self.prefill_hi(prefilled))

    def worker_range(self, context, prompt_len):
        # The worker selects at the start of a step (the first decode step, then block boundaries), before its
        # attention; during the prefill, at the end of each step (``prefill_hi`` of the tokens cached then).
        return self._range(context, prompt_len, _compressed(context, prompt_len, strict=False), context)

    def scheduler_range(self, processed, prompt_len):
        # Blocks are freed only once the step that selected has run (its copies are done).
        compressed = _compressed(processed, prompt_len, strict=True)
        return self._range(processed - 1, prompt_len, compressed, processed)

    def peak_blocks(self, step_tokens: int) -> int | None:
        if not self.reselect:
            return None  # generated tokens are appended without bound (the paper's behaviour)
        prefill = self.budget_blocks + 1 + -(-step_tokens // self.block_size) + 1
        return max(prefill, self.budget_blocks + self.reselect + 1)

    def reselects(self, context: torch.Tensor, prompt_len: torch.Tensor) -> torch.Tensor:
        """Rows (already compressed, decoding) whose step starting at ``context`` selects again."""
        if not self.reselect:
            return torch.zeros_like(context, dtype=torch.bool)
        done = self._selections(context, prompt_len)[0]
        before = self._selections(context - 1, prompt_len)[0]
        return (done > before) & (context > prompt_len)

    def stashes(self, context: torch.Tensor, prompt_len: torch.Tensor) -> torch.Tensor:
        """Rows (compressed, decoding) whose query at ``context`` belongs to the next re-selection's window."""
        if not self.reselect:
            return torch.zeros_like(context, dtype=torch.bool)
        done, _ = self._selections(context, prompt_len)
        first_hi = _maximum(self.window_start_block(prompt_len), self.selected_blocks(prompt_len))
        base = first_hi + self._window_blocks(prompt_len)
        next_start = (base + (done + 1) * self.reselect) * self.block_size
        return (context >= next_start - self.config.window) & (context >= prompt_len)


class H2OBlocks(StreamingBlocks):
    """H2O (heavy hitters + recent tokens, accumulated attention) at block granularity.

    A request's blocks are, in order: ``sink_blocks`` sinks (never evicted), ``heavy_blocks`` heavy-hitter slots,
    evicted blocks, and the ``recent_blocks`` most recent blocks (the block being written included; by default half
    of the blocks after the sinks, rounded up: H2O's even split). The scheduler's arithmetic is ``streaming``'s with
    the sinks and heavy slots as the kept front, so a request holds exactly ``budget_blocks`` once it is longer.

    Each layer accumulates, for every block it keeps and per KV head, the attention mass the block's tokens received
    (softmax probabilities of every query since the block was written, the prompt's queries included, summed over
    the block's tokens and over the query heads sharing the KV head: kvcompress's ``h2o`` summed per block). When a
    step moves blocks out of the recent window, each layer and KV head keeps, in the heavy slots, its
    ``heavy_blocks`` highest-scored blocks among the slots' current blocks and the ones leaving; the winners are
    copied into the slots of the losers (keys, values and score; ``kvcompress.vllm.scores``), and the rest is freed.
    So the lowest-scored block is evicted, per layer and KV head, whenever a request passes its budget, never a
    sink or a recent block. A prompt prefilled in one step is scored over all its queries, then cut to the budget
    at its end (H2O's prompt step); a prompt prefilled in chunks is cut after each chunk, so a request holds at
    most its budget plus one chunk.
    """

    scored = True

    def __init__(self, config: BlockPolicyConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        sinks = config.sink_blocks
        after_sinks = self.budget_blocks - sinks
        self.recent_blocks = config.recent_blocks or -(-after_sinks // 2)
        self.heavy_blocks = after_sinks - self.recent_blocks
        self.first_sink_blocks = sinks
        self.sink_blocks = sinks + self.heavy_blocks  # the kept front of streaming's arithmetic: sinks + heavy slots


class CascadeBlocks(StreamingBlocks):
    """Cascading KV Cache (Willette et al., 2024, arXiv:2406.17808; kvcompress's ``cascade``) at block granularity.

    The blocks after the ``sink_blocks`` sinks are ``N`` circular sub-caches ("cascades") of ``W`` blocks each
    (``config.cascades``; 0: min(4, blocks after the sinks)). Cascade 0 is the most recent ``W`` blocks, in place
    (the block being written included), as in the paper where the first cascade takes every token. Cascades
    ``1 .. N-1`` are fixed slots after the sinks (``W`` blocks each, in order), so the scheduler's arithmetic is
    ``streaming``'s with the sinks and those slots as the kept front, and a request holds exactly
    ``sink_blocks + N W`` blocks once longer (the budget, less the blocks ``N`` does not divide).

    The token-acceptance rule, with the block as the unit: the ``c``-th block to leave cascade 0 (``c = 0, 1, ...``,
    the paper's global clock in blocks) is offered to cascade 1; cascade ``i`` accepts only when ``c`` is a
    multiple of ``2^i`` (``b = 2``): the block then overwrites the cascade's oldest slot and the block it displaces
    is offered to cascade ``i + 1`` (beyond the last cascade it is dropped). When cascade ``i`` does not accept,
    the incoming block and the cascade's newest block compete, and the one with the larger exponential moving
    average (EMA) of the attention it received stays in the newest slot (ties go to the incoming block, the
    authors' code); the other is dropped. Which slot is oldest or newest follows from ``c`` alone (cascade ``i``
    has accepted ``floor(c / 2^i) + 1`` blocks by clock ``c``), so no per-request state is kept.

    Scores (``kvcompress.vllm.scores``): per block and KV head, ``mu <- gamma mu + (1 - gamma) s`` at every token
    step, ``s`` the attention mass the block's tokens received in that step, summed over the query heads of the
    KV head; a new block starts at 0, and ``gamma = exp(-N ln(100) / (N W block_size))`` (the paper's Eq. 14 with
    the cascades' size in tokens). The sum of the tokens' EMAs is the EMA of the block's sum, so the block score is
    exactly the paper's token EMAs summed over the block.

    Choices the block unit forces, or where this differs from the paper (kvcompress's per-token ``cascade``):

    * the unit: a block of ``block_size`` tokens is accepted, compared and dropped whole, and the acceptance clock
      counts blocks, not tokens;
    * decisions per KV head (the KV head's own query heads' attention), where the paper decides once for all heads
      (mean over all query heads): vLLM's one block table is shared by the heads anyway (the cascades' slots are
      copied per ``[block, head]``), and under tensor parallelism each rank then decides for its own KV heads with
      no exchange, so the outputs do not depend on the number of ranks;
    * the cascades start full: their slots hold the request's first blocks after the sinks (the paper fills empty
      cascades as tokens arrive); the clock starts with the first block to leave cascade 0;
    * positions are the original ones (vLLM caches rotated keys), not re-indexed inside the cache;
    * a prompt prefilled in one step is attended whole, then its blocks leave cascade 0 in order at its end (the
      v1 paper runs the prompt token by token); its queries update the EMA in closed form (query ``m`` of ``q``
      weighted ``(1 - gamma) gamma^(q-1-m)``, the later official strided variant).
    """

    scored = True

    def __init__(self, config: BlockPolicyConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        sinks = config.sink_blocks
        after_sinks = self.budget_blocks - sinks
        self.cascades = config.cascades or min(4, after_sinks)
        self.ring_blocks = after_sinks // self.cascades  # W
        self.recent_blocks = self.ring_blocks
        self.first_sink_blocks = sinks
        self.sink_blocks = sinks + (self.cascades - 1) * self.ring_blocks  # sinks + the slots of cascades 1 .. N-1
        self.budget_blocks = sinks + self.cascades * self.ring_blocks
        self.gamma = math.exp(-self.cascades * math.log(100) / (self.cascades * self.ring_blocks * block_size))

    def ring_slots(self, ring: int) -> tuple[int, int]:
        """The logical blocks ``[first, end)`` holding the slots of cascade ``ring`` (1 .. N-1)."""
        first = self.first_sink_blocks + (ring - 1) * self.ring_blocks
        return first, first + self.ring_blocks

    def offers(self, leaving_block: int) -> list[tuple[int, bool, int]]:
        """What happens to the block leaving cascade 0 at logical index ``leaving_block``, cascade by cascade:
        ``(ring, accepts, slot)``, ``slot`` the logical block overwritten (the oldest if it accepts, else the
        newest, which the incoming block competes with); the list stops at the first cascade that does not accept
        (or after the last one)."""
        clock = leaving_block - self.sink_blocks
        steps = []
        for ring in range(1, self.cascades):
            period = 2**ring
            accepted_before = clock // period + (clock % period != 0)  # acceptances at clocks 0 .. clock - 1
            first, _ = self.ring_slots(ring)
            if clock % period == 0:
                steps.append((ring, True, first + accepted_before % self.ring_blocks))
            else:
                steps.append((ring, False, first + (accepted_before - 1) % self.ring_blocks))
                break
        return steps


class BuzzBlocks(StreamingBlocks):
    """BUZZ (Zhao et al., 2024, arXiv:2410.23079; kvcompress's ``buzz``) at block granularity: sinks + a sliding
    window + a middle of segmented heavy hitters.

    A request's blocks are ``sink_blocks`` sinks, a middle of ``T`` slots, and the sliding window of the ``w`` most
    recent blocks (``recent_blocks``, the block being written included). Blocks that leave the window gather in the
    middle (the new buffer); nothing is dropped until the middle would hold more than ``T`` blocks. Then, per layer
    and KV head, the new blocks are cut into consecutive hives of ``s`` blocks (``stride``; aligned at the oldest new
    block, the last one may be short) and each hive keeps its block with the highest accumulated attention (the
    paper's local max, ties to the earliest), while the old blocks (survivors of earlier evictions) are thinned by
    interval sampling with ``ŝ = (s + 1) // 2``, keeping the old blocks 0, ŝ, 2ŝ, ... (the first always). The
    survivors, old then new in order, become the old blocks and the buffer empties; where they still exceed ``T``
    (small ``T``), every ``ŝ``-th survivor is kept again until they fit (kvcompress's ``prefill_mode="loop"``).

    How many blocks the middle holds after ``c`` blocks have left the window is a function of ``c`` alone (the
    count of survivors does not depend on the scores), eventually periodic, so the scheduler and the worker agree
    on it from token counts: the middle lives in ``T`` fixed slots right after the sinks, in order (old, then new),
    and the worker hides the unused slots and the blocks that left the window (``[sink_blocks + middle, window)``,
    one range), while the scheduler frees the blocks after the slots (streaming's arithmetic with the sinks and the
    slots as the kept front), so a decoding request holds exactly ``sink_blocks + T + w`` blocks, the budget. Until
    ``T`` blocks have left the window, the slots are the request's own blocks, in place; after that, a block leaving
    the window is copied into the next free slot (all KV heads), or, when the middle is full, triggers the eviction
    above, whose survivors are copied per KV head into the slots (keys, values and score:
    ``kvcompress.vllm.scores.buzz_refill``).

    Scores are block H2O's: the attention mass every query since the block was written gave its tokens, summed over
    the query heads of the KV head (the paper's accumulated attention, kvcompress's ``group_reduce="sum"``).

    Parameters: the budget in blocks is ``sink_blocks + w + T``. With ``recent_blocks=0``, ``w`` is the largest
    window whose Theorem 3.1 threshold fits, ``sink_blocks + w + round(r w) <= budget`` with ``r = (s² + 1) / (s +
    1)`` (odd ``s``) or ``s - 1`` (even), as kvcompress's ``budget_kind="peak"``; where no window fits (fewer than
    ``sink_blocks + 1 + round(r)`` blocks: 6 for ``s = 5`` and one sink block), ``w = 1``. ``T`` is the rest of the
    budget (at least ``round(r w)``), since the slots are held anyway.

    Choices the block unit forces, or where this differs from the paper:

    * the unit: a block of ``block_size`` tokens enters the middle, competes in its hive and is dropped whole; the
      window, the threshold and the hives count blocks, not tokens (with one sink block, the sinks are the first
      ``block_size`` tokens, not 4);
    * decisions per KV head (as kvcompress's ``buzz``); the number of survivors is the same for every head;
    * positions are the original ones (vLLM caches rotated keys; kvcompress's ``position_mode="original"``);
    * a prompt prefilled in one step is attended whole (every prompt query adds to the scores), then its blocks
      leave the window one by one at its end, each going through the rule above (as if decoded, with the whole
      prompt's scores); a chunked prefill does the same after each step. log-n scaling and the ablations
      (``local_max=False``, ``swap_strides``) are not offered.
    """

    scored = True

    def __init__(self, config: BlockPolicyConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        sinks, stride = config.sink_blocks, config.stride
        self.stride, self.old_stride = stride, (stride + 1) // 2
        after_sinks = self.budget_blocks - sinks
        ratio = (stride * stride + 1) / (stride + 1) if stride % 2 else float(stride - 1)
        window = config.recent_blocks
        if not window:
            fits = [w for w in range(1, after_sinks) if w + max(1, round(ratio * w)) <= after_sinks]
            window = max(fits, default=1)
        self.recent_blocks = window
        self.threshold = after_sinks - window  # T, at least 1 (``BlockPolicyConfig.budget_blocks``)
        self.first_sink_blocks = sinks
        self.sink_blocks = sinks + self.threshold  # the kept front of streaming's arithmetic: sinks + the slots
        self._states, self._start, self._period = self._middle_cycle()
        self._middle = torch.tensor([old + new for old, new in self._states])

    def thinned(self, old: int, new: int) -> tuple[int, int]:
        """The eviction when the middle holds ``old`` old and ``new`` new blocks: ``(survivors, every)``, the number
        kept and the extra thinning of the survivor list (every ``every``-th survivor; 1: none)."""
        kept = -(-old // self.old_stride) + -(-new // self.stride)
        every = 1
        while kept > self.threshold:
            kept, every = -(-kept // self.old_stride), every * self.old_stride
        return kept, every

    def _cycle_index(self, left):
        start, period = self._start, self._period
        if isinstance(left, torch.Tensor):
            return torch.where(left < start + period, left, start + (left - start) % period)
        return left if left < start + period else start + (left - start) % period

    def state(self, left: int) -> tuple[int, int]:
        """``(old, new)`` blocks in the middle once ``left`` blocks have left the window (before any eviction that
        the next leaving block triggers)."""
        return self._states[self._cycle_index(left)]

    def _middle_cycle(self) -> tuple[list[tuple[int, int]], int, int]:
        """The middle's ``(old, new)`` after ``c = 0, 1, ...`` blocks left the window, until it repeats: ``(states,
        start, period)``; state(c) = states[c] for c < start + period, else states[start + (c - start) % period]."""
        seen: dict[tuple[int, int], int] = {}
        old, new, states = 0, 0, []
        while (old, new) not in seen:
            seen[(old, new)] = len(states)
            states.append((old, new))
            new += 1
            if old + new > self.threshold:
                old, new = self.thinned(old, new)[0], 0
        start = seen[(old, new)]
        return states, start, len(states) - start

    def middle_blocks(self, left):
        """The middle's size once ``left`` blocks have left the window (int or int64 tensor)."""
        if isinstance(left, torch.Tensor):
            return self._middle.to(left.device)[self._cycle_index(left)]
        return int(self._middle[self._cycle_index(left)])

    def left_blocks(self, context):
        """How many blocks have left the window once ``context`` tokens are cached."""
        return _maximum(context // self.block_size - self.recent_blocks + 1 - self.first_sink_blocks, 0)

    def worker_range(self, context, prompt_len):
        left = self.left_blocks(context)
        sinks = self.first_sink_blocks
        return sinks + self.middle_blocks(left), sinks + left

    def scheduler_range(self, processed, prompt_len):
        return super().worker_range(processed, prompt_len)  # the slots stay allocated, hidden or not

    def leaving_hi(self, context):
        """The first block after the slots still in the window: blocks before it left and were refilled."""
        return super().worker_range(context, 0)[1]


def _compressed(count, prompt_len, strict: bool):
    if isinstance(count, torch.Tensor):
        return (count > prompt_len if strict else count >= prompt_len) & (prompt_len > 0)
    return prompt_len > 0 and (count > prompt_len if strict else count >= prompt_len)


POLICIES = {
    "full": BlockPolicy,
    "streaming": StreamingBlocks,
    "window": WindowBlocks,
    "snapkv": SnapKVBlocks,
    "h2o": H2OBlocks,
    "cascade": CascadeBlocks,
    "buzz": BuzzBlocks,
}


def make_policy(config: BlockPolicyConfig, block_size: int) -> BlockPolicy:
    """The policy object for ``config`` at vLLM's KV ``block_size`` (tokens per block)."""
    return POLICIES[config.method](config, block_size)
