"""``native_kernels``: LESS's inference kernels run on PyTorch's own CPU kernels, and oneDNN's switch is restored."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import kvcompress
from kvcompress.generation import cache_argument
from kvcompress.methods.less.kernels import init_kernels, phi_features, psi_features
from kvcompress.methods.less.native import native_kernels


@pytest.fixture
def onednn_on():
    found = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True
    yield
    torch.backends.mkldnn.enabled = found


def test_the_switch_turns_onednn_off_inside_and_restores_it(onednn_on):
    x = torch.randn(9, 128, 1, generator=torch.Generator().manual_seed(0)) * 4
    with native_kernels(x):
        assert not torch.backends.mkldnn.enabled
        with native_kernels(x):  # nested: still off, and the outer one restores
            assert not torch.backends.mkldnn.enabled
        assert not torch.backends.mkldnn.enabled
        native = F.gelu(x)
    assert torch.backends.mkldnn.enabled
    torch.testing.assert_close(native, F.gelu(x))  # the same exact GELU (float32 rounding), another kernel


def test_the_switch_leaves_onednn_off_where_the_user_turned_it_off(onednn_on):
    torch.backends.mkldnn.enabled = False
    with native_kernels(torch.zeros(1)):
        pass
    assert not torch.backends.mkldnn.enabled


def test_the_last_thread_out_restores_the_switch(onednn_on):
    inside, leave = threading.Barrier(3), threading.Barrier(3)
    seen = []

    def worker(delay: float) -> None:
        with native_kernels(torch.zeros(1)):
            inside.wait()
            seen.append(torch.backends.mkldnn.enabled)
            leave.wait()
            threading.Event().wait(delay)  # leave one after the other
        seen.append(torch.backends.mkldnn.enabled)

    threads = [threading.Thread(target=worker, args=(d,)) for d in (0.0, 0.05)]
    for thread in threads:
        thread.start()
    inside.wait()
    leave.wait()
    for thread in threads:
        thread.join()
    assert seen[:2] == [False, False]
    assert seen[2] is False  # the first thread out: the second is still inside
    assert seen[3] is True and torch.backends.mkldnn.enabled


def test_the_switch_is_a_no_op_off_the_cpu(onednn_on):
    with native_kernels(torch.empty(2, device="meta")):
        assert torch.backends.mkldnn.enabled


def test_features_equal_the_training_form():
    kernels = init_kernels(q_heads=4, kv_heads=2, head_dim=16, rank=8, hidden=32, seed=3)
    with torch.no_grad():
        kernels.psi_s1.fill_(0.7)
    query, key = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    weights = kernels.inference_weights()
    gelu = F.gelu
    with torch.no_grad():
        phi = gelu(gelu(query @ kernels.phi_w1) @ kernels.phi_w2).abs()
        psi = (gelu(gelu(key @ kernels.psi_w1) @ kernels.psi_w2) @ kernels.psi_mix()).abs()
    torch.testing.assert_close(phi_features(query, *weights.phi), phi)
    torch.testing.assert_close(psi_features(key, *weights.psi), psi)


def test_a_decoding_step_restores_the_switch(onednn_on, tiny_llama):
    model = tiny_llama
    cache = kvcompress.cache_for(model, "less", budget=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    with torch.no_grad():
        model(input_ids=ids[:, :16], use_cache=True, **cache_argument(model, cache))
        for t in range(16, 20):  # decoding steps that fold and read the state
            model(input_ids=ids[:, t : t + 1], use_cache=True, **cache_argument(model, cache))
    assert cache.compressed_layers[0].folded
    assert torch.backends.mkldnn.enabled
