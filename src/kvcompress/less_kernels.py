"""LESS kernels (φ, ψ) and the LESS attention arithmetic shared by the cache, the masked form and training.

Paper: Dong et al., 2024, "Get More with LESS: Synthesizing Recurrence with KV Cache Compression for Efficient LLM
Inference" (arXiv:2402.09398). Spec: ``../shared/specs/less.md``. The method itself (config, policy) is
``kvcompress.methods.less``; its cache layer is ``kvcompress.methods.less_layer``.

What lives here:

- ``LayerKernels``: one layer's φ (per query head) and ψ (per KV head) in the official code's form (spec §1.4):
  ``φ(q) = |GELU(GELU(Dropout(q W1)) W2)|``, ``u = |s1| ⊙ GELU(GELU(Dropout(k W1)) W2)``,
  ``ψ(k) = |u + (u W3) ⊙ s2|``; no biases, Xavier-uniform weights, ``s1 = s2 = 1e-4`` (the warm start),
  dropout 0.3 in training only. GQA (spec A3): ψ, and so the state ``H``, ``z``, are per KV head; φ is per query head.
- ``LessKernels``: the kernels of every layer plus metadata (model shape, base policy, training settings), saved as
  a directory with ``meta.json`` and one ``layer_XXX.pt`` per layer (training writes them one by one) and loaded
  with ``load_kernels``, which raises a clear error when they do not fit the model or the base policy.
- ``mix_low_rank``: Eq. 3 in log-sum-exp form. The sparse part enters as its softmax output and log-normaliser,
  the low-rank part as ``num = φ(q) H`` and ``den = φ(q) zᵀ``: ``out = e^{lse_s - lse} out_s + e^{lse_lr - lse}
  num / den`` with ``lse = logaddexp(lse_s, log den)``; equal to ``(φH + Σ e^s v) / (φzᵀ + Σ e^s)`` but safe for any
  logit size. Choice: where ``den == 0`` (nothing evicted, or ψ ≡ 0) the low-rank term is exactly absent
  (``log 0 = -inf``) instead of the official code's ``max(den, 1e-6)`` floor, so LESS equals its base policy exactly
  then; the floor only ever added a ≤1e-6 phantom mass.
- The parallel ("masked", spec §1.9) form. Eviction in a real cache is permanent, so a token's fate is one number:
  ``evict_at[j]``, the first query row that no longer sees token ``j`` in the sparse cache (``S`` if never). Row
  ``i`` attends exactly to ``{j <= i : evict_at[j] > i}`` and its state holds ``{j : evict_at[j] <= i}``; so
  ``H_i`` is a cumulative sum of ``ψ(k_j)ᵀ v_j`` ordered by eviction row (``O(S R D)``, no ``S x S`` low-rank
  matrix), which equals the spec's masked ``φ(Q)ψ(K)ᵀ ⊙ M_lr`` form. ``eviction_times`` finds ``evict_at`` by
  running the base policy's own cache layer token by token on the layer's queries and keys, with the statistics
  the real decode computes (softmax over the cached tokens only: the generation rule of spec §1.8 / A6). So the
  masked form equals prefilling one token and decoding the rest through the real cache (A16), for any evicting
  method, and training sees exactly the masks decoding will produce.
- ``masked_forward``: logits of a whole window with every layer in the masked form (an attention function switched
  in for one forward), and ``capture_attention`` to record a layer's post-RoPE Q, K, V and its output after W_O.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_FORMAT = 1
META_FILE = "meta.json"
CHUNK_ELEMENTS = 1 << 24  # float32 logits per query chunk in the masked form (~64 MB)


def layer_file(directory: str | os.PathLike[str], layer: int) -> Path:
    """Path of one layer's kernel file inside a kernel directory."""
    return Path(directory) / f"layer_{layer:03d}.pt"


# ----------------------------------------------------------------------------------------------------- kernels


def _xavier_(weight: torch.Tensor, generator: torch.Generator | None) -> None:
    """Xavier-uniform per head: ``U(-a, a)``, ``a = sqrt(6 / (fan_in + fan_out))`` of one ``[in, out]`` slice."""
    bound = math.sqrt(6.0 / (weight.shape[-2] + weight.shape[-1]))
    with torch.no_grad():
        weight.uniform_(-bound, bound, generator=generator)


class LayerKernels(nn.Module):
    """φ and ψ of one attention layer: per-head weight tensors ``[heads, in, out]`` (spec §1.4, code form)."""

    def __init__(
        self,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        rank: int = 8,
        hidden: int = 128,
        dropout: float = 0.3,
        scalar_init: float = 1e-4,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.q_heads, self.kv_heads, self.head_dim, self.rank, self.hidden = q_heads, kv_heads, head_dim, rank, hidden
        self.phi_w1 = nn.Parameter(torch.empty(q_heads, head_dim, hidden))
        self.phi_w2 = nn.Parameter(torch.empty(q_heads, hidden, rank))
        self.psi_w1 = nn.Parameter(torch.empty(kv_heads, head_dim, hidden))
        self.psi_w2 = nn.Parameter(torch.empty(kv_heads, hidden, rank))
        self.psi_w3 = nn.Parameter(torch.empty(kv_heads, rank, rank))  # the R x R "interaction" residual
        self.psi_s1 = nn.Parameter(torch.full((kv_heads, 1, rank), float(scalar_init)))  # code: scalingD
        self.psi_s2 = nn.Parameter(torch.full((kv_heads, 1, rank), float(scalar_init)))  # code: scalingD2
        self.dropout = nn.Dropout(dropout)
        for weight in (self.phi_w1, self.phi_w2, self.psi_w1, self.psi_w2, self.psi_w3):
            _xavier_(weight, generator)

    def phi(self, query: torch.Tensor) -> torch.Tensor:
        """Query features ``[B, H_q, S, R]`` (non-negative) of post-RoPE queries ``[B, H_q, S, D]``."""
        hidden = F.gelu(self.dropout(query.float() @ self.phi_w1))
        return F.gelu(hidden @ self.phi_w2).abs()

    def psi(self, key: torch.Tensor) -> torch.Tensor:
        """Key features ``[B, H_kv, S, R]`` (non-negative) of post-RoPE keys ``[B, H_kv, S, D]``."""
        hidden = F.gelu(self.dropout(key.float() @ self.psi_w1))
        u = self.psi_s1.abs() * F.gelu(hidden @ self.psi_w2)
        return (u + (u @ self.psi_w3) * self.psi_s2).abs()

    def check_shape(self, q_heads: int, kv_heads: int, head_dim: int, layer_idx: int) -> None:
        if (q_heads, kv_heads, head_dim) != (self.q_heads, self.kv_heads, self.head_dim):
            raise ValueError(
                f"LESS kernels of layer {layer_idx} were made for {self.q_heads} query heads, {self.kv_heads} KV heads "
                f"and head_dim {self.head_dim}, but the model has {q_heads}, {kv_heads} and {head_dim}: "
                "they belong to another model (train kernels for this one with `python -m kvcompress.train.less`)"
            )


@dataclass(eq=False)
class LessKernels:
    """The kernels of every layer of one model, with their metadata (``meta``: model shape, base policy, training)."""

    layers: list[LayerKernels]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.layers[0].rank

    @property
    def hidden(self) -> int:
        return self.layers[0].hidden

    def parameter_count(self) -> int:
        return sum(p.numel() for layer in self.layers for p in layer.parameters())

    def eval(self) -> LessKernels:
        for layer in self.layers:
            layer.eval()
        return self

    def check_base(self, base: dict[str, Any]) -> None:
        """Raise if these kernels were trained with another eviction method than ``base`` (``{"name", ...}``)."""
        trained = self.meta.get("base")
        if trained is None:
            return
        if trained.get("name") != base.get("name"):
            raise ValueError(
                f"LESS kernels were trained with base policy {trained.get('name')!r} but are used with "
                f"{base.get('name')!r}; the low-rank state must learn what that policy evicts (train kernels for "
                f"{base.get('name')!r} with `python -m kvcompress.train.less --base {base.get('name')}`)"
            )

    def save(self, directory: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Path:
        """Write ``meta.json`` and one file per layer (``dtype=torch.float16`` halves the size)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta)
        meta.update(format=KERNEL_FORMAT, num_layers=len(self.layers), rank=self.rank, hidden=self.hidden)
        _write_json(directory / META_FILE, meta)
        for index, layer in enumerate(self.layers):
            save_layer(directory, index, layer, dtype=dtype)
        return directory


def layer_shape_meta(layer: LayerKernels) -> dict[str, int]:
    return {
        "q_heads": layer.q_heads,
        "kv_heads": layer.kv_heads,
        "head_dim": layer.head_dim,
        "rank": layer.rank,
        "hidden": layer.hidden,
    }


def save_layer(
    directory: str | os.PathLike[str],
    index: int,
    layer: LayerKernels,
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write one layer's kernels (atomically: a finished file is always complete)."""
    path = layer_file(directory, index)
    state = {name: tensor.detach().to(dtype).clone() for name, tensor in layer.state_dict().items()}
    payload = {"format": KERNEL_FORMAT, "layer": index, "shape": layer_shape_meta(layer), "state_dict": state}
    payload.update(extra or {})
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} is not a LESS kernel directory (no {META_FILE}); kernels are written by "
            "`python -m kvcompress.train.less --out DIR`"
        )
    return json.loads(path.read_text())


def load_layer(directory: str | os.PathLike[str], index: int) -> tuple[LayerKernels, dict[str, Any]]:
    """One layer's kernels (float32, eval mode) and the rest of its file (training history, ...)."""
    payload = torch.load(layer_file(directory, index), map_location="cpu", weights_only=True)
    shape = payload["shape"]
    layer = LayerKernels(**shape)
    layer.load_state_dict({name: tensor.float() for name, tensor in payload["state_dict"].items()})
    layer.eval()
    return layer, {k: v for k, v in payload.items() if k != "state_dict"}


SHIPPED = Path(__file__).resolve().parent / "data" / "less"  # kernels that come with the package


def shipped_kernels() -> list[str]:
    """Names of the kernel sets shipped with the package (usable as ``LessConfig(kernels=NAME)``)."""
    return sorted(p.name for p in SHIPPED.iterdir() if (p / META_FILE).is_file()) if SHIPPED.is_dir() else []


def resolve_kernels(name_or_path: str | os.PathLike[str]) -> Path:
    """A kernel directory: an existing path, or the name of a shipped kernel set."""
    path = Path(name_or_path)
    if path.exists():
        return path
    if (SHIPPED / str(name_or_path) / META_FILE).is_file():
        return SHIPPED / str(name_or_path)
    raise FileNotFoundError(
        f"LESS kernels {str(name_or_path)!r}: no such directory and no shipped kernel set of that name "
        f"(shipped: {', '.join(shipped_kernels()) or 'none'})"
    )


def load_kernels(directory: str | os.PathLike[str], allow_missing: bool = False) -> LessKernels:
    """Load a kernel directory (or shipped set by name). Layers not trained yet raise, or with ``allow_missing`` get
    ψ ≡ 0 (= the base policy)."""
    directory = resolve_kernels(directory)
    meta = read_meta(directory)
    if meta.get("format") != KERNEL_FORMAT:
        raise ValueError(f"LESS kernel format {meta.get('format')!r} in {str(directory)!r}; expected {KERNEL_FORMAT}")
    count = int(meta["num_layers"])
    missing = [i for i in range(count) if not layer_file(directory, i).is_file()]
    if missing and not allow_missing:
        raise FileNotFoundError(
            f"LESS kernels in {str(directory)!r} are incomplete: layers {missing} are not trained yet "
            "(resume the training with the same command; it continues with the missing layers)"
        )
    layers = []
    for index in range(count):
        if index in missing:
            layers.append(zero_kernels(**{k: meta[k] for k in ("q_heads", "kv_heads", "head_dim", "rank", "hidden")}))
        else:
            layers.append(load_layer(directory, index)[0])
    meta = dict(meta, missing_layers=missing)
    return LessKernels(layers=layers, meta=meta)


def zero_kernels(q_heads: int, kv_heads: int, head_dim: int, rank: int = 8, hidden: int = 128) -> LayerKernels:
    """Kernels with ``s1 = 0``, so ψ ≡ 0: the state stays empty and LESS is exactly its base policy."""
    layer = LayerKernels(q_heads, kv_heads, head_dim, rank, hidden)
    with torch.no_grad():
        layer.psi_s1.zero_()
    return layer.eval()


def init_kernels(
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    rank: int = 8,
    hidden: int = 128,
    seed: int = 0,
    layer_idx: int = 0,
    dropout: float = 0.3,
) -> LayerKernels:
    """Untrained kernels as the paper initialises them, deterministic in ``(seed, layer_idx)``."""
    generator = torch.Generator().manual_seed(seed * 100_003 + layer_idx)
    return LayerKernels(q_heads, kv_heads, head_dim, rank, hidden, dropout=dropout, generator=generator)


# ---------------------------------------------------------------------------------------------- arithmetic


def mix_low_rank(
    lse_sparse: torch.Tensor, out_sparse: torch.Tensor, num: torch.Tensor, den: torch.Tensor
) -> torch.Tensor:
    """Eq. 3 in log-sum-exp form (float32).

    ``lse_sparse`` ``[...]`` and ``out_sparse`` ``[..., D]``: log-normaliser and softmax output of the cached tokens;
    ``num`` ``[..., D]`` = ``φ(q) H`` and ``den`` ``[...]`` = ``φ(q) zᵀ`` of the low-rank state.
    """
    positive = den > 0
    safe_den = torch.where(positive, den, torch.ones_like(den))
    lse_lr = torch.where(positive, safe_den.log(), torch.full_like(den, -math.inf))
    lse = torch.logaddexp(lse_sparse, lse_lr)
    weight_sparse = torch.exp(lse_sparse - lse)[..., None]
    weight_lr = torch.exp(lse_lr - lse)[..., None]
    return weight_sparse * out_sparse + weight_lr * (num / safe_den[..., None])


def grouped(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H_q, ...]`` -> ``[B, H_kv, G, ...]``: the query heads of one KV head together (``repeat_kv`` order)."""
    return tensor.view(tensor.shape[0], kv_heads, tensor.shape[1] // kv_heads, *tensor.shape[2:])


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    evict_at: torch.Tensor | None,
    scaling: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention restricted to the cached tokens, in float32: ``(lse [B, H_q, S], out [B, H_q, S, D])``.

    Row ``i`` sees ``{j <= i : evict_at[j] > i}`` (``evict_at`` ``[B, H_kv, S]``; ``None`` = nothing evicted).
    """
    batch, q_heads, length, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    q = grouped(query, kv_heads).float()
    k, v = key.float()[:, :, None], value.float()[:, :, None]
    idx = torch.arange(length, device=query.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * q_heads * length))
    lses, outs = [], []
    for start in range(0, length, chunk):
        rows = idx[start : start + chunk]
        logits = (q[:, :, :, start : start + chunk] @ k.transpose(-1, -2)) * scale  # [B, Hkv, G, c, S]
        visible = (idx[None, :] <= rows[:, None])[None, None]  # [1, 1, c, S]
        if evict_at is not None:
            visible = visible & (evict_at[:, :, None, :] > rows[None, None, :, None])
        logits = logits.masked_fill(~visible[:, :, None], -math.inf)
        lse = logits.logsumexp(-1)
        lses.append(lse)
        outs.append(torch.exp(logits - lse[..., None]) @ v)
    lse = torch.cat(lses, dim=-1).reshape(batch, q_heads, length)
    out = torch.cat(outs, dim=-2).reshape(batch, q_heads, length, dim)
    return lse, out


def low_rank_parallel(
    phi_q: torch.Tensor, psi_k: torch.Tensor, value: torch.Tensor, evict_at: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num = φ(q_i) H_i`` ``[B, H_q, n, D]`` and ``den = φ(q_i) z_iᵀ`` ``[B, H_q, n]`` for the last ``n`` rows ``i``
    (``phi_q`` ``[B, H_q, n, R]`` holds the features of those rows' queries; ``n = S`` for every row).

    ``H_i = Σ_{j : evict_at[j] <= i} ψ(k_j)ᵀ v_j`` (Eq. 6), built as a scatter of each token's outer product to its
    eviction row followed by a cumulative sum over rows; differentiable in φ and ψ.
    """
    batch, kv_heads, length, rank = psi_k.shape
    dim = value.shape[-1]
    rows = phi_q.shape[2]
    slot = evict_at.clamp(max=length)  # never evicted: row S, beyond the window
    outer = psi_k[..., :, None] * value.float()[..., None, :]  # [B, Hkv, S, R, D]
    state = outer.new_zeros(batch, kv_heads, length + 1, rank, dim)
    state = state.scatter_add(2, slot[..., None, None].expand_as(outer), outer).cumsum(2)[:, :, :length]
    norm = psi_k.new_zeros(batch, kv_heads, length + 1, rank)
    norm = norm.scatter_add(2, slot[..., None].expand_as(psi_k), psi_k).cumsum(2)[:, :, :length]
    f = grouped(phi_q, kv_heads)  # [B, Hkv, G, n, R]
    num = torch.einsum("bkgsr,bksrd->bkgsd", f, state[:, :, length - rows :])
    den = torch.einsum("bkgsr,bksr->bkgs", f, norm[:, :, length - rows :])
    q_heads = phi_q.shape[1]
    return num.reshape(batch, q_heads, rows, dim), den.reshape(batch, q_heads, rows)


def less_masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    evict_at: torch.Tensor | None,
    kernels: LayerKernels | None,
    scaling: float | None = None,
) -> torch.Tensor:
    """The masked (parallel) LESS attention output ``[B, H_q, S, D]`` (float32); ``kernels=None``: sparse only."""
    lse, out = sparse_attention(query, key, value, evict_at, scaling)
    if kernels is None or evict_at is None:
        return out
    num, den = low_rank_parallel(kernels.phi(query), kernels.psi(key), value, evict_at)
    return mix_low_rank(lse, out, num, den)


# ------------------------------------------------------------------------------------- base-policy simulation


def eviction_times(
    policy: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """Run ``policy``'s cache layer token by token over one layer's post-RoPE ``query`` ``[B, H_q, S, D]``,
    ``key``/``value`` ``[B, H_kv, S, D]`` (positions ``0..S-1``, no padding) and return ``evict_at`` ``[B, H_kv, S]``:
    the first row whose query no longer sees each token (``S`` if kept to the end).

    The statistics are those the real decode hands the policy (``attention_with_stats`` over the cached tokens plus
    the current one), so the result equals the evictions of prefilling token 0 and decoding the rest one by one.
    """
    from kvcompress.attention import attention_with_stats
    from kvcompress.cache import CompressedLayer

    if policy.position_mode != "original":
        raise ValueError("the masked LESS form needs a base policy with position_mode='original'")
    batch, kv_heads, length, _ = key.shape
    layer = CompressedLayer(policy)
    evict_at = torch.full((batch, kv_heads, length), length, dtype=torch.long, device=key.device)
    alive = torch.zeros(batch, kv_heads, length, dtype=torch.bool, device=key.device)
    positions = torch.arange(length, device=key.device)[None, :].expand(batch, -1)
    request = policy.stats
    for t in range(length):
        layer.update(key[:, :, t : t + 1], value[:, :, t : t + 1])
        layer.register_new_tokens(positions[:, t : t + 1], None)
        alive[:, :, t] = True
        stats = None
        if request.any:
            mask = layer.attention_mask(1)
            _, stats = attention_with_stats(query[:, :, t : t + 1], layer.keys, layer.values, mask, scaling, request)
        layer.after_attention(stats)
        kept = torch.zeros_like(alive).scatter_(2, layer.token_idx, layer.valid)
        dropped = alive & ~kept
        if bool(dropped.any()):
            evict_at[dropped] = t + 1
            alive &= kept
    return evict_at


# ------------------------------------------------------------------------------- whole-model passes and capture

LESS_ATTENTION = "kvcompress_less"


class AttentionRun:
    """What the LESS attention function does for one forward (passed as the ``less_run`` model keyword)."""

    def __call__(self, layer_idx: int, query, key, value, scaling) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class CaptureRun(AttentionRun):
    """Full causal attention that records each layer's post-RoPE ``query``, ``key``, ``value`` (``records[idx]``)."""

    records: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __call__(self, layer_idx, query, key, value, scaling):
        self.records[layer_idx] = (query, key, value)
        groups = query.shape[1] // key.shape[1]
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=groups > 1)


@dataclass
class MaskedRun(AttentionRun):
    """Masked (parallel) form of a base policy, with LESS kernels or without (Baseline); ``policies=None``: full.

    ``policies[idx]`` is a base ``Policy`` for layer ``idx`` (a fresh cache layer is simulated per forward);
    ``less`` a ``LessConfig`` whose kernels are used (``None``: sparse only). ``evictions`` keeps each layer's
    ``evict_at`` of the last forward.
    """

    policies: Sequence[Any] | None = None
    less: Any = None
    evictions: dict[int, torch.Tensor] = field(default_factory=dict)

    def __call__(self, layer_idx, query, key, value, scaling):
        if self.policies is None:
            return less_masked_attention(query, key, value, None, None, scaling).to(query.dtype)
        evict_at = eviction_times(self.policies[layer_idx], query, key, value, scaling)
        self.evictions[layer_idx] = evict_at
        kernels = None
        if self.less is not None:
            kernels = self.less.kernels_for(layer_idx, query.shape[1], key.shape[1], key.shape[-1])
        return less_masked_attention(query, key, value, evict_at, kernels, scaling).to(query.dtype)


def _less_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    run: AttentionRun | None = kwargs.get("less_run")
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError("the masked LESS form takes unpadded windows (no attention_mask with padding)")
    if run is None:
        run = CaptureRun()
    output = run(module.layer_idx, query, key, value, scaling)
    return output.transpose(1, 2).contiguous(), None


def _no_mask(**_: object) -> None:
    return None


@contextmanager
def less_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Switch ``model`` to the LESS masked-form attention function for the block, then back."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if LESS_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(LESS_ATTENTION, _less_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(LESS_ATTENTION, _no_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(LESS_ATTENTION)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def masked_forward(model: nn.Module, input_ids: torch.Tensor, run: AttentionRun) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` of unpadded windows (positions ``0..S-1``) with every layer's attention by ``run``."""
    with less_attention(model):
        return model(input_ids=input_ids, use_cache=False, less_run=run).logits


def masked_run(config: Any, num_layers: int) -> MaskedRun:
    """A ``MaskedRun`` for a method config: a ``LessConfig`` (base policy + kernels), another evicting config
    (Baseline, Baseline+), or ``full``."""
    from kvcompress.methods.full import FullConfig
    from kvcompress.methods.less import LessConfig

    if isinstance(config, FullConfig):
        return MaskedRun()
    if isinstance(config, LessConfig):
        base = config.base_config
        return MaskedRun(policies=[base.policy(i) for i in range(num_layers)], less=config)
    return MaskedRun(policies=[config.policy(i) for i in range(num_layers)])
