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


@dataclass(frozen=True, kw_only=True)
class KVCompressSpec(FullAttentionSpec):
    """``FullAttentionSpec`` whose blocks are evicted by ``policy``."""

    policy: BlockPolicyConfig

    @classmethod
    def from_full(cls, spec: FullAttentionSpec, policy: BlockPolicyConfig) -> KVCompressSpec:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}, policy=policy)

    @classmethod
    def merge(cls, specs: list[KVCompressSpec]) -> KVCompressSpec:
        policies = {spec.policy for spec in specs}
        if len(policies) != 1:
            raise ValueError(f"kvcompress: all layers of one KV cache group need the same policy, got {policies}")
        return cls.from_full(FullAttentionSpec.merge(specs), policies.pop())
