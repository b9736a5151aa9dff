"""A tensor that grows along its token dimension in place: appending writes into room left at the end.

``torch.cat`` of a store and one new token copies the whole store (what transformers' ``DynamicCache`` does every
decoding step). ``AppendBuffer`` keeps the store as a view of the first slots of a larger buffer, so an append
writes only the new tokens; the buffer is reallocated (one copy) when it is full, with room grown geometrically
and never more than one forward ahead, as the slot layer's buffers grow (``kvcompress.core.capacity``).
"""

from __future__ import annotations

import torch

from kvcompress.core.capacity import headroom


class AppendBuffer:
    """Room behind one ``[B, H, L, ...]`` store (appended along dim 2). The owner keeps the store as it is returned;
    a store replaced by anything else (a gather, a batch reorder) simply starts a new buffer at its next append."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def append(self, store: torch.Tensor, new: torch.Tensor, most_ahead: int) -> torch.Tensor:
        """``store`` with ``new`` appended along dim 2, as a view of this buffer. A new buffer keeps room for at
        least a quarter more slots (16 at least), but at most ``most_ahead`` (one forward's tokens) beyond the
        store: a short prompt never holds much more than it stores. Under autograd it concatenates instead: an
        earlier forward's graph may have saved the buffer, and writing into it would break that graph's backward."""
        if torch.is_grad_enabled() and (store.requires_grad or new.requires_grad):
            self._buffer = None
            return torch.cat([store, new], dim=2)
        length, count = store.shape[2], new.shape[2]
        buffer = self._buffer
        if buffer is None or not self.holds(store) or length + count > buffer.shape[2]:
            room = min(headroom(length), most_ahead)
            buffer = store.new_empty(*store.shape[:2], length + count + room, *store.shape[3:])
            buffer.narrow(2, 0, length).copy_(store)
            self._buffer = buffer
        buffer.narrow(2, length, count).copy_(new)
        return buffer.narrow(2, 0, length + count)

    def release(self) -> None:
        """Let the buffer go (its store was replaced: the next append starts a new one)."""
        self._buffer = None

    def holds(self, store: torch.Tensor) -> bool:
        """Whether ``store`` is this buffer's first slots (the view ``append`` returned): only then may the next
        append write behind it without touching any token a view handed out still shows."""
        buffer = self._buffer
        return (
            buffer is not None
            and store.data_ptr() == buffer.data_ptr()
            and store.stride() == buffer.stride()
            and store.shape[:2] == buffer.shape[:2]
            and store.dtype == buffer.dtype
        )

    def nbytes(self, store: torch.Tensor) -> int:
        """Bytes allocated for ``store``: the whole buffer where it is this buffer's view."""
        tensor = self._buffer if self.holds(store) else store
        return tensor.numel() * tensor.element_size()
