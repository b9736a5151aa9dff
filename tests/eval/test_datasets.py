"""The ``dataset`` task on small files written in each benchmark's published schema (tests/eval/fixtures)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from kvcompress.cli import main
from kvcompress.eval import leaderboard
from kvcompress.eval.runner import read_rows, run_eval
from kvcompress.eval.tasks import make_task
from kvcompress.eval.tasks.datasets import cut_middle, load_items
from kvcompress.eval.tasks.published import detect_schema
from kvcompress.models import tiny_model, tiny_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
RULER_NIAH = FIXTURES / "ruler" / "niah_single_1" / "validation.jsonl"


def _items(path, **kwargs):
    return list(load_items(path, **kwargs))


def test_ruler_rows_split_at_the_last_question_with_the_answer_prefix_field():
    items = _items(RULER_NIAH)
    assert [i.id for i in items] == ["niah_single_1-00000", "niah_single_1-00001"]
    first = items[0]
    assert first.context.startswith("A special magic number is hidden") and "is: 4827153." in first.context
    assert first.question == "What is the special magic number for quiet-lantern mentioned in the provided text?"
    assert first.answer_prefix == "The special magic number for quiet-lantern mentioned in the provided text is"
    assert first.answers == ["4827153"] and first.max_new_tokens == 128 and first.source_id == 0
    assert first.scorer("... text is 4827153.") == {"score": 1.0}


def test_ruler_older_rows_carry_the_answer_prefix_in_the_input():
    (item,) = _items(FIXTURES / "ruler" / "vt" / "validation.jsonl")
    assert item.question == "Question: Find all variables that are assigned the value 48213 in the text above."
    assert item.answer_prefix.startswith("Answer: According to the chain(s)") and item.answer_prefix.endswith("are:")
    assert item.max_new_tokens == 30 and item.stop_when_found == ("QPZKD", "HJWUE")
    assert item.scorer(" QPZKD, HJWUE") == {"score": 1.0} and item.scorer("QPZKD") == {"score": 0.5}


def test_ruler_qa_uses_string_match_part_and_keeps_the_documents_in_the_context():
    (item,) = _items(FIXTURES / "ruler" / "qa_1" / "validation.jsonl")
    assert "Document 2:" in item.context and "Question: In which city" in item.question
    assert item.question.startswith("Answer the question based on the given documents.")  # the restated one
    assert item.answer_prefix == "Answer:" and item.max_new_tokens == 32 and item.stop_when_found == ()


def test_ruler_task_from_the_question_when_the_folder_does_not_name_it(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(RULER_NIAH.read_text())
    assert {i.subset for i in _items(path)} == {"niah"}
    assert {i.subset for i in _items(path, subset="niah_single_2")} == {"niah_single_2"}


def test_kvpress_export_scores_each_row_by_its_task():
    items = _items(FIXTURES / "kvpress" / "ruler_4096.jsonl")
    assert [i.subset for i in items] == ["niah_single_1", "qa_1"]
    assert items[1].scorer("Bergen, I think") == {"score": 1.0} and items[1].max_new_tokens == 32
    assert [i.id for i in _items(FIXTURES / "kvpress" / "ruler_4096.jsonl", subset="qa_1")] == ["qa_1-00000"]
    (trec,) = _items(FIXTURES / "kvpress" / "longbench_trec.jsonl")
    assert trec.answer_prefix == "Type:" and trec.max_new_tokens == 84
    assert trec.scorer(" Location\nHuman being") == {"score": 1.0}  # LongBench's trec: first line, class match


def test_longbench_prompts_are_its_templates_cut_after_the_context():
    items = _items(FIXTURES / "longbench" / "hotpotqa.jsonl")
    first = items[0]
    assert first.context.startswith("Answer the question based on the given passages.")
    assert first.context.endswith("Bergen is a city on the west coast of Norway.")
    assert first.question.endswith("Question: In which city is the Lantern Museum?")
    assert first.answer_prefix == "Answer:" and first.chat and first.max_new_tokens == 32
    assert first.source_id == "5f0c1e2a9d3b4c7e8a6b1d2c3e4f5a6b"
    assert first.scorer("The Lantern Museum is in Bergen") == {"score": pytest.approx(2 * (1 / 5) / (1 / 5 + 1))}


def test_longbench_few_shot_prompt_is_raw_and_exactly_longbenchs():
    (item,) = _items(FIXTURES / "longbench" / "trec.jsonl")
    row = json.loads((FIXTURES / "longbench" / "trec.jsonl").read_text())
    published = (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        + row["context"]
        + "\n"
        + row["input"]
    )
    assert not item.chat and item.context + item.question + item.answer_prefix == published
    assert item.answer_prefix == "Type:" and item.scorer("Location") == {"score": 1.0}


def test_infinitebench_prompts_options_and_labels():
    (kv,) = _items(FIXTURES / "infinitebench" / "kv_retrieval.jsonl")
    assert kv.context.startswith("Extract the value corresponding to the specified key in the JSON object below.")
    assert kv.question == 'Key: "3e5d7f9a-3333-4b6c-8d7e-000000000003"'  # the cue moved to the answer prefix
    assert kv.answer_prefix == "The value associated with the specified key is:" and kv.max_new_tokens == 50
    assert kv.scorer(' "9f8e7d6c-4444-4a3b-9c2d-000000000004".') == {"score": 1.0}
    (choice,) = _items(FIXTURES / "infinitebench" / "longbook_choice_eng.jsonl")
    assert choice.answers == ["Light housework", "D"] and "D. Light housework" in choice.question
    assert choice.answer_prefix == "The letter of the correct answer is"
    assert choice.scorer(" D") == {"score": 1.0} and choice.scorer(" A") == {"score": 0.0}
    (qa,) = _items(FIXTURES / "infinitebench" / "longbook_qa_eng.jsonl")
    assert qa.question == "Question: Where does Alain walk Georgie every morning?" and qa.answer_prefix == "Answer:"


def test_loogle_gives_one_sample_per_question():
    items = _items(FIXTURES / "loogle" / "shortdep_qa.jsonl")
    assert [i.id for i in items] == ["shortdep_qa-00000", "shortdep_qa-00001"]
    assert items[0].context.startswith("Please answer the question based on the long texts below. \n The Lantern")
    assert items[1].question == "Question: Who founded the Lantern Museum?" and items[1].max_new_tokens == 300
    (cloze,) = _items(FIXTURES / "loogle" / "shortdep_cloze.jsonl")
    assert cloze.answers == {"<mask-0>": "Ingrid Olsen", "<mask-1>": "Bergen"}
    assert cloze.scorer("{'<mask-0>': 'Ingrid Olsen', '<mask-1>': 'Oslo'}") == {"score": 0.5, "partial": 0.5}


def test_schema_is_told_from_the_fields():
    firsts = {p.parent.name: json.loads(p.read_text().splitlines()[0]) for p in FIXTURES.rglob("*.jsonl")}
    assert detect_schema(firsts["longbench"]) == "longbench"
    assert detect_schema(firsts["kvpress"]) == "kvpress"
    assert detect_schema(firsts["infinitebench"]) == "infinitebench"
    assert detect_schema(firsts["loogle"]) == "loogle"
    assert detect_schema(firsts["vt"]) == "ruler"
    assert detect_schema({"text": "x"}) is None


@pytest.mark.parametrize(
    ("content", "kwargs", "message"),
    [
        (
            '{"index": 0, "input": "What is the special magic number?", "outputs": ["1"]}\n{"index": 1,\n',
            {},
            r"line 2: not valid JSON",
        ),
        ('{"index": 0, "input": "x", "length": 1}\n', {"schema": "ruler"}, r"line 1: field 'outputs' is missing"),
        ('{"index": 0, "input": "What is the special magic number?", "outputs": 5, "length": 1}\n', {}, r"'outputs'"),
        (
            '{"index": 0, "input": "no question here", "outputs": ["1"], "length": 1}\n',
            {},
            r"cannot tell the RULER task",
        ),
        ("[1, 2]\n", {}, r"line 1: a row must be a JSON object"),
        (
            '{"index": 0, "input": "x", "outputs": ["1"]}\n',
            {"schema": "longbench"},
            r"line 1: field 'dataset' is missing",
        ),
        ('{"text": "x"}\n', {}, r"line 1: cannot tell the schema from the fields text"),
        ("\n\n", {}, r"holds no rows"),
        (
            '{"input": "doc", "title": "t", "qa_pairs": "__import__(\'os\').getcwd()", "output": "none"}\n',
            {"subset": "shortdep_qa"},
            r"line 1: field 'qa_pairs' is not a JSON or Python literal",
        ),
        ('{"id": 0, "context": "c", "input": "q", "answer": ["a"], "options": []}\n', {}, r"file name 'bad.jsonl'"),
        (
            '{"input": "q", "context": "c", "answers": ["a"], "dataset": "vcsum", "all_classes": null, "_id": "1"}\n',
            {},
            r"line 1: LongBench dataset 'vcsum' is not covered",
        ),
    ],
)
def test_malformed_files_name_the_file_line_and_problem(tmp_path, content, kwargs, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        _items(path, **kwargs)
    assert "\n" not in str(error.value)
    if "line" in message:
        assert str(path) in str(error.value)


def test_missing_file_and_bad_parameters(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="does not exist"):
        make_task("dataset", model, tokenizer, file="nowhere.jsonl").build_samples(1)
    with pytest.raises(ValueError, match="needs --param file"):
        make_task("dataset", model, tokenizer)
    with pytest.raises(ValueError, match="file must be one path"):
        make_task("dataset", model, tokenizer, file=("a", "b"))
    with pytest.raises(ValueError, match="schema must be one of"):
        make_task("dataset", model, tokenizer, file=str(RULER_NIAH), schema="squad")
    with pytest.raises(ValueError, match="max_context_tokens"):
        make_task("dataset", model, tokenizer, file=str(RULER_NIAH), max_context_tokens=0)
    with pytest.raises(ValueError, match="subset must be one of"):
        make_task(
            "dataset", model, tokenizer, file=str(FIXTURES / "loogle" / "shortdep_qa.jsonl"), subset="x"
        ).build_samples(1)


def test_samples_hold_the_context_then_the_question(tiny):
    model, tokenizer = tiny
    task = make_task("dataset", model, tokenizer, file=str(FIXTURES / "longbench" / "hotpotqa.jsonl"))
    samples = task.build_samples(5)
    assert [s.id for s in samples] == ["hotpotqa-00000", "hotpotqa-00001"]  # the file holds two
    context = tokenizer.decode(samples[0].inputs["context_ids"][0])
    question = tokenizer.decode(samples[0].inputs["question_ids"][0])
    assert "Bergen is a city on the west coast of Norway." in context and "Question:" not in context
    assert "Question: In which city is the Lantern Museum?" in question and question.endswith("Answer:")
    assert samples[0].info["subtask"] == "hotpotqa" and samples[0].info["answers"] == ["Bergen"]
    assert task.build_samples(1)[0].id == "hotpotqa-00000"


def test_max_context_tokens_drops_the_middle(tiny):
    import torch

    ids = torch.arange(10).unsqueeze(0)
    assert cut_middle(ids, 5).tolist() == [[0, 1, 7, 8, 9]]
    assert cut_middle(ids, 20) is ids
    model, tokenizer = tiny
    task = make_task("dataset", model, tokenizer, file=str(RULER_NIAH), max_context_tokens=100)
    sample = task.build_samples(1)[0]
    assert sample.inputs["context_ids"].shape[1] == 100 and sample.info["context_tokens_cut"] > 0


@pytest.mark.parametrize(
    ("path", "first_id", "subtask"),
    [
        (RULER_NIAH, "niah_single_1-00000", "niah_single_1"),
        (FIXTURES / "kvpress" / "ruler_4096.jsonl", "niah_single_1-00000", "niah_single_1"),
        (FIXTURES / "longbench" / "trec.jsonl", "trec-00000", "trec"),
        (FIXTURES / "infinitebench" / "kv_retrieval.jsonl", "kv_retrieval-00000", "kv_retrieval"),
        (FIXTURES / "loogle" / "shortdep_qa.jsonl", "shortdep_qa-00000", "shortdep_qa"),
    ],
)
def test_run_eval_on_each_schema(tiny, tmp_path, path, first_id, subtask):
    args = dict(out_dir=tmp_path, progress=False, file=str(path), max_new_tokens=4)
    out = run_eval("dataset", tiny, ["full", "window"], [32], samples=1, **args)
    rows = [r for r in read_rows(out) if r["kind"] == "result"]
    assert [(r["sample"], r["mode"], r["method"]) for r in rows] == [
        (first_id, mode, method) for mode in ("agnostic", "aware") for method in ("full", "window")
    ]
    for row in rows:
        assert row["task"] == "dataset" and row["info"]["subtask"] == subtask
        assert 0.0 <= row["scores"]["score"] <= 1.0 and isinstance(row["extra"]["prediction"], str)
        assert row["task_params"]["file"] == str(path) and max(row["tokens_stored"]) <= max(row["tokens_seen"], 32)
    window = [r for r in rows if r["method"] == "window"]
    assert all(max(r["tokens_stored"]) == 32 for r in window)  # the prompts are longer than the budget
    again = run_eval("dataset", tiny, ["full", "window"], [32], samples=1, **args)
    assert len([r for r in read_rows(again) if r["kind"] == "result"]) == len(rows)  # resumed: nothing added


def test_command_line_answers_a_malformed_file_with_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(RULER_NIAH.read_text().splitlines()[0] + "\n{oops\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the eval command renames argv[0]
    args = ["eval", "dataset", "--model", folder, "--param", f"file={bad}", "--samples", 2, "--out", tmp_path / "run"]
    with pytest.raises(SystemExit) as status:
        main([str(a) for a in args])
    assert status.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if "error" in line] == [
        f"kvcompress eval: error: {bad} line 2: not valid JSON (Expecting property name enclosed in double quotes, "
        "column 2) (see `kvcompress eval --help`)"
    ]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_kvpress_rows_of_other_benchmarks_are_scored_by_their_task(tmp_path):
    common = {"context": "c", "question": "q", "answer_prefix": "Answer:", "max_new_tokens": 9}
    path = _write(
        tmp_path / "kvpress.jsonl",
        [
            {**common, "task": "kv_retrieval", "answer": ["ab-12"]},
            {**common, "task": "code_debug", "answer": ["C"]},  # kvpress keeps the letter only
            {**common, "task": "longdep_qa", "answer": "the cat sat on the mat"},
            {**common, "task": "shortdep_cloze", "answer": json.dumps({"<mask-0>": "Bob"})},
            {**common, "task": "hotpotqa_e", "answers": ["Oslo"], "all_classes": None},
        ],
    )
    kv, debug, qa, cloze, hotpot = _items(path)
    assert kv.scorer("it is ab-12.") == {"score": 1.0} and kv.max_new_tokens == 9
    assert debug.scorer("C. func") == {"score": 1.0} and debug.scorer("B") == {"score": 0.0}
    assert qa.scorer("the cat sat")["score"] == pytest.approx(0.5)
    assert cloze.scorer("{'<mask-0>': 'Bob'}") == {"score": 1.0, "partial": 1.0}
    assert hotpot.scorer("Oslo") == {"score": 1.0}
    _write(path, [{**common, "task": "squad", "answer": ["x"]}])
    with pytest.raises(ValueError, match=r"line 1: task 'squad' is not a RULER, LongBench, InfiniteBench or LooGLE"):
        _items(path)


def test_longbench_e_rows_and_subset_selection(tmp_path):
    row = {"input": "Q?", "context": "C.", "answers": ["a"], "length": 5, "language": "en", "all_classes": None}
    path = _write(
        tmp_path / "mixed.jsonl",
        [{**row, "dataset": "hotpotqa_e", "_id": "1"}, {**row, "dataset": "passage_count", "_id": "2"}],
    )
    assert [i.subset for i in _items(path)] == ["hotpotqa", "passage_count"]
    (count,) = _items(path, subset="passage_count")
    assert count.question.startswith("Please enter the final count") and count.answer_prefix == "The final answer is:"
    assert count.scorer("a") == {"score": 0.0}  # no number in the answer


def test_infinitebench_placeholders_come_from_the_input(tmp_path):
    math = _write(
        tmp_path / "math_find.jsonl",
        [{"id": 3, "context": "[4, 52, 7]", "input": "What is the largest number? The largest number of the list is:",
          "answer": [52], "options": []}],
    )  # fmt: skip
    (item,) = _items(math)
    assert item.context == "What is the largest number in the following list?\n\n[4, 52, 7]"
    assert item.scorer("52") == {"score": 1.0} and item.max_new_tokens == 3 and item.source_id == 3
    run = _write(
        tmp_path / "code_run.jsonl",
        [
            {
                "id": 0,
                "context": "def func_1(x): ...",
                "input": "What is func_1(-3)? {input}",
                "answer": [-6],
                "options": [],
            }
        ],
    )
    (item,) = _items(run)
    assert item.context.startswith("There is a function called func_1 in the following Python code.")
    assert item.question == "Please compute the exact value of func_1(-3)." and item.answer_prefix.endswith(
        "func_1(-3) is"
    )
    bad = _write(tmp_path / "passkey.jsonl", [{"id": 0, "context": "c", "input": "q", "answer": [5], "options": []}])
    with pytest.raises(ValueError, match=r"line 1: field 'answer' must hold strings for passkey"):
        _items(bad)


def test_the_leaderboard_runs_a_benchmark_file(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    file = FIXTURES / "longbench" / "hotpotqa.jsonl"
    args = ["--model", str(folder), "--task", "dataset", "--param", f"file={file}", "--param", "max_new_tokens=4"]
    leaderboard.main([*args, "--kept", "0.5", "--methods", "full,snapkv", "--samples", "2", "--out", str(tmp_path)])
    table = capsys.readouterr().out
    assert "| 0.5 | snapkv |" in table and "| 1 | full |" in table
    assert "| method | budget | hotpotqa |" in table  # the per-task table


def test_prompts_survive_chat_templates_that_trim_the_message(tiny):
    model, tokenizer = tiny
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<u>{{ m['content'] | trim }}</u>{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    task = make_task("dataset", model, tokenizer, file=str(FIXTURES / "kvpress" / "longbench_trec.jsonl"))
    sample = task.build_samples(1)[0]
    context, question = (tokenizer.decode(sample.inputs[key][0]) for key in ("context_ids", "question_ids"))
    assert context.startswith("<u>Please determine") and context.endswith("Type: Human being")
    assert question == "\n\nQuestion: Where is Bergen ?</u><a>Type:"
