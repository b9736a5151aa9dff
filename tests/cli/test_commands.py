"""Every ``kvcompress`` command run for real through typer's runner on a tiny model saved to a folder: what each
writes and prints is checked against values computed here (tokens, bytes, rows, files), not against its help."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import sys

import pytest
import torch
from typer.testing import CliRunner

from kvcompress.cli import app
from kvcompress.methods.less.kernels import load_layer
from kvcompress.models import list_models, registry, tiny_model, tiny_tokenizer
from kvcompress.registry import METHODS
from kvcompress.train.pod_adapt import load_adapted
from tests.helpers import needs_smollm2

runner = CliRunner()
WIDE = {"COLUMNS": "1000"}  # one line per table row: nacl's defaults with the storage fields pass 400 columns
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny llama: K+V, 2 layers, 2 KV heads, head_dim 16, fp32
PROMPT = "The quick brown fox jumps over the lazy dog."  # 44 characters: 44 tokens of the character tokenizer
BOOK = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith slipped quickly "
    "through the glass doors of Victory Mansions. "
) * 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", seed=1).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _keep_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the pass-through commands rename argv[0]


def invoke(*args: object):
    result = runner.invoke(app, [str(a) for a in args], env=WIDE)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def table_cells(output: str) -> list[list[str]]:
    """The cells of every row of the rich tables in ``output``."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines() if line.startswith("│")]


def generate_numbers(output: str) -> dict[str, int]:
    counts = [row for row in table_cells(output) if row[0] != "saved" and not row[0].startswith("wall time")]
    return {row[0]: int(row[1].split(" ")[0].replace(",", "")) for row in counts}


# --------------------------------------------------------------------------------------------------- generate


def test_generate_with_the_full_cache_prints_the_model_own_greedy_text(model_dir):
    output = invoke("generate", PROMPT, "--model", model_dir, "-m", "full", "--max-new-tokens", 6)
    model, tokenizer = tiny_model("llama", seed=1), tiny_tokenizer()
    ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(expected[0, 44:])
    assert output.startswith(text + "\n")
    numbers = generate_numbers(output)
    assert numbers["prompt tokens"] == 44
    [wall] = [row[1] for row in table_cells(output) if row[0].startswith("wall time")]
    assert wall.endswith("s for 6 new tokens")
    assert numbers["tokens seen (logical)"] == 44 + 5  # the last token generated is never fed
    assert numbers["tokens stored per layer (physical)"] == 49
    assert numbers["KV bytes stored"] == numbers["KV bytes, full cache"] == 49 * BYTES_PER_TOKEN


@pytest.mark.parametrize(
    ("options", "stored"),
    [
        (["-m", "h2o", "--budget", 12, "--chunk-size", 8], 12),
        (["-m", "h2o", "-p", "budget=10", "-p", "heavy_ratio=0.25"], 10),  # -p typed by the field: an int
        (["-m", "snapkv", "--ratio", 0.5, "-p", "window=4"], 22 + 4),  # floor(0.5 x 44) after the prompt, + 4 decoded
        (["-m", "streaming", "--budget", 16, "-p", "sinks=2", "-p", "position_mode=original"], 16),
    ],
)
def test_generate_stores_what_the_budget_ratio_and_params_say(model_dir, options, stored):
    output = invoke("generate", PROMPT, "--model", model_dir, "--max-new-tokens", 5, *options)
    numbers = generate_numbers(output)
    assert numbers["tokens seen (logical)"] == 48
    assert numbers["tokens stored per layer (physical)"] == stored
    assert numbers["KV bytes stored"] == stored * BYTES_PER_TOKEN
    assert numbers["KV bytes, full cache"] == 48 * BYTES_PER_TOKEN
    saved = next(row[1] for row in table_cells(output) if row[0] == "saved")
    assert saved == f"{1 - stored / 48:.1%}"


def test_generate_reads_the_prompt_from_a_file(model_dir, tmp_path):
    (tmp_path / "prompt.txt").write_text("\ufeff" + PROMPT * 2, encoding="utf-8")  # a byte-order mark is dropped
    output = invoke("generate", "--file", tmp_path / "prompt.txt", "--model", model_dir, "--max-new-tokens", 2)
    assert generate_numbers(output)["prompt tokens"] == 88


def test_train_less_then_generate_with_its_kernels_and_refuse_the_smollm2_ones(model_dir, tmp_path):
    (tmp_path / "book.txt").write_text(BOOK)
    kernels = tmp_path / "kernels"
    output = invoke(
        "train", "less", "--model", model_dir, "--base", "h2o", "--budget", 8, "--data", tmp_path / "book.txt",
        "--out", kernels, "--window", 32, "--windows", 4, "--epochs", 1, "--hidden", 8, "--rank", 4, "--no-progress",
    )  # fmt: skip
    assert output.strip().endswith(str(kernels))
    meta = json.loads((kernels / "meta.json").read_text())
    assert meta["base"]["budget"] == 8 and meta["rank"] == 4 and meta["hidden"] == 8
    assert meta["training"]["windows"] == 4 and meta["training"]["epochs"] == 1
    assert sorted(p.name for p in kernels.glob("layer_*.pt")) == ["layer_000.pt", "layer_001.pt"]
    assert not (kernels / "activations").exists()  # removed once every layer is trained
    assert [len(load_layer(kernels, layer)[1]["history"]) for layer in range(2)] == [1, 1]  # one epoch each

    args = ["generate", PROMPT, "--model", model_dir, "-m", "less", "--budget", 8, "--max-new-tokens", 4]
    numbers = generate_numbers(invoke(*args, "-p", "base=h2o", "-p", f"kernels={kernels}"))
    assert numbers["tokens stored per layer (physical)"] == 8
    low_rank = 2 * 2 * 4 * 16 * 4  # layers x KV heads x rank x head_dim x fp32: LESS's state H
    assert numbers["KV bytes stored"] == 8 * BYTES_PER_TOKEN + low_rank

    result = runner.invoke(app, [*map(str, args), "-p", "base=h2o", "-p", "kernels=smollm2-135m-h2o-50of512"])
    assert result.exit_code != 0
    assert "LESS kernels have 30 layers but the model has 2" in str(result.exception)  # the shipped set, by name


# --------------------------------------------------------------------------------------------- listings


def test_methods_lists_every_registered_method_with_its_defaults():
    output = invoke("methods")
    rows = [row for row in table_cells(output) if len(row) == 3]
    assert [row[0] for row in rows] == list(METHODS)
    assert len(rows) == 24
    for name, defaults, paper in rows:
        config = METHODS[name]
        fields = dataclasses.fields(config)  # the method's own, then the storage fields every method takes
        fields = [f for f in fields if not f.name.startswith("kv_")] + [f for f in fields if f.name.startswith("kv_")]
        expected = ", ".join(f"{f.name}={(None if f.default is dataclasses.MISSING else f.default)!r}" for f in fields)
        assert defaults == (expected or "-"), name
        assert paper == config.paper
    assert f"{len(METHODS)} methods" in output
    assert "With preset=kvpress, streaming_oneshot, snapkv," in " ".join(output.split())


def test_models_lists_the_registry_with_installed_and_converted_columns(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path))  # nothing converted
    installed = tmp_path / "gemma_pkg"
    monkeypatch.setattr(registry, "_find_package_dir", lambda module: installed if "gemma" in module else None)
    output = invoke("models")
    rows = {row[0]: row[1:] for row in table_cells(output)}
    infos = list_models()
    assert len(rows) == len(infos) == 3
    smollm2 = ["HuggingFaceTB/SmolLM2-135M-Instruct", "no", "no"]
    for info in infos:  # whole install commands, one plain line each, whatever the terminal width
        assert f"  {info.name}: {info.install_command}\n" in output
    assert rows["smollm2-135m (default)"] == smollm2
    assert rows["gemma3-270m"][1:3] == ["yes", "no"]
    assert rows["qwen2.5-coder-0.5b"][1:3] == ["no", "no"]


# ----------------------------------------------------------------------------------------------- eval, report


def test_eval_writes_one_row_per_sample_and_config_resumes_and_report_tables_the_means(model_dir, tmp_path):
    essays = tmp_path / "data" / "paul_graham_essays"
    essays.mkdir(parents=True)
    for i in range(2):
        (essays / f"tiny{i}.txt").write_text(" ".join(f"Essay {i} sentence {j} is about {j * 7}." for j in range(30)))
    run = tmp_path / "run"
    args = [
        "eval", "summary", "--model", model_dir, "--methods", "full,window", "--budgets", 8, "--out", run,
        "--data", tmp_path / "data", "--param", "length=60", "--param", "max_new_tokens=4",
    ]  # fmt: skip
    output = invoke(*args, "--samples", 1)
    path = run / "summary.jsonl"
    assert output.strip().splitlines()[-1] == str(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["environment", "result", "result"]
    results = rows[1:]
    assert [(r["sample"], r["method"], r["budget"]) for r in results] == [
        ("summary-000", "full", None),
        ("summary-000", "window", 8),
    ]
    for row in results:
        assert row["info"]["essay"] == "tiny0"  # read from --data
        assert row["task_params"]["length"] == 60 and row["task_params"]["max_new_tokens"] == 4
        stored = 8 if row["method"] == "window" else row["tokens_seen"]
        assert row["tokens_seen"] == row["info"]["prompt_tokens"] - 1 + 4
        assert row["tokens_stored"] == [stored, stored] and row["kv_bytes"] == stored * BYTES_PER_TOKEN
    assert results[0]["scores"] == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}

    invoke(*args, "--samples", 2)  # resumes: only sample 1 is evaluated
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["environment", "result", "result", "environment", "result", "result"]
    assert [r["sample"] for r in rows[4:]] == ["summary-001"] * 2 and rows[4]["info"]["essay"] == "tiny1"
    invoke(*args, "--samples", 2)
    assert len(path.read_text().splitlines()) == 6  # nothing left to do, nothing written

    prefix = tmp_path / "report" / "r"
    output = invoke("report", run, "--out", prefix)
    assert output.strip().splitlines()[-1] == f"{prefix}.md"
    markdown = (tmp_path / "report" / "r.md").read_text()
    results = [r for r in rows if r["kind"] == "result"]
    for metric in ("rouge1", "rouge2", "rougeL"):
        table = markdown.split(f"**{metric}**")[1]
        for method, column in (("full", 0), ("window", 1)):
            values = [r["scores"][metric] for r in results if r["method"] == method]
            cell = f"{statistics.mean(values):.3f} ± {statistics.stdev(values) / math.sqrt(2):.3f} (2)"
            cells = ["", ""]
            cells[column] = cell
            assert f"| {method} | {cells[0]} | {cells[1]} |" in table, (metric, method)
    stored = markdown.split("**stored KV tokens per layer**")[1]
    full = statistics.mean(max(r["tokens_stored"]) for r in results if r["method"] == "full")
    assert f"| full | {full:.0f} (2) |  |" in stored and "| window |  | 8 (2) |" in stored
    png = tmp_path / "report" / "r-summary-aware-rouge1-vs-budget.png"
    assert png.read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------------- benchmarks


def test_bench_decode_measures_every_method_at_every_context(model_dir, tmp_path):
    output = invoke(
        "bench", "decode", "--model", model_dir, "--methods", "full,window", "--budget", 16, "--contexts", "32,64",
        "--steps", 2, "--warmup-steps", 1, "--chunk-size", 16, "--out", tmp_path,
    )  # fmt: skip
    saved = json.loads((tmp_path / "decode.json").read_text())
    rows = saved["rows"]
    assert saved["meta"]["contexts"] == "32,64" and saved["meta"]["budget"] == "16"
    assert [(r["method"], r["context"]) for r in rows] == [
        (method, context) for method in ("full", "window", "DynamicCache (sdpa)") for context in (32, 64)
    ]
    full = {row["context"]: row["step_ms"] for row in rows if row["method"] == "full"}
    for row in rows:
        stored = 16 if row["method"] == "window" else row["context"] + 1 + 2  # + warm-up + timed steps
        assert row["stored_tokens"] == stored and row["steps"] == 2
        assert row["kv_mib"] == pytest.approx(stored * BYTES_PER_TOKEN / 2**20)
        assert row["step_ms"] > 0 and row["vs_full"] == pytest.approx(row["step_ms"] / full[row["context"]])
    assert len((tmp_path / "decode.partial.jsonl").read_text().splitlines()) == 6
    table = (tmp_path / "decode.md").read_text()
    assert sum(line.startswith("| window | ") for line in table.splitlines()) == 2
    assert "| window | 64 |" in output
    assert (tmp_path / "decode.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_prefill_compares_one_pass_and_chunks(model_dir, tmp_path):
    invoke(
        "bench", "prefill", "--model", model_dir, "--methods", "window", "--budget", 16, "--prompts", "40,64",
        "--chunk-size", 16, "--repeats", 1, "--out", tmp_path,
    )  # fmt: skip
    rows = json.loads((tmp_path / "prefill.json").read_text())["rows"]
    assert sorted((r["prompt"], r["mode"], r["stored_tokens"]) for r in rows) == [
        (40, "chunks of 16", 16),
        (40, "one pass", 16),
        (64, "chunks of 16", 16),
        (64, "one pass", 16),
    ]
    for row in rows:
        assert row["kv_mib"] == pytest.approx(row["stored_tokens"] * BYTES_PER_TOKEN / 2**20)
        assert row["method"] == "window" and row["time_s"] > 0


def test_bench_cache_op_quick_times_every_method_and_reference(tmp_path):
    args = ["--quick", "--methods", "window,h2o", "--warmup", 1, "--tokens", 3, "--out", tmp_path]
    output = invoke("bench", "cache-op", *args)
    saved = json.loads((tmp_path / "cache_op.json").read_text())
    assert (saved["meta"]["heads"], saved["meta"]["head_dim"], saved["meta"]["window"]) == (8, 64, 256)
    rows = {row["cache"]: row for row in saved["rows"]}
    assert {"window", "h2o", "concat sink (reference)", "DynamicCache (transformers)"} <= set(rows)
    for name in ("window", "h2o", "concat sink (reference)"):
        assert rows[name]["stored"] == 4 + 256 and rows[name]["steps"] == 3  # sinks + window: bounded
    assert rows["DynamicCache (transformers)"]["stored"] == 4 + 256 + 1 + 3  # grows with every update
    for name in ("window", "h2o"):  # at capacity, every update evicts one token
        assert rows[name]["evictions"] == 3 and rows[name]["bounded"] is True
        assert rows[name]["peak_stored"] == rows[name]["avg_stored"] == 4 + 256
    assert "| h2o | yes |" in output


# ----------------------------------------------------------------------------------------------------- PoD


def test_train_pod_calibrate_then_adapt_with_its_similarity(model_dir, tmp_path):
    (tmp_path / "book.txt").write_text(BOOK)
    sim = tmp_path / "sim.pt"
    args = ["--model", model_dir, "--data", tmp_path / "book.txt"]
    output = invoke(
        "train", "pod-calibrate", *args, "--samples", 2, "--length", 32, "--last-queries", 4,
        "--out", sim, "--json", tmp_path / "sim.json",
    )  # fmt: skip
    assert f"wrote {sim}" in output
    result = torch.load(sim, weights_only=False)
    assert result["sim"].shape == (4, 2, 2) and result["kv_heads"] == 2
    assert torch.allclose(result["sim"].diagonal(dim1=1, dim2=2), torch.ones(4, 2))
    assert torch.equal(result["sim"], result["sim"].transpose(1, 2))
    assert result["meta"]["samples"] == 2 and result["meta"]["length"] == 32 and result["meta"]["last_queries"] == 4
    copy = json.loads((tmp_path / "sim.json").read_text())
    torch.testing.assert_close(torch.tensor(copy["sim"]), result["sim"], atol=1e-5, rtol=0)

    out = tmp_path / "adapt"
    output = invoke(
        "train", "pod-adapt", "--out", out, *args, "--similarity", sim, "--n-sink", 2, "--n-recent", 4,
        "--steps", 2, "--batch", 1, "--length", 16, "--trainable", "attention", "--lr", "1e-3",
    )  # fmt: skip
    assert f"wrote {out / 'final.pt'}" in output
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2]
    adapted, original = load_adapted(tiny_model("llama", seed=1), out / "final.pt"), tiny_model("llama", seed=1)
    for (name, a), (_, b) in zip(adapted.named_parameters(), original.named_parameters(), strict=True):
        attention = any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        assert torch.equal(a, b) != attention, name  # only the attention projections were trained


def test_unknown_trainer_names_the_choices():
    result = runner.invoke(app, ["train", "nope"])
    assert result.exit_code != 0 and "less, pod-calibrate, pod-adapt" in result.output


def test_report_of_a_missing_folder_fails_naming_it(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "none"), "--out", str(tmp_path / "r")])
    assert result.exit_code != 0
    assert "no .jsonl results" in str(result.exception)


# ------------------------------------------------------------------------------------------ the real model


@pytest.mark.slow
@needs_smollm2
def test_generate_less_with_the_shipped_smollm2_kernels():
    facts = " ".join(f"Fact {i}: the {c} box holds {i * 3} apples." for i, c in enumerate(["red", "blue"] * 20))
    prompt = facts + "\n\nHow many apples are in the red box of fact 0? Answer in one sentence."
    args = ["generate", prompt, "-m", "less", "--budget", 50, "-p", "base=h2o", "--max-new-tokens", 12]
    output = invoke(*args, "-p", "kernels=smollm2-135m-h2o-50of512", "--chunk-size", 64)
    numbers = generate_numbers(output)
    assert numbers["prompt tokens"] > 300
    seen = numbers["tokens seen (logical)"]
    assert numbers["prompt tokens"] < seen <= numbers["prompt tokens"] + 11  # it may stop at EOS
    assert numbers["tokens stored per layer (physical)"] == 50
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2: K+V, 30 layers, 3 KV heads, head_dim 64, fp32
    low_rank = 30 * 3 * 8 * 64 * 4  # the shipped kernels' rank 8: LESS's state H per layer and KV head
    assert numbers["KV bytes stored"] == 50 * per_token + low_rank
    assert numbers["KV bytes, full cache"] == numbers["tokens seen (logical)"] * per_token
    text = output.split("less on smollm2-135m")[0]
    assert len(re.findall(r"[A-Za-z]{3,}", text)) >= 2  # real words came out (a random model gives none)
