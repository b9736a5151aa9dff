"""The cascade's schedule: Algorithm 1 of the Cascading KV Cache on whole numbers, returning the slot moves.

Where a token goes never depends on the keys, values or scores: only on how many real tokens the sequence has seen.
Scores decide one thing, whether a selection's arriving token replaces the ring's newest one, and that changes no
counter. So the layout of a sequence (sinks stored, each ring's count and start) is a pure function of its token
count, computed here on Python integers, and a step's work on the buffers is a short list of slot moves that the
executor (``kvcompress.methods.cascade.executor``) applies to every sequence, head and tensor at once. Under
padding each sequence has its own count: the schedule then runs once per sequence.

Slot layout (per sequence): ``[0, S)`` sinks, then ring ``i`` in ``[S + i W, S + (i + 1) W)``; ring ``i`` holds
``count[i]`` tokens, its oldest at ring offset ``start[i]``, in stream order around the ring.

A step (one real token ``p``, 0-based among the sequence's real tokens): the first ``S`` tokens fill the sinks; then
the token travels down the rings. Ring ``i`` accepts when ``(p - S) mod b^i == 0`` (or, with ``eager_fill``, while
the cache is not yet full): an accepting ring with room appends it (a) and the step ends; a full accepting ring
overwrites its oldest slot with it and passes the token it held on to ring ``i + 1`` (b). A ring that does not
accept takes the token if it is empty (c), else the token competes with the ring's newest one (d: a selection,
decided by the scores). A token passed beyond the last ring is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Layout:
    """The constants of a schedule: ``S`` sinks, ``N`` rings of ``W`` slots, base ``b``, and the token count below
    which every ring accepts (``eager_fill``; 0: never)."""

    sinks: int
    width: int
    cascades: int
    base: int = 2
    eager_until: int = 0

    @property
    def slots(self) -> int:
        return self.sinks + self.cascades * self.width


@dataclass(frozen=True)
class Rings:
    """The layout of one sequence: real tokens seen, and per ring its token count and the offset of its oldest."""

    seen: int
    count: tuple[int, ...]
    start: tuple[int, ...]

    @classmethod
    def empty(cls, layout: Layout) -> Rings:
        return cls(0, (0,) * layout.cascades, (0,) * layout.cascades)

    def stored(self, layout: Layout) -> int:
        return min(self.seen, layout.sinks) + sum(self.count)


@dataclass(frozen=True)
class Moves:
    """One token's moves: column 0 writes the new token into ``dests[0]``, column ``c > 0`` writes the token that
    slot ``dests[c - 1]`` held before the step into ``dests[c]``. ``select``: the last column is a selection (d), a
    write only where the arriving token wins."""

    dests: tuple[int, ...]
    select: bool = False

    @property
    def reads(self) -> tuple[int, ...]:
        """The slots whose tokens move on (read before any write)."""
        return self.dests[:-1]


@lru_cache(maxsize=4096)
def advance(layout: Layout, rings: Rings) -> tuple[Rings, Moves]:
    """One real token through Algorithm 1: the layout after it and its moves (see the module docstring)."""
    p, sinks, width = rings.seen, layout.sinks, layout.width
    if p < sinks:
        return Rings(p + 1, rings.count, rings.start), Moves((p,))
    count, start = list(rings.count), list(rings.start)
    eager = p < layout.eager_until
    dests: list[int] = []
    select = False
    for i in range(layout.cascades):
        first = sinks + i * width
        if eager or (p - sinks) % layout.base**i == 0:
            if count[i] < width:  # (a) append
                dests.append(first + (start[i] + count[i]) % width)
                count[i] += 1
                break
            dests.append(first + start[i])  # (b) overwrite the oldest, pass it on
            start[i] = (start[i] + 1) % width
        elif count[i] == 0:  # (c) an empty ring takes the token
            dests.append(first + start[i])
            count[i] = 1
            break
        else:  # (d) selection against the ring's newest token
            dests.append(first + (start[i] + count[i] - 1) % width)
            select = True
            break
    return Rings(p + 1, tuple(count), tuple(start)), Moves(tuple(dests), select)


def ranks(layout: Layout, rings: Rings) -> list[int]:
    """Per slot, the rank of its token among the stored ones in stream order (``-1``: empty): sinks first, then the
    rings from the oldest (last) to the newest, each in ring order."""
    rank = [-1] * layout.slots
    n_sink = min(rings.seen, layout.sinks)
    rank[:n_sink] = range(n_sink)
    older = sum(rings.count)
    for i, (count, start) in enumerate(zip(rings.count, rings.start, strict=True)):
        older -= count
        first = layout.sinks + i * layout.width
        for order in range(count):
            rank[first + (start + order) % layout.width] = n_sink + older + order
    return rank
