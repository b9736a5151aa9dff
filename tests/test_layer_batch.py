"""A decoding step's evictions run once for all layers when the forward closes (``core.joint_eviction``): the same
victims, logits and kept tokens as every layer evicting alone, one policy call per step, and the evictions of a forward
that stopped before its last layer done before the next forward stores anything."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.less import LessConfig
from tests.methods.test_less import ids_of, strong_kernels

PROMPT, STEPS = 17, 24


def config_of(model, method: str):
    if method.startswith("less"):  # "less" on H2O, "less-BASE" on another batchable base
        base = method.partition("-")[2] or "h2o"
        return LessConfig(base=base, budget=10, kernels=strong_kernels(model))
    return kvcompress.registry.make_config(method, budget=10)


def decode(model, ids: torch.Tensor, cache) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Prefill in chunks of 5, then decode one token per forward: the logits and every layer's kept stream
    indices (sorted per row) after each step."""
    logits, kept = [], []
    with torch.no_grad():
        prefill(model, ids[:, :PROMPT], cache, chunk_size=5)
        for t in range(PROMPT, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], **cache_argument(model, cache)).logits)
            kept.append([layer.kept().token_idx.sort(dim=-1).values for layer in cache.compressed_layers])
    return logits, kept


def alone(cache):
    """``cache`` with every layer evicting right after its own attention."""
    for layer in cache.compressed_layers:
        layer.joint_eviction = False
    return cache


@pytest.mark.parametrize(
    "method", ["h2o", "less", "scissorhands", "tova", "knorm", "less-tova", "less-scissorhands", "less-knorm"]
)
@pytest.mark.parametrize("batch", [1, 2])
def test_layers_evicting_together_decode_as_layers_evicting_alone(tiny_llama, method, batch):
    ids = ids_of(batch, PROMPT + STEPS, seed=5)
    together = kvcompress.cache_for(tiny_llama, config_of(tiny_llama, method))
    assert all(layer.joint_eviction for layer in together.compressed_layers)
    logits, kept = decode(tiny_llama, ids, together)
    expected_logits, expected_kept = decode(
        tiny_llama, ids, alone(kvcompress.cache_for(tiny_llama, config_of(tiny_llama, method)))
    )
    for step in range(STEPS):
        assert torch.equal(logits[step], expected_logits[step]), f"step {step}"
        for got, want in zip(kept[step], expected_kept[step], strict=True):
            assert torch.equal(got, want), f"step {step}"
    assert all(layer.stored_length() == 10 for layer in together.compressed_layers)


@pytest.mark.parametrize("method", ["h2o", "scissorhands", "tova", "knorm"])
def test_a_decoding_step_runs_the_policy_once_for_every_layer(tiny_llama, monkeypatch, method):
    cache = kvcompress.cache_for(tiny_llama, method, budget=10)
    policy_class = type(cache.compressed_layers[0].policy)
    calls = []
    select = policy_class.select
    monkeypatch.setattr(policy_class, "select", lambda self, layer: calls.append(layer.rows) or select(self, layer))
    ids = ids_of(2, PROMPT + STEPS, seed=6)
    with torch.no_grad():
        prefill(tiny_llama, ids[:, :PROMPT], cache, chunk_size=5)
        model_layers = len(cache.compressed_layers)
        for t in range(PROMPT, PROMPT + 3):  # the first steps restack the layers' buffers (one copy per name)
            tiny_llama(ids[:, t : t + 1], **cache_argument(tiny_llama, cache))
        calls.clear()
        for t in range(PROMPT + 3, ids.shape[1]):
            tiny_llama(ids[:, t : t + 1], **cache_argument(tiny_llama, cache))
    # once per step, not once per layer, over the layers' rows stacked: layers x sequences
    assert [rows[0] for rows in calls] == [model_layers * 2] * (STEPS - 3)


def test_a_forward_that_stopped_before_its_last_layer_leaves_no_eviction_behind(tiny_llama):
    ids = ids_of(1, PROMPT + 2, seed=7)
    cache = kvcompress.cache_for(tiny_llama, "h2o", budget=10)
    with torch.no_grad():
        prefill(tiny_llama, ids[:, :PROMPT], cache, chunk_size=5)
        tiny_llama(ids[:, PROMPT : PROMPT + 1], **cache_argument(tiny_llama, cache))

    def stop(*_):
        raise KeyboardInterrupt  # a forward stopped after layer 0's attention, its eviction left for the end

    hook = tiny_llama.model.layers[1].register_forward_pre_hook(stop)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        tiny_llama(ids[:, PROMPT + 1 : PROMPT + 2], **cache_argument(tiny_llama, cache))
    hook.remove()
    first = cache.compressed_layers[0]
    assert cache.forward_pass.is_open and first.stored_length() == 11
    cache.forward_pass.begin(first)  # the next forward opens: the stopped one's evictions run first
    assert all(layer.stored_length() == 10 for layer in cache.compressed_layers)
