"""``kvcompress lm-eval ARGS``: lm-eval's command line with the ``kvcompress`` model registered, offline.

Sets ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` unless already set (a user with network may set them to
0 to run Hub tasks), builds the local tasks (``kvcompress.lmeval.tasks``) from the data folder
(``$KVCOMPRESS_DATA``, else the books shipped with the package; ``kvc_wikitext`` needs a data folder) into
``tasks_dir()`` when a ``kvc_`` task is asked for, adds that folder to ``--include_path`` (unless one is given), and
runs lm-eval's own CLI with every other argument unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lm_eval.__main__ import cli_evaluate
from lm_eval.tasks import TaskManager

from kvcompress.lmeval.model import KVCompressLM  # noqa: F401  (registers the "kvcompress" model)
from kvcompress.lmeval.tasks import build_tasks

OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def tasks_dir() -> Path:
    """Where the local tasks are built: ``$XDG_CACHE_HOME/kvcompress/lmeval-tasks`` (``~/.cache/...``)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "kvcompress" / "lmeval-tasks"


def task_manager(
    data: str | os.PathLike[str] | None = None, include_defaults: bool = True, **build: int
) -> TaskManager:
    """An lm-eval ``TaskManager`` that knows the local tasks (built now from ``data`` with ``build`` options);
    ``include_defaults=False`` leaves out lm-eval's own tasks (indexing them takes most of a minute on 2 cores)."""
    folder = build_tasks(tasks_dir(), data, **build)
    return TaskManager(include_path=str(folder), include_defaults=include_defaults)


def with_local_tasks(argv: Sequence[str]) -> list[str]:
    """``argv`` plus ``--include_path`` to freshly built local tasks when a ``kvc_`` task is requested.

    A given ``--include_path`` is left alone (e.g. tasks built with other sizes by ``python -m
    kvcompress.lmeval.tasks``).
    """
    args = list(argv)
    if not any("kvc_" in arg for arg in args) or any(arg.startswith("--include") for arg in args):
        return args
    return [*args, "--include_path", str(build_tasks(tasks_dir()))]


def main(argv: Sequence[str] | None = None) -> int:
    for name in OFFLINE:
        os.environ.setdefault(name, "1")
    sys.argv = ["lm_eval", *with_local_tasks(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0
