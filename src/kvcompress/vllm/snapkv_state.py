"""Per-request block SnapKV state in the worker, keyed by the id of the request's first KV block.

The metadata builder sees batch rows, not request ids, and rows move between steps. A request's first block is
never freed while the request lives (it receives the first selected block), so its id names the request among
the running ones. A request's first step (a prefill with nothing cached) resets what a finished request with
the same first block left behind. Per id the tracker keeps whether a prefill awaits compression and, once
compressed, the prompt length, from which ``SnapKVBlocks`` derives the evicted range every step.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from kvcompress.vllm.layout import KeyLayout
from kvcompress.vllm.policies import SnapKVBlocks
from kvcompress.vllm.snapkv import SelectRow, SnapKVStep, StashRow


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

    def track(self, common: CommonAttentionMetadata, context: torch.Tensor) -> tuple[SnapKVStep | None, torch.Tensor]:
        """This step's work (``None`` if none) and the compressed prompt length of each row (0 if not yet)."""
        num_reqs = common.num_reqs
        table = common.block_table_tensor[:num_reqs]
        keys = table[:, 0].long()
        self._grow(int(keys.max()) if num_reqs else 0)
        live = common.seq_lens[:num_reqs] > 0
        prefilling = common.is_prefilling[:num_reqs].to(torch.bool) & live
        self.prompt_len[keys[prefilling & (context == 0)]] = 0
        selecting = ~prefilling & live & self.pending[keys]
        self.prompt_len[keys[selecting]] = context[selecting]
        self.pending[keys[selecting]] = False
        self.pending[keys[prefilling]] = True
        prompt_len = self.prompt_len[keys]
        decoding = ~prefilling & live & (prompt_len > 0)
        reselecting = decoding & self.policy.reselects(context, prompt_len)
        stashing = prefilling | (decoding & self.policy.stashes(context, prompt_len))
        # Prefill selections at the end of this step: rows whose step moves blocks past the prefill range's end.
        ends = context + (common.query_start_loc[1 : num_reqs + 1] - common.query_start_loc[:num_reqs]).long()
        squeezing = prefilling & (self.policy.prefill_hi(ends) > self.policy.prefill_hi(context))
        step = None
        if stashing.any() or selecting.any() or reselecting.any() or squeezing.any():
            step = SnapKVStep(
                self.policy,
                self.layout,
                self._stash_rows(common, keys, context, stashing),
                self._select_rows(table, keys, context, prompt_len, selecting | reselecting, selecting),
                self._prefill_rows(table, keys, context, ends, squeezing),
            )
        return step, prompt_len

    @staticmethod
    def _stash_rows(common, keys, context, prefilling) -> list[StashRow]:
        starts = common.query_start_loc_cpu
        return [
            StashRow(int(keys[i]), int(starts[i]), int(starts[i + 1]), int(context[i]))
            for i in prefilling.nonzero().flatten().tolist()
        ]

    def _select_rows(self, table, keys, context, prompt_len, selecting, first) -> list[SelectRow]:
        rows, policy = [], self.policy
        for i in selecting.nonzero().flatten().tolist():
            tokens, length = int(context[i]), int(prompt_len[i])
            lo, after = policy.worker_range(tokens, length)
            if first[i]:  # the prompt's selection: what the prefill kept is the front + the blocks from prefill_hi
                front, before = policy.prefill_front, int(policy.prefill_hi(tokens))
            else:
                front, before = int(lo), int(policy.worker_range(tokens - 1, length)[1])
            blocks = table[i, : -(-tokens // policy.block_size)].long().clone()
            rows.append(SelectRow(int(keys[i]), tokens, int(lo), before, int(after), blocks, front))
        return rows

    def _prefill_rows(self, table, keys, context, ends, squeezing) -> list[SelectRow]:
        rows, policy = [], self.policy
        for i in squeezing.nonzero().flatten().tolist():
            tokens, front = int(ends[i]), policy.prefill_front
            before, after = int(policy.prefill_hi(context[i])), int(policy.prefill_hi(ends[i]))
            blocks = table[i, : -(-tokens // policy.block_size)].long().clone()
            rows.append(SelectRow(int(keys[i]), tokens, front, before, after, blocks, front))
        return rows
