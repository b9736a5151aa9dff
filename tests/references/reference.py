"""The reference engine: replays a recorded run sequence by sequence, with its own attention, for a reference rule.

Each sequence is replayed on its real tokens only (left padding never reaches a rule): a token is named by its
stream index, its RoPE position is its rank among the sequence's real tokens. Attention is recomputed here in
float64 from the recorded pre-RoPE queries and keys, with this module's RoPE and a causal mask over the tokens the
*reference* holds, so a wrong kept set in the library changes the statistics the library sees but not the
reference's. ``Rule`` subclasses (``tests/references/rules.py``) hold per-KV-head kept lists.
"""

from __future__ import annotations

import numpy as np

from tests.references.driver import Kept, Run


def rope(x: np.ndarray, positions: list[int], inv_freq: np.ndarray) -> np.ndarray:
    """Rotate ``x`` ``[..., n, d]`` to ``positions`` (rotate-half convention of Llama/Qwen2)."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Context:
    """What a rule may know about one (sequence, layer): its tokens' queries/keys, positions, and attention."""

    def __init__(self, layer: int, kv_heads: int, groups: int, scale: float, inv_freq: np.ndarray, peers) -> None:
        self.layer, self.kv_heads, self.groups, self.scale, self.inv_freq = layer, kv_heads, groups, scale, inv_freq
        self.queries: dict[int, np.ndarray] = {}  # stream index -> [H_q, d]
        self.keys: dict[int, np.ndarray] = {}  # stream index -> [H_kv, d]
        self.values: dict[int, np.ndarray] = {}  # stream index -> [H_kv, d]
        self.position: dict[int, int] = {}  # stream index -> RoPE position (rank among real tokens)
        self.peers = peers  # the rules of every layer of this sequence

    def attention(self, head: int, queries: list[int], keys: list[int], positions: dict[int, int] | None = None):
        """Softmax rows ``[G, len(queries), len(keys)]`` of the query heads of KV head ``head``; key ``t`` is
        visible to query ``s`` iff ``t <= s``. ``positions``: RoPE positions (default: the original ones)."""
        positions = self.position if positions is None else positions
        group = slice(head * self.groups, (head + 1) * self.groups)
        q = np.stack([self.queries[t][group] for t in queries], 1)  # [G, nq, d]
        k = np.stack([self.keys[t][head] for t in keys], 0)  # [nk, d]
        q = rope(q, [positions[t] for t in queries], self.inv_freq)
        k = rope(k, [positions[t] for t in keys], self.inv_freq)
        logits = q @ k.T * self.scale
        visible = np.asarray(keys)[None, :] <= np.asarray(queries)[:, None]
        logits = np.where(visible[None], logits, -np.inf)
        logits -= logits.max(-1, keepdims=True)
        probs = np.exp(logits)
        return probs / probs.sum(-1, keepdims=True)


class Rule:
    """A method's rule on one (sequence, layer). ``forward(new)`` gets the real tokens of one forward (stream
    order); ``end_prompt()`` runs once after the prefill. ``kept[h]``: ascending stream indices of KV head h."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.kept: list[list[int]] = [[] for _ in range(ctx.kv_heads)]
        self.prompt = True

    def forward(self, new: list[int]) -> None:
        self.kept = [kept + new for kept in self.kept]

    def end_prompt(self) -> None:
        self.prompt = False


def top_keep(tokens: list[int], score, count: int, protected=()) -> list[int]:
    """The ``count`` tokens to keep: ``protected`` ones first, then the highest ``score[t]``; equal scores (and
    protected tokens among themselves) go to the newer token. Returns them ascending."""
    protected = set(protected)

    def rank(t: int):
        return (0, 0.0, -t) if t in protected else (1, -float(score[t]), -t)

    return sorted(sorted(tokens, key=rank)[: min(count, len(tokens))])


def simulate(run: Run, model, make_rule) -> tuple[list[list[Kept]], list[Kept]]:
    """Replay ``run`` with ``make_rule(ctx)`` per (sequence, layer); returns the expected kept sets after each
    forward (``[forward][layer]``) and after the prefill (``[layer]``), shaped like the recorded ones."""
    config = model.config
    layers = config.num_hidden_layers
    kv_heads, groups = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
    batch = run.mask.shape[0]
    rules = []  # [sequence][layer]
    for _ in range(batch):
        peers: list[Rule] = []
        for layer in range(layers):
            peers.append(make_rule(Context(layer, kv_heads, groups, head_dim**-0.5, inv_freq, peers)))
        rules.append(peers)
    real_seen = [0] * batch
    per_forward, after_prefill = [], None
    for forward in run.forwards:
        if forward.phase == "decode" and after_prefill is None:
            for peers in rules:
                for rule in peers:
                    rule.end_prompt()
            after_prefill = [[[sorted(h) for h in peers[layer].kept] for peers in rules] for layer in range(layers)]
        news = []
        for b in range(batch):
            new = [forward.start + i for i in range(forward.count) if forward.real[b, i]]
            for t in new:
                for rule in rules[b]:
                    rule.ctx.position[t] = real_seen[b]
                real_seen[b] += 1
            news.append(new)
        expected = []
        for layer in range(layers):
            for b in range(batch):
                ctx = rules[b][layer].ctx
                for i in range(forward.count):
                    if forward.real[b, i]:
                        ctx.queries[forward.start + i] = forward.queries[layer][b, i]
                        ctx.keys[forward.start + i] = forward.keys[layer][b, i]
                        ctx.values[forward.start + i] = forward.values[layer][b, i]
                rules[b][layer].forward(news[b])
            expected.append([[sorted(h) for h in rules[b][layer].kept] for b in range(batch)])
        per_forward.append(expected)
    return per_forward, after_prefill


def assert_same_kept(run: Run, model, make_rule) -> None:
    """The library's kept sets equal the reference's after every forward (every layer) and after the prefill."""
    expected, expected_prefill = simulate(run, model, make_rule)
    for index, (forward, want) in enumerate(zip(run.forwards, expected, strict=True)):
        for layer, (got_layer, want_layer) in enumerate(zip(forward.kept, want, strict=True)):
            assert got_layer == want_layer, (
                f"forward {index} ({forward.phase}, tokens {forward.start}..{forward.start + forward.count - 1}), "
                f"layer {layer}: library kept {got_layer}, reference {want_layer}"
            )
    assert run.after_prefill == expected_prefill, "after prefill: library != reference"
