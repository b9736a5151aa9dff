"""``DecodeGraph``: one decoding step of a model with a compressed cache, captured once and replayed (CUDA graphs).

A decoding step of a small model on a GPU is launch-bound: every operation is a kernel launch of ~10 µs whatever its
size, so the few operations per layer a compressed cache adds (write the token, score, pick the victim) cost more
than the attention they save. A CUDA graph replays the whole step (the model's layers and the cache's bookkeeping)
as one launch. That needs a step whose operations, shapes and addresses are the same every time:

- the cache is at its budget and decodes one token per sequence: each layer reuses its victim's slot, so no buffer
  grows and no shape changes (``steady``);
- no value that changes from step to step is baked into the step as a Python number: while a graph is in use each
  layer counts the tokens it has seen on the device too (``CompressedLayer.seen_tensor``) and copies its victims to
  one buffer (``free_buffer``) that the next step reads;
- no host synchronisation (the core has none in a decoding step; CUDA refuses to capture one).

The Python side of a step (the layers' counters) is not replayed by the GPU: ``DecodeGraph`` records how the
capture changed the cache's Python state (whole numbers only; anything else must be unchanged, or the graph is
dropped after that step and decoding goes on eagerly) and applies the same change after every replay.

Supported methods (``GRAPHED_METHODS``): those whose steady decoding step has been checked to be the same
operations every step (``tests/test_decode_graph.py`` traces two consecutive steps and compares them, then replays
a traced step against eager decoding). Other methods, a cache not yet at its budget, padding (an attention mask with
zeros) or a sliding-window model decode eagerly through the same object. A forward that changes the cache between
calls (more prompt, a reordered batch) or another batch shape drops the graph; decoding goes on eagerly and is
captured again once steady.

    graph = DecodeGraph(model, cache)
    logits = graph(input_ids, position_ids)   # [B, 1] each; logits [B, 1, vocab], valid until the next call

    tokens = greedy_decode(model, cache, prompt_ids, max_new_tokens=64, chunk_size=512)   # prefill + decode
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from kvcompress.core.layer import CompressedLayer
from kvcompress.generation import cache_argument, prefill

GRAPHED_METHODS = frozenset({"window", "h2o", "tova", "knorm", "random", "scissorhands", "less", "streaming"})
_NUMBERS = (int, float, bool, str, type(None))


def steady(layers: list[CompressedLayer]) -> bool:
    """Whether every layer's next decoding step runs the same operations as its last (``replay_steady``)."""
    return all(layer.replay_steady() for layer in layers)


def bind_step_buffers(layers: list[CompressedLayer]) -> None:
    """Give each (steady) layer the device counters and buffers a replayed step reads (``bind_replay_buffers``)."""
    for layer in layers:
        layer.bind_replay_buffers()


def _same(captured: tuple, now: tuple) -> bool:
    return all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(captured, now, strict=True))


def _numbers(attributes: dict[str, object]):
    for name, value in attributes.items():
        if isinstance(value, _NUMBERS):
            yield name, value
        elif isinstance(value, list | tuple) and all(isinstance(item, _NUMBERS) for item in value):
            yield name, tuple(value)


class DecodeGraph:
    """Decode one token per sequence with ``cache``, replaying a captured step once the cache is ``steady``.

    ``capture``: ``"cuda"`` (a CUDA graph; the default on a CUDA device) or ``"trace"`` (``make_fx``: the step as a
    graph of ATen operations replayed on any device, the same contract as a CUDA graph: used by the tests on CPU).
    ``None`` decodes eagerly (the reference)."""

    def __init__(self, model: nn.Module, cache: Any, capture: str | None = "auto") -> None:
        self.model, self.cache = model, cache
        self.layers = cache.compressed_layers
        if capture not in ("auto", "cuda", "trace", None):
            raise ValueError(f"capture must be 'auto', 'cuda', 'trace' or None, got {capture!r}")
        if capture == "cuda" and model.device.type != "cuda":
            raise ValueError(f"capture='cuda' needs a model on a CUDA device, got one on {model.device.type}")
        if capture == "auto":
            capture = "cuda" if model.device.type == "cuda" else None
        self.capture = capture if cache.config.name in GRAPHED_METHODS else None
        self.replay: Any = None
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.buffers: list[tuple] = []  # each layer's ``replay_state`` when captured
        self.logits: torch.Tensor | None = None
        self.delta: list[tuple[int, str, int]] | None = None  # the last step's changes of the Python state
        self.ready = False
        self.replays = 0

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.replay is not None and self._still_captured(input_ids, position_ids):
            return self._replayed(input_ids, position_ids)
        if self.replay is not None:  # something else changed the cache (a forward, a reorder) or the batch
            self.replay, self.ready, self.delta = None, False, None  # eager again until the step repeats
        if self.capture is None:
            return self._eager(input_ids, position_ids)
        if self.ready and steady(self.layers):
            return self._captured(input_ids, position_ids)
        before = self._python_state()
        if self.capture == "cuda":  # eager steps before the capture run on its side stream (CUDA's advice)
            logits = self._on_side_stream(input_ids, position_ids)
        else:
            logits = self._eager(input_ids, position_ids)
        delta = self._delta(before, self._python_state())
        # ready: this step changed the Python state as the previous one did (counters only), and nothing grows next
        self.ready = delta is not None and delta == self.delta and steady(self.layers)
        self.delta = delta
        return logits

    def _eager(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        kwargs = cache_argument(self.model, self.cache)
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **kwargs).logits

    def _on_side_stream(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            logits = self._eager(input_ids, position_ids)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        return logits

    def _captured(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Capture this step (it also runs it); check that it changed the Python state as the step before."""
        bind_step_buffers(self.layers)
        self.inputs = (input_ids.clone(), position_ids.clone())
        self.buffers = [layer.replay_state() for layer in self.layers]
        before = self._python_state()
        if self.capture == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._eager(*self.inputs)
            graph.replay()  # capturing queued nothing: this runs the step
            self.replay = graph.replay
        else:
            ran: list[torch.Tensor] = []
            traced = make_fx(lambda ids, positions: ran.append(self._eager(ids, positions)) or ran[-1])(*self.inputs)
            self.logits = ran[0]  # tracing runs the step; a replay returns new logits
            self.replay = lambda: traced(*self.inputs)
        if self._delta(before, self._python_state()) != self.delta:  # not the step seen before: decode eagerly
            self.replay, self.capture = None, None
        return self.logits

    def _still_captured(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> bool:
        """Whether the captured step still applies: the same batch shape, and every layer still reuses its victim's
        slot in the buffers the graph was captured with (a forward of another size would have compacted them)."""
        if input_ids.shape != self.inputs[0].shape or position_ids.shape != self.inputs[1].shape:
            return False
        return all(_same(state, layer.replay_state()) for layer, state in zip(self.layers, self.buffers, strict=True))

    def _replayed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        self.inputs[0].copy_(input_ids)
        self.inputs[1].copy_(position_ids)
        logits = self.replay()
        owners = self._owners()
        for owner, name, change in self.delta:
            setattr(owners[owner], name, getattr(owners[owner], name) + change)
        for layer in self.layers:
            layer.replayed_python_step()
        self.replays += 1
        return self.logits if logits is None else logits

    def _owners(self) -> list[object]:
        owners: list[object] = [self.cache]
        for layer in self.layers:
            owners += [layer, layer.slots, layer.policy]
        return owners

    def _python_state(self) -> list[dict[str, object]]:
        """Per owner, its attributes that are numbers (or lists and tuples of numbers, as tuples)."""
        skips: list[tuple[str, ...]] = [()]  # per owner (see ``_owners``): what ``replayed_python_step`` advances
        for layer in self.layers:
            skips += [layer.replay_managed, (), ()]
        return [
            {k: v for k, v in _numbers(getattr(o, "__dict__", {})) if k not in skip}
            for o, skip in zip(self._owners(), skips, strict=True)
        ]

    def _delta(self, before: list[dict], after: list[dict]) -> list[tuple[int, str, int]] | None:
        """The whole-number changes of one step (owner's index, name, change), or ``None`` if it changed anything
        else."""
        delta = []
        for owner, (old, new) in enumerate(zip(before, after, strict=True)):
            if old.keys() != new.keys():
                return None
            for name, value in new.items():
                if type(value) is int and type(old[name]) is int:
                    if value != old[name]:
                        delta.append((owner, name, value - old[name]))
                elif value != old[name]:
                    return None
        return delta


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    cache: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    chunk_size: int | None = None,
    capture: str | None = "auto",
) -> torch.Tensor:
    """Prefill ``input_ids`` ``[B, T]`` (no padding) into ``cache`` in ``chunk_size``-token forwards, then decode
    ``max_new_tokens`` tokens greedily through a ``DecodeGraph``; returns them ``[B, max_new_tokens]``. Every step
    runs (no stop on an end-of-sequence token: checking for one would wait for the device at every step)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    token = prefill(model, input_ids, cache, chunk_size=chunk_size).argmax(-1, keepdim=True)
    graph, tokens = DecodeGraph(model, cache, capture), [token]
    position = torch.full_like(token, input_ids.shape[1])
    for _ in range(max_new_tokens - 1):
        tokens.append(graph(tokens[-1], position)[:, -1].argmax(-1, keepdim=True))
        position = position + 1
    return torch.cat(tokens, dim=1)
