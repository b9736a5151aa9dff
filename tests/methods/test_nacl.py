"""NaCl: budget arithmetic (Table 4), proxy scores vs the full attention matrix, the selection rule vs a direct
reference, sampling law, ablation switches, re-eviction while decoding, and logits when nothing is evicted."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.nacl import NaClSplit
from kvcompress.methods.random import hash_uniform
from kvcompress.registry import make_config
from tests.helpers import cache_logits, filled_layer, kept_tokens, own_logits

B, HKV, G, L, D = 2, 2, 3, 40, 8


def hand_made(seed: int = 0, scale: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[B, H_kv * G, L, D]`` and keys ``[B, H_kv, L, D]`` with clearly non-uniform attention."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, HKV * G, L, D, generator=gen) * scale, torch.randn(B, HKV, L, D, generator=gen)


def reference_scores(query, keys, lo: int, hi: int, causal: bool = True, reduce: str = "mean") -> torch.Tensor:
    """Column sums of the proxy rows ``[lo, hi)`` of the FULL ``L x L`` softmax attention matrix, per KV head."""
    full_keys = keys.repeat_interleave(G, dim=1)
    logits = query @ full_keys.transpose(-1, -2) * D**-0.5  # [B, H_q, L, L]
    if causal:
        logits = logits.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    per_query_head = logits.softmax(-1)[:, :, lo:hi].sum(dim=2).reshape(B, HKV, G, L)
    return {"mean": per_query_head.mean(2), "sum": per_query_head.sum(2), "max": per_query_head.amax(2)}[reduce]


def reference_keep(scores, split: NaClSplit, seed: int, layer: int = 0, uniform: bool = False, temperature=1.0):
    """The rule written out per head: sinks + recent, top-C_p of the middle (ties: earlier), then C_r by
    Gumbel-top-k of score / temperature + noise(seed, layer, head, position) among the remaining middle tokens."""
    kept = []
    for b in range(scores.shape[0]):
        rows = []
        for h in range(scores.shape[1]):
            s = [float(x) for x in scores[b, h]]
            n = len(s)
            protected = set(range(split.sinks)) | set(range(n - split.recent, n))
            middle = [i for i in range(n) if i not in protected]
            top = sorted(middle, key=lambda i, s=s: (-s[i], i))[: split.top]
            rest = [i for i in middle if i not in top]
            u = hash_uniform(seed, layer, torch.tensor(h), torch.arange(n)) + 2.0**-32
            noise = (-torch.log(-torch.log(u))).tolist()
            key = {i: noise[i] + (0.0 if uniform else s[i] / temperature) for i in rest}
            sampled = sorted(rest, key=lambda i, key=key: (-key[i], i))[: split.random]
            rows.append(sorted(protected | set(top) | set(sampled)))
        kept.append(rows)
    return kept


def evict(config, query, keys, layer_idx: int = 0):
    """Drive one layer by hand: store the prompt, let the policy see its queries, compress once."""
    layer = filled_layer(config, keys, layer_idx=layer_idx)
    assert layer.policy.attend(layer, query, keys, keys, None, None) is None  # SDPA computes the output
    scores = layer.policy.proxy_scores(layer)
    layer.after_attention(None)
    return layer, scores


# --- budget arithmetic ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (0.1, NaClSplit(kept=350, sinks=4, recent=31, top=70, random=245, proxy=105)),
        (0.2, NaClSplit(kept=700, sinks=4, recent=66, top=210, random=420, proxy=630)),
        (0.3, NaClSplit(kept=1050, sinks=4, recent=48, top=368, random=630, proxy=700)),
    ],
)
def test_table4_presets_split_3500_tokens(ratio, expected):
    # spec 6.2 #10: L = 3500 at 20 % -> protect 70, proxy window 630, top-k 210, random 420, kept 700
    assert make_config("nacl", ratio=ratio).split(3500) == expected


def test_official_128k_preset_and_minimum_length():
    config = make_config("nacl", ratio=0.2, preset="official-128k")
    assert config.split(100_000) == NaClSplit(20_000, 256, 744, 12_000, 7_000, 1_000)
    assert config.split(2000).kept == 2000  # below min_evict_len = 2048: nothing evicted


def test_other_ratios_and_token_budgets_use_the_20_percent_proportions():
    assert make_config("nacl", ratio=0.5).split(1000) == NaClSplit(500, 4, 46, 150, 300, 450)
    assert make_config("nacl", budget=100).split(1000) == NaClSplit(100, 4, 6, 30, 60, 90)
    tiny = make_config("nacl", ratio=0.2).split(10)  # token 0 and the last token are always kept
    assert (tiny.kept, tiny.sinks, tiny.recent) == (2, 1, 1)


def test_ablation_shares_move_the_budget_between_top_k_and_random():
    assert make_config("nacl", ratio=0.2, random_share=0.0).split(3500)[3:5] == (630, 0)
    assert make_config("nacl", ratio=0.2, random_share=1.0).split(3500)[3:5] == (0, 630)


# --- proxy scores ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("reduce", ["mean", "sum", "max"])
def test_proxy_scores_equal_the_full_attention_matrix(causal, reduce):
    query, keys = hand_made()
    config = make_config("nacl", ratio=0.2, proxy_causal=causal, gqa_reduce=reduce)
    _, scores = evict(config, query, keys)
    lo, hi = config.proxy_bounds(L)
    assert (lo, hi) == (L - 7, L)  # Table 4's 18 % window
    torch.testing.assert_close(scores, reference_scores(query, keys, lo, hi, causal, reduce), rtol=1e-5, atol=1e-6)


def test_proxy_scores_are_computed_in_row_chunks(monkeypatch):
    import kvcompress.methods.nacl.policy

    query, keys = hand_made()
    config = make_config("nacl", ratio=0.2, proxy_tokens=30)
    _, whole = evict(config, query, keys)
    monkeypatch.setattr(kvcompress.methods.nacl.policy, "PROXY_CHUNK_ELEMENTS", B * HKV * G * L * 4)  # 4 rows per chunk
    _, chunked = evict(config, query, keys)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(whole, reference_scores(query, keys, L - 30, L), rtol=1e-5, atol=1e-6)
    assert torch.allclose(whole.sum(-1), torch.full((B, HKV), 30.0))  # each proxy row is a distribution


def test_proxies_in_the_last_rows_of_a_dense_layer_are_scored_as_plain_causal_attention(monkeypatch):
    """The fast path (no per-row mask, only the diagonal block masked) is taken here and scores as the general
    mask does."""
    import kvcompress.methods.nacl.policy

    decided = []
    dense = kvcompress.methods.nacl.policy._last_rows_of_a_dense_layer

    def spy(*args):
        decided.append(dense(*args))
        return decided[-1]

    monkeypatch.setattr(kvcompress.methods.nacl.policy, "_last_rows_of_a_dense_layer", spy)
    query, keys = hand_made()
    config = make_config("nacl", ratio=0.2, proxy_tokens=30)
    _, fast = evict(config, query, keys)
    assert decided and all(decided)
    monkeypatch.setattr(kvcompress.methods.nacl.policy, "_last_rows_of_a_dense_layer", lambda *a: False)
    _, general = evict(config, query, keys)
    torch.testing.assert_close(fast, general)


def test_gqa_scores_use_the_query_heads_of_each_kv_group():
    query, keys = hand_made()
    query[:, G:] = 0.0  # KV head 1's group attends uniformly; KV head 0's group does not
    _, scores = evict(make_config("nacl", ratio=0.2, proxy_causal=False), query, keys)
    torch.testing.assert_close(scores[:, 1], torch.full((B, L), 7 / L))
    assert scores[:, 0].std() > 0.05


def test_explicit_proxy_span():
    query, keys = hand_made()
    config = make_config("nacl", ratio=0.2, proxy_span=(10, 20))
    _, scores = evict(config, query, keys)
    torch.testing.assert_close(scores, reference_scores(query, keys, 10, 20), rtol=1e-5, atol=1e-6)
    assert make_config("nacl", ratio=0.2, proxy_span=(-8, -2)).proxy_bounds(L) == (L - 8, L - 2)


# --- the selection rule ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.3])
def test_kept_set_equals_direct_reference(ratio, seed):
    query, keys = hand_made(seed=seed)
    config = make_config("nacl", ratio=ratio, seed=seed, sinks=1)
    layer, scores = evict(config, query, keys, layer_idx=3)
    split = config.split(L)
    lo, hi = config.proxy_bounds(L)
    reference = reference_keep(reference_scores(query, keys, lo, hi), split, seed, layer=3)
    assert kept_tokens(layer) == reference
    assert layer.valid.sum(-1).eq(split.kept).all()  # |kept| = budget for every head


def test_top_k_part_is_exact_and_random_part_is_disjoint_from_it():
    query, keys = hand_made(seed=2)
    config = make_config("nacl", ratio=0.3, sinks=2)
    layer, scores = evict(config, query, keys)
    split = config.split(L)
    kept = kept_tokens(layer)
    for b in range(B):
        for h in range(HKV):
            middle = scores[b, h, split.sinks : L - split.recent]
            top = (middle.topk(split.top).indices + split.sinks).tolist()
            assert set(top) <= set(kept[b][h])
            assert len(kept[b][h]) == split.sinks + split.recent + split.top + split.random


def test_same_seed_same_set_other_seed_other_set_and_heads_differ():
    query, keys = hand_made(seed=4)
    first, _ = evict(make_config("nacl", ratio=0.3, seed=5), query, keys)
    again, _ = evict(make_config("nacl", ratio=0.3, seed=5), query, keys)
    other, _ = evict(make_config("nacl", ratio=0.3, seed=6), query, keys)
    assert kept_tokens(first) == kept_tokens(again)
    assert kept_tokens(first) != kept_tokens(other)
    assert all(kept[0] != kept[1] for kept in kept_tokens(first))  # KV heads choose independently
    next_layer, _ = evict(make_config("nacl", ratio=0.3, seed=5), query, keys, layer_idx=1)
    assert kept_tokens(next_layer) != kept_tokens(first)  # so do layers


def test_sampling_follows_softmax_of_scores():
    scores = torch.tensor([[[0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 0.2, 0.0]]])  # 6 middle candidates, positions 1..6
    split = NaClSplit(kept=3, sinks=1, recent=1, top=0, random=1, proxy=1)
    keys = torch.zeros(1, 1, 8, 2)
    expected = scores[0, 0, 1:7].softmax(-1)
    for sampling, law in (("softmax", expected), ("uniform", torch.full((6,), 1 / 6))):
        counts = torch.zeros(6)
        trials = 3000
        for seed in range(trials):
            config = make_config("nacl", budget=3, seed=seed, sampling=sampling)
            layer = filled_layer(config, keys)
            layer.apply(layer.policy.hybrid_selection(layer, scores, [split], event=0))
            chosen = kept_tokens(layer)[0][0][1]  # [sink, sampled, recent]
            counts[chosen - 1] += 1
        chi2 = float(((counts - trials * law) ** 2 / (trials * law)).sum())
        assert chi2 < 20.5, (sampling, counts / trials, law)  # 5 degrees of freedom, p ~ 0.001


def test_temperature_sharpens_sampling():
    query, keys = hand_made(seed=3)
    layer, _ = evict(make_config("nacl", ratio=0.3, temperature=1e-6, sinks=1, random_share=0.5), query, keys)
    config = make_config("nacl", ratio=0.3, sinks=1, random_share=0.0)
    greedy, _ = evict(config, query, keys)  # all top-k: with temperature -> 0 sampling becomes top-k
    assert kept_tokens(layer) == kept_tokens(greedy)


# --- ablation switches (Table 3) ------------------------------------------------------------------------------


def test_no_random_part_keeps_protected_plus_top_scores():
    query, keys = hand_made(seed=8)
    config = make_config("nacl", ratio=0.3, random_share=0.0, sinks=1)
    layer, scores = evict(config, query, keys)
    split = config.split(L)
    assert split.random == 0
    assert kept_tokens(layer) == reference_keep(scores, split, seed=0)


def test_no_proxy_part_and_uniform_sampling_ignore_the_top_k():
    query, keys = hand_made(seed=9)
    config = make_config("nacl", ratio=0.3, random_share=1.0, sampling="uniform", sinks=1)
    layer, scores = evict(config, query, keys)
    other, _ = evict(config, *hand_made(seed=10))
    assert kept_tokens(layer) == kept_tokens(other)  # uniform draws do not depend on the scores
    assert kept_tokens(layer) == reference_keep(scores, config.split(L), seed=0, uniform=True)


def test_shared_selection_keeps_the_same_tokens_in_every_head():
    query, keys = hand_made(seed=11)
    layer, scores = evict(make_config("nacl", ratio=0.3, head_wise=False), query, keys)
    kept = kept_tokens(layer)
    assert all(row[0] == row[1] for row in kept)
    shared = reference_keep(scores.mean(1, keepdim=True), make_config("nacl", ratio=0.3).split(L), seed=0)
    assert [[row[0]] for row in kept] == shared


def test_greedy_eviction_holds_the_budget_while_the_prompt_streams(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "nacl", budget=20, eviction="greedy")
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(0))
    stored = []
    with torch.no_grad():
        for start in range(0, 90, 10):
            tiny_llama(ids[:, start : start + 10], **cache_argument(tiny_llama, cache))
            stored.append(cache.tokens_stored())
    assert stored[0] == [10, 10] and all(s == [20, 20] for s in stored[1:])


# --- inside a model ------------------------------------------------------------------------------------------


def test_model_scores_equal_eager_attention_rows_and_budget_is_exact(tiny_llama):
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    tiny_llama.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = tiny_llama(ids, output_attentions=True).attentions  # [B, H_q, L, L] per layer
    config = make_config("nacl", ratio=0.3)
    cache = kvcompress.cache_for(tiny_llama, config)
    prefill(tiny_llama, ids, cache)
    lo, hi = config.proxy_bounds(60)
    for layer, attention in zip(cache.compressed_layers, attentions, strict=True):
        reference = attention[:, :, lo:hi].sum(2).reshape(1, 2, 2, 60).mean(2)
        torch.testing.assert_close(layer.state["score"], reference.gather(-1, layer.token_idx), rtol=1e-4, atol=1e-5)
        assert layer.valid.sum(-1).eq(config.split(60).kept).all()
        assert kept_tokens(layer)[0][0] != kept_tokens(layer)[0][1]


def test_chunked_prefill_keeps_the_same_tokens_as_one_pass(tiny_llama):
    ids = torch.randint(3, 128, (1, 75), generator=torch.Generator().manual_seed(2))
    one, chunked = (kvcompress.cache_for(tiny_llama, "nacl", ratio=0.2) for _ in range(2))
    prefill(tiny_llama, ids, one)
    prefill(tiny_llama, ids, chunked, chunk_size=8)
    for a, b in zip(one.compressed_layers, chunked.compressed_layers, strict=True):
        assert torch.equal(a.token_idx, b.token_idx)
        torch.testing.assert_close(a.state["score"], b.state["score"], rtol=1e-4, atol=1e-6)


class FloatOutputs(TorchDispatchMode):
    """Records the shape of every floating-point tensor an aten op allocates while active (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.is_floating_point()]
        self.shapes += [tuple(t.shape) for t in tensors if not t._is_view()]
        return out


@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_prefill_never_materialises_an_l_by_l_attention_block(chunk_rows, tiny_llama, monkeypatch):
    # Appx A.7 path: NaCl's own work (buffering proxy queries in attend, scoring and selecting in select) only
    # ever builds |P| x L logits per head (|P| = 17 proxy rows of L = 96 here), or chunk x L when chunked
    import kvcompress.methods.nacl.policy as nacl

    length, proxies, heads = 96, 17, tiny_llama.config.num_attention_heads
    if chunk_rows is not None:
        monkeypatch.setattr(nacl, "PROXY_CHUNK_ELEMENTS", heads * chunk_rows * length)
    recorder = FloatOutputs()
    for name in ("attend", "select"):
        original = getattr(nacl.NaClPolicy, name)

        def recorded(self, *args, original=original):
            with recorder:
                return original(self, *args)

        monkeypatch.setattr(nacl.NaClPolicy, name, recorded)
    config = make_config("nacl", ratio=0.2)
    assert config.proxy_bounds(length) == (length - proxies, length)
    cache = kvcompress.cache_for(tiny_llama, config)
    ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        prefill(tiny_llama, ids, cache)
    # tensors over the L keys: the logits block (rows x L per query head) and the keys broadcast per query head for
    # the matmul (head_dim x L); a per-head L x L matrix would be heads x 96 x 96 = 4.3x the largest allowed here
    sizes = [math.prod(shape) for shape in recorder.shapes if len(shape) >= 2 and shape[-1] == length]
    rows = proxies if chunk_rows is None else chunk_rows
    assert max(sizes) <= heads * max(rows, tiny_llama.config.head_dim) * length
    assert heads * proxies * length in sizes or chunk_rows is not None  # the unchunked proxy block was built
    assert all(cache_layer.stored_length() == config.split(length).kept for cache_layer in cache.compressed_layers)


@pytest.mark.parametrize("params", [{"budget": 512}, {"ratio": 0.2, "min_evict_len": 64}])
def test_nothing_evicted_reproduces_model_logits(params, tiny_llama):
    ids = torch.randint(3, 128, (1, 37), generator=torch.Generator().manual_seed(3))
    reference, _ = own_logits(tiny_llama, ids)
    logits, _ = cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "nacl", **params))
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)


def test_decode_interval_re_evicts_back_to_the_budget(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "nacl", ratio=0.2, decode_interval=4)
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    prefill(tiny_llama, ids, cache)
    sizes = []
    with torch.no_grad():
        for step in range(9):
            tiny_llama(ids[:, step : step + 1], **cache_argument(tiny_llama, cache))
            sizes.append(cache.tokens_stored()[0])
    assert sizes == [11, 12, 13, 10, 11, 12, 13, 10, 11]
    assert cache.get_seq_length() == 59
    for layer in cache.compressed_layers:
        assert 58 in layer.token_idx[0, 0].tolist()  # the newest token is protected


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "exactly one of ratio"),
        ({"ratio": 0.2, "budget": 5}, "exactly one of ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"ratio": 0.2, "random_share": 2.0}, "random_share"),
        ({"ratio": 0.2, "temperature": 0}, "temperature"),
        ({"ratio": 0.2, "sampling": "gumbel"}, "sampling"),
        ({"ratio": 0.2, "gqa_reduce": "median"}, "gqa_reduce"),
        ({"ratio": 0.2, "eviction": "greedy"}, "needs budget"),
        ({"ratio": 0.2, "proxy_tokens": 0}, "proxy_tokens"),
        ({"ratio": 0.2, "proxy_tokens": 4, "proxy_ratio": 0.1}, "at most one"),
        ({"ratio": 0.2, "preset": "table5"}, "preset"),
        ({"ratio": 0.2, "decode_interval": 0}, "decode_interval"),
    ],
)
def test_bad_parameters_are_named(params, message):
    with pytest.raises(ValueError, match=message):
        make_config("nacl", **params)


def test_seed_streams_are_independent_per_head():
    draws = hash_uniform(0, 0, torch.arange(2)[:, None], torch.arange(5000)[None])
    correlation = torch.corrcoef(draws.float())[0, 1]
    assert abs(float(correlation)) < 0.05 and math.isclose(float(draws.mean()), 0.5, abs_tol=0.02)
