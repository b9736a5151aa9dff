"""BUZZ: beehive-structured sparse KV cache with segmented heavy hitters (Zhao et al., 2024, arXiv:2410.23079).

Every layer and KV head keeps ``[k sinks | old samples | new buffer | w window]``. Tokens leaving the window gather
in the buffer until the middle (old + new) holds more than ``T``. Then the new tokens are cut into chunks ("hives")
of ``s`` and each chunk's token of highest accumulated attention survives (local max, Algorithm 2), while the old
tokens are interval-sampled with stride ``ŝ = ⌊(s+1)/2⌋`` (every ŝ-th from the first); the survivors become the old
set. Theorem 3.1's ``T/w = (s²+1)/(s+1)`` (odd s) or ``s − 1`` (even s) makes the steady-state old count ``w``.
"BUZZ with log n" (Eq. 7–8) multiplies the logits by ``ln(n)/ln(512)``, ``n`` = keys attended.

As in the paper and the official code (whose eviction step corrects the printed Algorithm 1); parameters in
``params``. Choices where the paper is silent or ambiguous:

- Threshold: ``T`` bounds old + new (the middle, Fig. 3, Remark 2, Eq. 10 and the official code; the printed line 9
  counts new tokens only); eviction when ``M = L − k − w > T``. Counts use valid (real) tokens only, per sequence, so
  left padding never counts and a padded batch behaves like single runs.
- Long prompts: a forward that leaves ``M > T`` after one pass keeps sampling (Remark 2, ``prefill_mode="loop"``):
  every extra pass only thins the old block by ``ŝ`` again, so ``j`` extra passes are computed at once as keeping
  every ``ŝ^j``-th survivor. ``prefill_mode="single"`` does one pass per forward, as the official code does.
- Scores: received attention accumulated H2O-style in float32 over every query since the token arrived
  (``score_mode="current"``: this forward's only, the code's ``buzz_fast``), per KV head, summed over its group's
  query heads (``group_reduce``). Old tokens' scores are never read again: not zeroed as the code does.
- Sampling keeps old indices 0, ŝ, 2ŝ, …; hives are aligned at the oldest new token, the last may be short, ties go
  to the earliest token.
- Order: eviction runs after the layer's attention (the current query sees the whole cache), so the attended length
  peaks at ``k + w + T + 1``.
- Positions: keys keep their original RoPE positions by default (``position_mode="cache"`` re-indexes them inside
  the cache, as the official code does for every method).
- log n: ``n`` = the sequence's valid keys in this call (per call as in the code; per sequence, so padding changes
  nothing), base 512, no clipping; ``log_n_per_row``: the keys each row may see. The eviction reads the rescaled
  probabilities.
- Budget: ``budget`` picks ``(w, T)`` so that a layer never stores more than ``budget`` tokens per head after a
  forward (``budget_kind="peak"``, the default: ``k + w + T <= budget``, like every other method's budget here).
  The paper's budget is the *average* stored length over decoding; ``budget_kind="average"`` targets that, and then
  the peak (``peak_tokens()``) is about 1.4 x the budget. ``s < 3`` is rejected (the cache would grow without bound).
- Multi-token forwards (a question fed after a compressed context): a forward of at most ``w + T`` tokens is never
  evicted by its own step; when it is longer than ``w`` the window stretches over it and the middle gets the rest
  of the peak (threshold ``T - (q - w)``), so the peak holds. A longer forward is a prompt chunk, sampled as above.
  The paper decodes one token at a time, where this never applies.
- Ablations (the paper's §4.3): ``local_max=False`` interval-samples new tokens with stride ``s`` (Fig. 8b, code's
  ``buzz_no_max``); ``swap_strides=True`` gives new tokens ŝ and old tokens s (Fig. 8a).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.checks import MAX_TOKENS, check_budget, ints, number, one_of, param
from kvcompress.core.contract import MethodConfig
from kvcompress.core.rope import POSITION_MODES
from kvcompress.methods.buzz.params import buzz_params, threshold_for
from kvcompress.methods.buzz.policy import BuzzPolicy

DEFAULT_WINDOW = 160  # the official code's recent_size, used when neither budget nor window is given


@dataclass(frozen=True)
class BuzzConfig(MethodConfig):
    """Sinks + beehive (local-max sampled new tokens, interval-sampled old tokens) + window, per KV head."""

    budget: int | None = param(None, check_budget)  # stored length per layer and head; sets w and T (buzz_params)
    budget_kind: str = one_of("average", "peak", default="peak")  # k + w + T after any forward, or the paper's average
    sinks: int = param(4, ints(0))  # k: first tokens, never evicted (paper: "1 to 5"; code: 4)
    window: int | None = param(None, ints(0))  # w: newest tokens, never evicted; None: from budget, else 160 (code)
    threshold: int | None = param(None, ints(1))  # T: evict when old + new > T; None: Theorem 3.1, T = round(r(s) · w)
    tw_ratio: float | None = param(None, number(0, MAX_TOKENS, "(]", " (T / w)"))  # T / w (Table A); None: Thm 3.1
    stride: int = param(5, ints(3))  # s: hive size for new tokens; old tokens use ŝ = (s + 1) // 2 (paper and code: 5)
    score_mode: str = one_of("accumulated", "current")  # H2O-style (the paper's BUZZ) or this forward only
    group_reduce: str = one_of("sum", "mean", "max")  # query heads of a KV head combine received attention
    local_max: bool = True  # False: interval sampling for new tokens too (Fig. 8b ablation)
    swap_strides: bool = False  # True: new tokens sampled with ŝ, old with s (Fig. 8a ablation)
    prefill_mode: str = one_of("loop", "single")  # sample until old + new <= T (Remark 2) or once per forward
    log_n: bool = False  # "BUZZ with log n": scale logits by ln(n) / ln(log_n_base), n = keys attended (Eq. 7-8)
    log_n_base: int = param(512, ints(2))  # n at which log-n scaling is the identity (the paper's pre-training length)
    log_n_per_row: bool = False  # n = keys each query row may see, instead of the keys of the call (code)
    position_mode: str = one_of(*POSITION_MODES)  # keys keep their RoPE positions or are re-indexed in the cache

    name = "buzz"
    paper = "https://arxiv.org/abs/2410.23079"
    policy_class = BuzzPolicy

    def resolved(self) -> tuple[int, int, int, int]:
        """The (k, w, T, s) this config runs with."""
        if self.budget is not None:
            return buzz_params(self.budget, self.budget_kind, self.sinks, self.stride, self.tw_ratio)
        window = DEFAULT_WINDOW if self.window is None else self.window
        threshold = threshold_for(window, self.stride, self.tw_ratio) if self.threshold is None else self.threshold
        return self.sinks, window, threshold, self.stride

    def peak_tokens(self) -> int:
        """The most tokens a layer stores per head after a forward (``k + w + T``; with ``prefill_mode="loop"``,
        and with ``"single"`` whenever one pass suffices); the step that triggers an eviction attends one more."""
        return sum(self.resolved()[:3])

    def validate(self) -> None:
        if self.budget is not None and (self.window is not None or self.threshold is not None):
            raise ValueError("give either budget or window/threshold, not both (budget sets window and threshold)")
        if self.threshold is not None and self.tw_ratio is not None:
            raise ValueError("give threshold or tw_ratio, not both (tw_ratio sets threshold = tw_ratio * window)")
        self.resolved()  # raises for a budget too small for the sinks and stride
