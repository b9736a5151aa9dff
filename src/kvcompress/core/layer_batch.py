"""A decoding step's evictions, run for every layer of a cache at once after the forward's last attention.

At a decoding step a layer's eviction (its policy's statistics update, its keep rule, the victims) reads and writes
that layer's bookkeeping only, and nothing reads it again before the layer's next forward. Per layer it is a dozen
small operations, each costing far more than its arithmetic. So when every layer of a cache runs the same policy
on slots of the same shape, the layers hand their statistics to one ``LayerBatch`` and the forward's last layer runs
the policy once over all of them: the layers' stream indices and method state are views of one buffer per name
(``[layers · B, H_kv, C]``: each layer's view stays contiguous; restacked with one copy when a layer replaces its
buffers), so the policy's operations on those stacked rows replace the same operations once per layer. Every
operation is per row (a layer's sequence and KV head), so the victims are those each layer would choose alone; the
layers then free them one by one as before.

Only policies that declare ``Policy.batchable`` take this path, at decoding steps of layers without padding,
observers or a sliding window; anything else evicts right after its own attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcompress.core.contract import AttentionStats, Keep
from kvcompress.core.eviction import protects_forward, victims_of_rule

if TYPE_CHECKING:  # annotations only: the layer module is imported by the cache, which connects the batch
    from kvcompress.core.layer import CompressedLayer


class LayerBatch:
    """The deferred evictions of one cache's layers during a forward (``defer``), run by its last layer."""

    def __init__(self, layers: list[CompressedLayer]) -> None:
        self.layers = layers
        self.waiting: list[tuple[CompressedLayer, AttentionStats]] = []
        self._stacked: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # name: (buffer, layers' views)

    @classmethod
    def connect(cls, layers: list[CompressedLayer]) -> None:
        """Give ``layers`` (one cache's, in forward order) a shared batch when their policies allow it."""
        first = layers[0].policy if layers else None
        if len(layers) > 1 and all(_same_method(layer.policy, first) for layer in layers):
            batch = cls(layers)
            for layer in layers:
                layer.batch = batch

    def defer(self, layer: CompressedLayer, stats: AttentionStats | None) -> bool:
        """Take ``layer``'s eviction of this forward (``True``), or leave it to the layer (a step this path does not
        cover). The forward's last layer runs every deferred one."""
        if layer is self.layers[0]:
            self.waiting = []  # (left by a forward that stopped before its last layer: its evictions are void)
        covered = self._covers(layer, stats)
        if covered:
            self.waiting.append((layer, stats))
        if layer is self.layers[-1]:
            self.run()
        return covered

    @staticmethod
    def _covers(layer: CompressedLayer, stats: AttentionStats | None) -> bool:
        return (
            layer.new_tokens == 1
            and layer.all_valid
            and not layer.observers
            and layer.sliding_window is None
            and stats is not None
            and stats.last_visible is None
            and layer.policy.wants_stats(layer)
        )

    def run(self) -> None:
        """Evict for every waiting layer: together where their shapes agree, else one by one."""
        waiting, self.waiting = self.waiting, []
        layers = [layer for layer, _ in waiting]
        if len(layers) < len(self.layers) or not self._stack(layers):
            for layer, stats in waiting:
                layer.after_attention(stats, alone=True)
            return
        together = StackedLayer(layers, {name: stacked[0] for name, stacked in self._stacked.items()})
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

    def _stack(self, layers: list[CompressedLayer]) -> bool:
        """Whether the layers agree in shape and bookkeeping, with their stream indices and method state made views
        of stacked buffers (one copy per name where they are not yet)."""
        first = layers[0]
        agreed = _bookkeeping(first)
        if any(_bookkeeping(layer) != agreed for layer in layers):
            return False
        names = ["token_idx", *(f"state.{name}" for name in first.slots.state)]
        for name in names:
            tensors = [_buffer(layer, name) for layer in layers]
            known = self._stacked.get(name)
            if known is not None and all(a is b for a, b in zip(tensors, known[1], strict=True)):
                continue
            if len({(tensor.shape, tensor.dtype) for tensor in tensors}) > 1:
                return False
            stacked, batch = torch.cat(tensors), tensors[0].shape[0]
            # slices, not ``chunk``: its views may not be written in place under autograd
            views = [stacked[i * batch : (i + 1) * batch] for i in range(len(layers))]
            for layer, view in zip(layers, views, strict=True):
                _set_buffer(layer, name, view)
            self._stacked[name] = (stacked, views)
        return True


class StackedLayer:
    """What a policy and the eviction read of a layer, for several layers stacked along the batch (a row of the
    stacked tensors is a layer's sequence)."""

    def __init__(self, layers: list[CompressedLayer], buffers: dict[str, torch.Tensor]) -> None:
        first = layers[0]
        self.layers = layers
        self.policy = first.policy
        self.device = first.device
        self.seen, self.seen_tensor, self.new_tokens = first.seen, first.seen_tensor, first.new_tokens
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
    not one-shot (a one-shot policy selects once, over the prompt: it has no decoding-step evictions, and a prompt of
    one token must not reach its selection as a decoding step)."""
    return policy.batchable and not policy.one_shot and type(policy) is type(first) and policy.config == first.config


def _bookkeeping(layer: CompressedLayer) -> tuple:
    """What the layers evicting together must agree on at this step."""
    return layer.seen, layer.occupied, layer.view_width, layer.dense, layer.ordered, tuple(layer.slots.state)


def _buffer(layer: CompressedLayer, name: str) -> torch.Tensor:
    return layer.slots.state[name[6:]] if name.startswith("state.") else layer.slots.tensors[name]


def _set_buffer(layer: CompressedLayer, name: str, tensor: torch.Tensor) -> None:
    if name.startswith("state."):
        layer.slots.state[name[6:]] = tensor
    else:
        layer.slots.tensors[name] = tensor


def _stacked_stats(stats: list[AttentionStats]) -> AttentionStats:
    """The layers' statistics of one query, stacked along the batch."""

    def joined(name: str) -> torch.Tensor | None:
        parts = [getattr(s, name) for s in stats]
        return None if parts[0] is None else torch.cat(parts)

    return AttentionStats(query_count=1, received=joined("received"), last=joined("last"), lse=joined("lse"))
