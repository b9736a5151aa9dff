"""``DecodeGraph``: one decoding step of a model with a compressed cache, captured once and replayed (CUDA graphs).

A decoding step of a small model on a GPU is launch-bound: every operation is a kernel launch of ~10 µs whatever its
size, so the few operations per layer a compressed cache adds (write the token, score, pick the victim) cost more
than the attention they save. A CUDA graph replays the whole step (the model's layers and the cache's bookkeeping)
as one launch. That needs a step whose operations, shapes and addresses are the same every time, and that keeps all
it changes in tensors (a replay runs no Python):

- the cache is at its budget and decodes one token per sequence: each layer reuses its victim's slot, so no buffer
  grows and no shape changes (``steady``);
- the layers are bound to the graph (``core.replay.ReplayBinding``): their per-step numbers are device scalars the
  step advances in place, their victims go to one buffer the next step reads, and their Python integers are set from
  those scalars, with one host read, only when something outside the graph reads them or runs a forward;
- no host synchronisation (the core has none in a decoding step; CUDA refuses to capture one).

Once the cache is steady the layers are bound and one step runs in Python in that form; the next steady step is
captured (it also runs) and later ones replay. Reading the cache's counters between replays (``get_seq_length()``,
a layer's ``seen``) waits for the device once to bring them up to date: a decoding loop counts its positions itself
(as ``greedy_decode`` does). ``tests/test_decode_graph.py`` checks for every supported method that
two consecutive bound steps trace to the same operations and leave the Python state as it was (counters aside),
then replays a traced step against eager decoding.

Supported methods (``GRAPHED_METHODS``): those whose steady decoding step has been checked that way. Other methods, a
cache not yet at its budget, padding (an attention mask with zeros) or a sliding-window model decode eagerly through
the same object. A forward that is not the graph's (more prompt), a reordered batch or another batch shape drops
the graph (the layers leave their bound form); decoding goes on eagerly and is captured again once steady.

    graph = DecodeGraph(model, cache)
    logits = graph(input_ids, position_ids)   # [B, 1] each; logits [B, 1, vocab], valid until the next call
    graph.close()                              # optional: leave the bound form (the cache works either way)

    tokens = greedy_decode(model, cache, prompt_ids, max_new_tokens=64, chunk_size=512)   # prefill + decode
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from kvcompress.core.layer import CompressedLayer
from kvcompress.core.replay import ReplayBinding
from kvcompress.generation import cache_argument, prefill

GRAPHED_METHODS = frozenset({"window", "h2o", "tova", "knorm", "random", "scissorhands", "less", "streaming"})


def steady(layers: list[CompressedLayer]) -> bool:
    """Whether every layer's next decoding step runs the same operations as its last (``replay_steady``)."""
    return all(layer.replay_steady() for layer in layers)


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
        self.binding = ReplayBinding(self.layers)
        self.replay: Any = None
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.buffers: list[tuple] = []  # each layer's ``replay_state`` when captured
        self.logits: torch.Tensor | None = None
        self.replays = 0

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.replay is not None and self._still_captured(input_ids, position_ids):
            return self._replayed(input_ids, position_ids)
        if self.replay is not None or (self.binding.bound and not self.binding.holds()):
            self.close()  # something else changed the cache (a forward, a reorder) or the batch: eager again
        if self.capture is None or not steady(self.layers):
            self.close()
            return self._eager(input_ids, position_ids)
        if not self.binding.bound:  # the first step in the bound form runs in Python (on CUDA, on a side stream)
            self.binding.bind()
            return self._step(input_ids, position_ids, side_stream=self.capture == "cuda")
        return self._captured(input_ids, position_ids)

    def close(self) -> None:
        """Drop the captured step and let the layers leave their bound form (their Python integers brought up to date
        with one host read); the cache then decodes eagerly, and a later steady step is captured again."""
        self.replay = None
        self.binding.unbind()

    def _eager(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        kwargs = cache_argument(self.model, self.cache)
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **kwargs).logits

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, side_stream: bool = False) -> torch.Tensor:
        """The graph's own step run in Python (the bound layers keep their form through it)."""
        stream = torch.cuda.Stream(self.model.device) if side_stream else None
        if stream is not None:  # eager steps before a capture run on its side stream (CUDA's advice)
            stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with self.binding.own_step(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            logits = self._eager(input_ids, position_ids)
        if stream is not None:
            torch.cuda.current_stream(self.model.device).wait_stream(stream)
        return logits

    def _captured(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Capture this step (which also runs it)."""
        self.inputs = (input_ids.clone(), position_ids.clone())
        self.buffers = [layer.replay_state() for layer in self.layers]
        if self.capture == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._step(*self.inputs)
            graph.replay()  # capturing queued nothing: this runs the step
            self.replay = graph.replay
        else:
            ran: list[torch.Tensor] = []
            traced = make_fx(lambda ids, positions: ran.append(self._step(ids, positions)) or ran[-1])(*self.inputs)
            self.logits = ran[0]  # tracing runs the step; a replay returns new logits
            self.replay = lambda: traced(*self.inputs)
        return self.logits

    def _still_captured(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> bool:
        """Whether the captured step still applies: the same batch shape, the layers still bound (no other forward
        ran), and every layer still reuses its victim's slot in the buffers the graph was captured with."""
        if input_ids.shape != self.inputs[0].shape or position_ids.shape != self.inputs[1].shape:
            return False
        if not self.binding.holds():
            return False
        return all(_same(state, layer.replay_state()) for layer, state in zip(self.layers, self.buffers, strict=True))

    def _replayed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        self.inputs[0].copy_(input_ids)
        self.inputs[1].copy_(position_ids)
        logits = self.replay()
        self.binding.replayed()
        self.replays += 1
        return self.logits if logits is None else logits


def _same(captured: tuple, now: tuple) -> bool:
    return all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(captured, now, strict=True))


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
    graph.close()
    return torch.cat(tokens, dim=1)
