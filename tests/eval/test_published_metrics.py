"""The published benchmarks' scores on predictions whose values are worked out by hand in each comment."""

from __future__ import annotations

import pytest

from kvcompress.eval.tasks.published import infinitebench as ib
from kvcompress.eval.tasks.published import loogle
from kvcompress.eval.tasks.published.metrics import (
    classification_score,
    code_sim_score,
    count_score,
    longbench_score,
    qa_f1_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
)
from kvcompress.eval.tasks.published.ruler import ruler_scores


def test_ruler_string_match_all_and_part():
    # niah / vt / cwe / fwe: the fraction of expected strings found, case-insensitive: 1 of 2.
    assert ruler_scores("qpzkd and ABCDE", ["QPZKD", "HJWUE"], "vt") == {"score": 0.5}
    # qa: any one reference found scores 1.
    assert ruler_scores("It is Bergen.", ["Oslo", "bergen"], "qa_1") == {"score": 1.0}
    assert ruler_scores("It is Oslo\x07", ["Bergen"], "qa_2") == {"score": 0.0}
    assert ruler_scores("QPZKD\x00HJWUE", ["QPZKD", "HJWUE"], "vt") == {"score": 1.0}  # control chars -> new lines


def test_qa_f1_score():
    # normalised: "eiffel tower in paris" vs "eiffel tower": 2 common, precision 2/4, recall 1 -> F1 = 2/3.
    assert qa_f1_score("The Eiffel Tower, in Paris.", "Eiffel Tower") == pytest.approx(2 / 3)
    assert qa_f1_score("London", "Paris") == 0.0


def test_rouge_l_f_measure():
    # LCS "the cat sat" = 3 tokens; precision 3/3, recall 3/6 -> F = 2 * 1 * 0.5 / 1.5 = 2/3.
    assert rouge_score("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)


def test_classification_score_keeps_longbenchs_loop():
    classes = ["Human being", "Location", "Numeric value"]
    assert classification_score("Location", "Location", classes) == 1.0
    # two class names found, the reference among them -> 1/2
    assert classification_score("Location or Human being", "Location", classes) == 0.5
    # "a" and "ab" are inside the reference "abc": LongBench removes "a", then skips "ab" (it removes from the
    # list it iterates over), so ["ab", "abc"] remain -> 1/2 (a clean filter would give 1).
    assert classification_score("abc", "abc", ["a", "ab", "abc"]) == 0.5


def test_retrieval_count_and_code_similarity():
    # numbers 3 and 12 predicted, one is paragraph 3 -> 1/2
    assert retrieval_score("Paragraph 3, not Paragraph 12", "Paragraph 3") == 0.5
    assert retrieval_zh_score("段落5", "段落5") == 1.0
    # numbers 7 and 9, one equals the count -> 1/2
    assert count_score("There are 7 unique paragraphs out of 9", "7") == 0.5
    assert count_score("none", "7") == 0.0
    # the comment line is skipped; the next line equals the reference
    assert code_sim_score("# next\nreturn x + 1\n", "return x + 1") == 1.0
    # difflib: 3 matching characters of 4 + 4 -> 2 * 3 / 8 = 0.75
    assert code_sim_score("abcd", "abce") == 0.75


def test_longbench_scorer_takes_the_best_reference_and_the_first_line_for_few_shot():
    assert longbench_score("hotpotqa", "Norway", ["Sweden", "Norway"], []) == 1.0
    # trec: only the first line counts; "Location" on the second line is not seen
    assert longbench_score("trec", "Human being\nLocation", ["Location"], ["Human being", "Location"]) == 0.0


def test_infinitebench_scores():
    assert ib.infinitebench_score("passkey", " 71432. Remember it.", ["71432"]) == 1.0
    assert ib.infinitebench_score("passkey", "7143", ["71432"]) == 0.0
    assert ib.infinitebench_score("kv_retrieval", 'is "9f8e-4444".', ["9f8e-4444"]) == 1.0
    assert ib.infinitebench_score("kv_retrieval", "is 9f8e", ["9f8e-4444"]) == 0.0
    # label = [option text, letter]
    assert ib.infinitebench_score("longbook_choice_eng", "D", ["Light housework", "D"]) == 1.0
    assert ib.infinitebench_score("longbook_choice_eng", "The answer is: C", ["Light housework", "D"]) == 0.0
    assert ib.infinitebench_score("longbook_choice_eng", "the answer is: D.", ["Light housework", "D"]) == 1.0
    assert ib.infinitebench_score("code_debug", "B. func_2", ["func_2", "B"]) == 1.0
    assert ib.infinitebench_score("longdialogue_qa_eng", "Ace Rothstein.", ["ACE"]) == 1.0
    assert ib.infinitebench_score("code_run", "The value is -12", [-12]) == 1.0
    assert ib.infinitebench_score("math_find", "It is 52.", [52]) == 1.0
    # values 1, 4 right, then 9 != 8 -> 2 of 3
    assert ib.infinitebench_score("math_calc", "[1, 4, 9]", [1, 4, 8]) == pytest.approx(2 / 3)
    # answer "to the river", normalised "to river"; prediction "river" -> precision 1, recall 1/2 -> 2/3
    assert ib.infinitebench_score("longbook_qa_eng", "the river", ["to the river"]) == pytest.approx(2 / 3)
    # per character: 北京 vs 北京市 -> precision 1, recall 2/3 -> F1 0.8
    assert ib.infinitebench_score("longbook_qa_chn", "北京", ["北京市"]) == pytest.approx(0.8)


def test_loogle_text_scores():
    scores = loogle.text_scores("the cat sat", "the cat sat on the mat")
    assert scores["score"] == pytest.approx(0.5)  # ROUGE-L recall: LCS 3 of 6 reference tokens
    assert scores["rouge1"] == pytest.approx(0.5)  # 3 of 6 reference unigrams
    assert scores["rouge2"] == pytest.approx(0.4)  # "the cat", "cat sat" of 5 reference bigrams
    # BLEU-1: unigram precision 1, brevity penalty exp(1 - 6/3) = e^-1
    assert scores["bleu1"] == pytest.approx(0.36787944)
    assert scores["bleu4"] == pytest.approx(0.0, abs=1e-12)  # no 4-gram in a 3-word answer


def test_loogle_cloze_reads_literals_and_runs_nothing(tmp_path):
    reference = {"<mask-0>": "Ingrid Olsen", "<mask-1>": "Bergen"}
    # mask-0 partly right ("Ingrid"), mask-1 exact -> exact 1/2, partial 2/2
    assert loogle.cloze_scores("{'<mask-0>': 'Ingrid', '<mask-1>': 'Bergen'}", reference) == {
        "score": 0.5,
        "partial": 1.0,
    }
    assert loogle.cloze_scores('{"<mask-0>": "Ingrid Olsen", "<mask-1>": "Bergen"}', reference)["score"] == 1.0
    marker = tmp_path / "ran"
    attack = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    assert loogle.cloze_scores(attack, reference) == {"score": 0.0, "partial": 0.0}
    assert not marker.exists()
