"""The leaderboard's kvpress columns: samples written for the other environment, its rows scored by the task's own
metric. The other environment is stood in for by a script that answers from the samples file (kvpress itself is
not installed here; docs/results/ruler.md has a real run)."""

from __future__ import annotations

import json
import sys

import pytest

from kvcompress.eval import kvpress_columns
from kvcompress.eval.kvpress_side import compression_ratio
from kvcompress.eval.leaderboard import leaderboard_rows, write_leaderboard
from kvcompress.eval.report import load_results
from kvcompress.eval.runner import run_eval
from kvcompress.eval.tasks import make_task

FAKE_SIDE = """
import json, sys
spec = json.load(open(sys.argv[1]))
answers = json.load(open(sys.argv[1] + ".answers"))
with open(sys.argv[2], "a") as out:
    for s in spec["samples"]:
        for press in spec["presses"]:
            for kept in spec["kept"]:
                text = answers[s["id"]] if press == "GoodPress" else "no idea"
                held = spec["bytes_per_token"] * len(s["context_ids"])  # masks only: every context token held
                out.write(json.dumps({"sample": s["id"], "press": press, "kept": kept, "prediction": text,
                    "kv_bytes": held, "prefill_s": 1.0, "decode_s": 1.0, "new_tokens": 3}) + "\\n")
"""


@pytest.mark.parametrize(("kept", "n"), [(0.5, 1001), (0.25, 977), (0.75, 1024), (0.3, 10)])
def test_the_kvpress_ratio_keeps_the_count_kvcompress_keeps(kept, n):
    # kvpress keeps int(n * (1 - compression_ratio)); kvcompress's ratio methods floor(kept * n)
    assert int(n * (1 - compression_ratio(kept, n))) == int(kept * n)


def test_kvpress_rows_join_the_leaderboard_scored_by_the_task(tmp_path, tiny, monkeypatch):
    model, tokenizer = tiny
    params = dict(length=1200, tasks=("niah_single_1",), modes=("agnostic",))
    path = run_eval("ruler", tiny, ["full"], [0.5], samples=2, out_dir=tmp_path, progress=False, **params)
    task = make_task("ruler", model, tokenizer, seed=0, **params)
    samples = task.build_samples(2)
    spec = tmp_path / "kvpress-samples.json"
    kvpress_columns.write_samples(spec, str(tmp_path), model, samples, [0.5], ["GoodPress", "BadPress"])
    written = json.loads(spec.read_text())
    assert [s["context_ids"] for s in written["samples"]] == [s.inputs["context_ids"][0].tolist() for s in samples]
    assert written["bytes_per_token"] == 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        model.config.hidden_size // model.config.num_attention_heads
    ) * 4  # fp32  # fmt: skip
    (tmp_path / "kvpress-samples.json.answers").write_text(
        json.dumps({s.id: " ".join(s.inputs["answers"]) for s in samples})
    )
    fake = tmp_path / "side.py"
    fake.write_text(FAKE_SIDE)
    monkeypatch.setattr(kvpress_columns, "SIDE_SCRIPT", fake)
    kvpress_columns.run_side(sys.executable, spec, tmp_path / "kvpress.jsonl", threads=1)
    rows = kvpress_columns.leaderboard_rows(task, samples, tmp_path / "kvpress.jsonl")
    assert {(r["method"], r["scores"]["score"]) for r in rows} == {
        ("kvpress:GoodPress", 1.0),
        ("kvpress:BadPress", 0.0),
    }
    entries = {e["method"]: e for e in leaderboard_rows([*_results(path), *rows], "score")}
    assert entries["kvpress:GoodPress"]["score"] == 100.0 and entries["kvpress:BadPress"]["score"] == 0.0
    full = {r["sample"]: r["kv_bytes"] for r in _results(path)}
    held = [written["bytes_per_token"] * len(s["context_ids"]) / full[s["id"]] for s in written["samples"]]
    assert entries["kvpress:GoodPress"]["bytes_x_full"] == pytest.approx(sum(held) / 2)  # against full's same sample
    assert max(held) < 1.0
    _, text = write_leaderboard(path, "tiny", plot=False, extra=rows)
    assert "| 0.5 | kvpress:GoodPress | 100.0 ± 0.0 | 2 |" in text


def _results(path):
    return load_results(path)[0]


def test_kvpress_options_are_checked(tmp_path, tiny):
    model, tokenizer = tiny
    task = make_task("ruler", model, tokenizer, length=1200, tasks=("niah_single_1",))
    with pytest.raises(ValueError, match="--kvpress .* is not an executable Python"):
        kvpress_columns.check_kvpress(str(tmp_path / "nothing"), ["KVzipPress"], task)
    with pytest.raises(ValueError, match="--presses needs at least one"):
        kvpress_columns.check_kvpress(sys.executable, [], task)
    passkey = make_task("passkey", model, tokenizer, length=300)
    with pytest.raises(ValueError, match="--kvpress needs a task that scores answer text"):
        kvpress_columns.check_kvpress(sys.executable, ["KVzipPress"], passkey)
