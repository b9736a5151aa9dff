"""The shared input of the comparison: niah samples as token ids, the budgets and the model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcompress.eval.tasks.niah import NiahTask
from kvcompress.models import load_model, model_cache_dir

SAMPLES_FILE = "samples.json"


def build_samples(
    count: int, length: int, budgets: list[int], seed: int = 0, model: str = "smollm2-135m", subtask: str = "single"
) -> dict[str, Any]:
    """``count`` niah samples of ``subtask`` at about ``length`` prompt tokens, as JSON-safe token ids.

    The context (chat header, RULER's instruction, the haystack with the needle) is what both sides compress;
    the question (with the end of the user turn, the assistant header and RULER's answer prefix) is fed after
    compression, as kvpress's pipeline does (query-agnostic).
    """
    loaded, tokenizer = load_model(model)
    task = NiahTask(loaded, tokenizer, seed=seed, length=length, subtasks=(subtask,), modes=("agnostic",))
    samples = task.build_samples(count)
    shortest = min(s.inputs["context_ids"].shape[1] for s in samples)
    for budget in budgets:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget < shortest:
            raise ValueError(f"budgets must be integers in [1, {shortest - 1}] (the shortest context), got {budget!r}")
    return {
        "model": model,
        "model_dir": str(model_cache_dir(model)),
        "seed": seed,
        "length": length,
        "subtask": subtask,
        "budgets": list(budgets),
        "samples": [
            {
                "id": s.id,
                "context_ids": s.inputs["context_ids"][0].tolist(),
                "question_ids": s.inputs["question_ids"][0].tolist(),
                "answers": s.inputs["answers"],
                "max_new_tokens": s.inputs["max_new_tokens"],
                "depths": s.info["depths"],
            }
            for s in samples
        ],
    }


def write_samples(out_dir: str | Path, **kwargs: Any) -> Path:
    path = Path(out_dir) / SAMPLES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(build_samples(**kwargs)))
    return path


def read_samples(out_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(out_dir) / SAMPLES_FILE).read_text())
