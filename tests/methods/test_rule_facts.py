"""The facts a ``Keep`` rule states (``newest_kept``, ``distinct``) only spare work: they never change a victim.

Every eviction of a real decode (prompt chunks, then one token at a time, one sequence and a padded batch) is
recomputed from the same rule with the facts withdrawn, and the victims must be the same slots.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvcompress
import kvcompress.core.layer as layer_module
from kvcompress.core.eviction import protects_forward
from kvcompress.generation import prefill
from tests.helpers import cache_logits

METHODS = {
    "window": {"budget": 9},
    "streaming": {"budget": 9, "sinks": 2, "circular": False},
    "h2o": {"budget": 9},
    "scissorhands": {"budget": 9, "history": 3},
    "knorm": {"budget": 9, "recent": 2},
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("padded", [False, True])
def test_stated_facts_never_change_a_victim(tiny_llama, monkeypatch, method, padded):
    original = layer_module.victims_of_rule
    checked = []

    def both_ways(rule, layer, protect_new=False):
        victims, invalidate = original(rule, layer, protect_new)
        bare = dataclasses.replace(rule, newest_kept=0, distinct=False)
        again, _ = original(bare, layer, protects_forward(layer.policy, bare, layer.new_tokens))
        assert (victims is None) == (again is None)
        if victims is not None:
            assert torch.equal(victims.sort(-1).values, again.sort(-1).values)
            checked.append(rule.newest_kept > 0 or rule.distinct)
        return victims, invalidate

    monkeypatch.setattr(layer_module, "victims_of_rule", both_ways)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 100, (2, 21), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
    cache = kvcompress.cache_for(tiny_llama, method, **METHODS[method])
    prefill(tiny_llama, ids[:, :-1], cache, attention_mask=mask[:, :-1], chunk_size=7)
    cache_logits(tiny_llama, ids, cache, attention_mask=mask, new_tokens=8)
    assert checked and any(checked)  # evictions happened, some of them under stated facts
