"""``kvcompress.core.rotation``: the rotation matrices a forward builds once and its layers share."""

from __future__ import annotations

import torch

from kvcompress.core.rope import rotate_by
from kvcompress.core.rotation import frames_along, rotation_to, turn, turn_along


def test_rotation_to_a_far_target_is_as_precise_as_a_near_one():
    """A ring's frame can lie thousands of positions from the query's own position. The rotation to it equals the
    float64 re-rotation to float64 precision; float32 angles would be off by ~1e-4 here (the cascade's logits then
    left the model's by 3e-5, four times the other methods' rounding)."""
    dim = 16
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # as models hold it
    x = torch.randn(2, 3, 1, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    position_ids = torch.tensor([[0, 3], [0, 7]])  # the query sits at each row's last position
    targets = (5, 903, 2003)
    turned = turn(x, rotation_to(position_ids, targets, inv_freq, dim, torch.float64))
    for k, target in enumerate(targets):
        delta = (target - position_ids[:, -1]).view(2, 1, 1)
        expected = rotate_by(x, delta, inv_freq, exact=True)
        torch.testing.assert_close(turned[:, :, k : k + 1], expected, rtol=0, atol=1e-12)


def test_frames_along_a_forward_turn_each_token_as_its_own_rotation():
    """``frames_along`` / ``turn_along``: every token of a forward rotated to its own targets at once, as
    ``rotation_to``'s matrix for that token alone rotates it (rows of positions shared by the batch, or one per
    sequence; partial rotary)."""
    dim, rotary = 16, 12
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)
    targets = [(9, 40, 2), (11, 41, 3), (12, 12, 12)]
    x = torch.randn(3, 2, 4, dim, generator=torch.Generator().manual_seed(1))  # [q, B, H, d]
    for position_ids in (torch.tensor([[0, 4, 5, 6]]), torch.tensor([[0, 4, 5, 6], [1, 2, 3, 9]])):
        rows = position_ids.shape[0]
        frames = frames_along(position_ids, targets, inv_freq, dim, torch.float32, 0.25)
        turned = turn_along(x.reshape(3 * rows, -1, dim), *frames).view(3, 2, 4, 3, dim)
        for m, token_targets in enumerate(targets):
            token = position_ids[:, : 2 + m]  # the token's own position last
            alone = turn(x[m][:, :, None], rotation_to(token, token_targets, inv_freq, dim, torch.float32, 0.25))
            torch.testing.assert_close(turned[m], alone, rtol=1e-6, atol=1e-6)
