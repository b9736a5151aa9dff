"""Every method holds its budget (issue 20): tokens stored per layer and KV head never exceed the budget (or the
method's documented peak) after the prefill and after every later forward, for budgets from 1 to twice the
context; decode-time methods never evict the tokens of the forward being processed when they fit in the budget (but
``periodic``, which ranks the step's own token at its compression steps as kvpress's ``DecodingPress`` does)."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.pod.budget import budget_report
from kvcompress.models import load_model
from kvcompress.registry import METHODS
from tests.helpers import needs_smollm2, tiny_tokenizer_dir

CONTEXT, QUESTION, STEPS = 24, 4, 3
BUDGETS = (1, 2, 3, 5, 8, 12, 17, 24, 36, 48)
FORWARDS = (CONTEXT, QUESTION, *[1] * STEPS)  # tokens of each forward


def params_for(method: str, budget: int) -> dict[str, object]:
    """The method at ``budget`` tokens per layer and KV head (its other parameters at their defaults)."""
    if method == "full":
        return {}
    if method == "snapkv":
        return {"budget": budget, "window": min(4, budget)}
    if method == "pod":
        return {"budget": budget, "block_size": 2}
    if method == "periodic":  # every 2 decoding steps back to the budget (see periodic_cap)
        return {"budget": budget, "interval": PERIODIC_INTERVAL}
    if method == "kvzip":  # (uniform: its head-level budgets hold on average, tests/references/test_kvzip.py)
        return {"budget": budget, "allocation": "uniform", "tokenizer": tiny_tokenizer_dir()}
    # the parts a budget holds, shrunk with it (their defaults need more than the smallest budgets)
    if method == "streaming":
        return {"budget": budget, "sinks": min(4, budget)}
    if method == "knorm":
        return {"budget": budget, "recent": min(8, budget)}
    if method == "cascade":
        sinks = min(4, budget - 1)
        return {"budget": budget, "sinks": sinks, "cascades": min(4, budget - sinks)}
    return {"budget": budget}


BUZZ_LEAST = 9  # buzz's smallest budget at its defaults: 4 sinks + 1 + T(w = 1) = 4 (a stride of 5 beside its window)


PERIODIC_INTERVAL = 2


def periodic_caps(budget: int, counts: tuple[int, ...]) -> list[int]:
    """What ``periodic`` holds after each forward of ``counts`` tokens: the first (the prompt) whole; every later
    one is a step, and after every ``PERIODIC_INTERVAL``-th step (or a forward of at least ``budget`` tokens) the
    cache is back to ``budget`` (its documented peak: the budget plus the tokens since the last compression)."""
    held, since, caps = 0, 0, []
    for index, count in enumerate(counts):
        held += count
        if index:
            since += 1
            if since >= PERIODIC_INTERVAL or count >= budget:
                held, since = min(held, budget), 0
        caps.append(held)
    return caps


def bound(cache) -> int:
    """The most tokens a layer may store per head after a forward: the budget, BUZZ's documented peak."""
    config = cache.config
    if config.name == "buzz":
        return config.peak_tokens()
    if config.name == "less":
        return config.base_config.budget
    return config.budget


def configs():
    for method in METHODS:
        # full keeps everything; pod's budget is in bytes (tests/methods/test_pod.py); duo has no budget: a head keeps
        # everything or its sinks and recent tokens (tests/methods/test_duo.py)
        if method in ("full", "pod", "duo"):
            continue
        for budget in BUDGETS:
            yield pytest.param(method, budget, id=f"{method}-{budget}")


def stored(cache) -> list[int]:
    """Real tokens stored per layer (the most over sequences and heads)."""
    return [int(layer.valid.sum(-1).max()) for layer in cache.compressed_layers]


def forward_kept(cache, first: int, count: int) -> bool:
    """Whether every layer and head still holds the tokens ``first .. first + count``."""
    wanted = set(range(first, first + count))
    for layer in cache.compressed_layers:
        for row in layer.token_idx.reshape(-1, layer.token_idx.shape[-1]):
            if not wanted <= set(row.tolist()):
                return False
    return True


def room_for_a_forward(cache, limit: int) -> int:
    """The longest forward a decode-time method promises to keep whole: the budget beside the sinks, or for
    cascade its first sub-cache (the only one taking every token)."""
    config = cache.config
    if config.name == "cascade":
        return config.width
    return limit - (getattr(config, "sinks", 0) or 0)


@pytest.mark.parametrize(("method", "budget"), list(configs()))
def test_stored_tokens_never_exceed_the_budget_and_the_forward_fed_is_kept(method, budget, tiny_llama):
    if method == "buzz" and budget < BUZZ_LEAST:
        with pytest.raises(
            ValueError, match=f"budget must be at least sinks \\+ 1 \\+ T\\(w=1\\) = {BUZZ_LEAST} .*got {budget}"
        ):
            kvcompress.cache_for(tiny_llama, method, **params_for(method, budget))
        return
    cache = kvcompress.cache_for(tiny_llama, method, **params_for(method, budget))
    one_shot = cache.compressed_layers[0].policy.one_shot
    limit = bound(cache)
    ids = torch.randint(1, 128, (1, CONTEXT + QUESTION + STEPS), generator=torch.Generator().manual_seed(budget))
    fed = 0
    with torch.no_grad():
        for steps, count in enumerate(FORWARDS):
            if method == "kvzip" and not fed:  # it compresses the context in prefill (it reruns the model on its ids)
                prefill(tiny_llama, ids[:, :count], cache)
            else:
                tiny_llama(ids[:, fed : fed + count], **cache_argument(tiny_llama, cache))
            appended = fed + count - CONTEXT if one_shot else 0  # one-shot: the budget bounds the prompt
            if method == "periodic":
                limit = periodic_caps(budget, FORWARDS)[steps]
            assert max(stored(cache)) <= limit + appended, (fed, count)
            fits = count <= room_for_a_forward(cache, limit)
            if not one_shot and fed and fits and method != "periodic":  # (it ranks the step's token, as kvpress)
                assert forward_kept(cache, fed, count), (fed, count)
            fed += count


POD_REQUESTS = [("ratio", 0.2), ("ratio", 0.5), ("ratio", 1.0), ("budget", 4), ("budget", 20)]


@pytest.mark.parametrize(("key", "value"), POD_REQUESTS)
def test_pod_at_a_ratio_or_budget_stores_at_most_the_requested_kv_bytes(key, value, tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "pod", block_size=2, n_sink=2, n_recent=4, **{key: value})
    ids = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_llama(ids, **cache_argument(tiny_llama, cache))
    report = budget_report(cache)
    assert report["stored_bytes"] <= report["requested_bytes"]
    assert report["stored_bytes"] > 0.7 * min(report["requested_bytes"], report["full_bytes"])  # not far below


def test_pod_without_a_grouping_for_the_model_names_what_to_give(tiny_llama):
    with pytest.raises(ValueError, match="no shipped grouping for a 2-layer model"):
        kvcompress.cache_for(tiny_llama, "pod", ratio=0.5)


@needs_smollm2
def test_pod_by_name_on_smollm2_uses_the_shipped_grouping_and_meets_half_the_bytes():
    model, tokenizer = load_model("smollm2-135m")
    cache = kvcompress.cache_for(model, "pod", ratio=0.5)
    ids = torch.randint(1, 40000, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **cache_argument(model, cache))
    report = budget_report(cache)
    assert 0.4 < report["stored_over_full"] <= 0.5
    assert cache.compressed_layers[5].head_starts != (5, 5, 5)  # blocks from the calibration, not dense
