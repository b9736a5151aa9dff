"""Passkey retrieval (Mohtashami & Jaggi, 2023, "Landmark Attention"): a random 5-digit key hidden in filler.

The prompt is the classic one: an instruction, the repeated filler "The grass is green. The sky is blue. ...",
and at a chosen depth the needle "The pass key is 12345. Remember it. 12345 is the pass key." The question "What
is the pass key?" follows the text, and the assistant turn starts with "The pass key is", so the key is the
first thing generated. Scores: ``accuracy``, exact match of the first number generated with the key (chance ~0),
and ``answer_nll``, the mean negative log-likelihood (nats per token) of the key's tokens teacher-forced after
the compressed prompt, through a copy of the prefilled cache (``QATask.answer_and_nll``): a graded score, lower
is better, that separates methods whose exact answers are all wrong. ``nll=False`` skips it.

``length`` is the prompt length in tokens (the filler is sized to reach it); ``depth`` the fraction of the
filler before the needle (``None``: sample ``i`` uses the ``i``-th van der Corput point 0, 1/2, 1/4, 3/4, ...,
which covers the context evenly and keeps the first samples when more are asked for). Prompts are prefilled in
chunks of ``chunk_size`` with the question inside them (query-aware, see ``prompting``); ``modes`` can add the
query-agnostic setting.
"""

from __future__ import annotations

import random
import re

from kvcompress.eval.tasks.base import Result, Sample, check_fraction, check_positive_int, van_der_corput
from kvcompress.eval.tasks.prompting import count_tokens, encode, split_prompt
from kvcompress.eval.tasks.qa import QATask

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


class PasskeyTask(QATask):
    name = "passkey"
    metrics = ("accuracy", "answer_nll")
    plot_metrics = ("accuracy", "answer_nll")
    description = "5-digit passkey in repeated filler; exact match and the key's teacher-forced NLL"
    defaults = {
        "length": 1024,
        "depth": None,
        "chunk_size": 64,
        "max_new_tokens": 8,
        "modes": ("aware",),
        "nll": True,
    }

    def validate(self) -> None:
        super().validate()
        check_positive_int(self.params["length"], "length", 64)
        if self.params["depth"] is not None:
            check_fraction(self.params["depth"], "depth")
        if not isinstance(self.params["nll"], bool):
            raise ValueError(f"nll must be true or false, got {self.params['nll']!r}")

    def build_prompt(self, key: str, depth: float) -> tuple[str, float]:
        """The context text with the needle at ``depth`` (filler repetitions before / all); the actual depth."""
        tokenizer = self.tokenizer
        needle = NEEDLE.format(key=key)
        fixed = count_tokens(tokenizer, INTRO + " " + needle) + count_tokens(tokenizer, QUESTION + ANSWER_PREFIX)
        fixed += 40  # chat template header and turn markers
        per_filler = count_tokens(tokenizer, " " + FILLER)
        repeats = max(1, (self.params["length"] - fixed) // per_filler)
        before = round(depth * repeats)
        parts = [INTRO] + [FILLER] * before + [needle] + [FILLER] * (repeats - before)
        return " ".join(parts), before / repeats

    def build_sample(self, index: int, rng: random.Random) -> Sample:
        """Sample ``index``: a random key at ``depth`` (the ``index``-th van der Corput point if unset)."""
        depth = self.params["depth"]
        if depth is None:
            depth = van_der_corput(index)
        key = str(rng.randint(10000, 99999))
        context, actual = self.build_prompt(key, depth)
        context_ids, question_ids = split_prompt(self.tokenizer, context, QUESTION, ANSWER_PREFIX)
        return Sample(
            id=f"passkey-{index:03d}",
            inputs={
                "context_ids": context_ids,
                "question_ids": question_ids,
                "answer_ids": encode(self.tokenizer, " " + key),
                "key": key,
            },
            info={
                "depth": round(actual, 4),
                "prompt_tokens": context_ids.shape[1] + question_ids.shape[1],
                "answer": key,
            },
        )

    def evaluate(self, sample, config, cache, mode):
        if self.params["nll"]:
            text, nll = self.answer_and_nll(sample, cache, mode)
        else:
            text, nll = self.generate(sample, cache, mode), None
        scores = {"accuracy": float(first_number(text) == sample.inputs["key"])}
        if nll is not None:
            scores["answer_nll"] = nll
        return Result(scores=scores, extra={"prediction": text})
