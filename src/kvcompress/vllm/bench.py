"""Fixed-pool serving benchmark: how many long requests run at once, and how fast, per policy.

    python -m kvcompress.vllm.bench --model DIR [--pool-blocks 48] [--requests 12] [--prompt-tokens 1000] ...

Every policy gets the same KV pool (``--pool-blocks`` blocks of 128 tokens, set with vLLM's
``num_gpu_blocks_override``) and the same requests, all submitted at once: long prompts of unrelated text,
``--new-tokens`` greedy tokens each (``ignore_eos``). The engine runs in this process so that its scheduler can
be read after every step. Printed per policy, as a markdown table:

* peak and mean number of running requests (what the pool admits at once), and vLLM's preemptions;
* requests/s and generated tokens/s over the whole run (first submission to last completion), with the run's
  wall and CPU seconds (the CPU time of this process, all threads);
* the peak number of KV blocks in use, in all and per request (the most any one request held after a step).

``--max-num-batched-tokens`` caps the tokens of a step (vLLM's option): below the prompt length, prompts are
prefilled in chunks and a policy that evicts during prefill holds its budget plus one chunk per request.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcompress.vllm.config import check_policies, exit_on_user_error

if TYPE_CHECKING:
    from vllm import LLM

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: its scheduler is read
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB reserved (not a share of RAM); cut to --pool-blocks

DEFAULT_POLICIES = (
    '{"method": "full"}',
    '{"method": "streaming", "budget": 384}',
    '{"method": "snapkv", "budget": 384}',
)
VOCABULARY = (
    "the a of and to in is was for on that with as by at from it his her they which this be are had not "
    "city river market winter letter doctor garden music island engine morning paper captain bridge summer "
    "village copper thunder basket silver forest window stone yellow orange travel pocket lamp harbor"
).split()


@dataclass
class RunStats:
    policy: str
    seconds: float
    cpu_seconds: float
    requests: int
    new_tokens: int
    peak_running: int
    mean_running: float
    preemptions: int
    peak_blocks: int
    peak_request_blocks: int

    def row(self) -> str:
        return (
            f"| {self.policy} | {self.peak_running} | {self.mean_running:.1f} | {self.preemptions} | "
            f"{self.peak_blocks} | {self.peak_request_blocks} | {self.requests / self.seconds:.3f} | "
            f"{self.new_tokens / self.seconds:.1f} | {self.seconds:.0f} | {self.cpu_seconds:.0f} |"
        )


HEADER = (
    "| policy | peak running | mean running | preemptions | peak KV blocks | peak blocks / request | requests/s "
    "| tokens/s | wall s | CPU s |\n|---|---|---|---|---|---|---|---|---|---|"
)


def make_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    """``count`` different texts of ``words`` random words each (deterministic)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(VOCABULARY, k=words)) for _ in range(count)]


def run_policy(model: str, policy: str, prompts: list[str], args: argparse.Namespace) -> RunStats:
    """Serve ``prompts`` with ``policy`` (JSON) on a pool of ``args.pool_blocks`` blocks, stepping the engine."""
    from vllm import LLM, SamplingParams  # imported once the policies are checked (vLLM's import prints)

    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        enforce_eager=True,
        num_gpu_blocks_override=args.pool_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        additional_config={"kvcompress": json.loads(policy)},
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    group = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    running, preemptions, peak_blocks, peak_request, done = [], {}, 0, 0, 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, text in enumerate(prompts):
        engine.add_request(str(i), text, params)
    while engine.has_unfinished_requests():
        done += sum(out.finished for out in engine.step())
        running.append(len(scheduler.running))
        preemptions.update({rid: request.num_preemptions for rid, request in scheduler.requests.items()})
        peak_blocks = max(peak_blocks, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        held = [sum(not block.is_null for block in blocks) for blocks in group.req_to_blocks.values()]
        peak_request = max([peak_request, *held])
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    close_engine(llm)
    return RunStats(
        policy_label(policy),
        seconds,
        cpu_seconds,
        done,
        done * args.new_tokens,
        max(running),
        sum(running) / len(running),
        sum(preemptions.values()),
        peak_blocks,
        peak_request,
    )


def close_engine(llm: LLM) -> None:
    """Shut the in-process engine down and release its KV pool before the next policy's engine starts."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def policy_label(policy: str) -> str:
    """``"streaming 384"`` for ``'{"method": "streaming", "budget": 384}'``, other parameters as ``name=value``."""
    data = json.loads(policy)
    words = [str(data.pop(key)) for key in ("method", "budget") if key in data]
    return " ".join(words + [f"{key}={value}" for key, value in data.items()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder or id vLLM can load")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), help="policies as JSON objects")
    parser.add_argument("--pool-blocks", type=int, default=48, help="KV pool size in blocks (the same for all)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-words", type=int, default=900, help="words per prompt (about 1.1 tokens each)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's cap on tokens per step")
    parser.add_argument("--dtype", default="float32", help="float32: bf16 prefill is slow without AVX-512")
    args = parser.parse_args(argv)
    exit_on_user_error("kvcompress.vllm.bench", check_policies, args.policies)
    prompts = make_prompts(args.requests, args.prompt_words)
    print(HEADER)
    for policy in args.policies:
        print(run_policy(args.model, policy, prompts, args).row(), flush=True)


if __name__ == "__main__":
    main()
