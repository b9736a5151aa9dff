"""What the question-answering tasks (passkey, niah, docqa, summary) share: their modes, the checks of the
parameters they have in common, answering a sample's question through a cache (``prompting.answer``) and the
teacher-forced NLL of a known answer from the same prefill (``answer_and_nll``)."""

from __future__ import annotations

import copy
import time

from kvcompress.core.cache import CompressedCache
from kvcompress.eval.tasks.base import Sample, Task, check_positive_int
from kvcompress.eval.tasks.prompting import MODES, continuation_nll, decode_answer, prefill_prompt
from kvcompress.generation import prefill


class QATask(Task):
    """A task whose samples hold ``context_ids`` and ``question_ids`` answered by greedy decoding.

    ``defaults`` must hold ``modes`` (drawn from ``prompting.MODES``) and ``chunk_size``, and ``max_new_tokens``
    unless every evaluation passes its own. Subclasses extend ``validate`` with ``super().validate()``.

    ``fill`` is how a prompt gets into a cache (``kvcompress.generation.prefill``); an experiment may set another
    function with the same signature on a task instance (e.g. one that replays a captured prefill).
    """

    fill = staticmethod(prefill)

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.params["modes"])

    def validate(self) -> None:
        if self.params["chunk_size"] is not None:  # None: the prompt in one forward
            check_positive_int(self.params["chunk_size"], "chunk_size")
        if self.params.get("max_new_tokens") is not None:  # None: each sample's own length (the dataset task)
            check_positive_int(self.params["max_new_tokens"], "max_new_tokens")
        for mode in self.params["modes"]:
            if mode not in MODES:
                raise ValueError(f"modes must be drawn from {', '.join(MODES)}; got {mode!r}")

    def generate(
        self,
        sample: Sample,
        cache: CompressedCache,
        mode: str,
        max_new_tokens: int | None = None,
        stop_when_found: list[str] | None = None,
    ) -> str:
        """The answer to ``sample`` through ``cache`` in ``mode``; ``max_new_tokens`` defaults to the task's.
        ``prompting.answer`` in its two halves, each timed into ``timings`` (``prefill_s``: the prefill and the
        compression; ``decode_s`` and ``new_tokens``: the question and the answer)."""
        prompt = self._prefill(sample, cache, mode)
        limit = self.params["max_new_tokens"] if max_new_tokens is None else max_new_tokens
        start = time.perf_counter()
        text = decode_answer(self.model, self.tokenizer, prompt, cache, limit, stop_when_found)
        self.timings["decode_s"] = time.perf_counter() - start
        # generate never feeds its last token to the cache
        self.timings["new_tokens"] = cache.get_seq_length() - prompt.shape[1] + 1
        return text

    def score_text(self, sample: Sample, text: str) -> dict[str, float]:
        """The scores of an answer given as text (another library's answer on the same ids); tasks whose metric
        reads only the answer text define it."""
        raise NotImplementedError(f"task {self.name!r} does not score answer text")

    def _prefill(self, sample: Sample, cache: CompressedCache, mode: str):
        inputs, start = sample.inputs, time.perf_counter()
        prompt = prefill_prompt(
            self.model, inputs["context_ids"], inputs["question_ids"], cache, mode, self.params["chunk_size"], self.fill
        )
        self.timings["prefill_s"] = time.perf_counter() - start
        return prompt

    def compressed_tokens(self, sample: Sample, mode: str | None) -> int:
        """The context (``agnostic``) or the prompt but its last token (``aware``): what ``prefill_prompt`` fills."""
        context = sample.inputs["context_ids"].shape[1]
        return context if mode == "agnostic" else context + sample.inputs["question_ids"].shape[1] - 1

    def answer_and_nll(self, sample: Sample, cache: CompressedCache, mode: str) -> tuple[str, float]:
        """``generate``'s answer and the mean NLL per token of ``sample.inputs["answer_ids"]`` from one prefill.

        The prompt is prefilled into ``cache`` once; a copy of the prefilled cache (``copy.deepcopy``: the same
        compressed state) scores the answer teacher-forced (``prompting.continuation_nll``) while ``cache``
        decodes, so the NLL costs one forward instead of a second prefill, and equals ``prompting.answer_nll``
        on a fresh cache of the same configuration.
        """
        inputs = sample.inputs
        prompt = self._prefill(sample, cache, mode)
        nll = continuation_nll(self.model, prompt, inputs["answer_ids"], copy.deepcopy(cache))
        text = decode_answer(self.model, self.tokenizer, prompt, cache, self.params["max_new_tokens"])
        return text, nll
