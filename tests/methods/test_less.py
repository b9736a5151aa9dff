"""LESS: warm start / ψ ≡ 0 = base policy, no eviction = full, state = direct sum over evicted tokens, masked form =
token-by-token decoding, kernel shapes and initial scalars, Eq. 3 arithmetic, kernel files, Baseline+ budgets."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import kvcompress
from kvcompress.core.forward import ForwardPass
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.h2o import H2OConfig
from kvcompress.methods.less import LessConfig, baseline_plus
from kvcompress.methods.less.kernels import (
    LayerKernels,
    LessKernels,
    _gelu,
    init_kernels,
    load_kernels,
    phi_features,
    psi_features,
)
from kvcompress.methods.less.masked import (
    eviction_times,
    less_masked_attention,
    low_rank_parallel,
    masked_forward,
    masked_run,
    sparse_attention,
)
from kvcompress.methods.less.policy import mix_low_rank
from kvcompress.methods.streaming import StreamingConfig
from tests.helpers import cache_logits, kept_tokens, own_logits


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def strong_kernels(model, hidden: int = 16, seed: int = 3) -> LessKernels:
    """Random kernels with scalars 1 (not 1e-4), so the low-rank term is large and every check has teeth."""
    config = model.config
    layers = []
    for index in range(config.num_hidden_layers):
        layer = init_kernels(config.num_attention_heads, config.num_key_value_heads, 16, 8, hidden, seed, index)
        with torch.no_grad():
            layer.psi_s1.fill_(1.0)
            layer.psi_s2.fill_(1.0)
        layers.append(layer.eval())
    return LessKernels(layers=layers, meta={})


def decode_logits(model, ids, cache) -> torch.Tensor:
    """Token 0 as the prompt, then every token alone through the cache: logits ``[B, S, vocab]``."""
    with torch.no_grad():
        return torch.cat(
            [model(ids[:, t : t + 1], **cache_argument(model, cache)).logits for t in range(ids.shape[1])], 1
        )


# --------------------------------------------------------------------------------------------- check 1 properties


def test_zero_psi_equals_base_policy_exactly(tiny_llama):
    ids = ids_of(1, 30)
    base_cache = kvcompress.cache_for(tiny_llama, "h2o", budget=12)
    less_cache = kvcompress.cache_for(tiny_llama, LessConfig(base="h2o", budget=12, init="zero"))
    base_logits, base_seq = cache_logits(tiny_llama, ids, base_cache, new_tokens=12)
    less_logits, less_seq = cache_logits(tiny_llama, ids, less_cache, new_tokens=12)
    assert torch.equal(less_logits, base_logits)
    assert torch.equal(less_seq, base_seq)
    for base_layer, less_layer in zip(base_cache.compressed_layers, less_cache.compressed_layers, strict=True):
        assert kept_tokens(less_layer) == kept_tokens(base_layer)
        assert not bool(less_layer.low_rank[..., -1].any())


def test_paper_init_is_a_warm_start_close_to_the_base_policy(tiny_llama):
    ids = ids_of(1, 30)
    base_logits, _ = cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "h2o", budget=12), new_tokens=8)
    cache = kvcompress.cache_for(tiny_llama, LessConfig(base="h2o", budget=12))
    logits, _ = cache_logits(tiny_llama, ids, cache, new_tokens=8)
    difference = float((logits - base_logits).abs().max())
    assert 0 < difference < 1e-2  # scalars 1e-4: the state is tiny but not zero
    assert bool(cache.compressed_layers[0].low_rank[..., -1].any())


def test_untrained_kernels_are_said_in_a_warning_naming_the_shipped_sets(tiny_llama):
    ids = ids_of(1, 8)
    with pytest.warns(UserWarning, match="no kernels given") as caught:
        cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "less", budget=12), new_tokens=1)
    assert {str(warning.message) for warning in caught} == {
        "less: no kernels given: untrained, ≈ its base 'h2o'; pass kernels=smollm2-135m-h2o-50of512 or a directory "
        "from `kvcompress train less`"
    }
    for config in (LessConfig(budget=12, init="zero"), LessConfig(budget=12, kernels=strong_kernels(tiny_llama))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # chosen kernels (trained, or ψ ≡ 0 asked for) warn of nothing
            cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, config), new_tokens=1)


@pytest.mark.parametrize("base", ["h2o", "streaming", "tova"])
def test_nothing_evicted_equals_full_cache(base, tiny_llama):
    ids = ids_of(1, 37, seed=1)
    reference, ref_seq = own_logits(tiny_llama, ids)
    config = LessConfig(base=base, budget=512, kernels=strong_kernels(tiny_llama))
    if base != "h2o":
        config = LessConfig(base=base, budget=512, init="paper")
    logits, seq = cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, config))
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(seq, ref_seq)


def test_state_equals_direct_sum_over_evicted_tokens(tiny_llama):
    config = LessConfig(base="h2o", budget=10, kernels=strong_kernels(tiny_llama))
    cache = kvcompress.cache_for(tiny_llama, config)
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for index, layer in enumerate(cache.compressed_layers):
        original = layer.update

        def recording(key_states, value_states, *args, _original=original, _index=index, **kwargs):
            seen.setdefault(_index, []).append((key_states.clone(), value_states.clone()))
            return _original(key_states, value_states, *args, **kwargs)

        layer.update = recording
    ids = ids_of(1, 36, seed=2)
    prefill(tiny_llama, ids[:, :20], cache)  # a prompt: many tokens evicted at once
    with torch.no_grad():
        for t in range(20, 36):  # then one by one
            tiny_llama(ids[:, t : t + 1], **cache_argument(tiny_llama, cache))
    for index, layer in enumerate(cache.compressed_layers):
        keys = torch.cat([k for k, _ in seen[index]], dim=2)  # [1, H_kv, 36, d] post-RoPE
        values = torch.cat([v for _, v in seen[index]], dim=2)
        kernels = layer.policy.kernels
        for head in range(keys.shape[1]):
            kept = set(layer.token_idx[0, head][layer.valid[0, head]].tolist())
            evicted = [j for j in range(36) if j not in kept]
            assert len(evicted) == 36 - 10
            psi = kernels.psi(keys[:, :, evicted])[0, head]  # [n, R]
            expected_h = psi.T @ values[0, head, evicted]
            torch.testing.assert_close(layer.low_rank[..., :-1][0, head], expected_h, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.low_rank[..., -1][0, head], psi.sum(0), rtol=1e-4, atol=1e-5)
        assert layer.low_rank[..., :-1].shape == (1, 2, 8, 16) and layer.low_rank[..., -1].shape == (1, 2, 8)


def test_folds_done_together_at_the_end_of_a_forward_equal_folding_layer_by_layer(tiny_llama):
    batch = torch.cat([ids_of(1, 30, seed=5), ids_of(1, 30, seed=6)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0  # left padding: the staged victims carry weights
    config = LessConfig(base="h2o", budget=10, kernels=strong_kernels(tiny_llama))
    together, alone = (kvcompress.cache_for(tiny_llama, config) for _ in range(2))
    for layer in alone.compressed_layers:
        layer.forward_pass = ForwardPass([layer])  # each layer a forward of its own: it folds its victims at once
    forward = together.forward_pass
    assert all(layer.forward_pass is forward for layer in together.compressed_layers)
    logits, _ = cache_logits(tiny_llama, batch, together, mask, 10)
    assert not forward.is_open and not any(layer.staged for layer in together.compressed_layers)  # all folded
    expected, _ = cache_logits(tiny_llama, batch, alone, mask, 10)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(together.compressed_layers, alone.compressed_layers, strict=True):
        torch.testing.assert_close(mine.low_rank, theirs.low_rank, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "base", [H2OConfig(budget=12), StreamingConfig(budget=12, sinks=4, position_mode="original")], ids=["h2o", "lambda"]
)
def test_masked_parallel_form_equals_token_by_token_decoding(base, tiny_llama):
    ids = ids_of(2, 40, seed=4)
    config = LessConfig(base=base, kernels=strong_kernels(tiny_llama))
    decoded = decode_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, config))
    masked = masked_forward(tiny_llama, ids, masked_run(config, tiny_llama.config.num_hidden_layers))
    torch.testing.assert_close(masked, decoded, rtol=1e-4, atol=1e-4)
    sparse_only = decode_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, base))
    assert float((masked - sparse_only).abs().max()) > 1e-2  # the low-rank term really mattered


def test_masked_baseline_equals_decoding_with_the_base_policy(tiny_llama):
    ids = ids_of(1, 40, seed=5)
    base = H2OConfig(budget=12)
    decoded = decode_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, base))
    masked = masked_forward(tiny_llama, ids, masked_run(base, tiny_llama.config.num_hidden_layers))
    torch.testing.assert_close(masked, decoded, rtol=1e-4, atol=1e-4)


def test_kernel_shapes_and_initial_scalars():
    kernels = LayerKernels(q_heads=9, kv_heads=3, head_dim=64, rank=8, hidden=128)
    assert kernels.phi_w1.shape == (9, 64, 128) and kernels.phi_w2.shape == (9, 128, 8)
    assert kernels.psi_w1.shape == (3, 64, 128) and kernels.psi_w2.shape == (3, 128, 8)
    assert kernels.psi_w3.shape == (3, 8, 8)
    assert kernels.psi_s1.shape == kernels.psi_s2.shape == (3, 1, 8)
    assert bool((kernels.psi_s1 == 1e-4).all()) and bool((kernels.psi_s2 == 1e-4).all())
    assert kernels.dropout.p == 0.3
    for weight, fan in ((kernels.phi_w1, 64 + 128), (kernels.psi_w2, 128 + 8), (kernels.psi_w3, 16)):
        bound = math.sqrt(6 / fan)
        assert (
            float(weight.detach().abs().max()) <= bound and float(weight.detach().abs().max()) > 0.8 * bound
        )  # Xavier-uniform
    assert not any(name.endswith("bias") for name, _ in kernels.named_parameters())
    kernels.eval()
    with torch.no_grad():
        phi = kernels.phi(torch.randn(2, 9, 5, 64))
        psi = kernels.psi(torch.randn(2, 3, 5, 64))
    assert phi.shape == (2, 9, 5, 8) and psi.shape == (2, 3, 5, 8)
    assert bool((phi >= 0).all()) and bool((psi >= 0).all())
    assert float(psi.max()) < 1e-2  # the 1e-4 scalars: a warm start


def test_psi_follows_the_official_code_form():
    torch.manual_seed(0)
    kernels = LayerKernels(q_heads=2, kv_heads=1, head_dim=4, rank=3, hidden=5).eval()
    with torch.no_grad():
        kernels.psi_s1.copy_(torch.tensor([[[0.5, -2.0, 1.0]]]))
        kernels.psi_s2.copy_(torch.tensor([[[0.3, 0.1, -0.7]]]))
    k = torch.randn(1, 1, 6, 4)
    gelu = torch.nn.functional.gelu
    u = kernels.psi_s1.abs()[0] * gelu(gelu(k[0, 0] @ kernels.psi_w1[0]) @ kernels.psi_w2[0])
    expected = (u + (u @ kernels.psi_w3[0]) * kernels.psi_s2[0]).abs()
    torch.testing.assert_close(kernels.psi(k)[0, 0], expected)
    q = torch.randn(1, 2, 6, 4)
    torch.testing.assert_close(kernels.phi(q)[0, 1], gelu(gelu(q[0, 1] @ kernels.phi_w1[1]) @ kernels.phi_w2[1]).abs())


# ------------------------------------------------------------------------------------------------ arithmetic


def test_mix_low_rank_is_eq3_and_stable_for_large_logits():
    torch.manual_seed(1)
    logits = torch.randn(5, 7) * 3
    values = torch.randn(7, 4)
    num, den = torch.rand(5, 4), torch.rand(5) + 0.1
    lse = logits.logsumexp(-1)
    out = logits.softmax(-1) @ values
    expected = (num + logits.exp() @ values) / (den + logits.exp().sum(-1))[:, None]
    torch.testing.assert_close(mix_low_rank(lse, out, num, den), expected)
    huge = mix_low_rank(lse + 85.0, out, num, den)  # exp(85+) would overflow a naive fp32 sum
    assert bool(torch.isfinite(huge).all())
    torch.testing.assert_close(huge, out, rtol=1e-5, atol=1e-5)
    tiny = mix_low_rank(lse - 85.0, out, num, den)  # e^-(lse) would overflow: the state's mass is all there is
    torch.testing.assert_close(tiny, num / den[:, None])
    # den = 0 (ψ ≡ 0 or nothing evicted; num = φ H is then 0 as well): no low-rank term at all
    assert torch.equal(mix_low_rank(lse, out, torch.zeros(5, 4), torch.zeros(5)), out)


def test_low_rank_parallel_equals_the_masked_matrix_form():
    torch.manual_seed(2)
    batch, kv_heads, groups, length, dim, rank = 2, 2, 2, 12, 4, 3
    phi = torch.rand(batch, kv_heads * groups, length, rank)
    psi = torch.rand(batch, kv_heads, length, rank)
    value = torch.randn(batch, kv_heads, length, dim)
    evict_at = torch.randint(1, length + 3, (batch, kv_heads, length)).clamp(max=length)
    evict_at = torch.maximum(evict_at, torch.arange(length) + 1)  # a token is evicted after it arrives
    num, den = low_rank_parallel(phi, psi, value, evict_at)
    rows = torch.arange(length)[:, None]
    lr_mask = evict_at[:, :, None, :] <= rows  # [B, H_kv, S(rows), S(keys)]
    scores = (phi.view(batch, kv_heads, groups, length, rank) @ psi[:, :, None].transpose(-1, -2)) * lr_mask[:, :, None]
    torch.testing.assert_close(num, (scores @ value[:, :, None]).flatten(1, 2))
    torch.testing.assert_close(den, scores.sum(-1).flatten(1, 2))


def test_sparse_attention_sees_only_cached_tokens():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    evict_at = torch.tensor([[[3, 6, 6, 6, 5, 6]]])
    lse, out = sparse_attention(q, k, v, evict_at)
    row = 4  # sees 1, 2, 3, 4 (token 0 left at row 3)
    logits = (q[0, :, row] @ k[0, 0, 1:5].T) * 0.5
    torch.testing.assert_close(out[0, :, row], logits.softmax(-1) @ v[0, 0, 1:5])
    torch.testing.assert_close(lse[0, :, row], logits.logsumexp(-1))
    assert torch.equal(less_masked_attention(q, k, v, None, None), sparse_attention(q, k, v, None)[1])


def test_eviction_times_keep_budget_plus_current_token_visible():
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 4, 30, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    evict_at = eviction_times(H2OConfig(budget=8).policy(0), q, k, v)
    assert bool((evict_at > torch.arange(30)).all())  # never before arriving
    rows = torch.arange(30)[:, None]
    visible = (evict_at[..., None, :] > rows) & (torch.arange(30) <= rows)  # [1, H_kv, rows, keys]
    assert visible.sum(-1)[..., 9:].eq(9).all()  # budget 8 cached + the current token, from row 8 on
    assert visible.sum(-1)[0, 0, :9].tolist() == list(range(1, 10))


# ------------------------------------------------------------------------------------ config, files, accounting


def test_state_counts_as_r_over_2_tokens_per_kv_head(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, LessConfig(base="h2o", budget=12))
    prefill(tiny_llama, ids_of(1, 30), cache)
    per_token = 2 * tiny_llama.config.num_hidden_layers * tiny_llama.config.num_key_value_heads * 16 * 4
    assert cache.nbytes() == (12 + 8 // 2) * per_token  # float32 model: H = R/2 tokens
    base = kvcompress.cache_for(tiny_llama, "h2o", budget=12)
    prefill(tiny_llama, ids_of(1, 30), base)
    z_bytes = 2 * 2 * 8 * 4
    assert cache.metadata_nbytes() == base.metadata_nbytes() + z_bytes


def test_baseline_plus_budgets():
    plus = baseline_plus(H2OConfig(budget=50))
    assert (plus.budget, plus.heavy, plus.budget - plus.heavy) == (54, 27, 27)
    lam = baseline_plus(StreamingConfig(budget=50, sinks=4, position_mode="original"))
    assert (lam.budget, lam.sinks) == (54, 4)


def test_streaming_by_name_keeps_original_positions_and_cache_mode_is_refused():
    assert LessConfig(base="streaming", budget=20).base_config.position_mode == "original"
    with pytest.raises(ValueError, match="position_mode"):
        LessConfig(base=StreamingConfig(budget=20))
    with pytest.raises(ValueError, match="budget is taken from the base config"):
        LessConfig(base=H2OConfig(budget=20), budget=30)
    with pytest.raises(ValueError, match="base must be one of"):
        LessConfig(base="nope")
    with pytest.raises(ValueError, match="init must be one of"):
        LessConfig(init="random")


def test_kernels_save_load_and_mismatch_errors(tiny_llama, tiny_qwen2, tmp_path):
    kernels = strong_kernels(tiny_llama)
    kernels.meta.update(num_layers=2, q_heads=4, kv_heads=2, head_dim=16, base={"name": "h2o", "budget": 12})
    kernels.save(tmp_path / "k", dtype=torch.float16)
    loaded = load_kernels(tmp_path / "k")
    torch.testing.assert_close(loaded.layers[1].psi_w1, kernels.layers[1].psi_w1, rtol=1e-3, atol=1e-3)
    ids = ids_of(1, 30)
    cache = kvcompress.cache_for(tiny_llama, LessConfig(base="h2o", budget=12, kernels=str(tmp_path / "k")))
    cache_logits(tiny_llama, ids, cache, new_tokens=2)
    with pytest.raises(ValueError, match="trained with base policy 'h2o'"):
        kvcompress.cache_for(tiny_llama, LessConfig(base="window", budget=12, kernels=str(tmp_path / "k")))
    small = LessKernels(layers=[init_kernels(4, 2, 8, 8, 16)] * 2, meta={})
    with pytest.raises(ValueError, match="another model"):
        cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, LessConfig(kernels=small, budget=12)), None, 1)
    one_layer = LessKernels(layers=kernels.layers[:1], meta={})
    with pytest.raises(ValueError, match="1 layers but the model has 2"):
        kvcompress.cache_for(tiny_llama, LessConfig(kernels=one_layer, budget=12))
    (tmp_path / "k" / "layer_001.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"layers \[1\] are not trained yet"):
        load_kernels(tmp_path / "k")
    partial = load_kernels(tmp_path / "k", allow_missing=True)
    assert not bool(partial.layers[1].psi(torch.randn(1, 2, 3, 16)).any())
    with pytest.raises(FileNotFoundError, match="not a LESS kernel directory"):
        load_kernels(tmp_path)
    with pytest.raises(ValueError, match="kernels: .*no shipped kernel set of that name"):
        kvcompress.cache_for(tiny_llama, LessConfig(kernels="no-such-kernels"))


def test_registry_and_batch_generation_with_padding(tiny_llama):
    assert kvcompress.METHODS["less"] is LessConfig
    long, short = ids_of(1, 26, seed=3), ids_of(1, 19, seed=4)
    batch = torch.zeros(2, 26, dtype=torch.long)
    mask = torch.zeros(2, 26, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 7:], mask[1, 7:] = short[0], 1
    config = LessConfig(base="h2o", budget=12, kernels=strong_kernels(tiny_llama))
    batch_logits, _ = cache_logits(tiny_llama, batch, kvcompress.cache_for(tiny_llama, config), mask, 8)
    for row, ids in enumerate((long, short)):
        single, _ = cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, config), None, 8)
        torch.testing.assert_close(batch_logits[row], single[0], rtol=1e-4, atol=1e-5)


def test_shipped_kernel_sets_load_with_their_metadata():
    from kvcompress.methods.less.kernels import shipped_kernels

    assert "smollm2-135m-h2o-50of512" in shipped_kernels()  # the set the README and demo use
    for name in shipped_kernels():
        kernels = load_kernels(name)
        meta = kernels.meta
        assert not meta["missing_layers"] and len(kernels.layers) == meta["num_layers"]
        for layer in kernels.layers:
            assert (layer.q_heads, layer.kv_heads, layer.head_dim) == (
                meta["q_heads"],
                meta["kv_heads"],
                meta["head_dim"],
            )


def test_kernels_are_copied_straight_to_the_models_device():
    """A layer on another device copies the shared kernels there tensor by tensor (no intermediate copy on the
    kernels' device), and the shared kernels stay where they are."""
    from kvcompress.registry import make_config
    from tests.models.test_devices import DeviceCheck

    config = make_config("less", budget=8)
    policy = config.policy(0)
    check = DeviceCheck(torch.device("meta"), cpu_only_allowed=True)
    with check:
        moved = policy.layer_kernels(4, 2, 16, torch.device("meta"))
    built = "/methods/less/kernels.py"  # the kernels themselves are built on the CPU (a CPU generator), then copied
    assert [p for p in check.problems if built not in p] == []
    shared = config.kernels_for(0, 4, 2, 16)
    assert all(p.device.type == "meta" for p in moved.parameters())
    assert all(p.device.type == "cpu" for p in shared.parameters())
    assert [type(p) for p in moved.parameters()] == [type(p) for p in shared.parameters()]


@pytest.mark.parametrize("kv_bits", [16, 4])
def test_per_head_budgets_fold_only_what_each_head_evicts(kv_bits, tiny_llama, monkeypatch):
    """A base keeping different counts per KV head (SnapKV with AdaKV's allocation: a ``KeepMask``) evicts fewer
    tokens in some rows: the state gets ``ψ(k)ᵀ v`` of each row's evicted tokens only (the rows evicting fewer are
    filled up with kept slots, which fold nothing), as read by attention at the eviction."""
    base = kvcompress.make_config("snapkv", ratio=0.3, allocation="adakv", window=4)
    storage = {} if kv_bits == 16 else {"kv_bits": kv_bits, "kv_group": 8, "kv_residual": 8}
    cache = kvcompress.cache_for(tiny_llama, LessConfig(base=base, kernels=strong_kernels(tiny_llama), **storage))
    records = []
    before_eviction = type(cache.compressed_layers[0]).before_eviction

    def recording(layer, victims, dropped):
        evicted = dropped.clone() if victims is None else torch.zeros_like(layer.valid).scatter_(2, victims, True)
        records.append((layer, layer.keys.clone(), layer.values.clone(), evicted & layer.valid))
        before_eviction(layer, victims, dropped)

    monkeypatch.setattr(type(cache.compressed_layers[0]), "before_eviction", recording)
    with torch.no_grad():
        tiny_llama(ids_of(2, 90, seed=5), **cache_argument(tiny_llama, cache))
    counts = torch.stack([evicted.sum(-1) for *_, evicted in records])
    assert bool((counts != counts.amax(-1, keepdim=True)).any())  # some row evicted fewer
    for layer in cache.compressed_layers:
        expected = sum(
            (layer.policy.kernels.psi(keys) * evicted[..., None]).transpose(2, 3) @ values
            for owner, keys, values, evicted in records
            if owner is layer
        )
        torch.testing.assert_close(layer.low_rank[..., :-1], expected, rtol=1e-4, atol=1e-5)


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


@pytest.mark.parametrize("shape", [(9, 128, 1), (9, 1, 8), (90, 128, 1), (3, 128, 5)])
def test_gelu_is_the_native_kernel_and_leaves_onednn_as_it_was(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4
    found = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = False
        native = F.gelu(x)  # PyTorch's own kernel
        torch.backends.mkldnn.enabled = True
        out = _gelu(x)
        assert torch.backends.mkldnn.enabled
    finally:
        torch.backends.mkldnn.enabled = found
    assert torch.equal(out, native) and out.is_contiguous() and out.shape == x.shape
