"""Capacity follows what is kept (issue 50): after a one-forward prefill of a prompt 4x the budget, after a prompt fed
in chunks, and after every decoding step, each method's layers hold at most their stored bytes plus one chunk
(``kvcompress.core.capacity``: one growth step, ``headroom(stored)`` slots), and nothing the cache holds besides
what its layers report grows with the prompt.

Two checks per forward:
- the layers' own accounting: ``allocated_nbytes()`` (keys and values) and ``allocated_metadata_nbytes()``
  (positions, method state) at most the stored bytes plus ``headroom(stored)`` slots of each;
- independently of that accounting: every tensor reachable from the cache object (layers, policies, shared
  buffers, attributes set on tensors), counted once per storage, minus what the layers report as allocated, is the
  same after a prompt of 4x and of 8x the budget: memory held but not reported does not grow with the prompt.
"""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.core.capacity import headroom
from kvcompress.generation import cache_argument, prefill
from kvcompress.registry import METHODS
from tests.helpers import duo_pattern_file, tiny_tokenizer_dir

BUDGET, STEPS = 32, 4


def params_for(method: str) -> dict[str, object]:
    """The method at ``BUDGET`` tokens per layer and KV head (PoD: its sharing at the paper's block size, ``n_recent``
    below the prompt; full: everything)."""
    if method == "full":
        return {}
    if method == "pod":
        return {"block_size": 2, "n_recent": 8}
    if method == "kvzip":
        return {"budget": BUDGET, "allocation": "uniform", "tokenizer": tiny_tokenizer_dir()}
    if method == "duo":  # streaming heads keep BUDGET tokens, retrieval heads everything
        return {"pattern": duo_pattern_file(), "sink_size": 4, "recent_size": BUDGET - 4}
    return {"budget": BUDGET}


def reachable_nbytes(root: object) -> int:
    """Bytes of every tensor storage reachable from ``root`` through attributes, containers and attributes set on
    tensors (models excluded), each storage counted once."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (torch.nn.Module, type, str, bytes, int, float, bool)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
            stack.extend(vars(item).values())
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return sum(storages.values())


def allocated(cache) -> int:
    return cache.allocated_nbytes() + cache.allocated_metadata_nbytes()


def assert_room_is_one_chunk(cache, kv_per_token: int, when: str) -> None:
    """Per layer: allocated bytes at most stored bytes plus ``headroom(stored)`` slots (keys and values of a
    token; bookkeeping at the layer's stored bytes per stored token)."""
    for index, layer in enumerate(cache.layers):
        stored = layer.stored_length()
        room = headroom(stored)
        kv_room = room * kv_per_token
        assert layer.allocated_nbytes() <= layer.kv_nbytes() + kv_room, (
            f"layer {index} {when}: {layer.allocated_nbytes()} bytes of keys and values allocated for "
            f"{layer.kv_nbytes()} stored ({stored} tokens, one chunk = {room} tokens = {kv_room} bytes)"
        )
        metadata = layer.metadata_nbytes()
        metadata_room = room * -(-metadata // max(stored, 1))
        assert layer.allocated_metadata_nbytes() <= metadata + metadata_room, (
            f"layer {index} {when}: {layer.allocated_metadata_nbytes()} bytes of bookkeeping allocated for "
            f"{metadata} stored ({stored} tokens)"
        )


def held_per_forward(model, method: str, prompt: int, chunk: int | None) -> list[tuple[int, int]]:
    """``(reachable bytes, allocated bytes)`` after the prefill and after each decoding step, every forward's
    bound checked on the way."""
    config = model.config
    kv_per_token = 2 * config.num_key_value_heads * config.head_dim * 4  # float32 keys and values, batch 1
    cache = kvcompress.cache_for(model, method, **params_for(method))
    ids = torch.randint(3, config.vocab_size, (1, prompt + STEPS), generator=torch.Generator().manual_seed(0))
    held = []
    with torch.no_grad():
        if chunk is None and type(cache.config).after_prefill is kvcompress.MethodConfig.after_prefill:
            model(input_ids=ids[:, :prompt], **cache_argument(model, cache))  # the prompt in one forward
        else:
            prefill(model, ids[:, :prompt], cache, chunk_size=chunk)
        assert_room_is_one_chunk(cache, kv_per_token, f"after a prompt of {prompt} tokens (chunks of {chunk})")
        held.append((reachable_nbytes(cache), allocated(cache)))
        for step in range(STEPS):
            model(input_ids=ids[:, prompt + step : prompt + step + 1], **cache_argument(model, cache))
            assert_room_is_one_chunk(cache, kv_per_token, f"after decoding step {step + 1}")
            held.append((reachable_nbytes(cache), allocated(cache)))
    return held


@pytest.mark.parametrize("chunk", [None, BUDGET], ids=["one-forward", "chunked"])
@pytest.mark.parametrize("method", list(METHODS))
def test_allocated_bytes_follow_stored_bytes(method, chunk, tiny_llama):
    short = held_per_forward(tiny_llama, method, 4 * BUDGET, chunk)
    long = held_per_forward(tiny_llama, method, 8 * BUDGET, chunk)
    unreported = [reachable - reported for reachable, reported in short]
    assert [reachable - reported for reachable, reported in long] == unreported
    assert all(count >= 0 for count in unreported)  # (the layers never report more than they hold)
