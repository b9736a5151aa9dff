"""A one-shot method's compression of an unpadded prompt: its kept count is known on the host (no read back from the
device, which on a GPU would stall the queue) and equals the per-sequence count of a padded batch; the compacted
layer holds its kept tokens in one slot of room, and a padded batch still reads its per-sequence counts."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcompress
from kvcompress.generation import prefill
from kvcompress.methods.oneshot import kept_per_sequence, share_of

READS = {"_local_scalar_dense", "item", "is_nonzero"}
SPECS = [
    ("keydiff", {"ratio": 0.5}),
    ("snapkv", {"ratio": 0.5, "window": 4}),
    ("snapkv", {"budget": 9, "window": 4}),
    ("snapkv", {"ratio": 0.4, "window": 4, "allocation": "pyramid"}),
    ("expected_attention", {"ratio": 0.5}),
    ("h2o_oneshot", {"ratio": 0.3}),
    ("tova_oneshot", {"budget": 11}),
    ("scissorhands_oneshot", {"ratio": 0.5}),
    # (its default position mode, "cache", checks once per forward whether the positions are the stream's: one read)
    ("streaming_oneshot", {"ratio": 0.5, "position_mode": "original"}),
]


class Reads(TorchDispatchMode):
    """Counts the operations that read a tensor's value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in READS
        return func(*args, **(kwargs or {}))


def reads_of_prefill(model, cache, ids: torch.Tensor, **kwargs) -> int:
    with torch.no_grad(), Reads() as reads:
        prefill(model, ids, cache, **kwargs)
    return reads.count


@pytest.mark.parametrize(("method", "params"), SPECS, ids=lambda v: v if isinstance(v, str) else None)
def test_an_unpadded_prompt_is_compressed_without_reading_the_device(tiny_llama, method, params):
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    baseline = reads_of_prefill(tiny_llama, kvcompress.cache_for(tiny_llama, "full"), ids)  # the model's own reads
    cache = kvcompress.cache_for(tiny_llama, method, **params)
    assert reads_of_prefill(tiny_llama, cache, ids) == baseline
    for layer in cache.compressed_layers:
        assert layer.compressed and layer.occupied < 40
        assert layer.slots.capacity == layer.occupied + 1  # the kept tokens and one slot of room


def test_a_padded_batch_reads_its_per_sequence_counts(tiny_llama):
    """Where sequences differ in length the counts are the device's, read once per layer (and the shorter
    sequence keeps fewer tokens)."""
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    baseline = reads_of_prefill(tiny_llama, kvcompress.cache_for(tiny_llama, "full"), ids, attention_mask=mask)
    cache = kvcompress.cache_for(tiny_llama, "keydiff", ratio=0.5)
    assert reads_of_prefill(tiny_llama, cache, ids, attention_mask=mask) > baseline
    kept = cache.compressed_layers[0].valid.sum(-1)[:, 0].tolist()
    assert kept == [20, 15]


@pytest.mark.parametrize("ratio", [0.1, 0.25, 1 / 3, 0.5, 0.7, 0.9, 1.0])
def test_a_count_known_on_the_host_equals_the_devices(ratio):
    lengths = torch.arange(1, 3000)
    host = [kept_per_sequence(n, ratio, None) for n in range(1, 3000)]
    assert host == kept_per_sequence(lengths, ratio, None).tolist()
    for budget in (1, 7, 512):
        assert [kept_per_sequence(n, None, budget) for n in range(1, 3000)] == kept_per_sequence(
            lengths, None, budget
        ).tolist()
    counts = torch.tensor(host)
    assert [share_of(n, ratio) for n in host] == share_of(counts, ratio).tolist()
