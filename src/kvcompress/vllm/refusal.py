"""A loud refusal on every attention backend kvcompress does not adapt (every one but vLLM's ``CPU_ATTN``).

Only the CPU attention backend evicts blocks (``kvcompress.vllm.backend``). On any other backend (FlashAttention,
FlashInfer, Triton, FlexAttention, the MLA backends, CPU ones included) a configured policy would do nothing, so
the plugin registers, through vLLM's ``register_backend``, each of those backends in its own name at this module's
path: resolving one with a kvcompress policy in the engine's configuration (``additional_config["kvcompress"]``
or ``$KVCOMPRESS_VLLM``) raises a one-line ``ValueError`` naming the backend, before its module is imported, as
vLLM selects the attention backend while building the model (before the weights load). Without a policy the
backend resolves to a subclass of vLLM's own class that changes nothing but this check in ``get_impl_cls`` (so
an engine whose backend selection vLLM had cached from an engine without a policy is refused too, at the layer's
construction); its ``__name__`` and ``get_name()`` are vLLM's.

This holds for ``vllm.LLM(...)``, ``vllm serve`` and ``EngineArgs`` alike; ``kvcompress.vllm.LLM`` and
``python -m kvcompress.vllm.serve`` refuse a non-CPU platform even earlier, before the engine starts.
"""

from __future__ import annotations

import os

from vllm.config import get_current_vllm_config_or_none
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from kvcompress.vllm.config import (
    ADAPTED_BACKEND,
    ENV_VAR,
    BlockPolicyConfig,
    parse_policy,
    policy_from_vllm_config,
)

_wrapped: dict[str, type] = {}


def current_policy() -> BlockPolicyConfig:
    """The policy of the engine being configured (``$KVCOMPRESS_VLLM`` where no vLLM config is current)."""
    config = get_current_vllm_config_or_none()
    if config is None:
        return parse_policy(os.environ.get(ENV_VAR))
    return policy_from_vllm_config(config)


def check_backend(name: str) -> None:
    """Refuse the attention backend ``name`` (``AttentionBackendEnum`` name) if a policy is configured."""
    policy = current_policy()
    if policy.active:
        raise ValueError(
            f"kvcompress: the {policy.method} policy runs only on vLLM's {ADAPTED_BACKEND} attention backend; "
            f"this engine selected the {name} attention backend, which kvcompress does not adapt (its KV blocks "
            f"would never be evicted): run on CPU or remove the kvcompress policy"
        )


def _wrap(name: str, original: type) -> type:
    def get_impl_cls():
        check_backend(name)
        return original.get_impl_cls()

    return type(
        original.__name__,
        (original,),
        {"get_impl_cls": staticmethod(get_impl_cls), "__module__": __name__, "__qualname__": name},
    )


def __getattr__(name: str) -> type:
    """``kvcompress.vllm.refusal.FLASH_ATTN`` etc.: the path vLLM resolves for a backend registered here."""
    if name not in AttentionBackendEnum.__members__ or name == ADAPTED_BACKEND:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    check_backend(name)  # before importing vLLM's module, which may not import on this machine
    if name not in _wrapped:
        _wrapped[name] = _wrap(name, resolve_obj_by_qualname(AttentionBackendEnum[name].value))
    return _wrapped[name]


def register_refusals() -> None:
    """Register every attention backend but ``CPU_ATTN`` (and those another plugin overrides) at this module."""
    for member in AttentionBackendEnum:
        if member.name != ADAPTED_BACKEND and member.value and not member.is_overridden():
            register_backend(member, f"{__name__}.{member.name}")
