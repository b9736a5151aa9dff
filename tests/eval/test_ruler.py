"""The RULER task family: every task's prompt follows RULER's template and holds what its answers need, at the
requested length; the answers are what RULER's rules make them (counted here from the prompt itself)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvcompress.eval.configs import expand_configs
from kvcompress.eval.tasks import make_task, run_task
from kvcompress.eval.tasks.ruler import NIAH, NOISE, TASK_NAMES

QUESTIONS = {
    "niah": "mentioned in the provided text?",
    "vt": "Question: Find all variables that are assigned the value",
    "cwe": "Question: What are the 10 most common words in the above list?",
    "fwe": "What are the three most frequently appeared words in the above coded text?",
}


def _build(tiny, task, length=2000, seed=0, count=1, **params):
    model, tokenizer = tiny
    ruler = make_task("ruler", model, tokenizer, seed=seed, length=length, tasks=[task], **params)
    samples = ruler.build_samples(count)
    texts = [
        (tokenizer.decode(s.inputs["context_ids"][0]), tokenizer.decode(s.inputs["question_ids"][0])) for s in samples
    ]
    return ruler, samples, texts


@pytest.mark.parametrize("task", TASK_NAMES)
@pytest.mark.parametrize("length", [2400, 8400])  # characters: the tiny tokenizer is character-level
def test_every_task_fills_its_length_and_keeps_the_question_apart(tiny, task, length):
    _, [sample], [(context, question)] = _build(tiny, task, length)
    total = sample.inputs["context_ids"].shape[1] + sample.inputs["question_ids"].shape[1]
    assert 0.9 * length <= total <= length  # the largest haystack that fits (one haystack unit at most short)
    assert sample.info["subtask"] == task and sample.inputs["answers"]
    asked = QUESTIONS["niah" if task in NIAH else task]
    assert asked in question and context.count(asked) == (task in ("cwe", "vt"))  # a worked example
    if task in NIAH or task == "vt":  # each expected string is written in the context
        for answer in sample.inputs["answers"]:
            assert answer in context


@pytest.mark.parametrize("task", list(NIAH))
def test_needles_and_question_follow_rulers_templates(tiny, task):
    haystack, type_k, type_v, num_k, num_v, num_q = NIAH[task]
    _, [sample], [(context, question)] = _build(tiny, task, 3000, seed=5)
    needles = re.findall(r"One of the special magic (\w+) for (\S+) is: (\S+)\.", context)
    assert {kind for kind, _, _ in needles} == {type_v}
    answers = sample.inputs["answers"]
    asked = re.search(r"for (.+) mentioned in the provided text\?", question).group(1)
    keys = re.split(r", and |, ", asked)
    assert len(keys) == num_q and len(answers) == num_q * num_v
    for key in keys:
        values = [value for _, k, value in needles if k == key]
        assert len(values) == num_v and set(values) <= set(answers)
    pattern = {"numbers": r"\d{7}", "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"}
    assert all(re.fullmatch(pattern[type_v], a) for a in answers)
    if type_k == "words":
        assert all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in keys)
    singular = num_q * num_v == 1
    assert context.startswith("A special magic" if singular else "Some special magic")
    assert ("What is the special" if singular else "What are all the special") in question
    if haystack == "noise":
        assert context.count(NOISE) > 10 and len(needles) == num_k * num_v
    elif haystack == "needle":  # the haystack is needles with other random keys
        assert len(needles) > 10 and len({k for _, k, _ in needles}) > 10
    else:
        assert NOISE not in context and len(needles) == max(num_k, num_q) * num_v


def test_variable_tracking_chain_leads_from_the_asked_value_to_every_answer(tiny):
    _, [sample], [(context, question)] = _build(tiny, "vt", 3000, seed=2)
    value = re.search(r"assigned the value (\d+)", question).group(1)
    task_text = context.split("Memorize and track")[-1]  # after the worked example
    holders = set(re.findall(rf"VAR (\w+) = {value}\b", task_text))
    links = dict(re.findall(r"VAR (\w+) = VAR (\w+)", task_text))
    changed = True
    while changed:
        new = {name for name, source in links.items() if source in holders} - holders
        holders |= new
        changed = bool(new)
    assert holders == set(sample.inputs["answers"]) and len(holders) == 5
    assert "5 variables are assigned the value" in question


@pytest.mark.parametrize(("length", "common", "rare"), [(2000, 6, 1), (8400, 30, 3)])
def test_common_words_are_the_ten_most_frequent_of_the_list(tiny, length, common, rare):
    _, [sample], [(context, _)] = _build(tiny, "cwe", length, seed=1)
    listing = context.split("Memorize the ones that appear most often.\n")[-1]
    counts = Counter(re.findall(r"\d+\. ([a-z-]+)", listing))
    assert sorted(counts[w] for w in sample.inputs["answers"]) == [common] * 10
    assert set(counts.values()) == {common, rare}


def test_frequent_words_are_the_three_most_frequent_coded_words(tiny):
    _, [sample], [(context, _)] = _build(tiny, "fwe", 4000, seed=4)
    counts = Counter(context.split("coded words. ")[-1].split())
    ranked = [word for word, _ in counts.most_common() if word != "..."]
    assert counts.most_common(1)[0][0] == "..."  # RULER's noise "word" is the most frequent
    assert ranked[:3] == sample.inputs["answers"]


def test_samples_cycle_through_the_tasks_and_are_reproducible(tiny):
    model, tokenizer = tiny
    first = make_task("ruler", model, tokenizer, seed=7, length=2400).build_samples(13)
    again = make_task("ruler", model, tokenizer, seed=7, length=2400).build_samples(13)
    assert [s.info["subtask"] for s in first] == [*TASK_NAMES, *TASK_NAMES[:2]]
    assert [s.inputs["answers"] for s in first] == [s.inputs["answers"] for s in again]


def test_bad_parameters_name_the_parameter(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="tasks must be drawn from"):
        make_task("ruler", model, tokenizer, tasks=["qa_1"])
    with pytest.raises(ValueError, match="length must be an integer >= 256"):
        make_task("ruler", model, tokenizer, length=100)
    with pytest.raises(ValueError, match="too short for ruler task 'niah_multikey_3'"):
        make_task("ruler", model, tokenizer, length=300, tasks=["niah_multikey_3"]).build_samples(1)


def test_a_kept_ratio_sizes_every_methods_budget_from_the_context(tiny):
    model, tokenizer = tiny
    task = make_task("ruler", model, tokenizer, length=1200, tasks=["niah_single_1"], modes=["agnostic", "aware"])
    [sample] = task.build_samples(1)
    configs = expand_configs(["full", "window", "snapkv"], [0.5])
    rows = list(run_task(task, configs, [sample]))
    context = sample.inputs["context_ids"].shape[1]
    prompt = context + sample.inputs["question_ids"].shape[1]
    by_key = {(r["method"], r["mode"]): r for r in rows}
    assert len(rows) == 6 and all(r["prefill_s"] > 0 and r["decode_s"] > 0 for r in rows)
    for row in rows:  # one character per printed token; the cache saw the prompt and every answer token but the last
        assert len(row["extra"]["prediction"]) <= row["new_tokens"] <= sample.inputs["max_new_tokens"]
        assert row["tokens_seen"] == prompt + row["new_tokens"] - 1
    # window keeps floor(0.5 * context) while the question goes in (agnostic), floor(0.5 * (prompt - 1)) (aware)
    assert by_key[("window", "agnostic")]["tokens_stored"][0] == context // 2
    assert by_key[("window", "aware")]["tokens_stored"][0] == (prompt - 1) // 2
    # snapkv keeps floor(0.5 * context), then appends the question and the answer without evicting
    snap = by_key[("snapkv", "agnostic")]
    assert snap["tokens_stored"][0] == context // 2 + snap["tokens_seen"] - context
