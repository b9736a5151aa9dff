"""PoD: dense limits, block starts, exact gate forms, cache decoding vs teacher forcing vs an eager reference, the
memory formula, the τ gate, composition with SnapKV, and Algorithm 1 on hand-made similarity matrices."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

import kvcompress
from kvcompress.core.attention import padding_mask_passthrough
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.h2o import H2OConfig
from kvcompress.methods.pod import PoDConfig
from kvcompress.methods.pod.grouping import (
    block_starts,
    delta_for_saving,
    group_layers,
    kv_key_rows,
    kv_saving,
    starts_from_similarity,
    uniform_starts,
)
from kvcompress.methods.pod.layer import pod_stats
from kvcompress.methods.snapkv import SnapKVConfig
from tests.helpers import cache_logits, own_logits


def blocks_from_starts(starts) -> list[list[list[int]]]:
    """Inverse of ``block_starts`` (for contiguous blocks)."""
    heads = len(starts[0])
    result = []
    for h in range(heads):
        blocks: list[list[int]] = []
        for layer, row in enumerate(starts):
            if row[h] == layer:
                blocks.append([layer])
            else:
                blocks[-1].append(layer)
        result.append(blocks)
    return result


def kv_elements(starts, n: int, n_sink: int, n_recent: int, head_dim: int, kv_heads: int | None = None) -> int:
    """Stored key + value elements of one sequence of ``n`` tokens under PoD (the memory formula, with values)."""
    layers = len(starts)
    kv_heads = len(starts[0]) if kv_heads is None else kv_heads
    kept = kv_key_rows(starts, kv_heads)
    distant = max(0, n - n_sink - n_recent)
    values = layers * kv_heads * n * head_dim
    keys = layers * kv_heads * min(n, n_sink + n_recent) * head_dim + kept * distant * head_dim
    return values + keys


# 4 layers, 4 query heads / 2 KV heads; per KV head: head 0 blocks [0][1-2][3], head 1 blocks [0-2][3]
STARTS = ((0, 0), (1, 0), (1, 0), (3, 3))
NS, NR = 3, 8


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return lm.eval()


def ids_of(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def dense_logits(model, ids):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model(ids).logits


def pod_logits(model, ids, **params):
    params = {"starts": STARTS, "n_sink": NS, "n_recent": NR, **params}
    cache = kvcompress.cache_for(model, "pod", **params)
    with torch.no_grad():
        return model(ids, **cache_argument(model, cache)).logits, cache


# --- an eager reference of spec §3.3 (full sequence, no cache), independent of the cache code -------------------
REFERENCE: dict = {}


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cfg = REFERENCE
    layer = module.layer_idx
    _, q_heads, length, dim = query.shape
    groups = q_heads // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    cfg["qk"][layer] = (query, key)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    causal = j <= i
    proximal = causal & ((j < cfg["ns"]) | (i - j < cfg["nr"]))
    distant = causal & ~proximal
    outputs, probs = [], []
    for h in range(q_heads):
        row = cfg["starts"][layer]
        start = row[h] if len(row) == q_heads else row[h // groups]
        own = query[:, h] @ key[:, h].transpose(-1, -2) * scaling
        if start == layer:
            logits = own.masked_fill(~causal, -math.inf)
        else:
            start_query, start_key = cfg["qk"][start]
            source = start_query[:, h] if cfg["v1"] else query[:, h]
            dist = source @ start_key[:, h].transpose(-1, -2) * scaling
            logits = torch.where(distant, dist, own).masked_fill(~causal, -math.inf)
            if cfg["tau"] is not None:
                lse_p = own.masked_fill(~proximal, -math.inf).logsumexp(-1)
                lse_d = dist.masked_fill(~distant, -math.inf).logsumexp(-1)
                skip = distant.any(-1) & (torch.sigmoid(lse_p - lse_d) >= cfg["tau"])
                logits = logits.masked_fill(skip[..., None] & distant, -math.inf)
        probs.append(logits.softmax(-1))
        outputs.append(probs[-1] @ value[:, h])
    cfg["probs"][layer] = torch.stack(probs, 1)  # [B, H_q, L, L]: the rows each query head's output used
    return torch.stack(outputs, 1).transpose(1, 2).contiguous(), None


def reference_logits(model, ids, starts=STARTS, v1=True, tau=None):
    AttentionInterface.register("pod_reference", reference_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("pod_reference", padding_mask_passthrough)
    REFERENCE.update(starts=starts, ns=NS, nr=NR, v1=v1, tau=tau, qk={}, probs={})
    model.set_attn_implementation("pod_reference")
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    finally:
        model.set_attn_implementation("sdpa")


# --- check 1: the tests of the issue ---------------------------------------------------------------------------
def test_singleton_blocks_reproduce_dense_logits_while_generating(model):
    ids = ids_of(40)
    reference, sequences = own_logits(model, ids, new_tokens=8)
    for params in ({"block_size": 1}, {"starts": uniform_starts(4, 2, 1)}):
        cache = kvcompress.cache_for(model, "pod", n_sink=NS, n_recent=NR, **params)
        logits, out = cache_logits(model, ids, cache, new_tokens=8)
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, sequences)


def test_delta_above_every_similarity_gives_singletons_and_dense_logits(model, tmp_path):
    sim = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "sim.pt"
    torch.save({"sim": sim, "kv_heads": 2}, path)
    starts = starts_from_similarity({"sim": sim, "kv_heads": 2}, 1.01, None)
    assert starts == uniform_starts(4, 2, 1)
    ids = ids_of(40)
    logits, _ = pod_logits(model, ids, starts=None, similarity=str(path), delta=1.01)
    torch.testing.assert_close(logits, dense_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_block_start_heads_are_dense(model):
    """Layer 0 starts every block; at layer 1 KV head 0 starts a block (its query heads 0, 1 stay dense) while KV
    head 1 shares layer 0's distant logits (query heads 2, 3 change)."""
    ids = ids_of(50)
    captured: dict[str, list[torch.Tensor]] = {"dense": [], "pod": []}
    hooks = []

    def capture(name):
        def hook(module, args):
            captured[name].append(args[0].detach().clone())

        return hook

    layers = model.model.layers
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(capture("dense")) for layer in layers[:2]]
    dense_logits(model, ids)
    for hook in hooks:
        hook.remove()
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(capture("pod")) for layer in layers[:2]]
    pod_logits(model, ids)
    for hook in hooks:
        hook.remove()
    dense0, dense1 = captured["dense"]
    pod0, pod1 = captured["pod"]
    torch.testing.assert_close(pod0, dense0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pod1[..., :32], dense1[..., :32], rtol=1e-5, atol=1e-6)  # query heads 0, 1
    assert (pod1[..., 32:] - dense1[..., 32:]).abs().max() > 1e-3  # query heads 2, 3 share


def test_rows_without_distant_tokens_equal_dense(model):
    ids = ids_of(60)
    dense = dense_logits(model, ids)
    logits, _ = pod_logits(model, ids)
    torch.testing.assert_close(logits[:, : NS + NR], dense[:, : NS + NR], rtol=1e-5, atol=1e-5)
    assert (logits[:, NS + NR :] - dense[:, NS + NR :]).abs().max() > 1e-2
    short, _ = pod_logits(model, ids[:, : NS + NR])
    torch.testing.assert_close(short, dense[:, : NS + NR], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tau", [None, 0.6])
@pytest.mark.parametrize("source", ["block_start", "own"])
def test_mixed_softmax_equals_lse_gate(model, source, tau):
    ids = ids_of(60, seed=2)
    softmax, _ = pod_logits(model, ids, query_source=source, tau=tau)
    gated, _ = pod_logits(model, ids, query_source=source, tau=tau, combine="lse")
    torch.testing.assert_close(gated, softmax, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("source", ["block_start", "own"])
def test_teacher_forced_cache_matches_eager_reference(model, source):
    ids = ids_of(70, seed=3)
    logits, _ = pod_logits(model, ids, query_source=source)
    reference = reference_logits(model, ids, v1=source == "block_start")
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_query_head_grouping_matches_eager_reference(model):
    starts = ((0, 0, 0, 0), (0, 1, 0, 0), (2, 1, 0, 2), (2, 1, 3, 2))  # per query head
    ids = ids_of(60, seed=4)
    logits, cache = pod_logits(model, ids, starts=starts, grouping="query_head")
    torch.testing.assert_close(logits, reference_logits(model, ids, starts=starts), rtol=1e-4, atol=1e-4)
    # KV head 0 (query heads 0, 1) keeps distant keys at layers 0, 1, 2; KV head 1 (2, 3) at 0, 2, 3
    assert [layer.full_heads.tolist() for layer in cache.compressed_layers] == [[0, 1], [0], [0, 1], [1]]


@pytest.mark.parametrize("params", [{}, {"query_source": "own"}, {"tau": 0.7}])
def test_decoding_with_cache_equals_teacher_forced(model, params):
    ids = ids_of(64, seed=5)
    teacher, _ = pod_logits(model, ids, **params)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, **params)
    with torch.no_grad():
        steps = [model(ids[:, :5], **cache_argument(model, cache)).logits]
        steps += [model(ids[:, t : t + 7], **cache_argument(model, cache)).logits for t in range(5, 26, 7)]
        steps += [model(ids[:, t : t + 1], **cache_argument(model, cache)).logits for t in range(26, 64)]
    torch.testing.assert_close(torch.cat(steps, 1), teacher, rtol=1e-4, atol=1e-4)


def test_generate_with_cache_equals_teacher_forced_greedy(model):
    ids = ids_of(30, seed=6)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    logits, sequences = cache_logits(model, ids, cache, new_tokens=10)
    teacher, _ = pod_logits(model, sequences[:, :-1])
    torch.testing.assert_close(logits[0], teacher[0, 29:], rtol=1e-4, atol=1e-4)


def test_padded_batch_equals_single_runs(model):
    long, short = ids_of(36, seed=7), ids_of(27, seed=8)
    batch = torch.zeros(2, 36, dtype=torch.long)
    mask = torch.zeros(2, 36, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 9:], mask[1, 9:] = short[0], 1
    params = {"starts": STARTS, "n_sink": NS, "n_recent": NR}
    both, _ = cache_logits(model, batch, kvcompress.cache_for(model, "pod", **params), mask, 8)
    for row, ids in enumerate((long, short)):
        single, _ = cache_logits(model, ids, kvcompress.cache_for(model, "pod", **params), None, 8)
        torch.testing.assert_close(both[row], single[0], rtol=1e-4, atol=1e-4)


def test_stored_bytes_equal_the_formula_at_every_length(model):
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    ids = ids_of(40, seed=9)
    with torch.no_grad():
        model(ids[:, :6], **cache_argument(model, cache))
        for t in range(6, 40):
            model(ids[:, t : t + 1], **cache_argument(model, cache))
            n = t + 1
            assert cache.nbytes() == 4 * kv_elements(STARTS, n, NS, NR, head_dim=16)
    dense = 2 * 4 * 2 * 40 * 16 * 4
    assert 1 - cache.nbytes() / dense == pytest.approx(kv_saving(STARTS, 40, NS, NR)[0])
    # keys actually dropped: non-start KV heads hold sinks + recent window only
    layer2 = cache.compressed_layers[2]
    assert layer2.keys.shape[1] == 0 and layer2.prox_keys.shape[2] == NS + NR


def test_tau_zero_equals_proximal_only_at_non_start_heads(model):
    ids = ids_of(60, seed=10)
    logits, cache = pod_logits(model, ids, tau=0.0)
    proximal_only = reference_logits(model, ids, tau=0.0)
    torch.testing.assert_close(logits, proximal_only, rtol=1e-4, atol=1e-4)
    stats = pod_stats(cache)
    assert stats["eligible"] > 0 and stats["fraction"] == 1.0
    _, untouched = pod_logits(model, ids, tau=1.0)
    assert pod_stats(untouched)["fraction"] < 1.0


def test_tau_reference_matches_at_intermediate_threshold(model):
    ids = ids_of(60, seed=11)
    logits, cache = pod_logits(model, ids, tau=0.5)
    torch.testing.assert_close(logits, reference_logits(model, ids, tau=0.5), rtol=1e-4, atol=1e-4)
    assert 0 < pod_stats(cache)["fraction"] < 1


# --- check 3: composition with SnapKV ---------------------------------------------------------------------------
@pytest.mark.parametrize("params", [{}, {"tau": 0.5}, {"combine": "lse"}, {"tau": 0.3, "combine": "lse"}])
def test_received_mass_at_block_start_heads_is_their_own_attention(model, params):
    """A base that accumulates received attention (H2O) at a layer where some KV heads start a block and others
    share (layer 1 under ``STARTS``): the mass of the start heads is the plain causal attention they pay, whatever
    ``tau`` and ``combine`` do to the sharing heads' softmax, over a prefill and three decoding steps (nothing
    evicted: the budget holds every token). The reference sums the eager reference's own softmax rows."""
    ids = ids_of(40, seed=5)
    cache = kvcompress.cache_for(
        model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, base=H2OConfig(budget=64), **params
    )
    with torch.no_grad():
        model(ids[:, :37], **cache_argument(model, cache))
        for t in range(37, 40):
            model(ids[:, t : t + 1], **cache_argument(model, cache))
    reference_logits(model, ids, tau=params.get("tau"))
    groups = 2
    checked = 0
    for layer_idx, row in enumerate(STARTS):
        layer = cache.compressed_layers[layer_idx]
        mass = torch.zeros(1, len(row), 40).scatter_(-1, layer.token_idx, layer.state["mass"])
        for kv_head, start in enumerate(row):
            if start != layer_idx:  # a sharing head's mass is never read: its block start's selection stands
                continue
            rows = REFERENCE["probs"][layer_idx][:, kv_head * groups : (kv_head + 1) * groups]
            torch.testing.assert_close(mass[:, kv_head], rows.sum(dim=(1, 2)).float(), rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked == 5  # layer 0's and 3's two heads, layer 1's head 0 (beside a sharing head 1)


def test_pod_with_snapkv_keeps_one_token_set_per_block_and_counts_bytes(model):
    ids = ids_of(60, seed=12)
    base = SnapKVConfig(budget=24, window=4)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, base=base)
    prefill(model, ids, cache, chunk_size=16)
    layers = cache.compressed_layers
    for index, layer in enumerate(layers):
        assert layer.values.shape[2] == 24
        for g in range(2):
            start = layers[STARTS[index][g]]
            assert torch.equal(layer.token_idx[:, g], start.token_idx[:, g])
    for layer in layers:  # proximal keys held = the kept tokens that are sinks or in the recent window
        for row, g in enumerate(layer.prox_heads.tolist()):
            pos = layer.rope_pos[0, g]
            expected = layer.token_idx[0, g][(pos < NS) | (59 - pos < NR)]
            slots = layer.prox_slot[0, row]
            assert torch.equal(layer.token_idx[0, g][slots[slots >= 0]], expected)
    key_rows = sum(layer.keys.shape[1] * 24 + layer.prox_keys.shape[1] * layer.prox_keys.shape[2] for layer in layers)
    assert cache.nbytes() == 4 * 16 * (4 * 2 * 24 + key_rows)
    assert cache.nbytes() < 2 * 4 * 2 * 24 * 16 * 4  # below SnapKV alone at the same budget
    with torch.no_grad():
        for t in range(5):
            model(ids_of(1, seed=20 + t), **cache_argument(model, cache))
    assert all(layer.values.shape[2] == 29 for layer in layers)


def test_pod_with_snapkv_at_full_ratio_equals_pod(model):
    ids = ids_of(40, seed=13)
    plain = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    composed = kvcompress.cache_for(
        model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, base=SnapKVConfig(ratio=1.0, window=4)
    )
    reference, _ = cache_logits(model, ids, plain, new_tokens=6)
    logits, _ = cache_logits(model, ids, composed, new_tokens=6)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_pod_with_snapkv_scores_the_window_as_the_explicit_softmax_does(model, monkeypatch):
    """A prefill chunk's output comes from the fused kernels and only the observation window's rows go through the
    explicit softmax: the kept tokens and the logits equal those of the explicit softmax over every row."""
    import kvcompress.methods.pod.attention

    def run():
        cache = kvcompress.cache_for(
            model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, base=SnapKVConfig(budget=24, window=4)
        )
        logits, _ = cache_logits(model, ids_of(60, seed=16), cache, new_tokens=4)
        return logits, [layer.token_idx.clone() for layer in cache.compressed_layers]

    logits, kept = run()
    monkeypatch.setattr(kvcompress.methods.pod.attention, "_fuses", lambda config, request: not request.any)
    explicit_logits, explicit_kept = run()
    assert all(torch.equal(a, b) for a, b in zip(kept, explicit_kept, strict=True))
    torch.testing.assert_close(logits, explicit_logits, rtol=1e-4, atol=1e-5)


def test_chunks_of_the_stream_as_it_came_share_their_masks_and_equal_the_general_masks(model, monkeypatch):
    """While every layer holds the stream as it came, a chunk's masks are built once per forward from the
    positions (``stream_masks``), the distant keys of a later chunk taken in two calls: the logits and kept tokens
    equal those of the per-layer masks."""
    import kvcompress.methods.pod.attention

    built = []
    shared = kvcompress.methods.pod.attention.stream_biases

    def spy(*args):
        built.append(shared(*args))
        return built[-1]

    def run():
        cache = kvcompress.cache_for(
            model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, base=SnapKVConfig(budget=24, window=4)
        )
        ids = ids_of(63, seed=17)
        prefill(model, ids[:, :60], cache, chunk_size=16)
        with torch.no_grad():
            steps = [model(ids[:, t : t + 1], **cache_argument(model, cache)).logits for t in range(60, 63)]
        return torch.cat(steps, 1), [layer.token_idx.clone() for layer in cache.compressed_layers]

    monkeypatch.setattr(kvcompress.methods.pod.attention, "stream_biases", spy)
    logits, kept = run()
    assert any(b is not None and b.split is not None for b in built)  # the unmasked call and the causal block
    assert any(b is not None and b.split is None for b in built)  # an early chunk: one masked call
    monkeypatch.setattr(kvcompress.methods.pod.attention, "stream_biases", lambda *args: None)
    general_logits, general_kept = run()
    assert all(torch.equal(a, b) for a, b in zip(kept, general_kept, strict=True))
    torch.testing.assert_close(logits, general_logits, rtol=1e-5, atol=1e-6)


def test_pod_with_snapkv_padded_batch_equals_single_runs(model):
    long, short = ids_of(40, seed=14), ids_of(31, seed=15)
    batch = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 9:], mask[1, 9:] = short[0], 1
    params = {"starts": STARTS, "n_sink": NS, "n_recent": NR, "base": SnapKVConfig(budget=20, window=4)}
    both, _ = cache_logits(model, batch, kvcompress.cache_for(model, "pod", **params), mask, 6)
    for row, ids in enumerate((long, short)):
        single, _ = cache_logits(model, ids, kvcompress.cache_for(model, "pod", **params), None, 6)
        torch.testing.assert_close(both[row], single[0], rtol=1e-4, atol=1e-4)


# --- config errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2, "starts": STARTS}, "exactly one of"),
        ({"block_size": 2, "n_recent": 0}, "n_recent"),
        ({"block_size": 2, "tau": 1.5}, "tau"),
        ({"block_size": 2, "query_source": "mine"}, "query_source"),
        ({"block_size": 2, "combine": "sum"}, "combine"),
        ({"starts": ((0, 0), (0, 1), (1, 1))}, "starts"),
        ({"block_size": 2, "target_saving": 0.7}, "target_saving"),
    ],
)
def test_bad_parameters_are_named(params, message):
    with pytest.raises(ValueError, match=message):
        PoDConfig(**params)


def test_missing_blocks_and_wrong_layer_count_are_refused(model):
    with pytest.raises(ValueError, match="similarity"):
        kvcompress.cache_for(model, "pod")
    with pytest.raises(ValueError, match="layers"):
        kvcompress.cache_for(model, "pod", starts=STARTS[:3])


# --- Algorithm 1 and the saving arithmetic ------------------------------------------------------------------------
def sim_of(*pairs: tuple[int, int, float], layers: int = 3) -> torch.Tensor:
    sim = torch.eye(layers)
    for a, b, value in pairs:
        sim[a, b] = sim[b, a] = value
    return sim[None]


def test_complete_linkage_splits_a_chain():
    sim = sim_of((0, 1, 0.9), (1, 2, 0.9), (0, 2, 0.2))
    assert group_layers(sim, 0.5) == [[[0, 1], [2]]]
    assert group_layers(sim, 0.1) == [[[0, 1, 2]]]
    assert group_layers(sim, 0.95) == [[[0], [1], [2]]]


def test_threshold_is_inclusive_and_blocks_restart_at_the_new_layer():
    sim = sim_of((0, 1, 0.5), (1, 2, 0.3), (0, 2, 0.9), (2, 3, 0.8), (1, 3, 0.1), (0, 3, 0.9), layers=4)
    assert group_layers(sim, 0.5) == [[[0, 1], [2, 3]]]
    assert block_starts(group_layers(sim, 0.5)) == ((0,), (0,), (2,), (2,))


def test_each_head_has_its_own_partition_and_layer_zero_starts():
    sim = torch.cat([sim_of((0, 1, 0.9), (1, 2, 0.1), (0, 2, 0.1)), sim_of((0, 1, 0.1), (1, 2, 0.9), (0, 2, 0.1))])
    blocks = group_layers(sim, 0.5)
    assert blocks == [[[0, 1], [2]], [[0], [1, 2]]]
    starts = block_starts(blocks)
    assert starts == ((0, 0), (0, 1), (2, 1))
    assert blocks_from_starts(starts) == blocks


def test_savings_follow_the_spec_formula():
    starts = block_starts([[[0, 1], [2]], [[0], [1, 2]]])  # B = 4 of 6 (layer, head) pairs keep distant keys
    at_n, asymptotic = kv_saving(starts, 100, 4, 16)
    assert asymptotic == pytest.approx(0.5 * (1 - 4 / 6))
    assert at_n == pytest.approx((6 - 4) * 80 / (2 * 6 * 100))
    assert kv_saving(starts, 10, 4, 16)[0] == 0.0
    elements = kv_elements(starts, 100, 4, 16, head_dim=8)
    assert elements == 3 * 2 * 100 * 8 + 3 * 2 * 20 * 8 + 4 * 80 * 8
    assert 1 - elements / (2 * 3 * 2 * 100 * 8) == pytest.approx(at_n)


def test_query_head_grouping_counts_a_kv_head_key_if_any_query_head_starts():
    starts = ((0, 0, 0, 0), (0, 1, 1, 1), (2, 1, 1, 1))  # 2 KV heads x 2 query heads
    # KV head 0 keeps keys at layers 0, 1 (query head 1), 2 (query head 0); KV head 1 at 0, 1
    assert kv_saving(starts, None, 0, 0, kv_heads=2)[1] == pytest.approx(0.5 * (1 - 5 / 6))


def test_delta_for_target_saving_is_the_largest_reaching_it():
    sim = sim_of((0, 1, 0.9), (1, 2, 0.7), (0, 2, 0.6))
    assert delta_for_saving(sim, 0.0) == math.inf
    delta = delta_for_saving(sim, 1 / 6)  # one merge (B = 2 of 3)
    assert delta == pytest.approx(0.9)
    assert delta_for_saving(sim, 1 / 3) == pytest.approx(0.6)


def test_training_path_with_autograd_equals_inference_path(model):
    """With gradients on, PoD runs one fused SDPA over doubled keys; without, the two-call Eq. 4 merge."""
    ids = ids_of(60, seed=16)
    expected, _ = pod_logits(model, ids)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    weight = model.model.layers[0].self_attn.q_proj.weight
    weight.requires_grad_(True)
    try:
        with torch.enable_grad():
            logits = model(ids, **cache_argument(model, cache)).logits
            logits.sum().backward()
        assert weight.grad is not None
    finally:
        weight.grad = None
    torch.testing.assert_close(logits.detach(), expected, rtol=1e-4, atol=1e-4)


def test_distant_tokens_follow_the_positions_the_model_gives(model, monkeypatch):
    # positions from 50: no token is a sink, and the oldest tokens are distant before n_sink + n_recent are seen
    ids = ids_of(10, seed=12)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    with torch.no_grad():
        logits = model(ids, position_ids=torch.arange(50, 60)[None], **cache_argument(model, cache)).logits
    monkeypatch.setitem(globals(), "NS", 0)  # the reference's sinks by index: none, as none has a position below 3
    torch.testing.assert_close(logits, reference_logits(model, ids), rtol=1e-4, atol=1e-4)
