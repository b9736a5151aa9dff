"""Scores shared by the published benchmarks: LongBench's per-dataset metrics (``metrics.py`` of THUDM/LongBench)
and the token F1 and ROUGE that InfiniteBench and LooGLE use too.

Each function scores one prediction against one reference, as the benchmark's own code does; the benchmark
takes the best over its references (``best_of``). Where the published code relies on a library this package
does not ship, the nearest well-kept one is used and the difference is stated:

- ROUGE: ``rouge-score`` (Google's reimplementation of ROUGE-1.5.5: lower case, tokens of letters and digits,
  no stemming here), not the ``rouge`` package LongBench and LooGLE call; values can differ a little.
- ``code_sim_score``: LongBench calls ``fuzzywuzzy.fuzz.ratio``; without python-Levenshtein that is
  ``round(100 * difflib.SequenceMatcher(None, a, b).ratio()) / 100``, which is what is computed here.
- Chinese word segmentation (``jieba``, for ``multifieldqa_zh``, ``dureader``, ``vcsum``) is not available, so
  those LongBench subsets are not scored (``LONGBENCH_METRICS`` leaves them out).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache

from kvcompress.eval.tasks.docqa import normalize_answer


def token_f1(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """F1 of the common tokens (multiset intersection) of two token lists; 0 when nothing is shared."""
    common = sum((Counter(prediction) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str) -> float:
    """SQuAD-style F1 of the normalised words (lower case, no punctuation or articles)."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


_CHINESE_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."  # noqa: E501, RUF001


def normalize_zh_answer(text: str) -> str:
    """Lower case, no ASCII or Chinese punctuation, no white space (LongBench / InfiniteBench)."""
    drop = set(string.punctuation + _CHINESE_PUNCTUATION)
    return "".join(ch for ch in text.lower() if ch not in drop and not ch.isspace())


@lru_cache(maxsize=4)
def _rouge(kind: str):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind], use_stemmer=False)


def rouge(prediction: str, reference: str, kind: str = "rougeL", measure: str = "fmeasure") -> float:
    """One ROUGE measure (``fmeasure``, ``recall`` or ``precision``) of ``prediction`` against ``reference``."""
    return getattr(_rouge(kind).score(reference, prediction)[kind], measure)


def rouge_score(prediction: str, reference: str) -> float:
    """LongBench's ``rouge_score``: the ROUGE-L F-measure."""
    return rouge(prediction, reference, "rougeL", "fmeasure")


def classification_score(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    """LongBench's ``classification_score``: 1 / (number of class names found) if the reference is among them.

    Class names contained in the reference (and not equal to it) are dropped as LongBench's loop drops them: it
    removes from the list it iterates over, so the name after each removed one is not examined.
    """
    matches = [name for name in all_classes if name in prediction]
    index = 0
    while index < len(matches):
        name = matches[index]
        if name in reference and name != reference:
            del matches[index]
        index += 1
    return 1.0 / len(matches) if reference in matches else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    """The fraction of the numbers in ``prediction`` equal to ``target`` (0 when it has none)."""
    numbers = re.findall(r"\d+", prediction)
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, reference: str, pattern: str = r"Paragraph (\d+)") -> float:
    """LongBench's ``retrieval_score``: the fraction of the numbers predicted that are the paragraph's number."""
    found = re.findall(pattern, reference)
    if not found:
        raise ValueError(f"reference {reference!r} names no paragraph (expected {pattern!r})")
    return _fraction_equal(prediction, found[0])


def retrieval_zh_score(prediction: str, reference: str) -> float:
    return retrieval_score(prediction, reference, r"段落(\d+)")


def count_score(prediction: str, reference: str) -> float:
    """LongBench's ``count_score``: the fraction of the numbers predicted equal to the count."""
    return _fraction_equal(prediction, str(reference))


def code_sim_score(prediction: str, reference: str) -> float:
    """LongBench's ``code_sim_score``: similarity of the first predicted line that is not a comment or a fence."""
    line = next(
        (
            text
            for text in prediction.lstrip("\n").split("\n")
            if "`" not in text and "#" not in text and "//" not in text
        ),
        "",
    )
    return round(100 * difflib.SequenceMatcher(None, line, reference).ratio()) / 100


# LongBench dataset -> metric (its eval.py); the Chinese subsets needing jieba are left out.
LONGBENCH_METRICS: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
FIRST_LINE_ONLY = ("trec", "triviaqa", "samsum", "lsht")  # LongBench scores only the first line of these


def longbench_score(dataset: str, prediction: str, references: Sequence[str], all_classes: Sequence[str]) -> float:
    """LongBench's ``scorer`` for one prediction: the best metric over the references."""
    if dataset in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = LONGBENCH_METRICS[dataset]
    if metric is classification_score:
        return max(metric(prediction, ref, all_classes) for ref in references)
    return max(metric(prediction, ref) for ref in references)
