"""Scheduler side: the KV cache manager that frees the blocks a policy evicts.

vLLM calls ``remove_skipped_blocks`` for every scheduled request before it allocates the request's next blocks
(this is how its sliding-window manager frees blocks behind the window). Here it frees the policy's range of
logical blocks; the freed entries of the request's block list become vLLM's null block, so the request keeps
its block indices (and the worker its append-only block table) while the pool gets the blocks back.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from kvcompress.vllm.config import PREFIX_CACHING_ERROR
from kvcompress.vllm.policies import make_policy
from kvcompress.vllm.spec import KVCompressSpec

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, whose handlers print in every process


class BlockEvictionManager(FullAttentionManager):
    """``FullAttentionManager`` that frees the blocks outside the policy's kept set as a request advances."""

    def __init__(self, kv_cache_spec: KVCompressSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        if self.enable_caching:
            raise ValueError(PREFIX_CACHING_ERROR.format(method=kv_cache_spec.policy.method))
        self.policy = make_policy(kv_cache_spec.policy, self.block_size)
        # vLLM admits a waiting request if the pool holds what it can hold at once: with eviction during
        # prefill, its budget plus one step, not its whole prompt (vLLM's cap for sliding-window layers).
        self.max_admission_blocks_per_request = kv_cache_spec.admission_blocks()
        logger.info(
            "kvcompress: %s, %d blocks of %d tokens per request",
            kv_cache_spec.policy.method,
            self.policy.budget_blocks,
            self.block_size,
        )

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        # SnapKV selects at the prompt's end, also in a recompute after a preemption (``kvcompress.vllm.snapkv_state``)
        prompt_len = num_prompt_tokens or 0
        first, end = self.policy.scheduler_range(processed_computed_tokens, prompt_len)
        self._remove_blocks_in_range(request_id, first, end)  # walks back from ``end`` to the first freed block
        if self.policy.one_shot:  # SnapKV's range may also grow downwards, once: from the prefill's front to ``lo``
            self._remove_blocks_in_range(request_id, first, min(end, self.policy.prefill_front))

    def live_blocks(self, request_id: str) -> int:
        """Blocks of the pool the request holds now (its null entries are evicted blocks)."""
        return sum(not block.is_null for block in self.req_to_blocks.get(request_id, ()))
