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
import sys
from dataclasses import dataclass, fields
from typing import Any

ENV_VAR = "KVCOMPRESS_VLLM"
CONFIG_KEY = "kvcompress"
SCORING = ("one_pass", "second_pass")
METHODS = ("full", "streaming", "window", "snapkv", "h2o", "cascade", "buzz")


@dataclass(frozen=True)
class BlockPolicyConfig:
    """A block-granular eviction policy and its parameters (all counts in tokens unless named ``*_blocks``).

    method: ``full`` (no eviction), ``streaming``, ``window``, ``snapkv``, ``h2o``, ``cascade`` or ``buzz`` (see
        ``kvcompress.vllm.policies``).
    budget: KV tokens kept per request and layer, rounded down to whole KV blocks (vLLM's ``block_size``);
        for ``snapkv`` the budget of the compressed prompt (generated tokens are appended after it).
    sink_blocks: ``streaming``, ``h2o``, ``cascade`` and ``buzz``: leading blocks always kept (the attention sinks
        live in the first block).
    window: ``snapkv`` only: observation window, the last prompt tokens whose queries vote (at most one block).
    kernel: ``snapkv`` only: width of the max pooling applied to the token votes before blocks are scored (odd).
    reselect_blocks: ``snapkv`` only: select again each time generated tokens fill this many more blocks, so a
        request holds at most its budget plus ``reselect_blocks + 1`` blocks; 0 (default): the prompt only, as in
        the paper.
    recent_blocks: ``h2o`` and ``buzz``: the most recent blocks always kept, the block being written included; 0
        (default): for ``h2o`` half of the blocks after the sinks, rounded up (H2O's even split between heavy hitters
        and recent tokens); for ``buzz`` the sliding window that Theorem 3.1 of BUZZ fits in the budget (see
        ``kvcompress.vllm.policies.BuzzBlocks``).
    cascades: ``cascade`` only: the number N of circular sub-caches the blocks after the sinks are split into (each
        of ``(budget blocks - sink_blocks) // N`` blocks; blocks left over by the division are not used); 0
        (default): min(4, the blocks after the sinks), the paper's 4 where the budget holds them.
    stride: ``buzz`` only: the hive size s, in blocks: each hive of s blocks that left the window keeps its
        heaviest block; older survivors are thinned by every ``(s + 1) // 2``-th (the paper's and its code's 5).
    scoring: ``h2o``, ``cascade`` and ``buzz``: how the attention mass per block is collected. ``"second_pass"``
        (default): vLLM's kernel computes the output, then a second torch pass recomputes the probabilities over
        the same keys for the mass; ``"one_pass"``: the backend computes each step's attention in torch, output and
        mass from the same probabilities, instead of calling vLLM's CPU kernel. Both give the same scores and
        outputs equal up to float32 rounding; the default is the faster on CPU (vLLM's C++ kernel outruns torch's
        attention by more than the second pass costs).
    """

    method: str = "full"
    budget: int = 0
    sink_blocks: int = 1
    window: int = 32
    kernel: int = 7
    reselect_blocks: int = 0
    recent_blocks: int = 0
    cascades: int = 0
    stride: int = 5
    scoring: str = "second_pass"

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ValueError(f"kvcompress: unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        for name in (
            "budget",
            "sink_blocks",
            "window",
            "kernel",
            "reselect_blocks",
            "recent_blocks",
            "cascades",
            "stride",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"kvcompress: {name} must be an integer (tokens or blocks), got {value!r}")
        if self.method != "full" and self.budget <= 0:
            raise ValueError(f"kvcompress: method {self.method!r} needs a positive budget (tokens), got {self.budget}")
        if self.sink_blocks < 0:
            raise ValueError(f"kvcompress: sink_blocks must be >= 0, got {self.sink_blocks}")
        if self.reselect_blocks < 0:
            raise ValueError(f"kvcompress: reselect_blocks must be >= 0 (0: select once), got {self.reselect_blocks}")
        if self.cascades < 0 or self.cascades == 1:
            raise ValueError(
                f"kvcompress: cascades must be 0 (min(4, the blocks after the sinks)) or >= 2, got {self.cascades}"
            )
        if self.scoring not in SCORING:
            raise ValueError(f"kvcompress: scoring must be one of {', '.join(SCORING)}, got {self.scoring!r}")
        if self.stride < 3:
            raise ValueError(f"kvcompress: stride must be >= 3 blocks (s <= 2 never shrinks), got {self.stride}")
        if self.recent_blocks < 0:
            raise ValueError(f"kvcompress: recent_blocks must be >= 0 (0: half the budget), got {self.recent_blocks}")
        if self.window < 1:
            raise ValueError(f"kvcompress: window must be >= 1 token, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kvcompress: kernel must be an odd integer >= 1, got {self.kernel}")

    @property
    def active(self) -> bool:
        return self.method != "full"

    def budget_blocks(self, block_size: int) -> int:
        """The budget in whole KV blocks, checked against what the method needs at ``block_size``."""
        blocks = self.budget // block_size
        # snapkv: its observation window (at most one block) spans one or two blocks, kept whole, and at least
        # one selected block (the request's first block, which names the request in the worker, is never freed).
        # h2o: its sinks, the recent blocks (at least the one being written) and at least one heavy-hitter block.
        needed = {
            "streaming": self.sink_blocks + 1,
            "window": 1,
            "snapkv": 3,
            "h2o": self.sink_blocks + max(self.recent_blocks, 1) + 1,
            # cascade: its sinks and at least two sub-caches of one block (the recent one and one that selects).
            "cascade": self.sink_blocks + max(self.cascades, 2),
            # buzz: its sinks, the sliding window (at least the block being written) and a middle of one block.
            "buzz": self.sink_blocks + max(self.recent_blocks, 1) + 1,
        }.get(self.method, 0)
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
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"kvcompress: the policy {value!r} is not valid JSON ({error})") from None
    else:
        data = value
    if not isinstance(data, dict):
        raise ValueError(
            f'kvcompress: the policy must be a JSON object such as {{"method": "streaming", "budget": 1024}}, '
            f"got {value!r}"
        )
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


PREFIX_CACHING_ERROR = (
    "kvcompress: the {method} policy evicts and rewrites KV blocks, so vLLM's prefix caching would share blocks "
    "whose content depends on the eviction; start vLLM with --no-enable-prefix-caching "
    "(enable_prefix_caching=False in Python)"
)
ADAPTED_BACKEND = "CPU_ATTN"
CPU_BLOCK_SIZE = 128  # vLLM's default KV block size on CPU for models without MLA or mamba layers


def check_engine(
    policy: BlockPolicyConfig,
    block_size: int | None = None,
    enable_prefix_caching: bool | None = None,
    attention_backend: str | None = None,
) -> None:
    """Refuse, before an engine starts, what ``policy`` cannot run with: ``ValueError`` with one line.

    ``block_size`` is vLLM's ``--block-size`` (``None``: the CPU default, 128), ``enable_prefix_caching`` and
    ``attention_backend`` vLLM's options of those names (``None``: not given). Only vLLM's CPU attention
    backend is adapted, so any other platform or backend is refused by name.
    """
    if not policy.active:
        return
    if enable_prefix_caching:
        raise ValueError(PREFIX_CACHING_ERROR.format(method=policy.method))
    if attention_backend is not None and str(attention_backend).upper() != ADAPTED_BACKEND:
        raise ValueError(
            f"kvcompress: the {policy.method} policy runs only on vLLM's {ADAPTED_BACKEND} attention backend, "
            f"not {attention_backend}"
        )
    check_platform(policy)
    policy.budget_blocks(block_size or CPU_BLOCK_SIZE)


def check_platform(policy: BlockPolicyConfig) -> None:
    """Refuse an active ``policy`` on a vLLM platform other than CPU (no other attention backend is adapted)."""
    from vllm.platforms import current_platform

    if policy.active and not current_platform.is_cpu():
        raise ValueError(
            f"kvcompress: the {policy.method} policy runs only on vLLM's {ADAPTED_BACKEND} attention backend "
            f"(CPU); this vLLM runs on {current_platform.device_name!r}, whose attention backends are not adapted"
        )


def exit_on_user_error(prog: str, check, *args) -> Any:
    """``check(*args)``; a ``ValueError`` becomes one line ``PROG: error: ...`` on stderr and exit status 2."""
    try:
        return check(*args)
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def check_policies(policies: list[str]) -> None:
    """Check command-line policies (JSON) as ``check_engine`` does, before any engine starts."""
    for policy in policies:
        check_engine(parse_policy(policy), enable_prefix_caching=False)
