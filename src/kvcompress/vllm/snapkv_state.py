"""Per-request block SnapKV state in the worker, keyed by the id of the request's first KV block.

The metadata builder sees batch rows, not request ids, and rows move between steps. A request's first block is
never freed while the request lives (it receives the first selected block), so its id names the request among
the running ones. A request's first step (a prefill with nothing cached) resets what a finished request with
the same first block left behind. Per id the tracker keeps whether a prefill awaits compression and, once
compressed, the prompt length, from which ``SnapKVBlocks`` derives the evicted range every step.

The selection point is always the prompt's end (the prompt length, from vLLM's runner: ``kvcompress.vllm.rows``),
as for the scheduler, which frees from the same prompt length. Normally the prompt's last prefill step ends there
and the selection runs at the start of the first decode step. A step that passes the prompt's end (vLLM's
recompute of a preempted request: prompt and generated tokens in one prefill) selects after its attention, voted
by the window queries up to the prompt's end. A request whose first run had selected is not selected again: over
every step of its recompute (one or several) nothing of its own is stashed or selected, and the carry puts its first
run's kept blocks and window queries back (``kvcompress.vllm.carry``).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from kvcompress.vllm.carry import CarryStep
from kvcompress.vllm.layout import KeyLayout
from kvcompress.vllm.policies import SnapKVBlocks
from kvcompress.vllm.snapkv import SelectRow, SnapKVReplay, SnapKVStep, StashRow


class SnapKVTracker:
    """Which rows stash queries, which compress their prompt (or squeeze it, at the end of a prefill step) in a step,
    and every row's compressed prompt length."""

    def __init__(self, policy: SnapKVBlocks, layout: KeyLayout) -> None:
        self.policy = policy
        self.layout = layout
        self.prompt_len = torch.zeros(0, dtype=torch.long)  # by first block id; 0: not compressed
        self.pending = torch.zeros(0, dtype=torch.bool)  # by first block id: prefilled, not yet compressed

    def _grow(self, max_id: int) -> None:
        if max_id >= len(self.prompt_len):
            size = max(2 * len(self.prompt_len), max_id + 1)
            self.prompt_len = torch.cat([self.prompt_len, self.prompt_len.new_zeros(size - len(self.prompt_len))])
            self.pending = torch.cat([self.pending, self.pending.new_zeros(size - len(self.pending))])

    def compressed(self, key: int) -> bool:
        """Whether the request keyed ``key`` has made its prompt's selection (departing now: worth carrying)."""
        return key < len(self.prompt_len) and bool(self.prompt_len[key] > 0)

    def track(
        self,
        common: CommonAttentionMetadata,
        context: torch.Tensor,
        prompt_lens: torch.Tensor,
        requests: list[str] | None = None,
        carry: CarryStep | None = None,
    ) -> tuple[SnapKVStep | None, torch.Tensor]:
        """This step's work (``None`` if none) and the compressed prompt length of each row (0 if not yet).

        ``prompt_lens``: each row's prompt length; ``requests``: each row's request id; ``carry``: this step's
        departures and replays (``kvcompress.vllm.carry``).
        """
        num_reqs = common.num_reqs
        table = common.block_table_tensor[:num_reqs]
        keys = table[:, 0].long()
        self._grow(int(keys.max()) if num_reqs else 0)
        live = common.seq_lens[:num_reqs] > 0
        prefilling = common.is_prefilling[:num_reqs].to(torch.bool) & live
        ends = context + (common.query_start_loc[1 : num_reqs + 1] - common.query_start_loc[:num_reqs]).long()
        # Rows recomputing a preempted request that had selected: nothing of their own is selected or stashed, the
        # carry gives their first run's front blocks and window queries back (``kvcompress.vllm.carry``).
        recomputed = torch.zeros(num_reqs, dtype=torch.bool)
        if carry is not None:
            recomputed[sorted(carry.rows())] = True
        self.prompt_len[keys[prefilling & (context == 0)]] = 0
        # A prefill step passing the prompt's end selects after its attention (a recompute after a preemption).
        crossing = prefilling & (context < prompt_lens) & (ends > prompt_lens)
        selecting = ~prefilling & live & self.pending[keys] & ~recomputed
        compressing = selecting | crossing
        self.prompt_len[keys[compressing]] = prompt_lens[compressing]
        self.pending[keys[compressing]] = False
        self.pending[keys[prefilling & ~crossing & (ends <= prompt_lens)]] = True
        prompt_len = self.prompt_len[keys]
        decoding = ~prefilling & live & (prompt_len > 0)
        reselecting = decoding & self.policy.reselects(context, prompt_len) & ~recomputed
        stashing = ((prefilling & ~crossing) | (decoding & self.policy.stashes(context, prompt_len))) & ~recomputed
        # Prefill selections at the end of this step: rows whose step moves blocks past the prefill range's end.
        moving = self.policy.prefill_hi(ends) > self.policy.prefill_hi(context)
        squeezing = prefilling & ~crossing & ~recomputed & moving
        step = None
        if stashing.any() or selecting.any() or reselecting.any() or squeezing.any() or crossing.any() or carry:
            step = SnapKVStep(
                self.policy,
                self.layout,
                self._stash_rows(common, keys, context, stashing),
                self._select_rows(table, keys, context, prompt_len, selecting | reselecting, selecting, requests),
                self._prefill_rows(table, keys, context, ends, squeezing, requests),
                carry=carry,
            )
            for i in (crossing & ~recomputed).nonzero().flatten().tolist():
                row, stash = self._cross_rows(common, table, keys, context, ends, prompt_len, i, requests)
                step.cross.append(row)
                step.cross_stash.append(stash)
            if carry is not None:
                step.replays = [self._replay(keys, prompt_len, replay) for replay in carry.replays]
                step.recomputing = list(carry.recomputing)
        return step, prompt_len

    @staticmethod
    def _stash_rows(common, keys, context, prefilling) -> list[StashRow]:
        starts = common.query_start_loc_cpu
        return [
            StashRow(int(keys[i]), int(starts[i]), int(starts[i + 1]), int(context[i]))
            for i in prefilling.nonzero().flatten().tolist()
        ]

    def _select_rows(self, table, keys, context, prompt_len, selecting, first, requests) -> list[SelectRow]:
        rows, policy = [], self.policy
        for i in selecting.nonzero().flatten().tolist():
            tokens, length = int(context[i]), int(prompt_len[i])
            lo, after = policy.worker_range(tokens, length)
            if first[i]:  # the prompt's selection: what the prefill kept is the front + the blocks from prefill_hi
                front, before = policy.prefill_front, int(policy.prefill_hi(tokens))
            else:
                front, before = int(lo), int(policy.worker_range(tokens - 1, length)[1])
            blocks = table[i, : -(-tokens // policy.block_size)].long().clone()
            request = requests[i] if requests is not None else None
            rows.append(SelectRow(int(keys[i]), tokens, int(lo), before, int(after), blocks, front, request))
        return rows

    def _prefill_rows(self, table, keys, context, ends, squeezing, requests) -> list[SelectRow]:
        rows, policy = [], self.policy
        for i in squeezing.nonzero().flatten().tolist():
            tokens, front = int(ends[i]), policy.prefill_front
            before, after = int(policy.prefill_hi(context[i])), int(policy.prefill_hi(ends[i]))
            blocks = table[i, : -(-tokens // policy.block_size)].long().clone()
            request = requests[i] if requests is not None else None
            rows.append(SelectRow(int(keys[i]), tokens, front, before, after, blocks, front, request))
        return rows

    def _cross_rows(self, common, table, keys, context, ends, prompt_len, i, requests) -> tuple[SelectRow, StashRow]:
        """Row ``i`` passes its prompt's end in this prefill step: the prompt's selection after the attention, as
        the first decode step would make it (the prompt's tokens, the window queries up to the prompt's end)."""
        policy, length, start = self.policy, int(prompt_len[i]), int(common.query_start_loc_cpu[i])
        lo, after = policy.worker_range(length, length)
        before = int(policy.prefill_hi(context[i]))
        blocks = table[i, : -(-int(ends[i]) // policy.block_size)].long().clone()
        request = requests[i] if requests is not None else None
        row = SelectRow(int(keys[i]), length, int(lo), before, int(after), blocks, policy.prefill_front, request)
        return row, StashRow(int(keys[i]), start, start + length - int(context[i]), int(context[i]))

    def _replay(self, keys, prompt_len, replay) -> SnapKVReplay:
        """The last step of a recompute whose first run had selected, cached ``replay.count`` tokens and stopped
        there: the re-selection its next step would have made (if due) and its recomputed queries that join the next
        window."""
        policy, i, count = self.policy, replay.row, replay.count
        length = prompt_len[i : i + 1]
        here = torch.tensor([count])
        select = None
        if bool(policy.reselects(here, length)[0]):
            lo, after = (int(v) for v in policy.worker_range(count, int(length)))
            before = int(policy.worker_range(count - 1, int(length))[1])
            blocks = replay.blocks[: -(-count // policy.block_size)]
            select = SelectRow(int(keys[i]), count, lo, before, after, blocks, lo, replay.request)
        stash = None
        if bool(policy.stashes(here, length)[0]):
            stash = StashRow(int(keys[i]), replay.start + count - replay.context, replay.end, count)
        return SnapKVReplay(replay.request, int(keys[i]), replay.blocks, select, stash, replay)
