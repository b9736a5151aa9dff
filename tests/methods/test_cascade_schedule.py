"""The cascade's schedule (``methods/cascade/schedule.py``: Algorithm 1 on whole numbers, returning slot moves)
against the plain-list reference (``tests/references/cascade_schedule.py``): applying the moves to an array of slots
leaves every ring holding the reference's tokens, in its order, after every token."""

from __future__ import annotations

import pytest

from kvcompress.methods.cascade.schedule import Layout, Rings, advance, offsets, slot_angle
from tests.helpers import layout_slots, ranks
from tests.references.cascade_schedule import CascadeLists


def angles(layout: Layout, rings: Rings) -> list[int]:
    """Per slot, the angle its key is stored at (empty slots: the angle a token written there would take)."""
    return [slot_angle(layout, rings, slot) for slot in range(layout_slots(layout))]


def frame_of_slot(layout: Layout) -> list[int]:
    """Per slot, its frame in ``offsets``: 0 for the sinks, ``1 + i`` for ring ``i``."""
    return [0] * layout.sinks + [1 + slot // layout.width for slot in range(layout.cascades * layout.width)]


LAYOUTS = [
    Layout(sinks=2, width=2, cascades=4),
    Layout(sinks=0, width=3, cascades=3, base=3),
    Layout(sinks=4, width=4, cascades=4, eager_until=20),
    Layout(sinks=1, width=5, cascades=1),
    Layout(sinks=3, width=1, cascades=5),
    Layout(sinks=2, width=3, cascades=2, base=4, eager_until=8),
]


def score(token: int) -> int:
    return (token * 2654435761) % 1009 // 4  # a fixed pseudo-random score with ties


def wins(arriving: int, resident: int) -> bool:
    return score(arriving) >= score(resident)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_the_moves_keep_what_algorithm_1_keeps(layout):
    reference = CascadeLists(layout.sinks, layout.width, layout.cascades, layout.base, layout.eager_until)
    rings, slots = Rings.empty(layout), [-1] * layout_slots(layout)
    for token in range(300):
        reference.insert(token, wins)
        rings, moves = advance(layout, rings)
        assert rings.seen == token + 1
        items = [token, *(slots[slot] for slot in moves.reads)]  # read before any write
        for column, (dest, item) in enumerate(zip(moves.dests, items, strict=True)):
            last = column == len(moves.dests) - 1
            if not (last and moves.select) or wins(item, slots[dest]):
                slots[dest] = item
        assert slots[: min(token + 1, layout.sinks)] == reference.sinks
        for i, ring in enumerate(reference.rings):
            first = layout.sinks + i * layout.width
            order = [first + (rings.start[i] + k) % layout.width for k in range(rings.count[i])]
            assert [slots[slot] for slot in order] == ring, (token, i)
        stored = reference.sinks + [t for ring in reversed(reference.rings) for t in ring]
        rank = ranks(layout, rings)
        assert sorted(stored) == stored  # (sinks, then the oldest ring ... the newest: stream order)
        assert [
            slots[slot] for slot in sorted(range(layout_slots(layout)), key=rank.__getitem__) if rank[slot] >= 0
        ] == stored
        assert rings.stored(layout) == len(stored)


def test_a_selection_is_only_ever_the_last_column_and_each_ring_is_written_once():
    layout = Layout(sinks=2, width=3, cascades=4)
    rings = Rings.empty(layout)
    for _ in range(500):
        rings, moves = advance(layout, rings)
        rings_written = [(dest - layout.sinks) // layout.width for dest in moves.dests if dest >= layout.sinks]
        assert len(set(rings_written)) == len(rings_written)
        assert len(moves.dests) <= layout.cascades


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_a_key_keeps_its_angle_in_its_ring_and_each_frame_gives_the_ranks(layout):
    """The angle convention: a token's angle changes only when it moves to another ring (or, for a sink, with the
    oldest ring's frame), and rank = angle + the offset of the slot's frame for every stored token."""
    rings, slots, where = Rings.empty(layout), [-1] * layout_slots(layout), {}
    frame = frame_of_slot(layout)
    for token in range(200):
        before = angles(layout, rings)
        rings, moves = advance(layout, rings)
        items = [token, *(slots[slot] for slot in moves.reads)]
        moved = set()
        for dest, item in zip(moves.dests, items, strict=True):  # (every arriving token wins here)
            slots[dest] = item
            moved.add(item)
            where[item] = dest
        after, rank, offset = angles(layout, rings), ranks(layout, rings), offsets(layout, rings)
        for slot, item in enumerate(slots):
            if rank[slot] < 0:
                continue
            assert rank[slot] == after[slot] + offset[frame[slot]]
            if item not in moved and slot >= layout.sinks:
                assert after[slot] == before[slot]  # a ring token that stays keeps its angle
