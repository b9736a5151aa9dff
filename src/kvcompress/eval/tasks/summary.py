"""Summary fidelity: ROUGE of each method's summary of a passage against the full-cache summary of it.

No reference summaries exist offline, so the reference is what the model writes with its full cache: the score
measures how much compression changes the output, not summary quality (the full cache scores 1 by definition).
Sample ``i`` is a passage of about ``length`` tokens of consecutive sentences from essay ``i mod (number of
essays)``, at a seeded offset. The prompt asks for a three-sentence summary; ``max_new_tokens`` tokens are
decoded greedily. Scores: ROUGE-1, ROUGE-2 and ROUGE-L F-measures from ``rouge-score`` (Porter stemming).
The full-cache summary is generated once per sample and mode and shared by every configuration.
"""

from __future__ import annotations

import random
from functools import cached_property

from kvcompress.eval.configs import EvalConfig
from kvcompress.eval.data import Document, prose
from kvcompress.eval.tasks.base import Result, Sample, check_positive_int
from kvcompress.eval.tasks.prompting import sentences, split_prompt, take_sentences
from kvcompress.eval.tasks.qa import QATask

QUESTION = "Summarize the text above in three sentences."
ANSWER_PREFIX = ""
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measures of ``prediction`` against ``reference`` (``rouge-score``, stemmed).

    Identical texts score 1 on every measure, also when too short for bigrams (where ROUGE itself gives 0).
    """
    from rouge_score import rouge_scorer

    if prediction.strip() == reference.strip():
        return dict.fromkeys(ROUGE_TYPES, 1.0)
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    scores = scorer.score(reference, prediction)
    return {name: scores[name].fmeasure for name in ROUGE_TYPES}


class SummaryTask(QATask):
    name = "summary"
    metrics = ROUGE_TYPES
    description = "ROUGE of each summary against the full-cache summary"
    defaults = {
        "length": 1024,
        "chunk_size": 64,
        "max_new_tokens": 64,
        "modes": ("aware",),
        "corpus": None,
        "data": None,
    }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._references: dict[tuple[str, str | None], str] = {}

    def validate(self) -> None:
        super().validate()
        check_positive_int(self.params["length"], "length", 32)

    @cached_property
    def _essays(self) -> list[Document]:
        """The texts the passages are taken from (loaded once)."""
        return prose(self.params["corpus"], self.params["data"])

    def build_sample(self, index: int, rng: random.Random) -> Sample:
        """Sample ``index``: a passage from essay ``index mod (number of essays)`` at a random sentence."""
        doc = self._essays[index % len(self._essays)]
        pieces = sentences(doc.text)
        passage = take_sentences(self.tokenizer, pieces, self.params["length"] - 60, rng.randrange(len(pieces)))
        context_ids, question_ids = split_prompt(self.tokenizer, " ".join(passage), QUESTION, ANSWER_PREFIX)
        return Sample(
            id=f"summary-{index:03d}",
            inputs={"context_ids": context_ids, "question_ids": question_ids},
            info={"essay": doc.name, "prompt_tokens": context_ids.shape[1] + question_ids.shape[1]},
        )

    def reference(self, sample: Sample, mode: str | None) -> str:
        """The full-cache summary of ``sample`` (generated once, then shared by every configuration)."""
        key = (sample.id, mode)
        if key not in self._references:
            self._references[key] = self.generate(sample, self.new_cache(EvalConfig("full")), mode)
        return self._references[key]

    def evaluate(self, sample, config, cache, mode):
        text = self.generate(sample, cache, mode)
        if config.method == "full" and not config.params and (sample.id, mode) not in self._references:
            self._references[(sample.id, mode)] = text
        reference = self.reference(sample, mode)
        return Result(scores=rouge_scores(text, reference), extra={"prediction": text})
