"""``DecodeGraph``: a captured decoding step replayed gives what eager decoding gives.

On the CPU the capture is ``make_fx``'s trace: the step as a fixed graph of ATen operations, with every Python value
baked in and every tensor the step reads at the address it had when traced, which is the contract of a CUDA graph
(``tests/gpu`` replays real CUDA graphs). Two checks per supported method: two consecutive steady steps trace to the
same operations (no stream position or slot index baked in as a number), and replaying the traced step for many
tokens reproduces eager decoding exactly (logits every step, kept tokens at the end, and once the graph is left
every Python number of the cache, its layers, slots and policies: a replay runs no Python, so what a step changes
must live in the layers' device counters, ``core.replay``).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import kvcompress
from kvcompress.core.replay import ReplayBinding
from kvcompress.decode_graph import GRAPHED_METHODS, DecodeGraph, greedy_decode
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import tiny_model

BATCH, PROMPT, BUDGET = 2, 40, 16


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


def _prefilled(model, method: str):
    cache = kvcompress.cache_for(model, method, budget=BUDGET)
    ids = torch.randint(3, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    return cache


def _positions(step: int) -> torch.Tensor:
    return torch.full((BATCH, 1), PROMPT + step)


def _step(model, cache):
    return lambda ids, positions: (
        model(input_ids=ids, position_ids=positions, **cache_argument(model, cache), use_cache=True).logits
    )


@pytest.mark.parametrize("bound", [True, False], ids=["device-counters", "python-counters"])
@pytest.mark.parametrize("method", sorted(GRAPHED_METHODS))
def test_two_steady_steps_trace_to_the_same_operations(model, method, bound):
    cache = _prefilled(model, method)
    token = torch.full((BATCH, 1), 5)
    with torch.no_grad():
        for step in range(3):  # reach the budget: every layer reuses its victim's slot
            _step(model, cache)(token, _positions(step))
        binding = ReplayBinding(cache.compressed_layers)
        if bound:
            binding.bind()
        with binding.own_step():  # (a forward outside the graph's own steps would unbind the layers)
            codes = [make_fx(_step(model, cache))(token, _positions(step)).code for step in (3, 4)]
    # without the device counters the step bakes in the stream index it writes: a number that changes every step
    assert (codes[0] == codes[1]) == bound


@pytest.mark.parametrize("method", sorted(GRAPHED_METHODS))
def test_replaying_a_traced_step_reproduces_eager_decoding(model, method):
    graphed = DecodeGraph(model, _prefilled(model, method), capture="trace")
    eager = DecodeGraph(model, _prefilled(model, method), capture=None)
    token = torch.full((BATCH, 1), 5)
    with torch.no_grad():
        for step in range(24):
            expected = eager(token, _positions(step))
            torch.testing.assert_close(graphed(token, _positions(step)), expected, rtol=0, atol=0)
            token = expected[:, -1:].argmax(-1)
    assert graphed.replays >= 18  # captured once the cache reached its budget and its step repeated
    assert eager.replay is None and eager.replays == 0
    for ours, theirs in zip(graphed.layers, eager.layers, strict=True):
        assert ours.seen == theirs.seen and ours.get_seq_length() == PROMPT + 24  # (read: one sync, still bound)
        assert int(ours.seen_tensor) == ours.seen
        assert torch.equal(ours.kept().token_idx, theirs.kept().token_idx)
    graphed.close()
    assert _python_state(graphed.cache) == _python_state(eager.cache)
    assert all(layer.seen_tensor is None for layer in graphed.layers)


def _python_state(cache) -> list[dict]:
    """Every number (and tuple or list of numbers) of the cache, its layers, their slots and policies, the bound form's
    own attributes aside; the slots' real-token count as its value (how much of it lags in Python differs between a
    replayed and an eager step)."""
    owners = [cache]
    for layer in cache.compressed_layers:
        owners += [layer, layer.slots, layer.policy]
    numbers = (int, float, bool, str, type(None))
    state = []
    for owner in owners:
        fields = {
            name: tuple(value) if isinstance(value, list | tuple) else value
            for name, value in getattr(owner, "__dict__", {}).items()
            if name not in ("_real_lag", "replay_binding", "seen_tensor", "free_buffer", "start_tensor")
            and (
                isinstance(value, numbers)
                or (isinstance(value, list | tuple) and all(isinstance(item, numbers) for item in value))
            )
        }
        if hasattr(owner, "real_seen"):
            fields["real_seen"] = owner.real_seen.tolist()
        state.append(fields)
    return state


def test_other_methods_decode_eagerly(model):
    graph = DecodeGraph(model, _prefilled(model, "cascade"), capture="trace")
    with torch.no_grad():
        for step in range(8):
            graph(torch.full((BATCH, 1), 5), _positions(step))
    assert graph.replay is None and graph.replays == 0
    assert all(layer.seen_tensor is None for layer in graph.layers)


def test_greedy_decoding_through_replayed_steps_gives_the_tokens_of_eager_decoding(model):
    ids = torch.randint(3, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(2))
    runs = [
        greedy_decode(model, kvcompress.cache_for(model, "h2o", budget=BUDGET), ids, 20, capture=capture)
        for capture in ("trace", None)
    ]
    assert runs[0].shape == (BATCH, 20)
    assert torch.equal(runs[0], runs[1])
    with torch.no_grad():
        reference = model.generate(
            ids,
            **cache_argument(model, kvcompress.cache_for(model, "h2o", budget=BUDGET)),
            max_new_tokens=20,
            do_sample=False,
        )[:, PROMPT:]
    eos = model.generation_config.eos_token_id  # generate stops a row there (then pads): compare up to it
    for ours, theirs in zip(runs[1].tolist(), reference.tolist(), strict=True):
        end = ours.index(eos) + 1 if eos in ours else len(ours)
        assert ours[:end] == theirs[:end]


@pytest.mark.parametrize("method", ["h2o", "streaming"])
def test_a_prompt_forward_between_steps_drops_the_graph_and_decoding_goes_on_eagerly(model, method):
    graphed = DecodeGraph(model, _prefilled(model, method), capture="trace")
    eager = DecodeGraph(model, _prefilled(model, method), capture=None)
    token, more = (
        torch.full((BATCH, 1), 5),
        torch.randint(3, 128, (BATCH, 6), generator=torch.Generator().manual_seed(3)),
    )
    with torch.no_grad():
        for step in range(16):
            if step == 8:  # six more prompt tokens: the layers compact, their buffers change
                assert graphed.replay is not None
                for graph in (graphed, eager):
                    prefill(model, more, graph.cache)
            position = _positions(step + (6 if step >= 8 else 0))
            expected = eager(token, position)
            torch.testing.assert_close(graphed(token, position), expected, rtol=0, atol=0)
            token = expected[:, -1:].argmax(-1)
    assert graphed.replay is not None  # captured again once steady


def test_wrong_arguments_are_refused_with_the_parameter_named(model):
    cache = kvcompress.cache_for(model, "h2o", budget=BUDGET)
    with pytest.raises(ValueError, match="capture must be"):
        DecodeGraph(model, cache, capture="graph")
    with pytest.raises(ValueError, match="capture='cuda' needs a model on a CUDA device"):
        DecodeGraph(model, cache, capture="cuda")
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        greedy_decode(model, cache, torch.ones(1, 4, dtype=torch.long), 0)
