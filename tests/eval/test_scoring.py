"""Scores against known values: every task scores a right answer at its best and a wrong one at its worst, the
metric functions on hand-checked inputs, ROUGE on hand-computed pairs, perplexity from the model's own logits."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress.eval.configs import EvalConfig
from kvcompress.eval.tasks import TASKS, make_task, perplexity, run_task
from kvcompress.eval.tasks.docqa import WORDS, best_subspan_em
from kvcompress.eval.tasks.niah import string_match_all, string_match_part
from kvcompress.eval.tasks.passkey import first_number
from kvcompress.eval.tasks.summary import rouge_scores
from kvcompress.models import tiny_model, tiny_tokenizer

FULL = EvalConfig("full")
WINDOW = EvalConfig("window", (), 8)


@pytest.fixture
def texts(tmp_path, corpus):
    """Task parameters pointing every task at small data made here (books, a WikiText-like file, essays)."""
    books = tmp_path / "books"
    books.mkdir()
    body = "\n".join(f"Line {i} of a long book with words {i * 7}." for i in range(200))
    (books / "b1.txt").write_text("*** START OF THIS PROJECT GUTENBERG EBOOK B ***\n" + body + "\n*** END OF X ***")
    wiki = tmp_path / "test.txt"
    wiki.write_text(" = Title = \n" + " The text goes on and on . " * 40)
    return {
        "stream-ppl": {"length": 40, "chunk_size": 8, "bin": 10, "books": str(books)},
        "ppl": {"length": 40, "chunk_size": 8, "text": str(wiki)},
        "passkey": {"length": 100, "nll": False},  # the key's NLL: tests/eval/test_answer_nll.py
        "niah": {"length": 220, "haystack": str(corpus), "subtasks": ("multivalue",)},
        "docqa": {"documents": 2, "doc_tokens": 20, "corpus": str(corpus)},
        "summary": {"length": 60, "max_new_tokens": 4, "corpus": str(corpus)},
    }


def test_the_tasks_are_registered():
    assert sorted(TASKS) == ["dataset", "docqa", "niah", "passkey", "ppl", "ruler", "stream-ppl", "summary"]


def _answers(name: str, sample) -> tuple[str, str]:
    """A right and a wrong answer to ``sample`` of task ``name``."""
    if name == "passkey":
        key = sample.inputs["key"]
        return f" {key}, not 9{key}.", f" 9{key}, not {key}."  # only the first number counts
    if name == "niah":
        answers = sample.inputs["answers"]
        return " " + ", ".join(answers) + ".", " 0000000 and 0000000."
    if name == "docqa":
        answer = sample.inputs["answer"]
        return f" {answer.upper()}!", f" {next(w for w in WORDS if w != answer)}."
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["passkey", "niah", "docqa"])
def test_qa_task_scores_the_right_answer_1_and_a_wrong_one_0(tiny, texts, name, monkeypatch):
    model, tokenizer = tiny
    task = make_task(name, model, tokenizer, seed=4, **texts[name])
    [sample] = task.build_samples(1)
    right, wrong = _answers(name, sample)
    metric = task.metrics[0]
    for text, expected in ((right, 1.0), (wrong, 0.0)):
        monkeypatch.setattr(task, "generate", lambda *args, text=text, **kwargs: text)
        rows = list(run_task(task, [FULL], [sample]))
        assert len(rows) == len(task.modes)
        for row in rows:
            assert row["scores"][metric] == expected, (text, row["mode"])
            assert row["extra"]["prediction"] == text


def test_niah_scores_the_fraction_of_values_found(tiny, texts, monkeypatch):
    model, tokenizer = tiny
    task = make_task("niah", model, tokenizer, seed=4, **texts["niah"])
    [sample] = task.build_samples(1)
    answers = sample.inputs["answers"]
    assert len(answers) == 4
    monkeypatch.setattr(task, "generate", lambda *args, **kwargs: f" {answers[2]} and {answers[0]}")
    assert [row["scores"]["score"] for row in run_task(task, [FULL], [sample])] == [0.5, 0.5]


def test_summary_scores_each_method_against_the_full_cache_summary(tiny, texts, monkeypatch):
    """Right: the full cache's summary in other case and punctuation (ROUGE 1, not the identical-text shortcut);
    wrong: no word in common (ROUGE 0). The reference is what ``full`` generated, whatever the order."""
    model, tokenizer = tiny
    reference = "The essay talks about topic forty."
    for prediction, expected in (("the essay, talks about topic FORTY", 1.0), ("Dogs run fast", 0.0)):
        task = make_task("summary", model, tokenizer, **texts["summary"])
        [sample] = task.build_samples(1)
        outputs = {"full": reference, "window": prediction}
        monkeypatch.setattr(task, "generate", lambda sample, cache, mode, outputs=outputs: outputs[cache.config.name])
        rows = {row["method"]: row for row in run_task(task, [WINDOW, FULL], [sample])}
        assert rows["full"]["scores"] == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
        assert rows["window"]["scores"] == {"rouge1": expected, "rouge2": expected, "rougeL": expected}
        assert rows["window"]["extra"]["prediction"] == prediction


@pytest.mark.parametrize("name", ["stream-ppl", "ppl"])
def test_perplexity_is_exp_of_the_mean_loss_along_the_stream(tiny, texts, name, monkeypatch):
    """A model that is always right scores ppl 1 (its best); one uniform over the 128 tokens ppl 128; losses
    ln 2, ln 2, ln 16 repeated give ppl 4 (the exp of their mean), and the bins hold their own means."""
    model, tokenizer = tiny
    task = make_task(name, model, tokenizer, **texts[name])
    [sample] = task.build_samples(1)
    ids = sample.inputs["ids"]
    assert ids.shape == (1, 40)
    cases = [
        (torch.zeros(39), 1.0),
        (torch.full((39,), math.log(128)), 128.0),
        (torch.tensor([math.log(2), math.log(2), math.log(16)] * 13), 4.0),  # mean 2 ln 2; median ln 2
    ]
    for losses, ppl in cases:

        def fake(model, input_ids, cache, chunk_size=1, progress=False, losses=losses):
            assert torch.equal(input_ids, ids)
            return losses.clone()

        monkeypatch.setattr(perplexity, "stream_nll", fake)
        [row] = run_task(task, [FULL], [sample])
        assert row["scores"]["ppl"] == pytest.approx(ppl, rel=1e-6)  # float32 losses, as stream_nll returns
        assert row["scores"]["nll"] == pytest.approx(math.log(ppl), abs=1e-6)
        if name == "stream-ppl":  # bins of 10 over 39 losses: 10, 10, 10, 9
            expected = [round(float(losses[i : i + 10].mean()), 4) for i in range(0, 39, 10)]
            assert row["extra"]["nll_bins"] == expected and len(expected) == 4


@pytest.mark.parametrize("name", ["stream-ppl", "ppl"])
def test_full_cache_perplexity_equals_the_model_own_logits(texts, name):
    """Fed in chunks of 8 through the full cache, the perplexity equals exp(mean NLL) of one plain SDPA forward of
    the model over the whole window, the NLL taken from its log-softmax by hand in float64."""
    model = tiny_model("llama", seed=2)
    task = make_task(name, model, tiny_tokenizer(), **texts[name])
    [sample] = task.build_samples(1)
    [row] = run_task(task, [FULL], [sample])
    ids = sample.inputs["ids"][0]
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = model(ids[None]).logits[0].double()
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    nll = -sum(float(log_probs[t, ids[t + 1]]) for t in range(len(ids) - 1)) / (len(ids) - 1)
    assert row["scores"]["nll"] == pytest.approx(nll, rel=1e-5)
    assert row["scores"]["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
    assert row["tokens_stored"] == [39, 39]


def test_first_number_is_the_first_run_of_digits():
    assert first_number("The pass key is 12345. Remember 67890.") == "12345"
    assert first_number(" 0042 and 7") == "0042"
    assert first_number("key12a34") == "12"
    assert first_number("no digits here") is None
    assert first_number("") is None


def test_best_subspan_em_known_values():
    assert best_subspan_em("The Raven!", ["raven"]) == 1.0  # case and punctuation
    assert best_subspan_em("an   obsidian, a  garnet", ["Obsidian garnet"]) == 1.0  # articles and spaces
    assert best_subspan_em("cobaltish", ["cobalt"]) == 1.0  # a substring, not a word match
    assert best_subspan_em("co balt", ["cobalt"]) == 0.0
    assert best_subspan_em("marble", ["cobalt", "marble"]) == 1.0  # any answer
    assert best_subspan_em("marble", ["cobalt", "ember"]) == 0.0


def test_string_match_all_and_part_known_values():
    refs = ["1234567", "7654321", "1111111"]
    assert string_match_all("1234567 7654321 1111111", refs) == 1.0
    assert string_match_all("7654321 twice 7654321", refs) == pytest.approx(1 / 3)
    assert string_match_all("x1234567x and 1111111", refs) == pytest.approx(2 / 3)
    assert string_match_all("VAR abcde", ["ABCDE", "FGHIJ"]) == 0.5
    assert string_match_all("", refs) == 0.0
    with pytest.raises(ValueError, match="references"):
        string_match_all("1234567", [])
    assert string_match_part("7654321 only", refs) == 1.0
    assert string_match_part("VAR ABCDE", ["abcde"]) == 1.0
    assert string_match_part("nothing", refs) == 0.0


def test_rouge_on_pairs_computed_by_hand():
    # Same words, other order. Unigrams: 6 of 6 -> 1. Bigrams of the reference: the-cat cat-sat sat-on on-the
    # the-mat; of the prediction: on-the the-mat mat-the the-cat cat-sat; 4 shared of 5 and 5 -> 0.8.
    # Longest common subsequence: "the cat sat" (or "on the mat"), 3 of 6 and 6 -> 0.5.
    scores = rouge_scores("on the mat the cat sat", "the cat sat on the mat")
    assert scores["rouge1"] == pytest.approx(1.0)
    assert scores["rouge2"] == pytest.approx(0.8)
    assert scores["rougeL"] == pytest.approx(0.5)
    # Porter stemming: cats -> cat, running / runs -> run. Prediction a cat run (3), reference the cat were run
    # (4): 2 shared unigrams -> F = 2 * 2 / (3 + 4) = 4/7; no shared bigram -> 0; LCS "cat run" -> 4/7.
    scores = rouge_scores("A cat runs", "The cats were running")
    assert scores["rouge1"] == pytest.approx(4 / 7)
    assert scores["rouge2"] == pytest.approx(0.0)
    assert scores["rougeL"] == pytest.approx(4 / 7)
    # Different lengths: prediction 8 tokens, reference 6; 4 shared unigrams -> 8/14; bigrams 2 shared of 7 and 5
    # -> 4/12; LCS "cat sat on mat" 4 -> 8/14.
    scores = rouge_scores("a cat sat on a red mat today", "the cat sat on the mat")
    assert scores == pytest.approx({"rouge1": 4 / 7, "rouge2": 1 / 3, "rougeL": 4 / 7})
    assert rouge_scores("Hi.", "Hi.") == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}  # too short for bigrams
