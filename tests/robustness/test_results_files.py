"""Results files survive faults and concurrency: a torn last line never swallows the next row, two writers on one
file never write a row twice, and ``report`` counts each row once and names every line it skips."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcompress.eval.report import load_results
from kvcompress.eval.report import main as report_main
from kvcompress.eval.runner import row_key, run_eval
from kvcompress.models import tiny_model, tiny_tokenizer
from kvcompress.results import ResultsFile, append_row, read_rows
from tests.helpers import result_row

REPO = Path(__file__).resolve().parents[2]


def keyed(path: Path) -> ResultsFile:
    return ResultsFile(path, lambda row: row.get("key"))


@pytest.mark.parametrize("writer", ["append_row", "ResultsFile"])
def test_a_torn_last_line_stays_apart_from_the_next_row(tmp_path, writer):
    path = tmp_path / "r.jsonl"
    path.write_text('{"key": "a"}\n{"key": "b", "ppl"')  # a write cut short
    row = {"key": "c", "ppl": 1.0}
    append_row(row, path) if writer == "append_row" else keyed(path).append(row)
    problems: list[str] = []
    assert read_rows(path, problems) == [{"key": "a"}, row]
    assert problems == [f"{path}:2: is not valid JSON (an interrupted write?); skipped"]
    assert path.read_text().splitlines()[1] == '{"key": "b", "ppl"'  # kept, on its own line


def test_a_whole_row_cut_before_its_newline_is_kept(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"key": "a"}\n{"key": "b"}')
    assert keyed(path).append({"key": "c"})
    assert read_rows(path) == [{"key": "a"}, {"key": "b"}, {"key": "c"}]


def test_lines_that_are_json_but_no_object_are_skipped_and_named(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('[1, 2]\n{"key": "a"}\n"text"\nnull\n')
    problems: list[str] = []
    assert read_rows(path, problems) == [{"key": "a"}]
    assert [p.split(": ")[0] for p in problems] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert "not an object (a list)" in problems[0]
    assert not keyed(path).done("[1, 2]") and keyed(path).done("a")


def test_a_second_writer_sees_the_first_writers_rows_and_never_writes_them_again(tmp_path):
    path = tmp_path / "r.jsonl"
    first, second = keyed(path), keyed(path)
    assert not second.done("a")
    assert first.append({"key": "a", "by": 1})
    assert second.done("a")
    assert not second.append({"key": "a", "by": 2})
    assert second.append({"key": None, "kind": "environment"}) and first.append({"key": None, "kind": "environment"})
    assert [row.get("by") for row in read_rows(path)] == [1, None, None]


WRITER = """
import importlib.util, sys, time
from pathlib import Path
path, go, name, source = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = importlib.util.spec_from_file_location("results", source)  # the module alone (standard library only)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
ResultsFile = module.ResultsFile
results = ResultsFile(path, lambda row: row.get("key"))
while not go.exists():
    time.sleep(0.001)
for key in range(300):
    if not results.done(key):
        results.append({"key": key, "by": name, "pad": "x" * 2000})  # rows longer than one write on some systems
"""


def test_concurrent_processes_on_one_file_write_every_row_once(tmp_path):
    path, go = tmp_path / "r.jsonl", tmp_path / "go"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    source = REPO / "src" / "kvcompress" / "results.py"
    procs = [subprocess.Popen([sys.executable, str(script), str(path), str(go), str(i), source]) for i in range(3)]
    time.sleep(0.5)
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    rows = read_rows(path)
    assert sorted(row["key"] for row in rows) == list(range(300))
    assert path.read_text().count("\n") == 300  # no torn or glued line


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


def test_an_eval_resumed_after_a_torn_line_loses_no_row(tiny, tmp_path):
    args = {"samples": 2, "out_dir": tmp_path, "progress": False, "length": 300}
    path = run_eval("passkey", tiny, ["full", "window"], [32], **args)
    whole = path.read_text()
    lines = whole.splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:40])  # the last row's write cut short
    run_eval("passkey", tiny, ["full", "window"], [32], **args)
    problems: list[str] = []
    results, _ = load_results(path, problems)
    assert len(results) == len([line for line in lines if '"kind": "result"' in line]) == 4
    assert {row_key(r) for r in results} == {row_key(json.loads(x)) for x in lines if '"kind": "result"' in x}
    assert len(problems) == 1 and problems[0].startswith(f"{path}:{len(lines)}: is not valid JSON")


def test_two_eval_processes_on_one_out_write_every_row_once(tmp_path):
    go = tmp_path / "go"
    script = tmp_path / "eval.py"
    script.write_text(
        textwrap.dedent(f"""
        import time, torch
        from pathlib import Path
        from kvcompress.eval.runner import run_eval
        from kvcompress.models import tiny_model, tiny_tokenizer
        torch.set_num_threads(1)
        pair = tiny_model("llama"), tiny_tokenizer()
        Path({str(tmp_path)!r}, "ready-" + str(time.time_ns())).touch()
        while not Path({str(go)!r}).exists():
            time.sleep(0.001)
        run_eval("passkey", pair, ["full", "window"], [32], samples=3, out_dir={str(tmp_path)!r}, progress=False,
                 length=300)
        """)
    )
    env = {"PYTHONPATH": f"{REPO / 'src'}:{REPO}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script)], env=env) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:  # both loaded and waiting
        time.sleep(0.05)
    go.touch()
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    rows = read_rows(tmp_path / "passkey.jsonl")
    keys = [row_key(row) for row in rows if row["kind"] == "result"]
    assert len(keys) == len(set(keys)) == 6  # 3 samples x 2 methods
    assert [row["kind"] for row in rows].count("environment") == 2  # both ran at once


def test_report_counts_a_duplicated_row_once_and_names_bad_lines(tmp_path, capsys):
    path = tmp_path / "passkey.jsonl"
    rows = [result_row("full", None, f"s{i}", {"accuracy": float(i % 2)}) for i in range(4)]
    lines = [json.dumps(row) for row in rows + rows[:2]]  # two runs wrote the first two rows twice
    lines += ["[1, 2]", '{"kind": "result", "task": "passkey"}', '{"kind": "resu']
    path.write_text("\n".join(lines) + "\n")
    problems: list[str] = []
    results, _ = load_results(path, problems)
    assert len(results) == 4
    assert [p.split(": ")[0] for p in problems] == [f"{path}:7", f"{path}:9", f"{path}:8"]
    assert report_main([str(path), "--out", str(tmp_path / "report"), "--no-plots"]) == 0
    table = (tmp_path / "report.md").read_text()
    assert "(4)" in table and "(6)" not in table
    err = capsys.readouterr().err
    assert f"{path}:7" in err and f"{path}:8" in err and "Traceback" not in err
