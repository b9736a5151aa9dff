"""Evaluation suite: tasks, a resumable runner and reports.

    >>> from kvcompress.eval.runner import run_eval
    >>> from kvcompress.eval.report import write_report
    >>> path = run_eval("passkey", "smollm2-135m", ["full", "window", "h2o"], [64, 128], samples=10, out_dir="runs/x")
    >>> write_report("runs/x", "runs/x/report")

Tasks (``TASKS``): ``stream-ppl``, ``ppl``, ``passkey``, ``niah``, ``docqa``, ``summary``. Command lines:
``python -m kvcompress.eval.runner TASK ...`` and ``python -m kvcompress.eval.report RUN_DIR --out PREFIX``.
"""

from __future__ import annotations

from kvcompress.eval.configs import EvalConfig, expand_configs, parse_method
from kvcompress.eval.tasks import TASKS, make_task, run_task

__all__ = ["TASKS", "EvalConfig", "expand_configs", "make_task", "parse_method", "run_task"]
