from __future__ import annotations

import json

import pytest

from kvcompress.eval.runner import parse_task_params, read_rows, run_eval
from kvcompress.eval.tasks.passkey import PasskeyTask


def _results(path):
    return [r for r in read_rows(path) if r["kind"] == "result"]


def test_run_eval_writes_one_row_per_sample_method_budget_and_the_environment(tiny, tmp_path):
    path = run_eval(
        "passkey", tiny, ["full", "window"], [32, 64], samples=2, out_dir=tmp_path, progress=False, length=300
    )
    rows = read_rows(path)
    env = [r for r in rows if r["kind"] == "environment"]
    assert len(env) == 1 and {"torch", "transformers", "torch_threads", "cpu", "date"} <= set(env[0])
    results = _results(path)
    assert [(r["sample"], r["method"], r["budget"]) for r in results] == [
        ("passkey-000", "full", None),
        ("passkey-000", "window", 32),
        ("passkey-000", "window", 64),
        ("passkey-001", "full", None),
        ("passkey-001", "window", 32),
        ("passkey-001", "window", 64),
    ]
    for row in results:
        assert row["task"] == "passkey" and row["task_params"]["length"] == 300
        assert set(row["scores"]) == {"accuracy", "answer_nll"}
        assert row["time_s"] > 0 and row["kv_bytes"] > 0 and len(row["tokens_stored"]) == 2
        assert max(row["tokens_stored"]) == (row["tokens_seen"] if row["budget"] is None else row["budget"])


def test_rerun_skips_done_rows_and_only_adds_new_samples(tiny, tmp_path, monkeypatch):
    args = dict(out_dir=tmp_path, progress=False, length=300)
    path = run_eval("passkey", tiny, ["full", "window"], [32], samples=2, **args)
    before = path.read_text()
    evaluated = []
    original = PasskeyTask.evaluate

    def counting(self, sample, config, cache, mode):
        evaluated.append((sample.id, config.method))
        return original(self, sample, config, cache, mode)

    monkeypatch.setattr(PasskeyTask, "evaluate", counting)
    run_eval("passkey", tiny, ["full", "window"], [32], samples=2, **args)
    assert evaluated == [] and path.read_text() == before  # nothing run, nothing written
    run_eval("passkey", tiny, ["full", "window"], [32], samples=3, **args)
    assert evaluated == [("passkey-002", "full"), ("passkey-002", "window")]
    assert len(_results(path)) == 6
    run_eval("passkey", tiny, ["full", "window"], [32], samples=2, out_dir=tmp_path, progress=False, length=320)
    assert len(_results(path)) == 10  # other task parameters: other rows


def test_rows_survive_an_interrupted_last_line(tiny, tmp_path):
    path = run_eval("passkey", tiny, ["full"], [32], samples=1, out_dir=tmp_path, progress=False, length=300)
    with path.open("a") as handle:
        handle.write('{"kind": "result", "task": "pass')  # a write cut short
    assert len(_results(path)) == 1


def test_run_eval_rejects_unknown_tasks_and_bad_sample_counts(tiny, tmp_path):
    with pytest.raises(ValueError, match="task must be one of"):
        run_eval("nope", tiny, ["full"], [32], samples=1, out_dir=tmp_path)
    with pytest.raises(ValueError, match="samples"):
        run_eval("passkey", tiny, ["full"], [32], samples=0, out_dir=tmp_path)


def test_parse_task_params_reads_json_and_lists():
    assert parse_task_params(["length=1024", "modes=agnostic+aware", "depth=0.5", "haystack=/x/y"]) == {
        "length": 1024,
        "modes": ("agnostic", "aware"),
        "depth": 0.5,
        "haystack": "/x/y",
    }
    assert json.loads(json.dumps(parse_task_params(["subtasks=single"]))) == {"subtasks": "single"}
