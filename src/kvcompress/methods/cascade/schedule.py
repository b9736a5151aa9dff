"""The cascade's schedule: Algorithm 1 of the Cascading KV Cache on whole numbers, returning the slot moves.

Where a token goes depends only on the sequence's count of real tokens (scores decide only whether a selection's
arriving token replaces the ring's newest one, which changes no counter), so a step is a short list of slot moves,
computed here on Python integers and applied by the ``executor`` to every sequence, head and tensor at once.

Slot layout (per sequence): ``[0, S)`` sinks, then ring ``i`` in ``[S + i W, S + (i + 1) W)`` holding ``count[i]``
tokens in stream order around the ring, its oldest at offset ``start[i]``.

A step (real token ``p``, 0-based): the first ``S`` tokens fill the sinks; then the token travels down the rings.
Ring ``i`` accepts when ``(p - S) mod b^i == 0`` (or, with ``eager_fill``, while the cache is not full): an accepting
ring with room appends it (a); a full one overwrites its oldest slot with it and passes the token it held on to ring
``i + 1`` (b). A ring that does not accept takes the token if it is empty (c), else the token competes with the
ring's newest one (d: a selection, decided by the scores). A token passed beyond the last ring is dropped.

Keys are stored at one angle convention: ring ``i``'s ``k``-th token ever written there (``k = passed[i]`` for its
oldest) sits at angle ``S + i W + k``, so inside a ring rank - angle is one number (``offsets``), whatever the ring's
start, and a key keeps its angle while it stays in its ring. The sinks sit at ``j + sink_shift``, in the oldest
ring's frame once it holds tokens. With one ring a ring token's angle is its index among the real tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """``S`` sinks, ``N`` rings of ``W`` slots, base ``b``, the token count below which every ring accepts
    (``eager_fill``; 0: never)."""

    sinks: int
    width: int
    cascades: int
    base: int = 2
    eager_until: int = 0

    @property
    def fill(self) -> int:
        """The sinks' angle shift while the rings are empty (``sink_shift``)."""
        return (self.cascades - 1) * self.width


@dataclass(frozen=True)
class Rings:
    """One sequence's layout: real tokens seen, per ring its token count and its tokens overwritten (b) so far."""

    seen: int
    count: tuple[int, ...]
    passed: tuple[int, ...]
    width: int

    @classmethod
    def empty(cls, layout: Layout) -> Rings:
        return cls(0, (0,) * layout.cascades, (0,) * layout.cascades, layout.width)

    @property
    def start(self) -> tuple[int, ...]:
        """Per ring, the offset of its oldest token (``passed mod W``)."""
        return tuple(passed % self.width for passed in self.passed)

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


def advance(layout: Layout, rings: Rings) -> tuple[Rings, Moves]:
    """One real token through Algorithm 1: the layout after it and its moves (see the module docstring)."""
    p, sinks, width = rings.seen, layout.sinks, layout.width
    if p < sinks:
        return Rings(p + 1, rings.count, rings.passed, width), Moves((p,))
    count, passed_by, start = list(rings.count), list(rings.passed), list(rings.start)
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
            passed_by[i] += 1
        elif count[i] == 0:  # (c) an empty ring takes the token
            dests.append(first + start[i])
            count[i] = 1
            break
        else:  # (d) selection against the ring's newest token
            dests.append(first + (start[i] + count[i] - 1) % width)
            select = True
            break
    return Rings(p + 1, tuple(count), tuple(passed_by), width), Moves(tuple(dests), select)


def sink_shift(layout: Layout, rings: Rings) -> int:
    """The sinks' angle minus their index: the oldest ring's first slot plus the tokens it overwrote."""
    return layout.fill + rings.passed[-1]


def offsets(layout: Layout, rings: Rings) -> tuple[int, ...]:
    """Rank minus angle of the sinks' frame, then of each ring's: a query at rank ``r`` is turned to angle
    ``r - offset`` to read a frame's keys at their ranks."""
    n_sink, older = min(rings.seen, layout.sinks), sum(rings.count)
    rows = [-sink_shift(layout, rings)]
    for i, (count, passed) in enumerate(zip(rings.count, rings.passed, strict=True)):
        older -= count
        rows.append(n_sink + older - layout.sinks - i * layout.width - passed)
    return tuple(rows)


def slot_angle(layout: Layout, rings: Rings, slot: int) -> int:
    """The angle ``slot``'s key is stored at (empty: the angle a token written there would take)."""
    if slot < layout.sinks:
        return slot + sink_shift(layout, rings)
    ring, offset = (slot - layout.sinks) // layout.width, (slot - layout.sinks) % layout.width
    passed = rings.passed[ring]
    start = passed % layout.width
    return layout.sinks + ring * layout.width + passed - start + offset + (layout.width if offset < start else 0)


def move_turn(layout: Layout, before: Rings, after: Rings, dest: int, source: int, slots: int) -> int:
    """How far a move of ``play`` turns its key: pool item ``source`` (a stored slot, or past ``slots`` a new key,
    un-rotated) to slot ``dest``'s angle after the moves; a new sink to ``dest`` plus the empty rings' shift."""
    target = dest + layout.fill if dest < layout.sinks else slot_angle(layout, after, dest)
    return target - (0 if source > slots else slot_angle(layout, before, source))


def sinks_after(layout: Layout, before: Rings, after: Rings) -> tuple[bool, int | None]:
    """After moves from ``before`` to ``after``: whether sinks were stored (their copy at angle ``j`` is taken
    again), and their new angle shift (``None``: unchanged)."""
    old = sink_shift(layout, before) if before.seen >= layout.sinks else layout.fill
    new = sink_shift(layout, after)
    return before.seen < layout.sinks, None if new == old else new


# --- several tokens at once ---------------------------------------------------------------------------------------
Move = tuple[int, int]  # (slot written, item of the pool: a stored slot, or ``slots + 1 + t`` for new token ``t``)


def play(
    layout: Layout, rings: Rings, tokens: Iterable[int], slots: int, wins: Callable[[int, int], bool] | None
) -> tuple[Rings, list[Move], bool]:
    """The new ``tokens`` through ``advance`` in turn, no attention between them: the layout after them, the moves
    taking each changed slot from the stored slots to its final token, and whether the last move is a selection
    left to the executor (``wins`` None: one token's). ``wins(arriving, resident)`` (pool items: ``slots`` is the
    scratch slot, the new tokens follow it) decides each selection."""
    source: dict[int, int] = {}
    selection = None
    for token in tokens:
        rings, moves = advance(layout, rings)
        items = [slots + 1 + token, *(source.get(slot, slot) for slot in moves.reads)]
        for column, (dest, item) in enumerate(zip(moves.dests, items, strict=True)):
            if moves.select and column == len(moves.dests) - 1:
                if wins is None:
                    selection = (dest, item)
                    continue
                if not wins(item, source.get(dest, dest)):
                    continue
            source[dest] = item
    changed = [(dest, item) for dest, item in source.items() if item != dest]
    return rings, changed + ([selection] if selection else []), selection is not None
