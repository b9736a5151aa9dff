"""RULER (Hsieh et al., 2024, arXiv:2404.06654) files as NVIDIA/RULER's ``scripts/data/prepare.py`` writes them, and
kvpress's export of them.

``ruler`` schema: ``<save_dir>/<task>/validation.jsonl``, one row per sample with ``index``, ``input`` (the whole
prompt: instruction, haystack, question), ``outputs`` (the expected strings), ``length`` (tokens), and in current
RULER ``answer_prefix`` (the answer's start, kept out of ``input``; older files end ``input`` with it). The task
(``niah_single_1`` ... ``qa_2``) is the folder name; it can be given as ``subset`` instead, and is otherwise told
from the question. ``input`` is split as kvpress splits it: the context ends where the last occurrence of the
task's question starts (``QUESTION_PATTERNS``); the answer prefix starts the assistant turn. Prepare files with
``--model_template_type base`` (the chat template is applied here).

``kvpress`` schema: kvpress's datasets (``simonjegou/ruler`` and the other ``evaluation/benchmarks`` exports)
saved as JSON lines: ``context``, ``question``, ``answer_prefix``, ``answer``, ``task``, ``max_new_tokens``. Rows
of a RULER task are scored as RULER; rows of a LongBench, InfiniteBench or LooGLE task as that benchmark (their
other columns, e.g. LongBench's ``answers`` and ``all_classes``, are read as there).

Scores (RULER's ``scripts/eval/synthetic/constants.py``): ``string_match_all`` (the fraction of the expected
strings found in the answer, case-insensitive) for niah, vt, cwe and fwe; ``string_match_part`` (1 if any is
found) for qa; the prediction's control characters become new lines first, as RULER's ``postprocess_pred`` does.
Generation lengths are RULER's ``tokens_to_generate`` per task family.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial

from kvcompress.eval.tasks.niah import string_match_all, string_match_part
from kvcompress.eval.tasks.published import Item, Row, check_subset

TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
ANSWER_PATTERNS = {"niah": re.compile(r"The special magic")} | {
    family: re.compile(r"Answer:") for family in ("vt", "cwe", "fwe", "qa")
}
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
_CONTROL = re.compile(r"[\x00-\x1f]")


def family(task: str) -> str:
    """``niah_multikey_2`` -> ``niah``: the RULER template family that fixes the question, metric and length."""
    return task.split("_")[0]


def ruler_scores(prediction: str, references: list[str], task: str) -> dict[str, float]:
    text = _CONTROL.sub("\n", prediction.strip()).strip()
    match = string_match_part if family(task) == "qa" else string_match_all
    return {"score": match(text, references)}


def _task_of(row: Row, subset: str | None) -> str:
    if subset is not None:
        return check_subset(subset, TASKS + tuple(QUESTION_PATTERNS), "ruler", "--param subset")
    if row.path.parent.name in TASKS:
        return row.path.parent.name
    text = row.text("input")
    for name, pattern in QUESTION_PATTERNS.items():
        if pattern.search(text):
            return name  # the family: enough for the question, the metric and the length
    raise row.error(
        f"cannot tell the RULER task from the folder name {row.path.parent.name!r} or the question; "
        f"give --param subset=one of {', '.join(TASKS)}"
    )


def _split(row: Row, task: str) -> tuple[str, str, str]:
    """(context, question, answer prefix) of a RULER row."""
    text = row.text("input")
    starts = list(QUESTION_PATTERNS[family(task)].finditer(text))
    if not starts:
        raise row.error(
            f"input has no RULER {family(task)} question (looked for {QUESTION_PATTERNS[family(task)].pattern!r})"
        )
    context, question = text[: starts[-1].start()], text[starts[-1].start() :]
    if "answer_prefix" in row.data:
        prefix = row.text("answer_prefix")
    else:  # older RULER files end the input with the answer prefix
        found = ANSWER_PATTERNS[family(task)].search(question)
        question, prefix = (question[: found.start()], question[found.start() :]) if found else (question, "")
    return context.rstrip(), question.strip(), prefix.strip()


def ruler_items(rows: Iterator[Row], subset: str | None) -> Iterator[Item]:
    task = None
    for count, row in enumerate(rows):
        outputs = row.texts("outputs")
        task = task or _task_of(row, subset)
        context, question, prefix = _split(row, task)
        yield Item(
            id=f"{task}-{count:05d}",
            subset=task,
            context=context,
            question=question,
            answer_prefix=prefix,
            answers=outputs,
            max_new_tokens=MAX_NEW_TOKENS[family(task)],
            scorer=partial(ruler_scores, references=outputs, task=task),
            stop_when_found=() if family(task) == "qa" else tuple(outputs),
            source_id=row.data.get("index"),
        )


def kvpress_items(rows: Iterator[Row], subset: str | None, scorer_for) -> Iterator[Item]:
    """Items of a kvpress export; ``scorer_for(task, row)`` gives the scorer of a non-RULER task's row."""
    count = 0
    for row in rows:
        task = row.text("task")
        if subset is not None and task != subset:
            continue
        if task in TASKS:
            answers = row.texts("answer")
            scorer = partial(ruler_scores, references=answers, task=task)
            stop = () if family(task) == "qa" else tuple(answers)
        else:
            answers, scorer = scorer_for(task, row)
            stop = ()
        yield Item(
            id=f"{task}-{count:05d}",
            subset=task,
            context=row.text("context"),
            question=row.text("question"),
            answer_prefix=row.text("answer_prefix"),
            answers=answers,
            max_new_tokens=row.integer("max_new_tokens"),
            scorer=scorer,
            stop_when_found=stop,
        )
        count += 1
