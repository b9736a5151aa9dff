"""kvpress's presses beside kvcompress's methods in one leaderboard, on identical token ids (``--kvpress``).

kvpress 0.5.5 pins an older ``transformers`` than kvcompress needs, so it runs in its own environment (for example
``scripts/vs_kvpress_env.sh``'s): the leaderboard writes its samples' token ids to ``<out>/kvpress-samples.json``,
runs ``kvpress_side.py`` (a script importing nothing of kvcompress) with that environment's Python, which appends
one row per sample x press x kept ratio to ``<out>/kvpress.jsonl`` (resumable), and scores the answers with the
task's own metric. The rows join the table as ``kvpress:<Press>`` at the same kept ratio; their bytes are what the
press's cache holds (every context token for presses that only mask), so the table compares stored bytes, not
masked ratios.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from kvcompress.core.model_spec import ModelSpec
from kvcompress.eval.tasks.base import Sample
from kvcompress.eval.tasks.qa import QATask
from kvcompress.models.registry import MODELS, model_cache_dir
from kvcompress.results import read_rows

SIDE_SCRIPT = Path(__file__).with_name("kvpress_side.py")
PREFIX = "kvpress:"


def check_kvpress(python: str, presses: list[str], task: QATask) -> None:
    """``ValueError`` naming the option for a Python that cannot run, no presses, or a task without a text metric."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"--kvpress {python!r} is not an executable Python (give kvpress's environment's python)")
    if not presses:
        raise ValueError("--presses needs at least one kvpress press (e.g. KVzipPress,KeyDiffPress) with --kvpress")
    if type(task).score_text is QATask.score_text:
        raise ValueError(f"--kvpress needs a task that scores answer text (ruler, niah); got {task.name!r}")


def model_folder(model: str) -> str:
    """The local folder kvpress loads: a registry model's converted weights, or the path or id given."""
    return str(model_cache_dir(model)) if model in MODELS else model


def bytes_per_token(model) -> int:
    spec = ModelSpec.of(model)
    return 2 * spec.layers * spec.kv_heads * spec.head_dim * next(model.parameters()).element_size()


def write_samples(path: Path, model: str, loaded, samples: list[Sample], kept: list[float], presses: list[str]):
    spec = {
        "model_dir": model_folder(model),
        "kept": kept,
        "presses": presses,
        "bytes_per_token": bytes_per_token(loaded),
        "samples": [
            {
                "id": s.id,
                "context_ids": s.inputs["context_ids"][0].tolist(),
                "question_ids": s.inputs["question_ids"][0].tolist(),
                "max_new_tokens": s.inputs["max_new_tokens"],
            }
            for s in samples
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec), encoding="utf-8")


def run_side(python: str, samples_path: Path, out: Path, threads: int) -> None:
    """Run the kvpress side; its progress lines go to this process's output. ``RuntimeError`` if it fails."""
    command = [python, str(SIDE_SCRIPT), str(samples_path), str(out), "--threads", str(threads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    status = subprocess.run(command, env=env, check=False).returncode
    if status:
        raise RuntimeError(f"the kvpress side exited with status {status}: {' '.join(command)}")


def leaderboard_rows(task: QATask, samples: list[Sample], side: Path) -> list[dict[str, Any]]:
    """The side's rows as leaderboard result rows, scored by ``task.score_text`` (rows of other samples skipped)."""
    by_id = {s.id: s for s in samples}
    rows = []
    for row in read_rows(side):
        sample = by_id.get(row.get("sample"))
        if sample is None:
            continue
        label = PREFIX + row["press"]
        rows.append(
            {
                "kind": "result",
                "sample": sample.id,
                "method": label,
                "label": label,
                "params": {},
                "budget": row["kept"],
                "scores": task.score_text(sample, row["prediction"]),
                "kv_bytes": row["kv_bytes"],
                "prefill_s": row["prefill_s"],
                "decode_s": row["decode_s"],
                "new_tokens": row["new_tokens"],
                "info": sample.info,
            }
        )
    return rows
