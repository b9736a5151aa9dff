"""BUZZ: the spec's test vector, structural invariants, parameter estimation, ablations and log-n scaling."""

from __future__ import annotations

import math

import pytest
import torch

import kvcompress
from kvcompress.core.contract import AttentionStats
from kvcompress.core.layer import CompressedLayer
from kvcompress.generation import cache_argument
from kvcompress.methods.buzz.params import buzz_params, middle_after_eviction, steady_sizes, theorem_ratio
from kvcompress.registry import make_config
from tests.helpers import kept_tokens


def spec_score(p: int) -> float:
    return float((7 * p) % 11)


class Stream:
    """One cache layer fed one token at a time; ``score(p)`` is the attention token ``p`` receives on arrival."""

    def __init__(self, config, heads: int = 1, batch: int = 1, groups: int = 1, seed: int = 0) -> None:
        self.layer = CompressedLayer(config.policy(0))
        self.heads, self.batch, self.groups = heads, batch, groups
        self.generator = torch.Generator().manual_seed(seed)
        self.attended: list[int] = []

    def push(self, score: torch.Tensor | float) -> None:
        """Append one token whose received attention is ``score`` (``[B, H, G]`` or a number); others get 0."""
        key = torch.randn(self.batch, self.heads, 1, 4, generator=self.generator)
        self.layer.update(key, key.clone())
        self.layer.register_new_tokens(None, None)
        length = self.layer.stored_length()
        self.attended.append(length)
        received = torch.zeros(self.batch, self.heads, self.groups, length)
        received[..., -1] = torch.as_tensor(score, dtype=torch.float32).expand(self.batch, self.heads, self.groups)
        self.layer.after_attention(AttentionStats(query_count=1, received=received))

    def kept(self) -> list[int]:
        return kept_tokens(self.layer)[0][0]

    def n_old(self) -> list[list[int]]:
        return (self.layer.state["old"] & self.layer.valid).sum(-1).tolist()


def test_spec_test_vector_step_by_step():
    """Spec §6: k=2, w=3, T=6, s=3 (ŝ=2), score(p) = 7p mod 11, one token at a time."""
    stream = Stream(make_config("buzz", sinks=2, window=3, threshold=6, stride=3))
    expected = {
        11: ([0, 1, 3, 6, 8, 9, 10, 11], 3),
        15: ([0, 1, 3, 8, 9, 12, 13, 14, 15], 4),
        18: ([0, 1, 3, 9, 14, 16, 17, 18], 3),
    }
    previous: list[int] = []
    for p in range(20):
        stream.push(spec_score(p))
        if p in expected:
            tokens, n_old = expected[p]
            assert stream.kept() == tokens, p
            assert stream.n_old() == [[n_old]], p
        else:  # no eviction between the table's rows: the cache only grows
            assert stream.kept() == previous + [p], p
        previous = stream.kept()
    assert stream.attended[11] == stream.attended[15] == stream.attended[18] == 12  # k + w + T + 1


def test_no_eviction_while_short_or_middle_within_threshold():
    config = make_config("buzz", sinks=3, window=5, threshold=10, stride=3)
    stream = Stream(config, heads=2)
    for p in range(3 + 5 + 10):  # L <= k + w, then M <= T
        stream.push(torch.rand(1, 2, 1, generator=stream.generator))
        assert kept_tokens(stream.layer) == [[list(range(p + 1))] * 2]
    stream.push(1.0)  # M = T + 1: the first eviction
    assert stream.layer.stored_length() < 19


def test_score_accumulates_and_group_is_summed_within_each_kv_head_only():
    config = make_config("buzz", sinks=0, window=0, threshold=2, stride=3)
    layer = CompressedLayer(config.policy(0))
    keys = torch.randn(1, 2, 3, 4)
    layer.update(keys, keys)
    layer.register_new_tokens(None, None)
    received = torch.zeros(1, 2, 3, 3)  # [B, H_kv, G, L]
    received[0, 0, :, 1] = 1.0  # KV head 0: its 3 query heads all look at token 1
    received[0, 1, 0, 2] = 0.5  # KV head 1: one query head looks at token 2, another at token 0
    received[0, 1, 1, 0] = 0.4
    layer.after_attention(AttentionStats(query_count=3, received=received))
    assert kept_tokens(layer) == [[[1], [2]]]  # one hive of 3 per head, local max of the group sums
    assert layer.state["score"].tolist() == [[[3.0], [0.5]]]


def test_eviction_matches_a_per_head_reference_under_random_scores():
    """A loop-based reference of spec §1.7 against the vectorised policy, 3 heads, random accumulated scores."""
    k, w, limit, s = 2, 4, 9, 3
    stream = Stream(make_config("buzz", sinks=k, window=w, threshold=limit, stride=s), heads=3, seed=1)
    reference = [[[], 0, []] for _ in range(3)]  # per head: tokens, n_old, scores
    for p in range(120):
        scores = torch.rand(1, 3, 1, generator=stream.generator)
        stream.push(scores)
        for head, state in enumerate(reference):
            tokens, n_old, acc = state
            tokens.append(p)
            acc.append(float(scores[0, head, 0]))
            middle = len(tokens) - k - w
            if middle > limit:
                old = list(range(k, k + n_old))[:: (s + 1) // 2]
                new_slots = list(range(k + n_old, len(tokens) - w))
                hives = [new_slots[i : i + s] for i in range(0, len(new_slots), s)]
                new = [max(hive, key=lambda j, acc=acc: (acc[j], -j)) for hive in hives]
                slots = list(range(k)) + old + new + list(range(len(tokens) - w, len(tokens)))
                state[0] = [tokens[j] for j in slots]
                state[2] = [acc[j] for j in slots]
                state[1] = len(old) + len(new)
        assert kept_tokens(stream.layer)[0] == [state[0] for state in reference], p
        assert stream.n_old() == [[state[1] for state in reference]]


def test_equal_length_across_heads_and_layers_and_peak_attended_length(tiny_llama):
    k, w, limit = 2, 6, 15  # T / w = 2.5 for s = 3 (Theorem 3.1)
    cache = kvcompress.cache_for(tiny_llama, "buzz", sinks=k, window=w, stride=3)
    assert cache.compressed_layers[0].policy.threshold == limit
    attended = []
    for layer in cache.compressed_layers:
        observe = layer.policy.observe

        def recording(layer_, stats, observe=observe):
            attended.append(layer_.stored_length())
            observe(layer_, stats)

        layer.policy.observe = recording
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_llama(ids, **cache_argument(tiny_llama, cache))
        for step in range(80):
            tiny_llama(torch.tensor([[step % 100 + 1]]), **cache_argument(tiny_llama, cache))
            lengths = {int(n) for layer in cache.compressed_layers for n in layer.valid.sum(-1).flatten()}
            assert len(lengths) == 1, step  # every head of every layer holds as many tokens
            assert set(cache.tokens_stored()) == lengths
            assert lengths.pop() <= k + w + limit
    assert max(attended) == k + w + limit + 1


@pytest.mark.parametrize(("stride", "window"), [(5, 40), (5, 100), (3, 30), (4, 25), (7, 20)])
def test_steady_state_old_count_within_two_of_theorem_fixed_point(stride, window):
    config = make_config("buzz", sinks=4, window=window, stride=stride)
    _, _, limit, _ = config.resolved()
    stream = Stream(config, heads=2, seed=stride)
    after_eviction = []
    for _ in range(4 + window + 12 * limit):
        before = stream.layer.stored_length()
        stream.push(torch.rand(1, 2, 1, generator=stream.generator))
        if stream.layer.stored_length() <= before:
            after_eviction.append(stream.n_old()[0][0])
    target = limit / theorem_ratio(stride)  # a* of Theorem 3.1 (real-valued)
    assert abs(target - window) <= 1  # Theorem 3.1: T chosen so that a* = w
    assert all(target <= a <= target + 2 for a in after_eviction[-5:]), (after_eviction[-5:], target)


def test_stride_below_three_is_rejected():
    for stride in (1, 2):
        with pytest.raises(ValueError, match="stride"):
            make_config("buzz", stride=stride)
    with pytest.raises(ValueError, match="stride"):
        theorem_ratio(2)


def test_bad_parameters_raise_naming_them():
    with pytest.raises(ValueError, match="budget_kind"):
        make_config("buzz", budget=100, budget_kind="max")
    with pytest.raises(ValueError, match="not both"):
        make_config("buzz", budget=100, window=10)
    with pytest.raises(ValueError, match="budget must be at least"):
        make_config("buzz", budget=8)
    with pytest.raises(ValueError, match="score_mode"):
        make_config("buzz", score_mode="sum")


def test_theorem_ratios_and_threshold_from_window():
    assert [round(theorem_ratio(s), 3) for s in (3, 4, 5, 6, 7, 8)] == [2.5, 3.0, 4.333, 5.0, 6.25, 7.0]
    assert make_config("buzz", window=100).resolved() == (4, 100, 433, 5)
    assert make_config("buzz").resolved() == (4, 160, 693, 5)
    assert make_config("buzz", window=50, tw_ratio=4.5).resolved() == (4, 50, 225, 5)
    assert middle_after_eviction(9, 6, 5) == 3 + 2


@pytest.mark.parametrize("budget", [50, 64, 100, 200, 512])
def test_budget_helper_hits_average_and_peak(budget):
    k, w, limit, s = buzz_params(budget, "average")
    average, low, peak = steady_sizes(k, w, limit, s)
    assert abs(average - budget) <= 2.5
    assert low < average < peak == k + w + limit
    k, w, limit, s = buzz_params(budget, "peak")
    assert k + w + limit <= budget < k + (w + 1) + round(theorem_ratio(s) * (w + 1))


@pytest.mark.parametrize("kind", ["average", "peak"])
def test_budget_helper_matches_a_simulated_stream(kind):
    config = make_config("buzz", budget=60, budget_kind=kind)
    k, w, limit, s = config.resolved()
    stream = Stream(config, seed=3)
    lengths = []
    for _ in range(3000):
        stream.push(torch.rand(1, 1, 1, generator=stream.generator))
        lengths.append(stream.layer.stored_length())
    steady = lengths[1000:]
    assert max(lengths) == k + w + limit == config.peak_tokens()
    if kind == "average":  # the paper's budget: the mean stored length; the peak is well above it
        assert abs(sum(steady) / len(steady) - 60) < 2 and max(steady) > 70
    else:  # the default: never more than the budget
        assert max(lengths) <= 60


def test_a_question_fed_after_the_context_is_kept_whole_and_the_peak_holds():
    config = make_config("buzz", budget=60)  # k=4 w=10 T=43
    k, w, limit, _ = config.resolved()
    stream = Stream(config, seed=1)
    for _ in range(200):
        stream.push(torch.rand(1, 1, 1, generator=stream.generator))
    question = 30  # longer than the window
    keys = torch.randn(1, 1, question, 4)
    stream.layer.update(keys, keys)
    stream.layer.register_new_tokens(None, None)
    received = torch.rand(1, 1, 1, stream.layer.view_width, generator=stream.generator)
    stream.layer.after_attention(AttentionStats(query_count=question, received=received))
    kept = stream.kept()
    assert kept[-question:] == list(range(200, 200 + question)) and len(kept) <= 60


def test_long_prompt_loops_until_middle_within_threshold_or_single_pass():
    """A 200-token prompt at k=2, w=4, T=10, s=3: 194 middle tokens -> 65 hives -> thinned by ŝ=2 thrice -> 9."""
    keys = torch.randn(1, 2, 200, 4, generator=torch.Generator().manual_seed(0))
    received = torch.rand(1, 2, 1, 200, generator=torch.Generator().manual_seed(1))
    for mode, middle in (("loop", 9), ("single", 65)):
        layer = CompressedLayer(
            make_config("buzz", sinks=2, window=4, threshold=10, stride=3, prefill_mode=mode).policy(0)
        )
        layer.update(keys, keys)
        layer.register_new_tokens(None, None)
        layer.after_attention(AttentionStats(query_count=200, received=received))
        assert layer.stored_length() == 2 + middle + 4
        hives = received[0, :, 0, 2:194].reshape(2, 64, 3).argmax(-1) + torch.arange(0, 192, 3) + 2
        last = received[0, :, 0, 194:196].argmax(-1) + 194
        first_pass = torch.cat([hives, last[:, None]], -1)  # 65 local maxima per head
        step = 8 if mode == "loop" else 1
        for head in range(2):
            expected = [0, 1] + first_pass[head, ::step].tolist() + [196, 197, 198, 199]
            assert kept_tokens(layer)[0][head] == expected


def test_ablation_without_local_max_interval_samples_new_tokens():
    stream = Stream(make_config("buzz", sinks=2, window=3, threshold=6, stride=3, local_max=False))
    for p in range(12):
        stream.push(spec_score(p))
    assert stream.kept() == [0, 1, 2, 5, 8, 9, 10, 11]


def test_ablation_swapped_strides_gives_new_tokens_the_small_stride():
    stream = Stream(make_config("buzz", sinks=2, window=3, threshold=6, stride=3, swap_strides=True))
    for p in range(12):
        stream.push(spec_score(p))
    assert stream.kept() == [0, 1, 3, 4, 6, 8, 9, 10, 11]  # hives of 2: [2,3]->3 [4,5]->4 [6,7]->6 [8]->8
    for p in range(12, 15):
        stream.push(spec_score(p))
    # M = 7 again at p = 14: old [3, 4, 6, 8] every 3rd -> [3, 8]; new [9, 10, 11] in hives of 2 -> 9, 11
    assert stream.kept() == [0, 1, 3, 8, 9, 11, 12, 13, 14]


def test_current_score_mode_uses_only_the_latest_forward():
    config = make_config("buzz", sinks=0, window=0, threshold=1, stride=3, score_mode="current")
    layer = CompressedLayer(config.policy(0))
    keys = torch.randn(1, 1, 3, 4)
    layer.update(keys, keys)
    layer.register_new_tokens(None, None)
    layer.state["score"] += torch.tensor([[[10.0, 0.0, 0.0]]])  # history the current mode must ignore
    received = torch.tensor([[[[0.1, 0.2, 0.7]]]])
    layer.after_attention(AttentionStats(query_count=1, received=received))
    assert kept_tokens(layer) == [[[2]]]


def test_log_n_at_512_keys_equals_plain_attention(tiny_llama):
    """A 512-token forward: every attention call attends n = 512 keys, so log_512(n) = 1 exactly."""
    ids = torch.randint(1, 128, (1, 512), generator=torch.Generator().manual_seed(3))
    plain = kvcompress.cache_for(tiny_llama, "buzz", window=600)
    scaled = kvcompress.cache_for(tiny_llama, "buzz", window=600, log_n=True)
    with torch.no_grad():
        a = tiny_llama(ids, **cache_argument(tiny_llama, plain)).logits
        b = tiny_llama(ids, **cache_argument(tiny_llama, scaled)).logits
    assert torch.equal(a, b)
    for x, y in zip(plain.compressed_layers, scaled.compressed_layers, strict=True):
        assert torch.equal(x.state["score"], y.state["score"])
    with torch.no_grad():  # the next step attends 513 keys: scaled by ln 513 / ln 512 > 1, so it differs
        nxt = torch.tensor([[7]])
        assert not torch.equal(
            tiny_llama(nxt, **cache_argument(tiny_llama, plain)).logits,
            tiny_llama(nxt, **cache_argument(tiny_llama, scaled)).logits,
        )


def test_log_n_scales_logits_by_log_base_512_of_keys_attended(tiny_llama):
    from kvcompress.core.attention import attention_with_stats

    config = make_config("buzz", window=600, log_n=True)
    layer = CompressedLayer(config.policy(0))
    keys, values = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    layer.update(keys, values)
    layer.register_new_tokens(None, None)
    query = torch.randn(1, 4, 1, 16)
    out, stats = layer.policy.attend(layer, query, keys, values, None, 0.25)
    factor = math.log(64) / math.log(512)
    ref, ref_stats = attention_with_stats(query * factor, keys, values, None, 0.25, layer.policy.stats)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(stats.received, ref_stats.received)
    logits = (query.view(1, 2, 2, 1, 16) @ keys[:, :, None].transpose(-1, -2)) * 0.25 * factor
    torch.testing.assert_close(stats.received, logits.softmax(-1).sum(3))


def test_log_n_per_row_counts_visible_keys_of_each_query():
    config = make_config("buzz", window=600, log_n=True, log_n_per_row=True)
    layer = CompressedLayer(config.policy(0))
    keys = torch.randn(1, 1, 8, 16)
    layer.update(keys, keys)
    layer.register_new_tokens(None, None)
    query = torch.randn(1, 1, 8, 16)
    _, stats = layer.policy.attend(layer, query, keys, keys, None, 0.25)
    logits = (query @ keys.transpose(-1, -2)) * 0.25
    n = torch.arange(1, 9).float()
    scaled = logits * (n.log() / math.log(512))[:, None]
    probs = scaled.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), -math.inf).softmax(-1)
    torch.testing.assert_close(stats.received[0, 0, 0], probs[0, 0].sum(0))


def test_generate_with_buzz_and_log_n_cache_position_mode(tiny_qwen2):
    ids = torch.randint(1, 100, (2, 30), generator=torch.Generator().manual_seed(4))
    for params in ({"log_n": True}, {"position_mode": "cache"}, {"group_reduce": "max", "score_mode": "current"}):
        cache = kvcompress.cache_for(tiny_qwen2, "buzz", sinks=2, window=4, stride=3, **params)
        out = tiny_qwen2.generate(
            ids, **cache_argument(tiny_qwen2, cache), max_new_tokens=20, do_sample=False, pad_token_id=0
        )
        assert out.shape == (2, 50)
        assert max(cache.tokens_stored()) <= 2 + 4 + 10
