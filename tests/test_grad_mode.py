"""``without_grad``: no gradients recorded inside, no context entered where they are already off."""

from __future__ import annotations

import torch

from kvcompress.core.grad_mode import without_grad


def test_without_grad_records_nothing_and_restores_the_callers_mode():
    modes = []

    @without_grad
    def doubled(tensor: torch.Tensor) -> torch.Tensor:
        """Twice ``tensor``."""
        modes.append(torch.is_grad_enabled())
        return tensor * 2

    weight = torch.ones(3, requires_grad=True)
    with torch.enable_grad():
        out = doubled(weight)
        assert torch.is_grad_enabled()  # the caller's mode, back after the call
    with torch.no_grad():
        doubled(weight)
    with torch.inference_mode():
        doubled(weight)
    assert modes == [False, False, False]
    assert not out.requires_grad and torch.equal(out, torch.full((3,), 2.0))
    assert doubled.__name__ == "doubled" and doubled.__doc__ == "Twice ``tensor``."
