"""Evaluation tasks by name. ``make_task(name, model, tokenizer, seed, **params)`` builds one."""

from __future__ import annotations

from typing import Any

from kvcompress.eval.tasks.base import Result, Sample, Task, run_task
from kvcompress.eval.tasks.datasets import DatasetTask
from kvcompress.eval.tasks.docqa import DocQATask
from kvcompress.eval.tasks.niah import NiahTask
from kvcompress.eval.tasks.passkey import PasskeyTask
from kvcompress.eval.tasks.perplexity import StreamPerplexityTask, WikitextPerplexityTask
from kvcompress.eval.tasks.ruler import RulerTask
from kvcompress.eval.tasks.summary import SummaryTask

TASKS: dict[str, type[Task]] = {
    task.name: task
    for task in (
        StreamPerplexityTask,
        WikitextPerplexityTask,
        PasskeyTask,
        NiahTask,
        RulerTask,
        DocQATask,
        SummaryTask,
        DatasetTask,
    )
}


def make_task(name: str, model: Any, tokenizer: Any, seed: int = 0, **params: Any) -> Task:
    """Build task ``name`` (see ``TASKS``) with its parameters; unknown names or parameters raise ``ValueError``."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {name!r}")
    return TASKS[name](model, tokenizer, seed=seed, **params)


__all__ = ["TASKS", "Result", "Sample", "Task", "make_task", "run_task"]
