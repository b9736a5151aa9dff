"""Algorithm 1 of the Cascading KV Cache (arXiv:2406.17808 v1) as plain lists: which tokens each sub-cache holds.

Written from the paper's description, not from the package's code: the sinks take the first ``S`` tokens; sub-cache
``i`` accepts token ``p`` when ``(p - S) mod b^i == 0`` (every sub-cache while ``p < eager_until``: the authors'
later eager fill); an accepting sub-cache with room appends, a full one appends and evicts its oldest token to the
next sub-cache; a sub-cache that does not accept takes the token when empty, else keeps the heavier of the token and
its newest one (``wins(arriving, resident)`` decides). A token evicted from the last sub-cache is gone.
"""

from __future__ import annotations

from collections.abc import Callable


class CascadeLists:
    def __init__(self, sinks: int, width: int, cascades: int, base: int = 2, eager_until: int = 0) -> None:
        self.sinks_n, self.width, self.base, self.eager_until = sinks, width, base, eager_until
        self.sinks: list[int] = []
        self.rings: list[list[int]] = [[] for _ in range(cascades)]  # oldest first
        self.p = 0

    def insert(self, token: int, wins: Callable[[int, int], bool]) -> None:
        p = self.p
        self.p += 1
        if p < self.sinks_n:
            self.sinks.append(token)
            return
        for i, ring in enumerate(self.rings):
            accepting = p < self.eager_until or (p - self.sinks_n) % self.base**i == 0
            if accepting:
                ring.append(token)
                if len(ring) <= self.width:
                    return
                token = ring.pop(0)  # the oldest goes on to the next sub-cache
            elif not ring:
                ring.append(token)
                return
            else:
                if wins(token, ring[-1]):
                    ring[-1] = token
                return
