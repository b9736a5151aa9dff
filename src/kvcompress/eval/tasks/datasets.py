"""``dataset``: a published long-context benchmark file you downloaded, in its authors' schema, scored their way.

    kvcompress eval dataset --param file=RULER/4096/niah_single_1/validation.jsonl \\
        --methods full,snapkv,streaming --budgets 0.25,0.5 --samples 50 --out runs/ruler4k
    kvcompress eval dataset --param file=LongBench/data/hotpotqa.jsonl --param max_context_tokens=7500
    kvcompress eval dataset --param file=InfiniteBench/kv_retrieval.jsonl --param modes=agnostic
    kvcompress eval dataset --param file=LooGLE/shortdep_qa.jsonl --param schema=loogle

Parameters (``--param key=value``):

- ``file`` (required): a JSON-lines file of one benchmark task.
- ``schema``: ``ruler`` (what RULER's ``prepare.py`` writes), ``kvpress`` (kvpress's datasets saved as JSON
  lines: ``context``, ``question``, ``answer_prefix``, ``answer``, ``task``, ``max_new_tokens``), ``longbench``,
  ``infinitebench``, ``loogle``; default ``auto``: told from the first row's fields.
- ``subset``: the benchmark task (``niah_single_1``, ``hotpotqa``, ``kv_retrieval``, ``shortdep_qa``, ...);
  default: the RULER folder name, LongBench's ``dataset`` field, the InfiniteBench / LooGLE file name, every
  task of a kvpress file. In a LongBench or kvpress file it also selects the rows of that task.
- ``max_new_tokens``: default each benchmark's own length per task.
- ``max_context_tokens``: cut the context to this many tokens by dropping its middle (LongBench's, LooGLE's and
  InfiniteBench's truncation, for contexts longer than the model's window); default: no cut.
- ``modes``: ``agnostic`` (kvpress's protocol: the context is compressed, then the question is asked) and/or
  ``aware`` (the question inside what is compressed); default both.
- ``chunk_size``: default none: what is compressed goes in one forward, then the cache is compressed (kvpress's
  protocol, as the ``ruler`` task); a number prefills in chunks of that many tokens, evicting between them.

``--samples N`` takes the first ``N`` questions of the file (fewer if it holds fewer; a LooGLE document gives one
per question). Sample ids are ``<task>-<number>`` in file order, so a rerun with a larger ``--samples`` resumes.
Each row's ``scores["score"]`` is the benchmark's metric for the task in [0, 1] (RULER's string match,
LongBench's per-dataset metric, InfiniteBench's per-task scorer, LooGLE's ROUGE-L recall and cloze match; see
``published``); ``info["subtask"]`` names the task, so ``kvcompress report`` tabulates the score per task.

Files are read as JSON only and nothing in them runs. A malformed file stops the run with one line naming the file,
the line and what is wrong (exit status 2 from the command line). Where the prompt differs from the benchmark's
(the chat template, one blank line between context and question) or a metric uses another library, the schema
module says so; docs/datasets.md says how to download each benchmark.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvcompress.eval.tasks.base import Result, Sample, check_positive_int
from kvcompress.eval.tasks.prompting import MODES, encode, split_prompt
from kvcompress.eval.tasks.published import (
    SCHEMA_NAMES,
    Item,
    Row,
    detect_schema,
    file_subset,
    infinitebench,
    longbench,
    loogle,
    read_rows,
    ruler,
)
from kvcompress.eval.tasks.qa import QATask

logger = logging.getLogger(__name__)

SCHEMAS = ("auto", *SCHEMA_NAMES)
_SHORT_ANSWERS = 1000  # references longer than this (characters of JSON) are left out of the rows' info


def kvpress_scorer(task: str, row: Row):
    """(references, scorer) of a kvpress row whose task is LongBench's, InfiniteBench's or LooGLE's."""
    name = task.removesuffix("_e")
    if name in longbench.PROMPTS:
        return longbench.scorer(name, row)
    if task in infinitebench.TEMPLATES:
        answers = row.field("answer")
        answers = answers if isinstance(answers, list) and answers else [answers]
        if task == "code_debug" and len(answers) == 1:  # kvpress keeps the letter only
            answers = [answers[0], answers[0]]
        return answers, lambda pred: {"score": infinitebench.infinitebench_score(task, pred, answers)}
    if task in loogle.TASKS:
        answer = row.text("answer")
        if task == "shortdep_cloze":  # kvpress stores the masks as a JSON string
            try:
                answer = loogle.parse_literal(answer)
            except ValueError:
                raise row.error("field 'answer' of shortdep_cloze must be a JSON object of masks") from None
            return answer, lambda pred: loogle.cloze_scores(pred, answer)
        return answer, lambda pred: loogle.text_scores(pred, answer)
    raise row.error(f"task {task!r} is not a RULER, LongBench, InfiniteBench or LooGLE task")


def load_items(path: str | Path, schema: str = "auto", subset: str | None = None) -> Iterator[Item]:
    """The questions of a benchmark file, read lazily; ``ValueError`` for a missing or malformed file."""
    path = Path(path).expanduser()
    rows = read_rows(path, "ruler" if schema == "auto" else schema)
    first = next(rows, None)
    if first is None:
        raise ValueError(f"file {str(path)!r} holds no rows")
    if schema == "auto":
        schema = detect_schema(first.data) or ""
        if not schema:
            raise first.error(
                f"cannot tell the schema from the fields {', '.join(sorted(first.data))}; "
                f"give --param schema=one of {', '.join(SCHEMA_NAMES)}"
            )
    rows = (dataclasses.replace(row, schema=schema) for row in itertools.chain([first], rows))
    if schema == "ruler":
        return ruler.ruler_items(rows, subset)
    if schema == "kvpress":
        return ruler.kvpress_items(rows, subset, kvpress_scorer)
    if schema == "longbench":
        return longbench.longbench_items(rows, subset)
    if schema == "infinitebench":
        return infinitebench.infinitebench_items(rows, file_subset(path, subset, infinitebench.TEMPLATES, schema))
    return loogle.loogle_items(rows, file_subset(path, subset, loogle.TASKS, schema))


def cut_middle(ids: torch.Tensor, limit: int) -> torch.Tensor:
    """``ids`` (``[1, T]``) without its middle tokens when ``T > limit``: the first ``limit // 2`` and the rest
    from the end."""
    if ids.shape[1] <= limit:
        return ids
    head = limit // 2
    return torch.cat([ids[:, :head], ids[:, ids.shape[1] - (limit - head) :]], dim=1)


class DatasetTask(QATask):
    name = "dataset"
    metrics = ("score", "partial", "rouge1", "rouge2", "bleu1", "bleu4")
    description = "a published benchmark file (RULER, LongBench, InfiniteBench, LooGLE; kvpress exports); its metric"
    defaults = {
        "file": None,
        "schema": "auto",
        "subset": None,
        "max_new_tokens": None,  # None: each benchmark's own per task
        "max_context_tokens": None,
        "chunk_size": None,  # None: one forward, then compression (kvpress's protocol)
        "modes": MODES,
    }

    def validate(self) -> None:
        super().validate()
        if isinstance(self.params["file"], tuple):
            raise ValueError(f"file must be one path, got {self.params['file']!r} ('+' separates list items)")
        if not isinstance(self.params["file"], str) or not self.params["file"]:
            raise ValueError("the dataset task needs --param file=PATH (a .jsonl file of RULER, LongBench, ...)")
        if self.params["schema"] not in SCHEMAS:
            raise ValueError(f"schema must be one of {', '.join(SCHEMAS)}; got {self.params['schema']!r}")
        if self.params["subset"] is not None and not isinstance(self.params["subset"], str):
            raise ValueError(f"subset must be a task name, got {self.params['subset']!r}")
        if self.params["max_context_tokens"] is not None:
            check_positive_int(self.params["max_context_tokens"], "max_context_tokens", 2)

    def build_samples(self, count: int) -> list[Sample]:
        """The first ``count`` questions of the file (all of them when it holds fewer)."""
        items = load_items(self.params["file"], self.params["schema"], self.params["subset"])
        samples = [self.build_item(item) for item in itertools.islice(items, count)]
        if not samples:
            raise ValueError(f"file {self.params['file']!r} has no question of subset {self.params['subset']!r}")
        if len(samples) < count:
            logger.warning("%s holds %d questions; using them all", self.params["file"], len(samples))
        return samples

    def build_item(self, item: Item) -> Sample:
        """Token ids of one question: the chat prompt split after the context (or LongBench's raw prompt)."""
        if item.chat:  # one blank line between the parts; no outer white space (chat templates may trim it)
            context_ids, question_ids = split_prompt(
                self.tokenizer, item.context.strip(), item.question.strip(), item.answer_prefix
            )
        else:
            context_ids = torch.tensor([self.tokenizer(item.context)["input_ids"]], dtype=torch.long)
            question_ids = encode(self.tokenizer, item.question + item.answer_prefix)
        if question_ids.shape[1] == 0:
            raise ValueError(f"{item.id} of {self.params['file']}: the question and answer prefix are empty")
        seen = context_ids.shape[1]
        if self.params["max_context_tokens"] is not None:
            context_ids = cut_middle(context_ids, self.params["max_context_tokens"])
        info: dict[str, Any] = {
            "subtask": item.subset,
            "source_id": item.source_id,
            "prompt_tokens": context_ids.shape[1] + question_ids.shape[1],
            "context_tokens_cut": seen - context_ids.shape[1],
        }
        if len(repr(item.answers)) <= _SHORT_ANSWERS:
            info["answers"] = item.answers
        return Sample(
            id=item.id, inputs={"context_ids": context_ids, "question_ids": question_ids, "item": item}, info=info
        )

    def evaluate(self, sample, config, cache, mode):
        item: Item = sample.inputs["item"]
        limit = self.params["max_new_tokens"] or item.max_new_tokens
        text = self.generate(sample, cache, mode, limit, list(item.stop_when_found) or None)
        return Result(scores=item.scorer(text), extra={"prediction": text})
