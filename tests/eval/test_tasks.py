from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from kvcompress.eval.configs import EvalConfig, expand_configs
from kvcompress.eval.tasks import make_task, run_task
from kvcompress.eval.tasks.base import van_der_corput
from kvcompress.eval.tasks.docqa import best_subspan_em
from kvcompress.eval.tasks.niah import string_match_all, string_match_part
from kvcompress.eval.tasks.passkey import FILLER, NEEDLE


def _context(tokenizer, sample) -> str:
    return tokenizer.decode(sample.inputs["context_ids"][0])


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_prompt_holds_the_key_at_the_requested_depth(tiny, depth):
    model, tokenizer = tiny
    task = make_task("passkey", model, tokenizer, seed=3, length=2000, depth=depth)
    [sample] = task.build_samples(1)
    text = _context(tokenizer, sample)
    key = sample.inputs["key"]
    assert re.fullmatch(r"\d{5}", key)
    needle = NEEDLE.format(key=key)
    assert text.count(needle) == 1
    before, after = text.split(needle)
    fraction = before.count(FILLER) / (before.count(FILLER) + after.count(FILLER))
    assert fraction == pytest.approx(depth, abs=0.05)
    assert sample.info["depth"] == pytest.approx(fraction, abs=1e-3)
    total = sample.inputs["context_ids"].shape[1] + sample.inputs["question_ids"].shape[1]
    assert 1800 <= total <= 2000


def test_passkey_default_depths_spread_and_stay_when_more_samples_are_asked(tiny):
    model, tokenizer = tiny
    task = make_task("passkey", model, tokenizer, seed=0, length=600)
    few, more = task.build_samples(3), task.build_samples(5)
    assert [s.info["depth"] for s in few] == [s.info["depth"] for s in more[:3]]
    assert [s.inputs["key"] for s in few] == [s.inputs["key"] for s in more[:3]]
    assert [van_der_corput(i) for i in range(5)] == [0.0, 0.5, 0.25, 0.75, 0.125]


def test_list_parameters_accept_a_single_value(tiny, corpus):
    model, tokenizer = tiny
    task = make_task("niah", model, tokenizer, modes="aware", subtasks=["vt"], haystack=str(corpus))
    assert task.modes == ("aware",) and task.params["subtasks"] == ("vt",)
    assert "modes" not in task.record_params()  # rows name their own mode


def test_passkey_rejects_bad_parameters(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="depth"):
        make_task("passkey", model, tokenizer, depth=1.5)
    with pytest.raises(ValueError, match="unknown parameter"):
        make_task("passkey", model, tokenizer, lenght=100)


def test_ruler_string_match_all_counts_the_fraction_found():
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("Only 1234567 here", ["1234567", "7654321", "1111111", "2222222"]) == 0.25
    assert string_match_all("VAR abcde and VAR FGHIJ", ["ABCDE", "fghij", "KLMNO"]) == pytest.approx(2 / 3)
    assert string_match_all("nothing", ["1234567"]) == 0.0
    assert string_match_part("it is 42 or 7", ["7", "99"]) == 1.0
    assert string_match_part("it is 42", ["7", "99"]) == 0.0


@pytest.mark.parametrize("subtask", ["single", "multikey", "multivalue", "multiquery", "vt"])
def test_niah_prompts_hold_every_needle_and_ask_for_the_answers(tiny, corpus, subtask):
    model, tokenizer = tiny
    task = make_task("niah", model, tokenizer, seed=1, length=1500, subtasks=(subtask,), haystack=str(corpus))
    [sample] = task.build_samples(1)
    context = _context(tokenizer, sample)
    question = tokenizer.decode(sample.inputs["question_ids"][0])
    answers = sample.inputs["answers"]
    for value in answers:
        assert value in context
    if subtask == "vt":
        assert len(answers) == 5
        chain = [re.search(rf"VAR {name} = (VAR \w+|\d+)\.", context).start() for name in answers]
        assert chain == sorted(chain)  # assignments appear in chain order
    else:
        needles = re.findall(r"One of the special magic numbers for ([\w-]+) is: (\d{7})\.", context)
        assert len(needles) == (1 if subtask == "single" else 4)
        expected = 4 if subtask in ("multivalue", "multiquery") else 1
        assert len(answers) == expected
        asked = {key for key, value in needles if value in answers}
        assert all(key in question for key in asked)
        if subtask == "multikey":  # distractor keys are not asked about
            assert sum(key in question for key, _ in needles) == 1
    assert not any(value in question for value in answers)
    assert sample.info["subtask"] == subtask
    assert 1300 <= sample.info["prompt_tokens"] <= 1500


def test_niah_runs_both_modes_with_the_same_prompt(tiny, corpus):
    model, tokenizer = tiny
    task = make_task("niah", model, tokenizer, length=400, haystack=str(corpus), subtasks=("single",))
    samples = task.build_samples(1)
    rows = list(run_task(task, expand_configs(["full", "window"], [32]), samples))
    assert [(r["mode"], r["method"]) for r in rows] == [
        ("agnostic", "full"),
        ("agnostic", "window"),
        ("aware", "full"),
        ("aware", "window"),
    ]
    prompt = samples[0].info["prompt_tokens"]
    for row in rows:
        assert 0.0 <= row["scores"]["score"] <= 1.0
        assert row["tokens_seen"] >= prompt
        expected = row["tokens_seen"] if row["method"] == "full" else 32
        assert row["tokens_stored"] == [expected, expected]
        assert row["kv_bytes"] == 2 * 2 * 2 * 16 * expected * 4  # K+V, layers, KV heads, head_dim, fp32


def test_docqa_answer_document_sits_at_the_chosen_position(tiny, corpus):
    model, tokenizer = tiny
    task = make_task("docqa", model, tokenizer, seed=2, doc_tokens=40, corpus=str(corpus))
    samples = task.build_samples(10)
    for i, sample in enumerate(samples):
        assert sample.info["position"] == i % 10
        context = _context(tokenizer, sample)
        question = tokenizer.decode(sample.inputs["question_ids"][0])
        team = re.search(r"code word of the (\w+) team", question).group(1)
        documents = re.split(r"\nDocument \[\d+\]", "\n" + context.split("\n\n", 1)[1])[1:]
        assert len(documents) == 10
        holders = [k for k, doc in enumerate(documents) if f"the {team} team is {sample.inputs['answer']}." in doc]
        assert holders == [sample.info["position"]]


def test_best_subspan_em_normalises_like_lost_in_the_middle():
    assert best_subspan_em(" Cobalt, I think.", ["cobalt"]) == 1.0
    assert best_subspan_em("The answer: the raven", ["Raven"]) == 1.0
    assert best_subspan_em("marble", ["cobalt"]) == 0.0


def test_stream_ppl_full_cache_matches_a_plain_forward(tiny, tmp_path):
    model, tokenizer = tiny
    books = tmp_path / "books"
    books.mkdir()
    text = "\n".join(f"Line {i} of a long book with words {i * 7}." for i in range(400))
    (books / "b1.txt").write_text("*** START OF THIS PROJECT GUTENBERG EBOOK B ***\n" + text + "\n*** END OF X ***")
    task = make_task("stream-ppl", model, tokenizer, seed=0, length=300, chunk_size=16, bin=50, books=str(books))
    [sample] = task.build_samples(1)
    assert sample.info["book"] == "b1" and sample.inputs["ids"].shape == (1, 300)
    [row] = run_task(task, [EvalConfig("full")], [sample])
    ids = sample.inputs["ids"]
    with torch.no_grad():
        expected = F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:]).item()
    assert row["scores"]["nll"] == pytest.approx(expected, rel=1e-4)
    assert row["scores"]["ppl"] == pytest.approx(math.exp(expected), rel=1e-4)
    assert len(row["extra"]["nll_bins"]) == 6  # 299 predictions in bins of 50
    assert row["tokens_stored"] == [299, 299]  # the last token is only a target


def test_ppl_windows_are_bounded_by_the_budget(tiny, tmp_path):
    model, tokenizer = tiny
    path = tmp_path / "test.txt"
    path.write_text(" = Title = \n" + " The text goes on and on . " * 100)
    task = make_task("ppl", model, tokenizer, length=200, chunk_size=8, text=str(path))
    samples = task.build_samples(2)
    total = task.build_samples(1)[0].info["token_offset"] + len(tokenizer(path.read_text())["input_ids"])
    assert samples[0].info["token_offset"] == 0
    assert samples[1].info["token_offset"] == round((total - 200) / 2)  # van der Corput: 0, then halfway
    rows = list(run_task(task, expand_configs(["full", "window"], [32]), samples[:1]))
    full, window = rows
    assert window["tokens_stored"] == [32, 32] and full["tokens_stored"] == [199, 199]
    assert window["scores"]["nll"] != pytest.approx(full["scores"]["nll"])


def test_summary_scores_against_the_full_cache_summary_made_once(tiny, corpus, monkeypatch):
    model, tokenizer = tiny
    task = make_task("summary", model, tokenizer, length=200, max_new_tokens=12, corpus=str(corpus))
    calls = []
    original = task.generate
    monkeypatch.setattr(task, "generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    samples = task.build_samples(1)
    rows = list(run_task(task, expand_configs(["window", "full", "random"], [16]), samples))
    assert len(calls) == 4  # window, the shared full reference, random; full reuses the reference
    scores = {r["method"]: r["scores"] for r in rows}
    assert scores["full"] == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    for method in ("window", "random"):
        assert set(scores[method]) == {"rouge1", "rouge2", "rougeL"}
        assert all(0.0 <= v <= 1.0 for v in scores[method].values())


@pytest.mark.parametrize("name", ["passkey", "niah", "docqa", "summary"])
@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        ("modes", "both", "modes must be drawn from agnostic, aware; got 'both'"),
        ("chunk_size", 0, "chunk_size must be an integer >= 1, got 0"),
    ],
)
def test_qa_tasks_share_mode_and_chunk_checks(tiny, name, param, value, message):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=re.escape(message)):
        make_task(name, model, tokenizer, **{param: value})


@pytest.mark.parametrize("name", ["passkey", "docqa", "summary"])
def test_qa_tasks_check_max_new_tokens(tiny, name):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        make_task(name, model, tokenizer, max_new_tokens=0)
