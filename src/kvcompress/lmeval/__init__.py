"""lm-evaluation-harness integration: the ``kvcompress`` model and local offline tasks (needs ``lm-eval``).

Importing this package registers the model with lm-eval. The installed lm-eval (0.4.13) discovers no plugins, so
the command line goes through ``kvcompress lm-eval ...`` (or ``python -m kvcompress.lmeval ...``), which registers
the model, builds the local tasks and hands every argument to lm-eval's own command line. From Python::

    import lm_eval, kvcompress.lmeval
    lm_eval.simple_evaluate(model="kvcompress", model_args="pretrained=smollm2-135m,method=h2o,budget=256",
                            tasks=["kvc_needle"], task_manager=kvcompress.lmeval.task_manager())
"""

from kvcompress.lmeval.cli import main, task_manager, tasks_dir
from kvcompress.lmeval.model import KVCompressLM
from kvcompress.lmeval.tasks import TASK_NAMES, build_tasks

__all__ = ["TASK_NAMES", "KVCompressLM", "build_tasks", "main", "task_manager", "tasks_dir"]
