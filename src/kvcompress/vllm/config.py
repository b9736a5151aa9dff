"""Which block policy a vLLM engine runs, read from its configuration.

A policy is chosen per engine, that is per served model, from (first match wins):

1. ``--additional-config '{"kvcompress": {"method": "streaming", "budget": 1024}}'`` (``additional_config`` of
   ``vllm.LLM`` / ``EngineArgs``);
2. the environment variable ``KVCOMPRESS_VLLM`` holding the same JSON object, e.g.
   ``KVCOMPRESS_VLLM='{"method": "snapkv", "budget": 512}'``.

With neither, or with ``"method": "full"``, the plugin leaves vLLM's attention and KV cache untouched.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

ENV_VAR = "KVCOMPRESS_VLLM"
CONFIG_KEY = "kvcompress"
METHODS = ("full", "streaming", "window", "snapkv")


@dataclass(frozen=True)
class BlockPolicyConfig:
    """A block-granular eviction policy and its parameters (all counts in tokens unless named ``*_blocks``).

    method: ``full`` (no eviction), ``streaming``, ``window`` or ``snapkv`` (see ``kvcompress.vllm.policies``).
    budget: KV tokens kept per request and layer, rounded down to whole KV blocks (vLLM's ``block_size``);
        for ``snapkv`` the budget of the compressed prompt (generated tokens are appended after it).
    sink_blocks: ``streaming`` only: leading blocks always kept (the attention sinks live in the first block).
    window: ``snapkv`` only: observation window, the last prompt tokens whose queries vote (at most one block).
    kernel: ``snapkv`` only: width of the max pooling applied to the token votes before blocks are scored (odd).
    """

    method: str = "full"
    budget: int = 0
    sink_blocks: int = 1
    window: int = 32
    kernel: int = 7

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"kvcompress: unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.method != "full" and self.budget <= 0:
            raise ValueError(f"kvcompress: method {self.method!r} needs a positive budget (tokens)")
        if self.sink_blocks < 0 or self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError("kvcompress: sink_blocks >= 0, window >= 1 and an odd kernel >= 1 are required")

    @property
    def active(self) -> bool:
        return self.method != "full"

    def budget_blocks(self, block_size: int) -> int:
        """The budget in whole KV blocks, checked against what the method needs at ``block_size``."""
        blocks = self.budget // block_size
        needed = {"streaming": self.sink_blocks + 1, "window": 1, "snapkv": 3}.get(self.method, 0)
        if blocks < needed:
            raise ValueError(
                f"kvcompress: budget {self.budget} is {blocks} block(s) of {block_size} tokens; "
                f"{self.method} needs at least {needed} blocks"
            )
        if self.method == "snapkv" and self.window > block_size:
            raise ValueError(f"kvcompress: snapkv window {self.window} must be at most one block ({block_size})")
        return blocks


def parse_policy(value: str | dict[str, Any] | None) -> BlockPolicyConfig:
    """A policy from a JSON string or a dict; ``None`` or ``""`` gives ``full`` (plugin inactive)."""
    if not value:
        return BlockPolicyConfig()
    data = json.loads(value) if isinstance(value, str) else dict(value)
    known = {f.name for f in fields(BlockPolicyConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"kvcompress: unknown policy parameter(s) {sorted(unknown)}; known: {sorted(known)}")
    return BlockPolicyConfig(**data)


def policy_from_vllm_config(vllm_config: Any) -> BlockPolicyConfig:
    """The policy of one engine: its ``additional_config["kvcompress"]``, else ``$KVCOMPRESS_VLLM``."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    if CONFIG_KEY in additional:
        return parse_policy(additional[CONFIG_KEY])
    return parse_policy(os.environ.get(ENV_VAR))
