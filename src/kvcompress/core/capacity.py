"""Capacity that follows what is kept: how much room a cache layer's buffers keep beyond the tokens they store.

A layer's buffers hold ``capacity`` slots per sequence and KV head, ``stored`` of them holding tokens; the rest is
*room* for tokens still to come. Room exists so that a cache that is filling appends without copying itself at
every step (a buffer grown one token at a time would be reallocated, and copied, at every decoding step). The rule,
for every layer kind (the slot layer, PoD's included, and the cascade's rings):

- **Filling** (tokens are added and nothing is evicted): the buffers grow geometrically, by a quarter of their size
  (``GROWTH_MIN`` slots at least), never beyond the tokens needed plus one forward, nor beyond the budget plus one
  forward (``grown_capacity``). So room never exceeds one growth step, ``headroom(stored)``.
- **Evicting**: a forward that evicted gives the freed capacity back at its end, keeping one slot (the next decoding
  step's token: a layer at its budget then decodes in place, without compaction or reallocation). A decoding step
  that evicts one token reuses the victim's slot and changes no capacity.
- **A prompt fed in chunks** (``CompressedCache.more_prompt``, which ``prefill`` opens around every chunk but the
  last): the room the chunk just fed used is kept for the next chunk, which is as long; the last chunk gives it back.

So after every forward a layer's allocated bytes are at most its stored bytes plus **one chunk**, where one chunk is
``headroom(stored)`` slots (``max(16, stored // 4)``: one growth step), or, inside ``more_prompt``, the tokens of the
chunk just fed. A prompt fed in one forward is not a chunk in this sense: a layer that evicted it keeps one slot of
room, never the prompt's size (``CompressedCache.allocated_nbytes`` reports what is held,
``tests/test_allocated_bytes.py`` checks the bound for every method).
"""

from __future__ import annotations

GROWTH_MIN = 16  # the smallest growth step, in slots: a short cache does not reallocate at every token


def headroom(stored: int) -> int:
    """Slots of room a filling buffer may keep beyond ``stored`` tokens: one growth step."""
    return max(GROWTH_MIN, stored // 4)


def grown_capacity(capacity: int, needed: int, max_chunk: int, budget: int | None) -> int:
    """The capacity a buffer of ``capacity`` slots grows to when ``needed`` slots must fit: one growth step
    beyond the old capacity, at least ``needed``, at most ``needed`` plus the largest forward so far
    (``max_chunk``) and, for a method with a token ``budget``, at most the budget plus that forward."""
    if capacity == 0:
        return needed
    grown = max(needed, min(capacity + headroom(capacity), needed + max_chunk))
    if budget is not None:
        grown = min(grown, max(needed, budget + max_chunk))
    return grown
