"""Full cache: no eviction. The reference every method is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.contract import MethodConfig, Policy


@dataclass(frozen=True)
class FullConfig(MethodConfig):
    """Keep every token (a ``DynamicCache`` with kvcompress bookkeeping)."""

    name = "full"
    paper = "-"
    policy_class = Policy
