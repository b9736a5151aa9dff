"""Needle accuracy through vLLM: the evaluation suite's ``niah`` samples, answered by vLLM under each policy.

    python -m kvcompress.vllm.needles --model DIR --data DATA [--samples 10] [--policies JSON ...]

The samples are exactly those of ``kvcompress eval niah --param modes=aware`` (same seed, length and subtasks;
``DATA`` is the folder holding ``paul_graham_essays/``): the context and the question form one prompt, so
SnapKV's observation window is the question. Each answer is vLLM's greedy continuation of the prompt's token
ids, scored with RULER's ``string_match_all`` as in the transformers path. Prints one markdown row per policy.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoTokenizer

from kvcompress.eval.tasks.niah import NiahTask, string_match_all
from kvcompress.vllm.bench import DEFAULT_POLICIES, close_engine, policy_label
from kvcompress.vllm.config import check_policies, exit_on_user_error

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def niah_samples(model: str, data: str, count: int, length: int):
    tokenizer = AutoTokenizer.from_pretrained(model)
    return NiahTask(None, tokenizer, seed=0, length=length, modes=("aware",), data=data).build_samples(count)


def _prompt(sample):
    from vllm.inputs import TokensPrompt

    ids = torch.cat([sample.inputs["context_ids"], sample.inputs["question_ids"]], dim=1)[0]
    return TokensPrompt(prompt_token_ids=ids.tolist())


def score_policy(model: str, policy: str, samples, max_model_len: int) -> float:
    """Mean ``string_match_all`` of vLLM's greedy answers to ``samples`` under ``policy`` (JSON)."""
    from vllm import LLM, SamplingParams  # imported once the policies are checked (vLLM's import prints)

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        enforce_eager=True,
        additional_config={"kvcompress": json.loads(policy)},
    )
    prompts = [_prompt(sample) for sample in samples]
    params = [SamplingParams(temperature=0, max_tokens=s.inputs["max_new_tokens"]) for s in samples]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    close_engine(llm)
    answers = [out.outputs[0].text for out in outputs]
    scores = [string_match_all(text, s.inputs["answers"]) for text, s in zip(answers, samples, strict=True)]
    return sum(scores) / len(scores)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder vLLM and transformers can load")
    parser.add_argument("--data", required=True, help="data folder holding paul_graham_essays/")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), help="policies as JSON objects")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--length", type=int, default=1024, help="context tokens per sample (niah's length)")
    args = parser.parse_args(argv)
    exit_on_user_error("kvcompress.vllm.needles", check_policies, args.policies)
    samples = niah_samples(args.model, args.data, args.samples, args.length)
    print("| policy (vLLM) | niah score |\n|---|---|")
    for policy in args.policies:
        print(
            f"| {policy_label(policy)} | {score_policy(args.model, policy, samples, 2 * args.length):.3f} |", flush=True
        )


if __name__ == "__main__":
    main()
