"""LooGLE (Li et al., 2023, arXiv:2311.04939) files as bigai-nlco/LooGLE distributes them (``<task>.jsonl``, e.g.
``shortdep_qa.jsonl``): ``input`` (the document), ``title``, ``qa_pairs``, ``output``.

``qa_pairs`` is a string holding a list of ``{"Q": ..., "A": ..., "S": [...]}`` written as a Python literal
(LooGLE reads it with ``eval``); here it is read with ``json.loads`` or, failing that, ``ast.literal_eval``, which
accepts literals only and runs no code. Each pair is one sample (``shortdep_qa``, ``longdep_qa``,
``shortdep_cloze``); ``longdep_summarization`` rows are one sample each, the reference being ``output``.

Prompts: LooGLE's ``config/task2prompt.json``, cut after the document: the instruction and the document form the
context; ``Question: {Q}`` the question; ``Answer:`` (``Summarization:``) starts the assistant turn, as kvpress
does. Generation lengths: ``config/task2maxlen.json``.

Scores (``Evaluation/automatic_metrics.py``): QA and summaries, ROUGE-1/2/L recall (LooGLE's default ``"r"``;
``rouge-score`` rather than the ``rouge`` package) with ROUGE-L recall as ``score``, and BLEU-1 / BLEU-4
(``nltk``'s ``sentence_bleu`` on white-space tokens, as LooGLE); METEOR and BERTScore are not computed (they need
WordNet and a BERT model). Cloze: ``score`` is the fraction of masks answered exactly, ``partial`` the fraction
sharing a word (LooGLE pools the counts over the file; here each sample gets its fraction).
"""

from __future__ import annotations

import ast
import json
import warnings
from collections.abc import Iterator
from typing import Any

from kvcompress.eval.tasks.published import Item, Row
from kvcompress.eval.tasks.published.metrics import rouge

TASKS = ("shortdep_qa", "longdep_qa", "shortdep_cloze", "longdep_summarization")
_CLOZE = (
    "Please fill in the clozes based on the given long texts below. Each of the placeholder '<mask-n>' in the "
    "question could be an entity of Person, Location or Organiocation. The same masks represent the same entity. "
    "Output a json format answer, for example: {'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion Magazine','<mask-2>': "
    "'Bethel Horizon'}\n"
)
# task -> (text before the document, question template, answer cue): task2prompt.json cut after {input}.
TEMPLATES = {
    "shortdep_qa": ("Please answer the question based on the long texts below. \n", "Question: {Q}", "Answer:"),
    "longdep_qa": ("Please answer the question based on the long texts below. \n", "Question: {Q}", "Answer:"),
    "shortdep_cloze": (_CLOZE, "Question: {Q} What are the masked entities?", "Answer:"),
    "longdep_summarization": ("Please generate a summary of the below paper. \n", "", "Summarization:"),
}
MAX_NEW_TOKENS = {"shortdep_qa": 300, "longdep_qa": 500, "longdep_summarization": 500, "shortdep_cloze": 50}


def parse_literal(text: str) -> Any:
    """A JSON or Python literal (no code runs); ``ValueError`` if it is neither."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        raise ValueError("not a JSON or Python literal") from None


def bleu(prediction: str, reference: str, order: int) -> float:
    """LooGLE's BLEU-``order`` (weight 1 on that n-gram order only) with ``nltk``, white-space tokens."""
    from nltk.translate.bleu_score import sentence_bleu

    weights = tuple(1.0 if n == order else 0.0 for n in range(1, 5))
    with warnings.catch_warnings():  # nltk warns when an n-gram order has no match (the score is then ~0)
        warnings.simplefilter("ignore")
        return float(
            sentence_bleu([reference.replace("\n", " ").split()], prediction.replace("\n", " ").split(), weights)
        )


def text_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-L recall (``score``), ROUGE-1/2 recall, BLEU-1/4, as LooGLE's automatic metrics."""
    prediction = prediction or "None"  # LooGLE scores an empty output as "None"
    scores = {kind: rouge(prediction, reference, kind, "recall") for kind in ("rougeL", "rouge1", "rouge2")}
    return {
        "score": scores.pop("rougeL"),
        **scores,
        "bleu1": bleu(prediction, reference, 1),
        "bleu4": bleu(prediction, reference, 4),
    }


def cloze_scores(prediction: str, reference: dict[str, str]) -> dict[str, float]:
    """Fractions of the masks answered exactly (``score``) and sharing a word (``partial``)."""
    try:
        guess = parse_literal(prediction.strip())
    except ValueError:
        guess = None
    if not isinstance(guess, dict):
        return {"score": 0.0, "partial": 0.0}
    exact = sum(guess.get(key) == value for key, value in reference.items())
    partial = sum(
        key in guess and bool(set(str(value).split()) & set(str(guess[key]).split()))
        for key, value in reference.items()
    )
    return {"score": exact / len(reference), "partial": partial / len(reference)}


def _pairs(row: Row, task: str) -> list[dict[str, Any]]:
    raw = row.field("qa_pairs")
    if raw == "none":
        return []
    try:
        pairs = parse_literal(raw) if isinstance(raw, str) else raw
    except ValueError:
        raise row.error("field 'qa_pairs' is not a JSON or Python literal list") from None
    if not isinstance(pairs, list) or not all(isinstance(p, dict) and "Q" in p and "A" in p for p in pairs):
        raise row.error("field 'qa_pairs' must be a list of objects with 'Q' and 'A'")
    for pair in pairs:
        want = dict if task == "shortdep_cloze" else str
        if not isinstance(pair["Q"], str) or not isinstance(pair["A"], want) or not pair["A"]:
            raise row.error(f"a qa_pairs entry of {task} needs a string 'Q' and a non-empty {want.__name__} 'A'")
    return pairs


def loogle_items(rows: Iterator[Row], task: str) -> Iterator[Item]:
    before, question_template, cue = TEMPLATES[task]
    count = 0
    for row in rows:
        context = before + row.text("input")
        if task == "longdep_summarization":
            questions = [("", row.text("output"))]
        else:
            questions = [(question_template.replace("{Q}", p["Q"]), p["A"]) for p in _pairs(row, task)]
        for question, answer in questions:
            score = cloze_scores if task == "shortdep_cloze" else text_scores
            yield Item(
                id=f"{task}-{count:05d}",
                subset=task,
                context=context,
                question=question,
                answer_prefix=cue,
                answers=answer,
                max_new_tokens=MAX_NEW_TOKENS[task],
                scorer=lambda pred, a=answer, s=score: s(pred, a),
                source_id=row.data.get("title"),
            )
            count += 1
