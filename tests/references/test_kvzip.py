"""KVzip against an independent reference: the model's own eager attention over context + reconstruction prompt.

The reference writes the reconstruction prompts from the documented text (package docstring of
``kvcompress.methods.kvzip``), runs a fresh copy of the tiny model (its own eager attention, no kvcompress) over
the context followed by each chunk's prompt, reads the attention probabilities the prompt's queries pay, restricts
them to the documented key subset (sinks, the chunk, the prompt) and renormalises (a softmax restricted to a
subset is the full softmax renormalised on it), takes the maximum over each KV head's query group and queries, and
evicts by the documented ranking. The library is read only through ``cache_for``, ``prefill`` and
``layer.token_idx``/``valid``.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcompress
from kvcompress.core.fused_attention import chunked_attention_with_lse
from kvcompress.generation import cache_argument, prefill
from kvcompress.models.testing import tiny_model, tiny_tokenizer
from tests.references.driver import kept_sets, token_ids

N_SINK = 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def reference_prompts(tokenizer, context: list[int], chunk: int, prefix: int = 0) -> list[tuple[int, int, list[int]]]:
    first = tokenizer.encode("\n\nRepeat the previous context exactly.", add_special_tokens=False)
    later = tokenizer.encode(
        "\n\nRepeat the part of the previous context exactly, starting with", add_special_tokens=False
    )
    newline = tokenizer.encode("\n", add_special_tokens=False)  # no chat template: a newline
    out = []
    spans = [(start, min(len(context), start + chunk)) for start in range(prefix, len(context), chunk)]
    for index, (start, end) in enumerate(spans):
        previous = context[spans[index - 1][0] : spans[index - 1][1]] if index else []
        lead = later + previous[-8:] if index else first
        out.append((start, end, lead + newline + context[start:end]))
    return out


@torch.no_grad()
def reference_scores(context: list[int], chunk: int, prefix: int = 0, n_sink: int = N_SINK) -> list[list[list[float]]]:
    """``[layer][KV head][token]`` reconstruction scores of one sequence (``n_sink``: kvzip's)."""
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    config = model.config
    heads, groups = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    length = len(context)
    scores = [[[0.0] * length for _ in range(heads)] for _ in range(config.num_hidden_layers)]
    for start, end, prompt in reference_prompts(tiny_tokenizer(), context, chunk, prefix):
        ids = torch.tensor([context + prompt])
        attentions = model(ids, output_attentions=True).attentions
        sinks = min(n_sink, start)
        columns = list(range(sinks)) + list(range(start, end)) + list(range(length, length + len(prompt)))
        for index, probs in enumerate(attentions):
            rows = probs[0, :, length:, :].double()  # [H_q, prompt, T]
            subset = rows[:, :, columns]
            subset = subset / subset.sum(-1, keepdim=True)
            own = subset[:, :, sinks : sinks + end - start]  # [H_q, prompt, chunk]
            for h in range(heads):
                best = own[h * groups : (h + 1) * groups].amax(dim=(0, 1))
                scores[index][h][start:end] = best.tolist()
    for layer in scores:  # sinks: never evicted
        for head in layer:
            head[:n_sink] = [math.inf] * n_sink
    return scores


def reference_kept(scores, allocation: str, ratio: float) -> list[list[list[int]]]:
    layers, heads, length = len(scores), len(scores[0]), len(scores[0][0])
    if allocation == "uniform":
        keep = max(1, math.floor(ratio * length))
        return [[sorted(sorted(range(length), key=lambda t: (-s[t], -t))[:keep]) for s in layer] for layer in scores]
    groups = [[(i, t, h) for t in range(length) for h in range(heads)] for i in range(layers)]
    if allocation == "global":
        groups = [[item for group in groups for item in group]]
    kept = [[[] for _ in range(heads)] for _ in range(layers)]
    for group in groups:
        removed = int(len(group) * (1 - ratio))  # kvpress: int(count * compression_ratio)
        ranked = sorted(group, key=lambda item: (scores[item[0]][item[2]][item[1]], item))
        for i, t, h in ranked[removed:]:
            kept[i][h].append(t)
    return [[sorted(h) for h in layer] for layer in kept]


CASES = {
    "global": ({"ratio": 0.5}, 64),
    "global-chunked": ({"ratio": 0.4, "chunk_size": 9}, 9),
    "layer": ({"ratio": 0.5, "allocation": "layer"}, 64),
    "layer-chunked": ({"ratio": 0.3, "allocation": "layer", "chunk_size": 11}, 11),
    "uniform": ({"ratio": 0.5, "allocation": "uniform", "chunk_size": 16}, 16),
    "global-small-chunks-prefix": ({"ratio": 0.5, "chunk_size": 5, "prefix": 6}, 5),
}


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kvzip_keeps_the_reference_pairs(case, batch, tiny_llama, tokenizer_dir):
    params, chunk = CASES[case]
    ids = token_ids(batch, 30, seed=7)
    cache = kvcompress.cache_for(tiny_llama, "kvzip", tokenizer=tokenizer_dir, **params)
    prefill(tiny_llama, ids, cache, chunk_size=12)
    got = [kept_sets(layer) for layer in cache.compressed_layers]  # [layer][sequence][head]
    assert cache.get_seq_length() == 30  # the reconstruction tokens are gone
    for b in range(batch):
        scores = reference_scores(ids[b].tolist(), chunk, params.get("prefix", 0))
        want = reference_kept(scores, params.get("allocation", "global"), params["ratio"])
        assert [layer[b] for layer in got] == want, f"sequence {b}"


@pytest.mark.parametrize("case", ["global", "global-small-chunks-prefix"])
def test_kvzip_scores_in_query_blocks_as_in_one(case, tiny_llama, tokenizer_dir, monkeypatch):
    """The reconstruction's queries scored and attended a small block at a time (16 queries: several blocks per
    chunk) keep the reference's pairs too."""
    monkeypatch.setattr("kvcompress.methods.kvzip.reconstruct.BLOCK_BYTES", 1)
    params, chunk = CASES[case]
    ids = token_ids(1, 30, seed=9)
    cache = kvcompress.cache_for(tiny_llama, "kvzip", tokenizer=tokenizer_dir, **params)
    prefill(tiny_llama, ids, cache)
    got = [kept_sets(layer)[0] for layer in cache.compressed_layers]
    want = reference_kept(reference_scores(ids[0].tolist(), chunk, params.get("prefix", 0)), "global", params["ratio"])
    assert got == want


@pytest.mark.parametrize("fallback", [False, True], ids=["cpu-kernel", "chunked-fallback"])
@pytest.mark.parametrize("case", ["global", "layer"])
def test_kvzip_scores_beside_the_fused_attention_keep_the_reference_pairs(
    case, fallback, tiny_llama, tokenizer_dir, monkeypatch
):
    """A chunk covering the whole context scored beside the fused attention (as on a GPU) instead of from the
    attention's explicit logits (as on a CPU) keeps the reference's pairs too (several chunks take that way on every
    device: the chunked cases above), also with the attention of devices without a fused kernel (MPS, XPU)."""
    monkeypatch.setattr("kvcompress.methods.kvzip.reconstruct.EXPLICIT_LOGITS_DEVICES", ())
    if fallback:
        monkeypatch.setattr("kvcompress.methods.kvzip.reconstruct.attention_with_lse", chunked_attention_with_lse)
    params, chunk = CASES[case]
    ids = token_ids(2, 30, seed=11)
    cache = kvcompress.cache_for(tiny_llama, "kvzip", tokenizer=tokenizer_dir, **params)
    prefill(tiny_llama, ids, cache)
    got = [kept_sets(layer) for layer in cache.compressed_layers]
    for b in range(2):
        want = reference_kept(reference_scores(ids[b].tolist(), chunk), params.get("allocation", "global"), 0.5)
        assert [layer[b] for layer in got] == want, f"sequence {b}"


@pytest.mark.parametrize("params", [{"ratio": 0.5}, {"ratio": 0.5, "allocation": "uniform", "chunk_size": 16}])
def test_kvzip_reconstruction_stores_nothing(params, tiny_llama, tokenizer_dir):
    """While the reconstruction runs, every layer holds the context alone: its buffers do not grow and its token
    count does not move (the chunk's keys live only in the layer's attention)."""
    ids = token_ids(1, 30, seed=10)
    cache = kvcompress.cache_for(tiny_llama, "kvzip", tokenizer=tokenizer_dir, **params)
    seen = []
    for layer in cache.compressed_layers:
        layer.observers.append(
            lambda layer: (
                layer.policy.scoring is not None
                and seen.append((layer.get_seq_length(), layer.occupied, layer.slots.capacity))
            )
        )
    prefill(tiny_llama, ids, cache)
    chunks = -(-30 // params.get("chunk_size", 2048))
    assert len(seen) == chunks * len(cache.compressed_layers)
    assert all(length == occupied == 30 and capacity <= 31 for length, occupied, capacity in seen)


def test_kvzip_reconstruction_stops_after_the_last_layers_scores(tiny_llama, tokenizer_dir):
    """A reconstruction forward's output is never read: it stops once its last layer is scored (that layer's MLP,
    the final norm and the LM head do not run for it), and the cache's forward is closed after it."""
    ids = token_ids(1, 30, seed=11)
    cache = kvcompress.cache_for(tiny_llama, "kvzip", tokenizer=tokenizer_dir, ratio=0.5, chunk_size=12)
    calls = {"first mlp": 0, "last mlp": 0, "head": 0}

    def counter(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    modules = {"first mlp": tiny_llama.model.layers[0].mlp, "last mlp": tiny_llama.model.layers[-1].mlp}
    modules["head"] = tiny_llama.lm_head
    hooks = [module.register_forward_hook(counter(name)) for name, module in modules.items()]
    try:
        prefill(tiny_llama, ids, cache)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"first mlp": 1 + 3, "last mlp": 1, "head": 1}  # the prefill, then 3 reconstruction chunks
    assert not any(layer.forward_pass.is_open for layer in cache.compressed_layers)


def test_kvzip_then_generate_appends_to_the_compressed_context(tiny_llama, tokenizer_dir):
    ids = token_ids(1, 34, seed=8)
    cache = kvcompress.cache_for(tiny_llama, "kvzip", tokenizer=tokenizer_dir, ratio=0.5)
    prefill(tiny_llama, ids[:, :30], cache)
    stored = [sum(map(len, kept_sets(layer)[0])) for layer in cache.compressed_layers]
    out = tiny_llama.generate(ids, **cache_argument(tiny_llama, cache), max_new_tokens=3, do_sample=False)
    assert out.shape[1] == 37 and cache.get_seq_length() == 36
    after = [sum(map(len, kept_sets(layer)[0])) for layer in cache.compressed_layers]
    assert [a - s for a, s in zip(after, stored, strict=True)] == [2 * 6, 2 * 6]  # 4 question + 2 decoded, 2 heads


def test_kvzip_refuses_a_cache_fed_by_generate_alone(tiny_llama, tokenizer_dir):
    cache = kvcompress.cache_for(tiny_llama, "kvzip", tokenizer=tokenizer_dir, ratio=0.5)
    with pytest.raises(ValueError, match="prefill"):
        tiny_llama.generate(token_ids(1, 20, 0), **cache_argument(tiny_llama, cache), max_new_tokens=2)


def test_kvzip_without_a_tokenizer_says_what_to_pass(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "kvzip", ratio=0.5)
    with pytest.raises(ValueError, match="tokenizer="):
        prefill(tiny_llama, token_ids(1, 20, 0), cache)


def test_kvzip_head_scores_are_the_reference_scores_max_over_tokens_then_contexts(tiny_llama, tmp_path):
    """``kvcompress train kvzip-calibrate`` on two contexts of the tiny model: each head's score is the largest
    reference score over a context's tokens (after the system prompt, which is ``prefix`` and ``n_sink``), then the
    largest over the contexts (the official ``save_head_score`` and ``load_head_score``); ``kvzip`` level="head"
    reads the file."""
    from kvcompress.methods.duo.patterns import load_pattern
    from kvcompress.methods.kvzip.head import KIND
    from kvcompress.train import kvzip_calibrate
    from kvcompress.train.duo_calibrate import calibration_windows

    model_dir = tmp_path / "tiny"
    tiny_llama.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    books = tmp_path / "books"
    books.mkdir()
    text = "It was a dark and stormy night; the rain fell in torrents, except at occasional intervals. " * 20
    (books / "text.txt").write_text(text)
    out = tmp_path / "kvzip.json"
    args = ["--model", str(model_dir), "--data", str(books), "--samples", "2", "--length", "24", "--out", str(out)]
    kvzip_calibrate.main(args)
    pattern = load_pattern(str(out), KIND)
    tokenizer = tiny_tokenizer()  # no chat template: its BOS token, then the instruction
    instruction = "Given the context, answer to the following question or request without explanation.\n\n"
    header = tokenizer.encode((tokenizer.bos_token or "") + instruction, add_special_tokens=False)
    want = None
    for window in calibration_windows(tokenizer, [text], 2, 24):
        scores = reference_scores(header + window.tolist(), 2048, prefix=len(header), n_sink=len(header))
        found = [[max(head[len(header) :]) for head in layer] for layer in scores]
        want = (
            found
            if want is None
            else [[max(a, b) for a, b in zip(x, y, strict=True)] for x, y in zip(want, found, strict=True)]
        )
    assert pattern.meta["system_prompt_tokens"] == len(header)
    torch.testing.assert_close(
        torch.tensor(pattern.scores), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    assert (pattern.sink_size, pattern.recent_size) == (128, 256)
    cache = kvcompress.cache_for(
        tiny_llama, "kvzip", level="head", ratio=0.5, pattern=str(out), sink_size=2, recent_size=4
    )
    prefill(tiny_llama, token_ids(1, 30, seed=3), cache)
    assert sum(int(layer.valid.sum()) for layer in cache.compressed_layers) < 4 * 30


# (context length, start, end, sinks) of a chunk: the whole context, or a later chunk's subsample
SCORINGS = {"whole": (40, 0, 40, 0), "subsample": (40, 16, 32, 4)}


@pytest.mark.parametrize(
    ("scoring", "explicit"),
    [("whole", True), ("whole", False), ("subsample", False)],
    ids=["whole-explicit-logits", "whole-beside-fused-attention", "subsample"],
)
def test_kvzip_scores_of_widely_spread_logits_equal_the_float64_softmax(scoring, explicit, monkeypatch):
    """Logits spread far beyond ``LOGIT_FLOOR`` within a row (a real model's reach 150-300): the scores equal a
    float64 softmax over the scored subsample (the first ``sinks`` context tokens, the chunk's, the reconstruction's
    own causal keys; the whole context: the attention's own) wherever a probability is above ``exp(-LOGIT_FLOOR)`` of
    its row's largest (below, a score stays below that bound), and the output the float64 attention over the whole
    context and the own keys; both ways of scoring (a several-chunk subsample takes the fused one on every device)."""
    from types import SimpleNamespace

    from kvcompress.methods.kvzip.reconstruct import LOGIT_FLOOR, score_chunk

    if not explicit:
        monkeypatch.setattr("kvcompress.methods.kvzip.reconstruct.EXPLICIT_LOGITS_DEVICES", ())
    length, start, end, sinks = SCORINGS[scoring]
    generator = torch.Generator().manual_seed(3)
    batch, kv_heads, groups, n, q, dim = 1, 2, 3, length, 7, 8
    query = torch.randn(batch, kv_heads * groups, q, dim, generator=generator) * 12
    key, value = (torch.randn(batch, kv_heads, n, dim, generator=generator) * 12 for _ in range(2))
    own_key, own_value = (torch.randn(batch, kv_heads, q, dim, generator=generator) for _ in range(2))
    policy = SimpleNamespace(scoring=SCORINGS[scoring], scores=torch.zeros(batch, kv_heads, n))
    output = score_chunk(policy, query, key, value, own_key, own_value, scaling=None)

    grouped = query.double().view(batch, kv_heads, groups * q, dim) * dim**-0.5
    context = grouped @ key.double().transpose(-1, -2)  # [B, H_kv, G*q, n]
    own = (grouped @ own_key.double().transpose(-1, -2)).view(batch, kv_heads, groups, q, q)
    own = own.masked_fill(torch.ones(q, q, dtype=torch.bool).triu(1), -math.inf).view(batch, kv_heads, groups * q, q)
    probs = torch.cat([context, own], -1).softmax(-1)
    subsample = torch.cat([context[..., :sinks], context[..., start:end], own], -1).softmax(-1)
    assert float((context.amax(-1) - context.amin(-1)).max()) > 3 * LOGIT_FLOOR  # the floor acts
    want = subsample[..., sinks : sinks + end - start].reshape(batch, kv_heads, groups, q, -1).amax(dim=(2, 3))
    want_output = probs @ torch.cat([value.double(), own_value.double()], 2)
    bound = math.exp(-LOGIT_FLOOR) * subsample.amax(-1).max()
    got = policy.scores[..., start:end].double()
    above = want > bound
    # float32 logits of magnitude |l| carry about |l| * eps of rounding, so exp of them that much relative error
    rtol = 8 * torch.finfo(torch.float32).eps * float(context.abs().max())
    torch.testing.assert_close(got[above], want[above], rtol=rtol, atol=0)
    assert bool((got[~above] <= bound * 1.01).all()) and int((~above).sum()) > 0
    assert not policy.scores[..., :start].any() and not policy.scores[..., end:].any()  # other chunks' columns
    got_output = output.view(batch, kv_heads, groups * q, dim).double()
    torch.testing.assert_close(got_output, want_output, rtol=rtol, atol=rtol)
