"""``kvcompress.core.rotation``: the rotation matrices a forward builds once and its layers share."""

from __future__ import annotations

import torch

from kvcompress.core.rope import rotate_by
from kvcompress.core.rotation import rotation_to, rotations_along, turn


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


def test_rotations_along_a_forward_are_each_tokens_own_rotation():
    """``rotations_along``: one batch of every token's rotation to its own targets, the matrices ``rotation_to``
    builds for each token alone, to the bit (rows of positions shared by the batch, or one per sequence)."""
    dim = 16
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    targets = [(9, 40, 2), (11, 41, 3), (12, 12, 12)]
    for position_ids in (torch.tensor([[0, 4, 5, 6]]), torch.tensor([[0, 4, 5, 6], [1, 2, 3, 9]])):
        rows = position_ids.shape[0]
        batched = rotations_along(position_ids, targets, inv_freq, dim, torch.float32, 0.25).view(3, rows, dim, -1)
        for m, token_targets in enumerate(targets):
            token = position_ids[:, : 2 + m]  # the token's own position last
            alone = rotation_to(token, token_targets, inv_freq, dim, torch.float32, 0.25)  # [rows, 1, d, 3 d]
            assert torch.equal(batched[m], alone[:, 0])
