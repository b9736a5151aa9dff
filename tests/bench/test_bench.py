"""Mechanics of the benchmarks (no timing assertions: timings on a shared CPU are noise)."""

from __future__ import annotations

import pytest
import torch

from kvcompress.bench import common, speed
from kvcompress.bench.cache_op import BUZZ_AVERAGE, CONCAT_SINK, CacheOpSetup, run_cache_op
from kvcompress.bench.cache_op_steps import synthetic_stats
from kvcompress.bench.decode import DECODE_COLUMNS, decode_table, run_decode
from kvcompress.bench.prefill import run_prefill
from kvcompress.bench.prefill_peaks import peaks_in_child
from kvcompress.bench.sink_references import CircularSinkCache, ConcatSinkCache
from kvcompress.bench.table import load_rows, markdown_table, save_rows
from kvcompress.core.layer import CompressedLayer
from kvcompress.models import tiny_model
from kvcompress.registry import make_config


def _token(index: int, batch: int = 2, heads: int = 3, dim: int = 4) -> torch.Tensor:
    """A key whose every entry is its stream index, so kept tokens can be read back from the cache."""
    return torch.full((batch, heads, 1, dim), float(index))


def test_concat_sink_reference_keeps_the_same_tokens_as_streaming_layer():
    sinks, window = 2, 5
    reference = ConcatSinkCache(sinks, window)
    layer = CompressedLayer(make_config("streaming", budget=sinks + window, sinks=sinks).policy(0))
    for i in range(20):
        key = _token(i)
        reference.update(key, key.clone())
        layer.update(key, key.clone())
        layer.after_attention(None)
        assert torch.equal(reference.keys, layer.keys), f"after token {i}"
        assert torch.equal(reference.values, layer.values)
    assert reference.keys[0, 0, :, 0].tolist() == [0, 1, 15, 16, 17, 18, 19]


def test_circular_sink_reference_keeps_the_same_token_set():
    sinks, window = 2, 5
    concat, circular = ConcatSinkCache(sinks, window), CircularSinkCache(sinks, window)
    for i in range(17):
        concat.update(_token(i), _token(i))
        keys, _ = circular.update(_token(i), _token(i))
        assert sorted(keys[0, 0, :, 0].tolist()) == concat.keys[0, 0, :, 0].tolist()


def test_synthetic_stats_have_the_shapes_policies_read():
    setup = CacheOpSetup(batch=2, heads=3, head_dim=4, window=8, tokens=1)
    generator = torch.Generator().manual_seed(0)
    for method in ("h2o", "tova", "scissorhands", "snapkv", "streaming"):
        policy = make_config(method, budget=40).policy(0)
        stats = synthetic_stats(policy.stats, setup, length=41, query_count=1, generator=generator)
        if not policy.stats.any:
            assert stats is None
            continue
        if policy.stats.received:
            assert stats.received.shape == (2, 3, 1, 41)
            assert torch.allclose(stats.received.sum(-1), torch.ones(2, 3, 1))
        if policy.stats.last_queries:
            assert stats.last.shape == (2, 3, 1, 1, 41)
            assert stats.last_visible is None  # one decoding query sees every key, as attention reports it


def test_cache_op_runs_every_method_and_reference_with_ratios():
    rows = run_cache_op(batch=1, heads=2, head_dim=8, window=16, warmup=1, tokens=3)
    names = [row["cache"] for row in rows]
    assert CONCAT_SINK in names and "streaming" in names and "DynamicCache (transformers)" in names
    for row in rows:
        assert row["steps"] == 3 or row["cache"].startswith("buzz")
        assert row["median_us"] > 0
        assert row["vs_concat_sink"] > 0 and row["vs_streaming"] > 0
    stored = {row["cache"]: row["stored"] for row in rows}
    assert stored["streaming"] == stored[CONCAT_SINK] == 4 + 16
    assert stored["cascade"] == stored["cascade N=1"] == 4 + 16  # circular: allocated once at the budget
    # the rings' decoding steps as a model runs them (with a query and its position): bounded, evicting every step
    for name in ("cascade (decode step)", "cascade N=1 (decode step)"):
        assert stored[name] == 4 + 16 and rows[names.index(name)]["evictions"] == 3
    assert stored["full"] == 4 + 16 + 1 + 3  # unbounded: fill + warm-up + timed tokens
    by_name = {row["cache"]: row for row in rows}
    assert by_name["streaming"]["evictions"] == 3 and by_name["full"]["evictions"] == 0
    assert by_name["streaming"]["avg_stored"] == by_name["streaming"]["peak_stored"] == 20


def test_cache_op_times_buzz_over_whole_eviction_cycles_at_peak_and_average_size():
    # window 16 + 4 sinks = 20: peak-sized (k, w, T, s) = (4, 3, 13, 5), average-sized (4, 4, 17, 5)
    rows = run_cache_op(["buzz"], batch=1, heads=2, head_dim=8, window=16, warmup=1, tokens=3, references=False)
    by_name = {row["cache"]: row for row in rows}
    peak, average = by_name["buzz"], by_name[BUZZ_AVERAGE]
    for row in (peak, average):
        # timing starts right after an eviction and ends on one: whole cycles, so the mean is amortised
        assert row["steps"] >= 3 and row["evictions"] >= 1 and row["stored"] < row["peak_stored"]
        assert row["cpu_mean_us"] > 0
    # peak-sized: filled to k + w + T = 20, the warm-up update evicts (middle 14 new -> ceil(14 / 5) = 3), then the
    # middle grows from 3 to T = 13 and the 11th timed update evicts again (middle 14 -> 1 + 3 = 4)
    assert (peak["steps"], peak["evictions"], peak["stored"]) == (11, 1, 4 + 3 + 4)
    assert peak["peak_stored"] == 4 + 3 + 13 and peak["bounded"]
    assert average["peak_stored"] == 4 + 4 + 17 and not average["bounded"]  # its *average* is the budget
    assert abs(average["avg_stored"] - 20) <= 2 and peak["avg_stored"] < 20


def test_markdown_table_formats_and_escapes():
    rows = [{"a": "x|y", "b": 1.234, "c": None}, {"a": "z", "b": 10.0, "c": True}]
    table = markdown_table(rows, [("a", "name", ""), ("b", "value", ".1f"), ("c", "flag", "")])
    assert table.splitlines() == [
        "| name | value | flag |",
        "|---|---:|---|",
        "| x\\|y | 1.2 | — |",
        "| z | 10.0 | yes |",
    ]


def test_save_and_load_rows_round_trip(tmp_path):
    path = save_rows(tmp_path / "sub" / "r.json", [{"a": 1}], {"machine": "m"})
    assert load_rows(path) == ([{"a": 1}], {"machine": "m"})


def test_tiny_model_decode_bench_returns_rows_with_expected_keys():
    model = tiny_model("llama")
    seen = []
    rows = run_decode(
        model, ["full", "streaming", "h2o"], budget=16, contexts=[32, 64], steps=2, chunk_size=16, on_row=seen.append
    )
    assert len(rows) == 8 and seen == rows  # 3 methods + DynamicCache, 2 contexts each
    expected = {key for key, _, _ in DECODE_COLUMNS} | {"budget", "rss_mib", "prefill_s"}
    for row in rows:
        assert expected <= set(row)
    stored = {(row["method"], row["context"]): row["stored_tokens"] for row in rows}
    assert stored[("streaming", 64)] == 16 and stored[("full", 64)] == 64 + 2 + 2  # + warm-up and timed steps
    assert "| full | 32 |" in decode_table(rows)


def test_tiny_model_prefill_bench_compares_one_pass_and_chunks():
    rows = run_prefill(tiny_model("llama"), ["full", "streaming"], budget=16, prompt_lengths=[48], chunk_size=16)
    assert [(row["method"], row["mode"]) for row in rows] == [
        ("full", "one pass"),
        ("full", "chunks of 16"),
        ("streaming", "one pass"),
        ("streaming", "chunks of 16"),
    ]
    assert [row["stored_tokens"] for row in rows] == [48, 48, 16, 16]
    assert all(row["time_vs_one_pass"] > 0 for row in rows)


def test_speed_bench_runs_every_default_method_on_a_tiny_model(monkeypatch):
    given = common.bench_params  # pod ships a layer grouping for SmolLM2 only: the tiny model's is given here
    monkeypatch.setattr(
        common, "bench_params", lambda m, b: {**given(m, b), **({"block_size": 2} if m == "pod" else {})}
    )
    rows = speed.run_speed(
        tiny_model("llama"), ("decode", "prefill"), budget=40, prompts=(96,), steps=2, chunk=32, threads=1
    )
    decoded = {row["method"] for row in rows if row["section"] == "decode"}
    prefilled = {row["method"] for row in rows if row["section"] == "prefill"}
    assert decoded == set(speed.DECODE_METHODS) and {"less", "pod"} <= decoded
    assert prefilled == set(speed.PREFILL_METHODS)
    assert all(row["cpu_ratio"] > 0 for row in rows)
    stored = {row["method"]: row["stored_tokens"] for row in rows if row["section"] == "prefill"}
    assert stored["full"] == 96 and stored["snapkv"] == stored["nacl"] == 40  # one-shot: compressed after the prompt


MAPPED_PROBE = """
import torch
from kvcompress.bench import common
mapped = common.map_large_allocations() if MAP else None
torch.ones(1 << 20).sum()  # a 4 MiB block freed: the adaptive threshold would put the next ones on the heap
common.release_free_memory()
before = common.current_rss()
blocks = [torch.ones(1 << 20) for _ in range(64)]  # 64 x 4 MiB, written
held = common.current_rss()
del blocks[::2]  # every other block freed: holes a heap could not hand back
print(mapped, held - before, common.current_rss() - before)
"""


def test_mapped_large_allocations_leave_the_resident_set_when_freed():
    # in a child process: the allocation mode stays for the rest of a process
    import subprocess
    import sys

    probe = "MAP = True" + MAPPED_PROBE
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    mapped, held, after = out.split()
    if mapped != "True":
        pytest.skip("not glibc: allocations cannot be mapped one by one")
    mib = 1 << 20
    assert int(held) >= 200 * mib  # the 256 MiB were resident
    assert int(after) <= int(held) - 100 * mib  # half of them freed: about 128 MiB handed back at once


def test_prefill_peaks_are_measured_in_a_child_process_with_mapped_allocations(tmp_path):
    tiny_model("llama").config.save_pretrained(tmp_path)  # the child loads it again (random weights: shapes only)
    load = {"device": "cpu", "dtype": "float32", "random_weights": True, "threads": 1}
    peaks = peaks_in_child(str(tmp_path), ["full", "streaming"], prompt=64, budget=16, chunk=16, seed=0, **load)
    assert set(peaks) == {"one_pass_dynamic", "full", "streaming", "mapped"}
    assert peaks["mapped"] == 1 and all(peaks[k] >= 0 for k in ("one_pass_dynamic", "full", "streaming"))
