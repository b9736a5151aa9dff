"""The KV cache spec of layers under a kvcompress policy: vLLM's full-attention spec plus the policy.

The worker's attention backend turns each full-attention layer's ``FullAttentionSpec`` into a
``KVCompressSpec`` (``KVCompressCPUBackend.customize_spec``); the engine core receives the specs from the
workers and, through ``KVCacheSpecRegistry``, gives the group a ``BlockEvictionManager``. The spec is grouped
with full attention (same page size and layout), so the KV pool is sized and shared exactly as without the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvcompress.vllm.config import BlockPolicyConfig
from kvcompress.vllm.policies import make_policy


@dataclass(frozen=True, kw_only=True)
class KVCompressSpec(FullAttentionSpec):
    """``FullAttentionSpec`` whose blocks are evicted by ``policy``.

    ``in_flight_tokens`` is vLLM's bound on the tokens one request can be scheduled in a step
    (``VllmConfig.max_in_flight_tokens``): a policy that evicts during prefill holds at most its budget plus
    those tokens' blocks, which is what vLLM's admission check and start-up pool sizing are told
    (``max_admission_blocks_per_request``, as vLLM does for sliding-window layers).
    """

    policy: BlockPolicyConfig
    in_flight_tokens: int = 0

    @classmethod
    def from_full(cls, spec: FullAttentionSpec, policy: BlockPolicyConfig, in_flight_tokens: int) -> KVCompressSpec:
        return cls(
            **{f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init},
            policy=policy,
            in_flight_tokens=in_flight_tokens,
        )

    @classmethod
    def merge(cls, specs: list[KVCompressSpec]) -> KVCompressSpec:
        policies = {spec.policy for spec in specs}
        if len(policies) != 1:
            raise ValueError(f"kvcompress: all layers of one KV cache group need the same policy, got {policies}")
        in_flight = max(spec.in_flight_tokens for spec in specs)
        return cls.from_full(FullAttentionSpec.merge(specs), policies.pop(), in_flight)

    def admission_blocks(self) -> int | None:
        """The most blocks a request of this group holds at once (``None``: its whole length)."""
        return make_policy(self.policy, self.block_size).peak_blocks(self.in_flight_tokens)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        full = super().max_memory_usage_bytes(vllm_config)
        blocks = self.admission_blocks()
        return full if blocks is None else min(full, blocks * self.page_size_bytes)
