"""Real vLLM CPU engines for the plugin's tests: SmolLM2-135M in-process, greedy decoding, block traces.

Run as ``python tests/vllm/engine.py OUT.json SPEC.json`` it writes greedy outputs of vLLM *without* the plugin
(``VLLM_PLUGINS=""`` is set by the caller), the reference the equivalence tests compare against.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
from collections import defaultdict
from dataclasses import dataclass, field

SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV pool
    "VLLM_CPU_OMP_THREADS_BIND": "0",  # one thread: faster than two on the 2-core machine
    "OMP_NUM_THREADS": "1",
}
for _name, _value in {**SERVER_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():  # engine in this process,
    os.environ.setdefault(_name, _value)  # so the tests can read its scheduler

from vllm import LLM, SamplingParams  # noqa: E402

WORDS = (
    "river stone garden lamp window market letter winter yellow music doctor island silver forest engine "
    "morning paper orange captain bridge pocket summer travel copper thunder village basket"
).split()


def prompt(num_words: int, seed: int) -> str:
    """A deterministic English-like text of ``num_words`` words with numbered sentences."""
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < num_words:
        words = rng.sample(WORDS, 6)
        sentences.append(
            f"Note {len(sentences) + 1}: the {words[0]} near the {words[1]} kept a {words[2]} "
            f"and a {words[3]} for the {words[4]} {words[5]}."
        )
    return " ".join(sentences)


def make_llm(
    model: str, policy: dict | None = None, max_model_len: int = 1024, dtype: str = "float32", **kwargs
) -> LLM:
    """An in-process engine; ``policy`` is the kvcompress policy (``None``: the plugin stays inactive).

    float32 by default: without AVX-512/AMX, vLLM's bf16 prefill is about 6x slower than float32 here (bf16
    decodes about 1.3x faster, which only pays off for short prompts).
    """
    extra = {"additional_config": {"kvcompress": policy}} if policy else {}
    return LLM(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
        **extra,
        **kwargs,
    )


def close(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(llm: LLM, prompts: list, max_tokens: int) -> list[list[int]]:
    """Greedy token ids, the prompts submitted together (continuous batching)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def manager(llm: LLM):
    """The scheduler's KV cache manager of the (single) attention group."""
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers[0]


@dataclass
class BlockTrace:
    """What the scheduler's KV cache manager held while requests ran."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)  # of each generated token
    live_blocks: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # per step
    logical_blocks: dict[str, int] = field(default_factory=dict)  # block indices a request went through
    owners: dict[int, set] = field(default_factory=lambda: defaultdict(set))  # block id -> (request, index)
    preemptions: int = 0
    running: list[int] = field(default_factory=list)  # requests running after each step

    @property
    def reused_blocks(self) -> int:
        """Block ids that held KV of more than one (request, logical block)."""
        return sum(len(owners) > 1 for owners in self.owners.values())


def trace_blocks(llm: LLM, prompts: list[str], max_tokens: int) -> BlockTrace:
    """Run ``prompts`` step by step, recording each request's live blocks after every engine step."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    group = manager(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for i, text in enumerate(prompts):
        engine.add_request(str(i), text, params)
    trace = BlockTrace()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                completion = out.outputs[0]
                trace.outputs[out.request_id] = list(completion.token_ids)
                trace.logprobs[out.request_id] = [
                    step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
                ]
        for internal_id, blocks in group.req_to_blocks.items():
            request_id = internal_id.rsplit("-", 1)[0]  # vLLM appends a random suffix to the caller's id
            trace.live_blocks[request_id].append(sum(not b.is_null for b in blocks))
            trace.logical_blocks[request_id] = len(blocks)
            for index, block in enumerate(blocks):
                if not block.is_null:
                    trace.owners[block.block_id].add((request_id, index))
        trace.running.append(len(scheduler.running))
        trace.preemptions = max([trace.preemptions, *(r.num_preemptions for r in scheduler.requests.values())])
    return trace


def _write_reference(out_path: str, spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    llm = make_llm(spec["model"], max_model_len=spec["max_model_len"])
    results = [greedy(llm, prompts, spec["max_tokens"]) for prompts in spec["batches"]]
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    _write_reference(sys.argv[1], sys.argv[2])
