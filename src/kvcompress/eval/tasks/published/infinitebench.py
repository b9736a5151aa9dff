"""InfiniteBench (Zhang et al., 2024, arXiv:2402.13718) files as OpenBMB/InfiniteBench distributes them
(``<task>.jsonl``, e.g. ``kv_retrieval.jsonl``): ``id``, ``context``, ``input``, ``answer``, ``options``.

The task is the file name (or ``subset``). Prompts are InfiniteBench's ``src/prompt.py`` templates for open
models (``yarn_mistral_templates``, the ones kvpress uses), cut where ``{context}`` ends: the instruction before
it and the context form the context; the question and options after it form the question; the template's closing
cue (``The pass key is``, ``Answer:``, ...) starts the assistant turn. As kvpress does, the cue ``The value
associated with the specified key is:`` that ends kv_retrieval's ``input`` moves to the assistant turn.
Generation lengths: InfiniteBench's ``DATA_NAME_TO_MAX_NEW_TOKENS``.

Scores: InfiniteBench's ``src/compute_scores.py`` per task, reimplemented: passkey and number_string, the first
integer in the answer equals the label; kv_retrieval, the label is one of the answer's words (InfiniteBench
compares the label list itself, which never matches; its first element is used, as kvpress does);
longbook_qa_eng, token F1 (Chinese: per character for longbook_qa_chn); longbook_choice_eng and code_debug, the
chosen option (label: the option's text and its letter, ``get_answer``); longdialogue_qa_eng, the name is one of
the upper-cased answer's words; math_find, the first number equals the label; code_run, the last word is the
integer label; math_calc, the fraction of leading values right; longbook_sum_eng, ROUGE-Lsum F (rouge-score
rather than Hugging Face ``evaluate``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from kvcompress.eval.tasks.published import Item, Row, split_suffix
from kvcompress.eval.tasks.published.metrics import normalize_zh_answer, qa_f1_score, rouge, token_f1

_OPTIONS = "A. {A}\nB. {B}\nC. {C}\nD. {D}"
_HIDDEN = "There is an important info hidden inside a lot of irrelevant text. Find it"
# task -> (text before the context, question after it, answer cue): yarn_mistral_templates cut at {context}.
TEMPLATES = {
    "passkey": (_HIDDEN + " and memorize it. I will quiz you about the important information.\n\n", "{input}",
                "The pass key is"),
    "number_string": (_HIDDEN + ". I will quiz you about the important information there.\n\n", "{input}",
                      "The sequence of digits is"),
    "kv_retrieval": ("Extract the value corresponding to the specified key in the JSON object below.\n\n", "{input}",
                     "The value associated with the specified key is:"),
    "longbook_sum_eng": ("Summarize the book below.\n\n", "", "Summary:"),
    "longbook_choice_eng": ("Read the book and answer the question.\n\n", "Question: {input}\n" + _OPTIONS,
                            "The letter of the correct answer is"),
    "longbook_qa_eng": ("Read the book and answer the question. Be very concise in your answer.\n\n",
                        "Question: {input}", "Answer:"),
    "longbook_qa_chn": ("阅读以下书籍然后回答问题。\n\n", "问题：{input}", "答案："),
    "math_find": ("{prefix}\n\n", "{input}", ""),
    "math_calc": ("Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: "
                  "[1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: ", "", "Values:"),
    "code_run": ("There is a function called {func} in the following Python code.\n\n",
                 "Please compute the exact value of {func_call}.", "The value of {func_call} is"),
    "code_debug": ("Following is a Python code where exactly one of the functions/methods has a deliberate error "
                   "that makes it crash.\n\n", "Options:\n" + _OPTIONS, "The correct option is:"),
    "longdialogue_qa_eng": ('Below is a dialogue script where one random occurrence of a character name is replaced '
                            'with "$$MASK$$", and you should try to guess who that character is.\n\n', "",
                            "The name that has been replaced with $$MASK$$ is likely"),
}  # fmt: skip
MAX_NEW_TOKENS = {
    "passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_sum_eng": 1200, "longbook_choice_eng": 40,
    "longbook_qa_eng": 40, "longbook_qa_chn": 40, "longdialogue_qa_eng": 40, "math_find": 3, "math_calc": 30000,
    "code_run": 5, "code_debug": 5,
}  # fmt: skip
CHOICE = ("longbook_choice_eng", "code_debug")


def first_int_match(prediction: str) -> str:
    return next((part for part in re.split("[^0-9]", prediction) if part), "")


def _words(prediction: str, drop: str) -> list[str]:
    for ch in drop:
        prediction = prediction.replace(ch, " ")
    return prediction.split()


def _after_cue(pred: str, cues: tuple[str, ...], targets: list[str]) -> bool | None:
    """Whether the text after the first cue found starts with a target; ``None`` when no cue is found."""
    for cue in cues:
        idx = pred.find(cue)
        if idx == -1:
            continue
        rest = pred[idx + len(cue) + 1 :] if len(pred) >= idx + len(cue) + 1 else None
        return rest is not None and any(rest.startswith(t) for t in targets)
    return None


def _squeeze(pred: str, drop: list[str]) -> str:
    for ch in drop:
        pred = pred.replace(ch, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    return pred


def choice_score(pred: str, label: list[str]) -> bool:
    """``get_score_one_longbook_choice_eng``; ``label`` = [option text, letter]."""
    pred = pred.strip()
    if pred == "":
        return False
    if pred[0] in "ABCD":
        return pred[0] in label
    if pred in label:
        return True
    pred = _squeeze(pred, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"])
    found = _after_cue(pred, ("answer is:", "answer:", "answer is", "option is"), label)
    if found is not None:
        return found
    return next((word in label for word in pred.split() if word in "ABCD"), False)


def code_debug_score(pred: str, label: list[str]) -> bool:
    """``get_score_one_code_debug``; ``label`` = [function name, letter]."""
    pred = pred.strip()
    fn_name, letter = label
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return True
    pred = _squeeze(pred, ["\n", "`", "'", '"', "-", "*", "Option", "option"])
    return bool(_after_cue(pred, ("answer is:", "is:", "answer:", "correct option is:"), [letter, fn_name]))


def math_find_score(pred: str, label: int | float) -> bool:
    found = re.search(r"\d+\.\d+|\d+", pred)
    if found is None:
        return False
    return (int(found.group(0)) if isinstance(label, int) else float(found.group(0))) == label


def code_run_score(pred: str, label: int) -> bool:
    words = _words(pred.strip(), "\n.`'\":")
    try:
        return bool(words) and int(words[-1]) == label
    except ValueError:
        return False


def math_calc_score(pred: str, label: list[int]) -> float:
    values = [int(part) for part in re.split("[^0-9]", pred) if part]
    right = 0
    for expected, got in zip(label, values):  # noqa: B905 (the prediction may be shorter)
        if expected != got:
            break
        right += 1
    return right / len(label)


def infinitebench_score(task: str, pred: str, answers: Any) -> float:
    """InfiniteBench's score of one prediction (``answers`` as ``get_answer`` gives them)."""
    first = answers[0]
    rules: dict[str, Callable[[], object]] = {
        "passkey": lambda: str(first) == first_int_match(pred),
        "number_string": lambda: str(first) == first_int_match(pred),
        "kv_retrieval": lambda: first in _words(pred, "\n:\"'.,?!{}"),
        "longbook_qa_eng": lambda: max(qa_f1_score(pred, ref) for ref in answers),
        "longbook_qa_chn": lambda: max(token_f1(list(normalize_zh_answer(pred)), list(normalize_zh_answer(r)))
                                       for r in answers),
        "longbook_choice_eng": lambda: choice_score(pred, answers),
        "code_debug": lambda: code_debug_score(pred, answers),
        "longdialogue_qa_eng": lambda: first in [w.upper() for w in _words(pred.strip(), "\n:\"'.,?!{}")],
        "math_find": lambda: math_find_score(pred, first),
        "code_run": lambda: code_run_score(pred, first),
        "math_calc": lambda: math_calc_score(pred, first if isinstance(first, list) else answers),
        "longbook_sum_eng": lambda: rouge(pred, first, "rougeLsum"),
    }  # fmt: skip
    return float(rules[task]())


def _answers(row: Row, task: str) -> Any:
    answer = row.field("answer")
    answers = answer if isinstance(answer, list) else [answer]
    if not answers:
        raise row.error("field 'answer' must not be empty")
    if task in CHOICE:
        options = row.field("options")
        if not isinstance(options, list) or len(options) != 4 or not all(isinstance(o, str) for o in options):
            raise row.error(f"field 'options' must list 4 strings for {task}")
        if len(answers) == 2 and answers[1] in ("A", "B", "C", "D"):
            return answers
        if answers[0] not in options:
            raise row.error(f"the answer {answers[0]!r} is not one of the options")
        return [answers[0], "ABCD"[options.index(answers[0])]]
    numeric = task in ("math_find", "code_run", "math_calc")
    kind = (int, float, list) if numeric else (str,)
    if not all(isinstance(a, kind) and not isinstance(a, bool) for a in answers):
        raise row.error(f"field 'answer' must hold {'numbers' if numeric else 'strings'} for {task}")
    return answers


def _prompt(row: Row, task: str) -> tuple[str, str, str]:
    question_input = row.text("input")
    fields = {"input": question_input}
    if task == "math_find":
        found = re.findall(r"The .+ of", question_input)
        if not found:
            raise row.error("math_find input names no target ('The ... of')")
        fields["prefix"] = f"What is {found[0].lower()[:-3]} in the following list?"
    if task == "code_run":
        found = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", question_input)
        if not found:
            raise row.error("code_run input names no call 'func_N(x)'")
        fields["func_call"], fields["func"] = found[0], found[0].split("(")[0]
    if task in CHOICE:
        fields |= dict(zip("ABCD", row.field("options"), strict=True))
    # One pass over each template: placeholders are filled, the data put in is never read for placeholders.
    before, after, cue = (
        re.sub(r"\{(\w+)\}", lambda m: fields.get(m.group(1), m.group(0)), part) for part in TEMPLATES[task]
    )
    if task == "kv_retrieval":
        after, _ = split_suffix(after, cue)
    return before + row.text("context"), after.strip(), cue


def infinitebench_items(rows: Iterator[Row], subset: str) -> Iterator[Item]:
    for count, row in enumerate(rows):
        context, question, prefix = _prompt(row, subset)
        answers = _answers(row, subset)
        yield Item(
            id=f"{subset}-{count:05d}",
            subset=subset,
            context=context,
            question=question,
            answer_prefix=prefix,
            answers=answers,
            max_new_tokens=MAX_NEW_TOKENS[subset],
            scorer=lambda pred, a=answers: {"score": infinitebench_score(subset, pred, a)},
            source_id=row.data.get("id"),
        )
