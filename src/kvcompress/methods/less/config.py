"""LESS, Low-rank Embedding Sidekick with Sparse policy (Dong et al., ICML 2024, arXiv:2402.09398).

Any eviction policy (H2O, Λ-masking = StreamingLLM sinks + recent with original positions, TOVA, ...) decides which
tokens stay; LESS adds, per layer and KV head, a constant-size state ``H ∈ R^{R×D}``, ``z ∈ R^R`` that absorbs every
evicted key/value through a learned feature map ψ before it is freed (``H += ψ(k)ᵀ v``, ``z += ψ(k)``, Eqs. 4–6);
each query reads it through a second map φ: attention mixes the exact softmax mass of the cached tokens with
``φ(q) H / φ(q) zᵀ`` (Eq. 3). φ and ψ are tiny per-head MLPs trained per layer to make the attention block's output
match the full cache (``kvcompress.train.less``). ``R = 8`` makes ``H`` as large as ``R/2 = 4`` cached tokens per KV
head; ``baseline_plus`` gives the base policy those 4 tokens instead (the paper's Baseline+).

As in the paper and the authors' code: the kernels' form (``kernels``), Eq. 3 in log-sum-exp form, the state update
at eviction (Eqs. 4–6, Algorithm 1), H2O scores from the softmax over cached tokens only (the LESS mass never enters
the base policy's statistics), Baseline+. Choices where the paper is silent or leaves a choice:

- GQA: ψ, ``H`` and ``z`` per KV head (``H`` still costs ``R/2`` tokens per KV head), φ per query head; the base
  policy's own GQA rule decides (our H2O sums the mass over a group's query heads).
- Prompt: attends in full (the state is empty); what the base policy evicts after it, between the chunks of a
  chunked prefill and at every later step is folded into ``H, z`` before it is freed, every layer's at the end of
  the forward (``layer``: a state is read only by its layer's next attention, so this is Algorithm 1's order).
- Positions: keys keep the RoPE position they were written with; a base re-indexing positions in the cache
  (``position_mode="cache"``) is refused, a base given by name is built with ``position_mode="original"`` (for
  ``base="streaming"`` the paper's Λ-masking).
- ``H, z`` in float32, counted in the cache's bytes (``H`` with the keys/values, ``z`` with the metadata); with a
  float32 model ``H`` is exactly ``R/2`` tokens per KV head.
- ``den = φ(q) zᵀ = 0`` means no low-rank term, not the official code's 1e-6 floor (``policy``); a decoding step
  takes Eq. 3 as one softmax (``low_rank_slots``). Kernels with ψ ≡ 0 (``init="zero"``) never fold: LESS is then
  exactly its base policy, as it is before the first eviction.
- Quantized storage (``kv_bits`` below 16): the kept tokens in KIVI codes, ``H, z`` in float32; the base policy
  scores, and LESS folds, what attention reads (``LessQuantizedLayer``).
- Untrained kernels (``kernels=None``): the paper's initialisation (scalars 1e-4: LESS ≈ its base policy); trained
  kernels are a directory written by ``python -m kvcompress.train.less``, matching the model's shape and the base
  method (not the budget: training and test sparsity are independent, Table 2). Untrained ones warn once.
- Budgets are tokens per layer and KV head, as for every method here (the paper's "5 %" is of the model's maximum
  context; our CPU experiments use a share of the evaluation window).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass

from kvcompress.core.checks import MAX_SEED, check_choice, ints, one_of, param
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.methods.less.kernels import (
    LayerKernels,
    LessKernels,
    init_kernels,
    load_kernels_once,
    resolve_kernels,
    shipped_kernels,
    zero_kernels,
)
from kvcompress.methods.less.layer import LessLayer, LessQuantizedLayer
from kvcompress.methods.less.policy import LessPolicy
from kvcompress.registry import METHODS, make_config

logger = logging.getLogger(__name__)

MAX_RANK = 1024  # R: the state H costs R/2 tokens per KV head
MAX_HIDDEN = 16384  # R': the kernel MLPs hold q_heads * R' * (D + R) weights per layer


@dataclass(frozen=True)
class LessConfig(MethodConfig):
    """An evicting method plus a learned low-rank state of everything it evicts."""

    base: str | MethodConfig = "h2o"  # the evicting method (registry name or config); "streaming" = Λ-masking
    budget: int | None = None  # tokens kept per layer and KV head by the base method given by name (None: its default)
    kernels: str | os.PathLike[str] | LessKernels | None = None  # trained kernels (directory) or None: untrained
    init: str = one_of("paper", "zero")  # untrained: Xavier, scalars 1e-4 (≈ base) or ψ ≡ 0 (= base)
    rank: int = param(8, ints(1, MAX_RANK))  # R: features of φ, ψ = rows of H (untrained kernels; trained carry theirs)
    hidden: int = param(128, ints(1, MAX_HIDDEN))  # R': kernel MLPs' width (paper 512 for D = 128; 128 ample at D = 64)
    seed: int = param(0, ints(0, MAX_SEED))  # seed of the untrained kernels' initialisation

    name = "less"
    paper = "https://arxiv.org/abs/2402.09398"
    policy_class = LessPolicy

    def layer_class(self) -> type[LessLayer]:
        return LessLayer if self.kv_bits == 16 else LessQuantizedLayer

    def validate(self) -> None:
        if isinstance(self.base, LessConfig) or self.base == "less":
            raise ValueError("base must be an evicting method, not less itself")
        if isinstance(self.base, str):
            check_choice(self.base, "base", tuple(sorted(set(METHODS) - {"less"})))
        elif not isinstance(self.base, MethodConfig):
            raise ValueError(f"base must be a method name or a method config, got {self.base!r}")
        elif self.budget is not None:
            raise ValueError("budget is taken from the base config when base is a config; leave budget=None")
        if isinstance(self.kernels, (str, os.PathLike)):
            try:
                resolve_kernels(self.kernels)
            except FileNotFoundError as error:
                raise ValueError(f"kernels: {error}") from None
        base = self.base_config
        if base.name == "full":
            raise ValueError(
                "base full keeps every token, so LESS's low-rank state would never receive one (less over full is "
                "full); give an evicting base such as h2o, window or streaming"
            )
        policy = base.policy(0)
        if policy.position_mode != "original":
            raise ValueError(
                f"base {base.name!r} uses position_mode={policy.position_mode!r}; LESS needs keys at their original "
                "RoPE positions: build the base with position_mode='original'"
            )
        if type(policy).attend is not Policy.attend:
            raise ValueError(f"base {base.name!r} computes attention itself; LESS cannot add its term to it")

    @property
    def base_config(self) -> MethodConfig:
        """The evicting method's config (built from ``base``/``budget`` when ``base`` is a name)."""
        if isinstance(self.base, MethodConfig):
            return self.base
        params: dict[str, object] = {} if self.budget is None else {"budget": self.budget}
        if "position_mode" in {f.name for f in dataclasses.fields(METHODS[self.base])}:
            params["position_mode"] = "original"
        return make_config(self.base, **params)

    @property
    def kernel_set(self) -> LessKernels | None:
        """The trained kernels (a directory's files are read once per process), or ``None`` for untrained ones;
        refused if trained with another base method."""
        if self.kernels is None:
            return None
        loaded = self.kernels if isinstance(self.kernels, LessKernels) else load_kernels_once(self.kernels)
        trained, name = loaded.meta.get("base"), self.base_config.name
        if trained is not None and trained.get("name") != name:
            raise ValueError(
                f"LESS kernels were trained with base policy {trained.get('name')!r} but are used with {name!r}; the "
                f"low-rank state must learn what that policy evicts (train kernels for {name!r} with "
                f"`python -m kvcompress.train.less --base {name}`)"
            )
        return loaded

    def kernels_for(self, layer_idx: int, q_heads: int, kv_heads: int, head_dim: int) -> LayerKernels:
        """Layer ``layer_idx``'s kernels (eval mode), checked against the model's head shape: the trained ones, or
        new untrained ones (deterministic in ``seed`` and the layer; the caller keeps them)."""
        kernels = self.kernel_set
        if kernels is not None:
            if layer_idx >= len(kernels.layers):
                raise ValueError(
                    f"LESS kernels have {len(kernels.layers)} layers but the model has more (layer {layer_idx}): "
                    "they belong to another model"
                )
            layer = kernels.layers[layer_idx]
            if (q_heads, kv_heads, head_dim) != (layer.q_heads, layer.kv_heads, layer.head_dim):
                raise ValueError(
                    f"LESS kernels of layer {layer_idx} were made for {layer.q_heads} query heads, {layer.kv_heads} "
                    f"KV heads and head_dim {layer.head_dim}, but the model has {q_heads}, {kv_heads} and {head_dim}: "
                    "they belong to another model (train kernels for this one with `python -m kvcompress.train.less`)"
                )
            return layer
        if self.init == "zero":
            return zero_kernels(q_heads, kv_heads, head_dim, self.rank, self.hidden)
        hint = f"pass kernels={', '.join(shipped_kernels()) or 'none'} or a directory from `kvcompress train less`"
        warnings.warn(f"less: no kernels given: untrained, ≈ its base {self.base_config.name!r}; {hint}", stacklevel=2)
        return init_kernels(q_heads, kv_heads, head_dim, self.rank, self.hidden, self.seed, layer_idx).eval()

    def connect(self, layers) -> None:
        kernels = self.kernel_set
        if kernels is not None and len(kernels.layers) != len(layers):
            raise ValueError(
                f"LESS kernels have {len(kernels.layers)} layers but the model has {len(layers)}: "
                "they belong to another model"
            )
        trained_budget = kernels.meta.get("base", {}).get("budget") if kernels is not None else None
        budget = getattr(self.base_config, "budget", None)
        if trained_budget is not None and budget is not None and trained_budget != budget:
            logger.info("LESS kernels trained at budget %s used at budget %s", trained_budget, budget)
        self.base_config.connect(layers)


def baseline_plus(base: MethodConfig, rank: int = 8) -> MethodConfig:
    """The paper's Baseline+: ``base`` with ``R/2`` more tokens per KV head, the memory of LESS's state ``H``.

    For H2O with its even split that is ``+R/4`` heavy hitters and ``+R/4`` recent tokens; for Λ (StreamingLLM) the
    sinks stay and the window grows by ``R/2``.
    """
    if not hasattr(base, "budget"):
        raise ValueError(f"baseline_plus needs a method with a token budget, got {base.name!r}")
    return dataclasses.replace(base, budget=base.budget + rank // 2)
