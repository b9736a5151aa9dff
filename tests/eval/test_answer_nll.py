"""The answer NLL (a graded retrieval score): teacher-forced after the prompt, through the compressed cache.

With the full cache it equals the model's own loss on the answer in one uncached forward; it feeds what the
cache has not seen plus the answer (but its last token) in one forward; an evicting cache changes it; the passkey
task writes it in every row (unless ``nll=False``) from a copy of the prefilled cache, equal to a fresh cache's.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import kvcompress
from kvcompress.eval.configs import EvalConfig, expand_configs
from kvcompress.eval.tasks import make_task, run_task
from kvcompress.eval.tasks.prompting import answer_nll, encode

FULL = EvalConfig("full")


def _parts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(context_ids, question_ids, answer_ids)`` of 40, 6 and 4 tokens (ids 4..127, no specials)."""
    generator = torch.Generator().manual_seed(seed)
    context, question, answer = (torch.randint(4, 128, (1, n), generator=generator) for n in (40, 6, 4))
    return context, question, answer


def _reference(model, context, question, answer) -> float:
    """Mean cross-entropy of ``answer`` from one forward over the whole sequence, no cache."""
    ids = torch.cat([context, question, answer], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -answer.shape[1] - 1 : -1]
    return F.cross_entropy(logits.float(), answer[0]).item()


@pytest.mark.parametrize("chunk_size", [None, 7])
@pytest.mark.parametrize("mode", ["agnostic", "aware"])
def test_full_cache_answer_nll_equals_one_uncached_forward(tiny, mode, chunk_size):
    model, _ = tiny
    context, question, answer = _parts()
    cache = kvcompress.cache_for(model, "full")
    value = answer_nll(model, context, question, answer, cache, mode, chunk_size)
    assert value == pytest.approx(_reference(model, context, question, answer), abs=1e-5)
    assert cache.tokens_seen() == 40 + 6 + 4 - 1  # the answer but its last token went through the cache


@pytest.mark.parametrize(("mode", "unseen"), [("agnostic", 6), ("aware", 1)])
def test_the_unseen_prompt_and_the_answer_go_in_one_forward(tiny, monkeypatch, mode, unseen):
    model, _ = tiny
    context, question, answer = _parts(1)
    calls: list[list[int]] = []
    original = model.forward

    def recording(*args, **kwargs):
        calls.append(kwargs["input_ids"][0].tolist())
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    answer_nll(model, context, question, answer, kvcompress.cache_for(model, "full"), mode, 16)
    prompt = torch.cat([context, question], dim=1)[0].tolist()
    assert calls[-1] == prompt[-unseen:] + answer[0, :-1].tolist()
    assert sum(calls[:-1], []) == prompt[:-unseen]  # the prefill: everything before, in chunks


def test_an_evicting_cache_scores_the_answer_from_what_it_kept(tiny):
    model, _ = tiny
    context, question, answer = _parts(2)
    full = answer_nll(model, context, question, answer, kvcompress.cache_for(model, "full"), "aware", 8)
    cache = kvcompress.cache_for(model, "window", budget=8)
    windowed = answer_nll(model, context, question, answer, cache, "aware", 8)
    assert max(cache.tokens_stored()) <= 8 and cache.tokens_seen() == 40 + 6 + 4 - 1
    assert abs(windowed - full) > 1e-3


CONFIGS = expand_configs(["full", "window", "h2o", "snapkv:window=4", "nacl", "random", "cascade"], [16])


def test_passkey_rows_hold_the_answer_nll_of_a_fresh_cache_and_the_generated_answer(tiny):
    """One prefill serves both scores: the NLL from a copy of the prefilled cache equals ``answer_nll`` on a fresh
    cache, and the row's cache (the one that decoded) saw the prompt and the generated tokens, not the key."""
    model, tokenizer = tiny
    task = make_task("passkey", model, tokenizer, seed=5, length=120, chunk_size=16, modes=("aware", "agnostic"))
    [sample] = task.build_samples(1)
    inputs = sample.inputs
    assert inputs["answer_ids"].tolist() == encode(tokenizer, " " + inputs["key"]).tolist()
    rows = list(run_task(task, CONFIGS, [sample]))
    assert len(rows) == 2 * len(CONFIGS)
    prompt_length = inputs["context_ids"].shape[1] + inputs["question_ids"].shape[1]
    for row, (mode, config) in zip(rows, [(m, c) for m in task.modes for c in CONFIGS], strict=True):
        fresh = task.new_cache(config)
        expected = answer_nll(
            model, inputs["context_ids"], inputs["question_ids"], inputs["answer_ids"], fresh, mode, 16
        )
        assert row["scores"]["answer_nll"] == pytest.approx(expected, abs=1e-6), (mode, config.label)
        assert row["tokens_seen"] == prompt_length + task.params["max_new_tokens"] - 1
    nll = {(r["mode"], r["method"]): r["scores"]["answer_nll"] for r in rows}
    assert nll[("aware", "window")] != pytest.approx(nll[("aware", "full")], abs=1e-3)
    assert "cpu_s" in rows[0] and rows[0]["cpu_s"] > 0


def test_passkey_nll_can_be_turned_off_and_is_checked(tiny):
    model, tokenizer = tiny
    task = make_task("passkey", model, tokenizer, length=100, nll=False)
    [row] = run_task(task, [FULL], task.build_samples(1))
    assert set(row["scores"]) == {"accuracy"}
    with pytest.raises(ValueError, match="nll must be true or false, got 'yes'"):
        make_task("passkey", model, tokenizer, nll="yes")
