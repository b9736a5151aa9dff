"""``kvcompress.core.append_buffer``: appends equal ``torch.cat``, write in place while there is room, keep at most
one forward ahead, and never touch a token a handed-out view shows."""

from __future__ import annotations

import torch

from kvcompress.core.append_buffer import AppendBuffer


def _tokens(count: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(2 * 3 * count * 4, dtype=torch.float32).view(2, 3, count, 4) + start


def test_appends_equal_cat_and_write_in_place_while_there_is_room():
    room, store = AppendBuffer(), _tokens(0)
    expected = store
    pointers = []
    for step in range(40):
        new = _tokens(1, start=1000.0 * step)
        store = room.append(store, new, most_ahead=8)
        expected = torch.cat([expected, new], dim=2)
        assert torch.equal(store, expected)
        pointers.append(store.data_ptr())
    assert len(set(pointers)) < 10  # reallocated only when full (room grows with the store, at most 8 ahead)
    assert pointers[-1] == pointers[-2]


def test_room_is_at_most_one_forward_ahead():
    room = AppendBuffer()
    store = room.append(_tokens(0), _tokens(100), most_ahead=5)
    assert room.nbytes(store) == (100 + 5) * 2 * 3 * 4 * 4  # a quarter of 100 would be 25: one forward (5) caps it
    store = room.append(store, _tokens(2), most_ahead=5)
    assert room.nbytes(store) == (100 + 5) * 2 * 3 * 4 * 4 and store.shape[2] == 102  # written into the room


def test_a_replaced_store_starts_a_new_buffer_and_old_views_keep_their_tokens():
    room = AppendBuffer()
    store = room.append(_tokens(0), _tokens(6), most_ahead=4)
    shown = store.clone()
    replaced = store[:, :, [0, 2, 4]]  # a gather (eviction): new memory
    assert not room.holds(replaced)
    grown = room.append(replaced, _tokens(1, start=-50.0), most_ahead=4)
    assert torch.equal(store, shown)  # the earlier view still shows what it showed
    assert torch.equal(grown, torch.cat([replaced, _tokens(1, start=-50.0)], dim=2))
    assert room.nbytes(store) == store.numel() * store.element_size()  # no longer this buffer's view


def test_release_lets_the_buffer_go():
    room = AppendBuffer()
    store = room.append(_tokens(0), _tokens(3), most_ahead=4)
    room.release()
    assert not room.holds(store)
    assert torch.equal(room.append(store, _tokens(1), most_ahead=4), torch.cat([store, _tokens(1)], dim=2))


def test_under_autograd_appends_concatenate_so_earlier_graphs_stay_valid():
    room = AppendBuffer()
    weight = torch.ones(1, requires_grad=True)
    first = room.append(_tokens(0), _tokens(2) * weight, most_ahead=4)
    loss = (first * first).sum()  # its graph saved ``first``
    second = room.append(first, _tokens(1) * weight, most_ahead=4)
    (loss + second.sum()).backward()  # raises if the second append wrote into the buffer ``first`` is a view of
    expected = 2 * (_tokens(2) ** 2).sum() + torch.cat([_tokens(2), _tokens(1)], dim=2).sum()
    assert torch.allclose(weight.grad, expected.view(1))
