"""Lost-in-the-middle multi-document QA (Liu et al., 2023, arXiv:2307.03172) with synthetic facts.

Each prompt holds ``documents`` short documents in LITM's format ("Document [i](Title: ...) text"): excerpts of
real prose (``data.prose``: the shipped books, or the Paul Graham essays of a data folder), each carrying one
synthetic fact "The code word of the {team} team is {word}." about a different team. The question asks for one team's
code word; the document holding it sits at a chosen position
(``position``, 0-based; ``None``: sample ``i`` uses position ``i mod documents``, so positions are covered
evenly). No offline QA set exists, hence synthetic facts in real text; the other nine documents are
distractors of the same form, as LITM's retrieved-but-wrong passages are.

Score: LITM's ``best_subspan_em``: 1 if the normalised answer (lower case, no punctuation, articles or extra
spaces) is a substring of the normalised prediction. Chance is about 1 / ``documents`` for a model that picks a
code word from the prompt at random.
"""

from __future__ import annotations

import random
import re
import string
from functools import cached_property

from kvcompress.eval.data import Document, prose
from kvcompress.eval.tasks.base import Result, Sample, check_positive_int
from kvcompress.eval.tasks.prompting import sentences, split_prompt, take_sentences
from kvcompress.eval.tasks.qa import QATask

TEAMS = (
    "red blue green yellow orange purple silver golden black white north south east west river mountain "
    "forest desert harbor valley"
).split()
WORDS = (
    "apricot bramble cobalt dynamo ember falcon garnet hickory indigo juniper kestrel lantern marble nutmeg "
    "obsidian pepper quartz raven saffron thistle umber velvet willow xenon yarrow zephyr"
).split()
INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
FACT = "The code word of the {team} team is {word}."
QUESTION = "Question: What is the code word of the {team} team?"
ANSWER_PREFIX = "Answer: The code word of the {team} team is"


def normalize_answer(text: str) -> str:
    """SQuAD / LITM normalisation: lower case, drop punctuation and articles, collapse white space."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def best_subspan_em(prediction: str, answers: list[str]) -> float:
    """1.0 if any normalised answer is a substring of the normalised prediction (LITM's metric)."""
    normalized = normalize_answer(prediction)
    return float(any(normalize_answer(a) in normalized for a in answers))


class DocQATask(QATask):
    name = "docqa"
    metrics = ("accuracy",)
    description = "10 documents, one holds the answer at a chosen position; exact match"
    defaults = {
        "documents": 10,
        "doc_tokens": 90,  # essay tokens per document (about 1K tokens of prompt for 10 documents)
        "position": None,
        "chunk_size": 64,
        "max_new_tokens": 8,
        "modes": ("aware",),
        "corpus": None,
        "data": None,
    }

    def validate(self) -> None:
        super().validate()
        check_positive_int(self.params["documents"], "documents", 2)
        if self.params["documents"] > len(TEAMS):
            raise ValueError(f"documents must be at most {len(TEAMS)}, got {self.params['documents']}")
        check_positive_int(self.params["doc_tokens"], "doc_tokens", 8)
        position = self.params["position"]
        if position is not None:
            check_positive_int(position, "position", 0)
            if position >= self.params["documents"]:
                raise ValueError(f"position must be in [0, documents - 1], got {position}")

    @cached_property
    def _documents(self) -> list[Document]:
        """The texts the documents are cut from (loaded once)."""
        return prose(self.params["corpus"], self.params["data"])

    def _document(self, number: int, doc: Document, fact: str, rng: random.Random) -> str:
        """Document ``[number]``: about ``doc_tokens`` tokens of ``doc`` from a random sentence, ``fact`` inside."""
        pieces = sentences(doc.text)
        excerpt = take_sentences(self.tokenizer, pieces, self.params["doc_tokens"], rng.randrange(len(pieces)))
        excerpt.insert(rng.randint(0, len(excerpt)), fact)
        title = doc.name.replace("_", " ").title()
        return f"Document [{number}](Title: {title}) {' '.join(excerpt)}"

    def build_sample(self, index: int, rng: random.Random) -> Sample:
        """Sample ``index``: the answer's document at ``position`` (``index mod documents`` if unset)."""
        n, docs = self.params["documents"], self._documents
        position = self.params["position"]
        if position is None:
            position = index % n
        teams, words = rng.sample(TEAMS, n), rng.sample(WORDS, n)
        chosen = rng.sample(docs, n) if len(docs) >= n else rng.choices(docs, k=n)
        blocks = [
            self._document(j + 1, doc, FACT.format(team=team, word=word), rng)
            for j, (doc, team, word) in enumerate(zip(chosen, teams, words, strict=True))
        ]
        target = teams[position]
        context = INSTRUCTION + "\n\n" + "\n".join(blocks)
        context_ids, question_ids = split_prompt(
            self.tokenizer, context, QUESTION.format(team=target), ANSWER_PREFIX.format(team=target)
        )
        return Sample(
            id=f"docqa-{index:03d}",
            inputs={"context_ids": context_ids, "question_ids": question_ids, "answer": words[position]},
            info={
                "position": position,
                "answer": words[position],
                "prompt_tokens": context_ids.shape[1] + question_ids.shape[1],
            },
        )

    def evaluate(self, sample, config, cache, mode):
        text = self.generate(sample, cache, mode)
        return Result(scores={"accuracy": best_subspan_em(text, [sample.inputs["answer"]])}, extra={"prediction": text})
