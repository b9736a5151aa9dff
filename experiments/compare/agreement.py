"""Kept-set agreement between two compressions of the same context: Jaccard and exact match per layer and head."""

from __future__ import annotations

from dataclasses import dataclass


def jaccard(a: list[int] | set[int], b: list[int] | set[int]) -> float:
    """|a ∩ b| / |a ∪ b| (1.0 for two empty sets)."""
    a, b = set(a), set(b)
    union = a | b
    return 1.0 if not union else len(a & b) / len(union)


@dataclass
class Agreement:
    """Agreement of two kept sets ``[layer][head] -> indices`` of one context."""

    jaccards: list[list[float]]  # [layer][head]
    differing: list[int]  # every index kept by exactly one side, over all layers and heads (with repeats)
    same_token_swaps: int = 0  # of ``differing``: those in heads where each side's extra tokens are the same token
    # ids as the other side's (occurrences of one token traded for others; their scores tie at layer 0)

    @property
    def mean_jaccard(self) -> float:
        values = [j for layer in self.jaccards for j in layer]
        return sum(values) / len(values)

    @property
    def min_jaccard(self) -> float:
        return min(j for layer in self.jaccards for j in layer)

    @property
    def exact(self) -> int:
        """(layer, head) pairs whose kept sets are identical."""
        return sum(j == 1.0 for layer in self.jaccards for j in layer)

    @property
    def pairs(self) -> int:
        return sum(len(layer) for layer in self.jaccards)


def compare_kept(
    ours: list[list[list[int]]], theirs: list[list[list[int]]], token_ids: list[int] | None = None
) -> Agreement:
    """Compare per layer and KV head; both must have the same number of layers and heads. With the context's
    ``token_ids``, also count the differences that only trade occurrences of the same tokens."""
    if len(ours) != len(theirs) or any(len(a) != len(b) for a, b in zip(ours, theirs, strict=True)):
        raise ValueError(
            f"kept sets must have the same layers and heads: {[len(x) for x in ours]} vs {[len(x) for x in theirs]}"
        )
    jaccards, differing, swaps = [], [], 0
    for layer_a, layer_b in zip(ours, theirs, strict=True):
        row = []
        for head_a, head_b in zip(layer_a, layer_b, strict=True):
            row.append(jaccard(head_a, head_b))
            only_a, only_b = set(head_a) - set(head_b), set(head_b) - set(head_a)
            differing.extend(sorted(only_a | only_b))
            if (
                token_ids is not None
                and only_a
                and sorted(token_ids[i] for i in only_a) == sorted(token_ids[i] for i in only_b)
            ):
                swaps += len(only_a) + len(only_b)
        jaccards.append(row)
    return Agreement(jaccards, differing, swaps)
