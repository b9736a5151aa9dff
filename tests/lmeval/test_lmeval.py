"""The lm-eval model: ``full`` equals lm-eval's own ``hf`` model, a budget stores less, the local tasks and CLI run."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from kvcompress.lmeval import KVCompressLM, build_tasks  # noqa: E402
from kvcompress.lmeval.cli import main, with_local_tasks  # noqa: E402
from kvcompress.lmeval.scoring import score_batch, split_request  # noqa: E402
from kvcompress.models import is_cached, load_model, model_cache_dir, tiny_model, tiny_tokenizer  # noqa: E402
from tests.helpers import data_folder, needs_smollm2  # noqa: E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TASKS = ["kvc_needle", "kvc_needle_ll", "kvc_wikitext"]
TEXT = "The grass is green. The sky is blue. The pass key is 31415. Remember it. " * 3
GEN = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}


def _lm(cls, **kwargs):
    return cls(pretrained=tiny_model(), tokenizer=tiny_tokenizer(), **kwargs)


def _requests():
    ll = [("What is the pass key? The pass key is", " 31415"), (TEXT, " and the sun is yellow"), ("A", " b c d e f")]
    return (
        [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(ll)],
        [Instance("loglikelihood_rolling", {}, (TEXT * 2,), 0)],
        [Instance("generate_until", {}, (TEXT + "The pass key is", GEN), i) for i in range(2)],
    )


def test_split_request_keeps_lm_eval_truncation():
    assert split_request([1, 2, 3], [4, 5], 10) == ([1, 2], [3, 4])
    assert split_request([1, 2, 3], [4, 5], 3) == ([2], [3, 4])
    assert split_request([1, 2, 3], [4, 5], 2) == ([], [3, 4])  # left-truncated to max_length + 1 tokens
    with pytest.raises(ValueError, match="continuation"):
        split_request([1], [], 10)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_full_equals_hf_on_every_request_type(batch_size):
    hf, kv = _lm(HFLM, batch_size=batch_size), _lm(KVCompressLM, method="full", chunk_size=16, batch_size=batch_size)
    ll, rolling, gen = _requests()
    for (ours, our_greedy), (theirs, their_greedy) in zip(kv.loglikelihood(ll), hf.loglikelihood(ll), strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5) and our_greedy == their_greedy
    assert kv.loglikelihood_rolling(rolling) == pytest.approx(hf.loglikelihood_rolling(rolling), rel=1e-5)
    assert kv.generate_until(gen) == hf.generate_until(gen)


def test_budget_stores_less_and_changes_scores():
    ll, rolling, _ = _requests()
    full = _lm(KVCompressLM, method="full", chunk_size=16)
    h2o = _lm(KVCompressLM, method="h2o", budget=32, chunk_size=16)
    assert full.loglikelihood_rolling(rolling) != pytest.approx(h2o.loglikelihood_rolling(rolling), rel=1e-3)
    full_info, h2o_info = full.get_model_info()["kvcompress"], h2o.get_model_info()["kvcompress"]
    assert h2o_info["kv_bytes_max"] < full_info["kv_bytes_max"] / 2
    assert h2o_info["method"] == "h2o" and h2o_info["params"]["budget"] == 32


def test_scores_go_through_the_cache_the_model_asked_for():
    model, seen = tiny_model(), []
    lm = KVCompressLM(pretrained=model, tokenizer=tiny_tokenizer(), method="window", budget=8, chunk_size=4)

    def cache():
        seen.append(lm.new_cache())
        return seen[-1]

    ids = tiny_tokenizer()(TEXT)["input_ids"]
    (answer,) = score_batch(model, cache, [(ids[:-5], ids[-5:])], 4096, 4)
    assert len(seen) == 1 and seen[0].tokens_seen() == len(ids) - 1
    assert max(seen[0].tokens_stored()) <= 8 and answer.kv_bytes == seen[0].nbytes()


def test_method_parameters_are_checked():
    with pytest.raises(ValueError, match="budget"):
        _lm(KVCompressLM, method="h2o", budget="many")
    with pytest.raises(ValueError, match="method"):
        _lm(KVCompressLM, method="nonsense")
    with pytest.raises(ValueError, match="chunk_size"):
        _lm(KVCompressLM, chunk_size=1.5)


def _reported(value: float) -> str | float:
    """A metric as lm-eval's table prints it (4 decimals). A random model's perplexities (~1e11 to 1e13) are
    ``exp`` of a mean log-likelihood of ~30 nats, so their 4th decimal is the 15th significant digit: they are
    compared as that log-likelihood instead, to the relative precision the request-level test asks of float32
    log-likelihoods (1e-5; one chunked prefill gave 1.264165e13 where lm-eval's model gave 1.264167e13)."""
    return f"{value:.4f}" if abs(value) < 1e3 else math.log(value)


def test_local_tasks_full_equals_hf_to_the_reported_digit(tmp_path):
    folder = build_tasks(tmp_path / "tasks", data_folder(tmp_path / "data"), samples=2, words=30, words_per_page=40)
    manager = lm_eval.tasks.TaskManager(include_path=str(folder), include_defaults=False)
    scores = {}
    for name, lm in (("hf", _lm(HFLM, max_length=512)), ("full", _lm(KVCompressLM, chunk_size=32, max_length=512))):
        out = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=manager, limit=2, verbosity="ERROR")
        scores[name] = {
            (task, metric): value
            for task, metrics in out["results"].items()
            for metric, value in metrics.items()
            if isinstance(value, float) and "stderr" not in metric
        }
    assert len(scores["hf"]) >= 6 and scores["full"].keys() == scores["hf"].keys()
    for key, theirs in scores["hf"].items():
        ours, theirs = _reported(scores["full"][key]), _reported(theirs)
        assert ours == (theirs if isinstance(theirs, str) else pytest.approx(theirs, rel=1e-5)), key


@pytest.mark.slow  # lm-eval's own CLI indexes its thousands of task files first: about a minute on 2 cores
def test_cli_runs_the_local_tasks_with_a_saved_model(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tiny_model().save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    args = ["--model", "kvcompress", "--tasks", "kvc_needle_ll", "--limit", "2", "--output_path", str(tmp_path / "out")]
    args += ["--model_args", f"pretrained={tmp_path / 'model'},method=streaming,budget=64,chunk_size=32"]
    assert with_local_tasks(args)[-2] == "--include_path"
    assert main(args) == 0
    (result,) = list((tmp_path / "out").rglob("results_*.json"))
    data = json.loads(result.read_text())
    assert data["config"]["kvcompress"]["method"] == "streaming"
    assert data["config"]["kvcompress"]["kv_bytes_max"] > 0
    assert "acc,none" in data["results"]["kvc_needle_ll"]


@pytest.mark.slow
@needs_smollm2
def test_smollm2_full_equals_hf_and_a_budget_stores_less(tmp_path):
    folder = build_tasks(tmp_path / "tasks", data_folder(tmp_path / "data"), samples=2, words=200)
    if not is_cached("smollm2-135m"):  # lm-eval's own model reads the converted folder: convert it first
        load_model("smollm2-135m")
    manager = lm_eval.tasks.TaskManager(include_path=str(folder), include_defaults=False)
    reported, info = {}, {}
    kvc = {"pretrained": "smollm2-135m", "chunk_size": 128}
    runs = {
        "hf": ("hf", {"pretrained": str(model_cache_dir("smollm2-135m")), "dtype": "float32", "device": "cpu"}),
        "full": ("kvcompress", kvc),
        "h2o": ("kvcompress", {**kvc, "method": "h2o", "budget": 64}),
    }
    for name, (model, args) in runs.items():
        out = lm_eval.simple_evaluate(
            model=model, model_args=args, tasks=["kvc_needle_ll", "kvc_wikitext"], task_manager=manager, limit=2
        )
        reported[name] = {
            task: {m: f"{v:.4f}" for m, v in row.items() if isinstance(v, float) and "stderr" not in m}
            for task, row in out["results"].items()
        }
        info[name] = out["config"].get("kvcompress")
    # values to lm-eval's 4 printed decimals; the bootstrap stderr of a 2-document perplexity is left out (fp
    # noise moved it by one in the 4th decimal: 0.6305 vs 0.6304)
    assert reported["full"] == reported["hf"]
    assert info["h2o"]["kv_bytes_max"] < info["full"]["kv_bytes_max"] / 2
    assert torch.isfinite(torch.tensor(float(reported["h2o"]["kvc_wikitext"]["word_perplexity,none"])))
