"""A decoding step's evictions, run for every layer of a cache at once when the forward closes.

A layer's eviction at a decoding step (a dozen small operations) touches its own bookkeeping only, which nothing
reads before its next forward. So layers with the same ``Policy.batchable`` policy (``connect``) leave it to the end
of the forward, where the policy runs once over their stream indices and state, views of one ``[layers · B, H_kv,
C]`` buffer per name (``ForwardPass.stacked``); every operation is per row, so each layer's victims are its own. A
step with padding, observers or a sliding window evicts right after its attention; a forward in which not every
layer deferred (or whose layers disagree in shape) evicts layer by layer at its end.
"""

from __future__ import annotations

import torch

from kvcompress.core.contract import AttentionStats, Keep, LayerView
from kvcompress.core.eviction import protects_forward, victims_of_rule
from kvcompress.core.forward import agree

JOB = "joint-evictions"


def connect(layers: list) -> None:
    """Let ``layers`` (one cache's, in forward order) evict together when their policies allow it."""
    first = layers[0].policy if layers else None
    if len(layers) > 1 and all(_same_method(layer.policy, first) for layer in layers):
        for layer in layers:
            layer.joint_eviction = True


def defer_eviction(layer, stats: AttentionStats | None) -> bool:
    """Leave ``layer``'s eviction of this forward to its end (``True``), or to the layer."""
    forward = layer.forward_pass
    covered = (
        forward.shared
        and forward.is_open
        and layer.new_tokens == 1
        and layer.all_valid
        and not layer.observers
        and layer.sliding_window is None
        and layer.policy.wants_stats(layer)
        # statistics over every key, or none asked for (a score kept in the state: knorm's)
        and (stats.last_visible is None if stats is not None else not layer.policy.stats.any)
    )
    if covered:
        forward.cached(JOB, list).append((layer, stats))
        forward.at_end(JOB, lambda: evict_waiting(forward))
    return covered


def evict_waiting(forward) -> None:
    """Evict for every layer that deferred in ``forward``: together where their shapes agree, else one by one."""
    waiting = forward.cached(JOB, list)
    layers = [layer for layer, _ in waiting]
    buffers = _stacked(forward, layers) if len(layers) == len(forward.layers) else None
    if buffers is None:
        for layer, stats in waiting:
            layer.after_attention(stats, alone=True)
        return
    together = StackedLayer(layers, buffers)
    policy = layers[0].policy
    policy.observe(together, _stacked_stats([stats for _, stats in waiting]))
    rule = policy.select(together)
    if rule is None:
        return
    if not isinstance(rule, Keep) or isinstance(rule.count, torch.Tensor):
        raise TypeError(f"{type(policy).__name__} is batchable but selected {rule!r} at a decoding step")
    victims, _ = victims_of_rule(rule, together, protects_forward(policy, rule, 1))
    if victims is not None:
        batch = victims.shape[0] // len(layers)
        for index, layer in enumerate(layers):
            layer.evict(victims[index * batch : (index + 1) * batch])


def _stacked(forward, layers: list) -> dict[str, torch.Tensor] | None:
    """The layers' stream indices and method state as stacked buffers (the layers' own made views of them), or
    ``None`` where the layers disagree in shape or bookkeeping."""
    first = layers[0]
    facts = [(x.seen, x.occupied, x.view_width, x.dense, x.ordered, tuple(x.slots.state)) for x in layers]
    if any(fact != facts[0] for fact in facts):
        return None
    buffers = {}
    for name in ["token_idx", *(f"state.{name}" for name in first.slots.state)]:
        homes = [(x.slots.state, name[6:]) if name.startswith("state.") else (x.slots.tensors, name) for x in layers]
        tensors = [home[key] for home, key in homes]
        buffers[name], views = forward.stacked(f"{JOB}.{name}", tensors) if agree(tensors) else (None, None)
        if views is None:
            return None
        for (home, key), tensor, view in zip(homes, tensors, views, strict=True):
            if tensor is not view:
                home[key] = view
    return buffers


class StackedLayer:
    """What a policy and the eviction read of a layer, for several layers stacked along the batch (a row of the
    stacked tensors is a layer's sequence)."""

    def __init__(self, layers: list[LayerView], buffers: dict[str, torch.Tensor]) -> None:
        first = layers[0]
        self.layers = layers
        self.policy = first.policy
        self.device = first.device
        self.seen, self.seen_step, self.new_tokens = first.seen, first.seen_step, first.new_tokens
        self.occupied, self.view_width = first.occupied, first.view_width
        self.dense, self.ordered, self.all_valid = first.dense, first.ordered, first.all_valid
        self.rows = tuple(buffers["token_idx"].shape[:2])
        width = self.view_width
        self.token_idx = buffers["token_idx"][:, :, :width]
        self.state = {name[6:]: tensor[:, :, :width] for name, tensor in buffers.items() if name.startswith("state.")}

    def new_index(self) -> torch.Tensor:
        return torch.cat([layer.new_index() for layer in self.layers])

    def real_count(self) -> torch.Tensor:
        return torch.cat([layer.real_count() for layer in self.layers])


def _same_method(policy, first) -> bool:
    """Whether ``policy`` may run for ``first``'s layers too: batchable, of the same class and configuration, and
    not one-shot (a prompt of one token must not reach a one-shot selection as a decoding step)."""
    return policy.batchable and not policy.one_shot and type(policy) is type(first) and policy.config == first.config


def _stacked_stats(stats: list[AttentionStats | None]) -> AttentionStats | None:
    """The layers' statistics of one query, stacked along the batch (``None`` where the policy asks for none)."""
    if stats[0] is None:
        return None
    names = [name for name in ("received", "last", "lse") if getattr(stats[0], name) is not None]
    return AttentionStats(1, **{name: torch.cat([getattr(s, name) for s in stats]) for name in names})
