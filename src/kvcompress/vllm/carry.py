"""Preemption: a recomputed request gets back the kept blocks of its first run (block SnapKV and block H2O).

vLLM preempts a running request by freeing all its KV blocks; when the request is scheduled again, vLLM recomputes
its prompt and the tokens it generated as a prefill from scratch, into new blocks. Without help, block SnapKV would
select again over the recomputed text and block H2O would score it with the recompute's full causal attention, so
the kept blocks could differ from those of the first run. Here the worker carries, per attention layer and request
id (``kvcompress.vllm.rows``), what decides the kept blocks, and gives it back after the recompute:

* **origin**, maintained at every selection (SnapKV) and refill (H2O): for each KV head, the logical block whose
  keys and values each front slot holds (SnapKV: the selected blocks copied to the request's first blocks; H2O: the
  heavy-hitter slots). Blocks outside the front are where they were written, so this is the whole kept set.
* when a request leaves the batch (preempted, or not scheduled for a step), each layer **parks** its state before
  the step's attention can overwrite its freed blocks: the origin, block H2O's scores of the request's kept blocks,
  block SnapKV's observation-window queries for the next re-selection.
* **replay**: when the request comes back with nothing cached, vLLM recomputes its prompt and generated tokens as a
  prefill, in one step or split over several (its step holds fewer tokens). Each recompute step leaves the policy's
  own prefill work undone for that request (no refill, no SnapKV prefill selection: the recompute's attention must
  not decide anything) and, after the step's attention, each layer copies into every front slot whose origin block
  was completed in this step (per KV head) the recomputed block its origin names. A block is completed, and so
  copied, in the step that writes its last token, and the scheduler frees a block only after the step that
  completed it, so every copy reads the block before it can be handed to another request. The recompute's own
  eviction between its steps is the policy's arithmetic from token counts, the same ranges as in the first run.
  In the step that reaches the tokens the request had cached (``count``), each layer also restores the scores
  (H2O, cascade, BUZZ) and the observation-window queries (SnapKV) and continues exactly where the first run
  stopped: the recompute's tokens past ``count`` (the token sampled just before the preemption) are handled as the
  first run's next decode step would handle them (H2O: their attention mass is added over the kept blocks and a
  block boundary they cross refills by score; SnapKV: a re-selection due at ``count`` runs, and their queries join
  the next observation window).

What is exact: the kept blocks of every layer and KV head after the recompute are the first run's (the same
logical blocks, in the same slots), whether the recompute took one step or several, and the scores of the scored
policies are the first run's. What cannot be: the recomputed keys and values of the generated tokens themselves
(vLLM's recompute attends to the whole text in one step, or to its kept blocks over several, where the first run
had attended to the kept blocks of each decode step), so the outputs after a preemption are the recompute's. A
request preempted again in the middle of its recompute keeps its first run's parked state and starts the recompute
over. A request preempted before its SnapKV selection is recomputed as a new request (SnapKV selects at its
prompt's end, from the recomputed queries): nothing is parked for it. A parked state is dropped when the request
finishes or comes back without a recompute (it was only left out of a step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Departure:
    """A request that left the batch: its ``count`` cached tokens lie in the blocks ``blocks`` (physical ids of its
    logical blocks ``0 .. ceil(count / block_size) - 1``); ``key``: its first block id (SnapKV's worker key)."""

    request: str
    count: int
    blocks: torch.Tensor
    key: int


@dataclass
class Replay:
    """A request being recomputed in this step (row ``row``, query rows ``[start, end)``, ``context`` tokens of the
    recompute cached before the step) whose first run had ``count`` tokens cached; ``blocks``: physical ids of its
    logical blocks ``0 .. ceil(length / block_size) - 1``, where ``length`` is what this step leaves cached. The
    step is the recompute's last (``final``) when ``length`` reaches ``count``; before, it is one of several steps
    the recompute is split over."""

    request: str
    row: int
    count: int
    length: int
    blocks: torch.Tensor
    start: int
    end: int
    context: int = 0

    @property
    def final(self) -> bool:
        return self.length >= self.count


@dataclass
class CarryStep:
    """This step's departures, replays and dropped requests, shared by all layers (built by the metadata builder).

    ``replays``: recomputes reaching their first run's ``count`` in this step; ``recomputing``: recompute steps
    before that (a recompute split over several steps)."""

    departures: list[Departure] = field(default_factory=list)
    replays: list[Replay] = field(default_factory=list)
    recomputing: list[Replay] = field(default_factory=list)
    returned: list[tuple[str, int]] = field(default_factory=list)  # (request, key): back without a recompute
    dropped: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.departures or self.replays or self.recomputing or self.returned or self.dropped)

    def rows(self) -> set[int]:
        """The rows being recomputed in this step (final or not): the policy's own work skips them."""
        return {replay.row for replay in self.replays + self.recomputing}


class CarryBook:
    """The metadata builder's side: which requests left, come back recomputed, or are gone, step by step.

    ``step`` keeps, from one step to the next, each row's request id, cached tokens after the step and block ids
    (one copy of the step's block table rows, a few integers per block of the batch).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.last: dict[str, tuple[int, torch.Tensor, int]] = {}  # request -> (count, blocks, key) after last step
        self.parked: dict[str, int] = {}  # request -> count, for requests whose layers hold a parked state
        self.recomputing: dict[str, int] = {}  # request -> count, for parked requests whose recompute is under way

    def step(self, requests: list[str], context, ends, starts, table, alive, replayable) -> CarryStep:
        """This step's rows: ``requests`` (ids), ``context`` (tokens cached before the step), ``ends`` (after it),
        ``starts`` (query row offsets, ``num_reqs + 1``), ``table`` (block ids). ``alive(request)``: not finished;
        ``replayable(request, key)``: whether a departing request's state is worth parking (SnapKV: it selected)."""
        out = CarryStep()
        present = {request: i for i, request in enumerate(requests) if request is not None}
        context_list, ends_list, starts = context.tolist(), ends.tolist(), starts.tolist()
        for request, (count, blocks, key) in self.last.items():
            i = present.get(request)
            busy = request in self.parked or request in self.recomputing
            if (i is None or context_list[i] == 0) and not busy:
                if alive(request) and replayable(request, key):
                    out.departures.append(Departure(request, count, blocks, key))
                    self.parked[request] = count
                else:
                    out.dropped.append(request)
        for request in list(self.recomputing):  # a recompute under way: goes on, or starts over if preempted again
            i = present.get(request)
            if i is None:
                if not alive(request):
                    out.dropped.append(request)
                    del self.recomputing[request]
                continue
            if context_list[i] == 0:
                self.parked[request] = self.recomputing.pop(request)
        for request in list(self.parked):
            i = present.get(request)
            if i is None:
                if not alive(request):  # finished while parked
                    out.dropped.append(request)
                    del self.parked[request]
                continue
            count = self.parked.pop(request)
            if context_list[i] > 0:  # only left out of a step: its blocks were never freed
                out.returned.append((request, int(table[i, 0])))
            else:
                self.recomputing[request] = count
        for request, count in list(self.recomputing.items()):
            i = present.get(request)
            if i is None:
                continue
            blocks = table[i, : -(-ends_list[i] // self.block_size)].long().clone()
            replay = Replay(request, i, count, ends_list[i], blocks, starts[i], starts[i + 1], context_list[i])
            if replay.final:
                out.replays.append(replay)
                del self.recomputing[request]
            else:
                out.recomputing.append(replay)
        rows = table[: len(requests)].long().clone()
        self.last = {
            request: (ends_list[i], rows[i, : -(-ends_list[i] // self.block_size)], int(rows[i, 0]))
            for i, request in enumerate(requests)
            if request is not None and ends_list[i] > 0
        }
        return out


class LayerCarry:
    """One attention layer's side: the origin of its front slots per request, and the parked states."""

    def __init__(self) -> None:
        self.origin: dict[str, torch.Tensor] = {}  # request -> [H_kv, front] logical block held by each front slot
        self.parked: dict[str, dict] = {}  # request -> what ``park`` stored

    def origin_of(self, request: str | None, num_kv_heads: int, front: int, device) -> torch.Tensor:
        """``[H_kv, front]`` logical blocks in the front slots (slots never written to hold their own block)."""
        origin = self.origin.get(request) if request is not None else None
        identity = torch.arange(front, device=device).expand(num_kv_heads, front)
        if origin is None:
            return identity
        if origin.shape[1] >= front:
            return origin[:, :front]
        return torch.cat([origin, identity[:, origin.shape[1] :]], dim=1)

    def drop(self, step: CarryStep) -> None:
        for request in step.dropped:
            self.origin.pop(request, None)
            self.parked.pop(request, None)

    def restore_front(self, kv_cache: torch.Tensor, origin: torch.Tensor, replay: Replay, block_size: int) -> None:
        """Copy, per KV head, the recomputed block ``origin[h, i]`` into front slot ``i`` (keys and values: whole
        ``[block, head]`` slabs, so the kernel's layout does not matter), for the origin blocks whose last token
        this recompute step wrote (tokens ``[replay.context, min(replay.length, replay.count))``): each is copied in
        the step that completes it, before the scheduler can free it. A slot holding its own block is left as is."""
        num_kv_heads, front = origin.shape
        ends = (origin + 1) * block_size  # tokens cached once each origin block is complete
        slots = torch.arange(front, device=origin.device).expand(num_kv_heads, front)
        done = (ends > replay.context) & (ends <= min(replay.length, replay.count)) & (origin != slots)
        heads, slot = done.nonzero(as_tuple=True)
        if len(heads):
            targets, sources = replay.blocks[slot], replay.blocks[origin[heads, slot]]
            kv_cache[targets, heads] = kv_cache[sources, heads]  # the right side is gathered before any write
