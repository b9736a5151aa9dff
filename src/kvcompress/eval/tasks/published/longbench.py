"""LongBench (Bai et al., 2023, arXiv:2308.14508) files as THUDM/LongBench distributes them (``data/<dataset>.jsonl``,
LongBench-E ``<dataset>_e.jsonl``): ``input``, ``context``, ``answers``, ``length``, ``dataset``, ``language``,
``all_classes``, ``_id``.

The prompt is LongBench's ``config/dataset2prompt.json`` template for the row's ``dataset``, cut where the
``{context}`` placeholder ends: what comes before it and the context form the context; what follows it (the
restated instruction, the question) forms the question; the trailing answer cue (``Answer:``, ``Summary:``,
``The answer is:``, ``Type:``, ...) starts the assistant turn, as kvpress does. The blank lines between context
and question are one blank line here. As LongBench's ``pred.py``, the few-shot and code datasets (``trec``,
``triviaqa``, ``samsum``, ``lsht``, ``lcc``, ``repobench-p``) are prompted as raw text, without the chat
template; their prompt is then LongBench's exactly. Generation lengths: ``config/dataset2maxlen.json``.

Scores: LongBench's ``eval.py`` per dataset (see ``metrics``): ``qa_f1_score`` (single- and multi-document QA,
triviaqa), ``rouge_score`` (summaries, samsum), ``classification_score`` (trec, lsht), ``retrieval_score``
(passage retrieval), ``count_score`` (passage_count), ``code_sim_score`` (lcc, repobench-p); the best over the
references, on the first line only for trec, triviaqa, samsum and lsht. Not covered: ``multifieldqa_zh``,
``dureader`` and ``vcsum``, whose metrics need Chinese word segmentation.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

from kvcompress.eval.tasks.published import Item, Row, check_subset, split_suffix
from kvcompress.eval.tasks.published.metrics import LONGBENCH_METRICS, longbench_score

_QA = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
_MULTIDOC = _QA + "\n\nThe following are given passages.\n{context}\n\n" + _QA + "\n\nQuestion: {input}\nAnswer:"
_STORY = "answer the question based on the story asconcisely as you can, using a single phrase if possible."
_ARTICLE = (
    "Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question "
    'cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no '
    'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)
# THUDM/LongBench LongBench/config/dataset2prompt.json (the datasets scored here).
PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
    "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
    "{context}\n\nNow, " + _STORY + " Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. "
    + _ARTICLE
    + "\n\nArticle: {context}\n\n "
    + _ARTICLE.replace("Answer the question as", "Answer the question based on the above article as")
    + "\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
    "based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": _MULTIDOC,
    "2wikimqa": _MULTIDOC,
    "musique": _MULTIDOC,
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
    "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
    "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript "
    "in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
    "Now, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n"
    "{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other "
    "words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
    "{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
    "carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. "
    "In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
    "count of unique paragraphs after removing duplicates. The output format should only contain the number, such as "
    "1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
    "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the "
    'number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
    "etc.\n\nThe answer is: ",
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}"
    "\n\n下面是一个摘要\n\n{input}"
    '\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
# The answer cue that starts the assistant turn (kvpress's evaluation/benchmarks/longbench table).
ANSWER_PREFIXES = {
    "gov_report": "Summary:",
    "multi_news": "Summary:",
    "samsum": "Summary:",
    "trec": "Type:",
    "lsht": "类别：",
    "passage_count": "The final answer is:",
    "passage_retrieval_en": "The answer is:",
    "passage_retrieval_zh": "答案是：",
    "lcc": "Next line of code:\n",
    "repobench-p": "Next line of code:\n",
}
MAX_NEW_TOKENS = {  # config/dataset2maxlen.json
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}  # fmt: skip
RAW_PROMPT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")  # no chat template in LongBench's pred.py
NOT_COVERED = ("multifieldqa_zh", "dureader", "vcsum")


def dataset_name(row: Row) -> str:
    """The row's LongBench dataset (LongBench-E's ``_e`` suffix dropped)."""
    name = row.text("dataset")
    name = name.removesuffix("_e")
    if name in NOT_COVERED:
        raise row.error(f"LongBench dataset {name!r} is not covered (its metric needs Chinese word segmentation)")
    if name not in PROMPTS:
        raise row.error(f"field 'dataset' must be a LongBench dataset ({', '.join(PROMPTS)}); got {name!r}")
    return name


def prompt_parts(name: str, context: str, question_input: str) -> tuple[str, str, str]:
    """(context, question, answer prefix) of LongBench's prompt for dataset ``name``."""
    before, after = PROMPTS[name].split("{context}")
    question = after.replace("{input}", question_input)
    cue = ANSWER_PREFIXES.get(name, "Answer:")
    if name in RAW_PROMPT:  # raw text: the parts are joined as they are, so the prompt is LongBench's exactly
        return (
            (before + context, question[: -len(cue)], cue)
            if question.endswith(cue)
            else (before + context, question, "")
        )
    question, prefix = split_suffix(question.strip("\n "), cue)
    return before + context, question, prefix


def scorer(name: str, row: Row, answers_key: str = "answers"):
    """(references, scorer) of a LongBench row of dataset ``name``."""
    answers = row.texts(answers_key)
    classes = row.field("all_classes") or []
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise row.error("field 'all_classes' must be null or a list of strings")
    if LONGBENCH_METRICS[name].__name__ == "classification_score" and not classes:
        raise row.error(f"field 'all_classes' must list the classes for {name}")
    score = partial(longbench_score, name, references=answers, all_classes=classes)
    return answers, lambda prediction: {"score": score(prediction)}


def longbench_items(rows: Iterator[Row], subset: str | None) -> Iterator[Item]:
    if subset is not None:
        check_subset(subset.removesuffix("_e"), PROMPTS, "longbench", "--param subset")
    count = 0
    for row in rows:
        name = dataset_name(row)
        if subset is not None and name != subset.removesuffix("_e"):
            continue
        context, question, prefix = prompt_parts(name, row.text("context"), row.text("input"))
        answers, score = scorer(name, row)
        yield Item(
            id=f"{name}-{count:05d}",
            subset=name,
            context=context,
            question=question,
            answer_prefix=prefix,
            answers=answers,
            max_new_tokens=MAX_NEW_TOKENS[name],
            scorer=score,
            chat=name not in RAW_PROMPT,
            source_id=row.data.get("_id"),
        )
        count += 1
