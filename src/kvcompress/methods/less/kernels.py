"""LESS kernels (φ, ψ; ``kvcompress.methods.less.config``): the modules, their files, the kernel sets shipped.

``LayerKernels`` holds one layer's φ (per query head) and ψ (per KV head, like the state ``H``, ``z``) in the official
code's form: ``φ(q) = |GELU(GELU(Dropout(q W1)) W2)|``, ``u = |s1| ⊙ GELU(GELU(Dropout(k W1)) W2)``,
``ψ(k) = |u + (u W3) ⊙ s2|``; no biases, Xavier-uniform weights, ``s1 = s2 = 1e-4`` (the warm start), dropout 0.3 in
training only. ``LessKernels`` is every layer's plus metadata (model shape, base policy, training), saved as a
directory of ``meta.json`` and one ``layer_XXX.pt`` per layer (training writes them one by one).
"""

from __future__ import annotations

import json
import math
import os
from collections import namedtuple
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvcompress.files import damaged, load_json, load_tensors, require_keys, shipped_folder, write_atomically

KERNEL_FORMAT = 1
SHAPE = ("q_heads", "kv_heads", "head_dim", "rank", "hidden")  # a layer's shape, as its file and meta.json record it
META_FILE = "meta.json"
KERNEL_FILE = "a LESS kernel file"
KERNEL_REMEDY = (
    "retrain the layer (delete the file and re-run `kvcompress train less` with the same --out: it trains the missing "
    "layers) or reinstall kvcompress for a shipped kernel set"
)


def layer_file(directory: str | os.PathLike[str], layer: int) -> Path:
    """Path of one layer's kernel file inside a kernel directory."""
    return Path(directory) / f"layer_{layer:03d}.pt"


class LayerKernels(nn.Module):
    """φ and ψ of one attention layer: per-head weight tensors ``[heads, in, out]`` (the official code's form)."""

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
        cpu = {"device": "cpu"}  # built on the CPU (its generator), whatever the default device; moved by the user
        self.phi_w1 = nn.Parameter(torch.empty(q_heads, head_dim, hidden, **cpu))
        self.phi_w2 = nn.Parameter(torch.empty(q_heads, hidden, rank, **cpu))
        self.psi_w1 = nn.Parameter(torch.empty(kv_heads, head_dim, hidden, **cpu))
        self.psi_w2 = nn.Parameter(torch.empty(kv_heads, hidden, rank, **cpu))
        self.psi_w3 = nn.Parameter(torch.empty(kv_heads, rank, rank, **cpu))  # the R x R "interaction" residual
        self.psi_s1 = nn.Parameter(torch.full((kv_heads, 1, rank), float(scalar_init), **cpu))  # code: scalingD
        self.psi_s2 = nn.Parameter(torch.full((kv_heads, 1, rank), float(scalar_init), **cpu))  # code: scalingD2
        self.dropout = nn.Dropout(dropout)
        for weight in (self.phi_w1, self.phi_w2, self.psi_w1, self.psi_w2, self.psi_w3):  # Xavier-uniform per head
            bound = math.sqrt(6.0 / (weight.shape[-2] + weight.shape[-1]))  # fan_in + fan_out of one [in, out] slice
            nn.init.uniform_(weight, -bound, bound, generator=generator)

    def phi(self, query: torch.Tensor) -> torch.Tensor:
        """Query features ``[B, H_q, S, R]`` (non-negative) of post-RoPE queries ``[B, H_q, S, D]``."""
        if not self.training:
            return phi_features(query, *self.inference_weights().phi)
        return F.gelu(F.gelu(self.dropout(query.float() @ self.phi_w1)) @ self.phi_w2).abs()

    def psi(self, key: torch.Tensor) -> torch.Tensor:
        """Key features ``[B, H_kv, S, R]`` (non-negative) of post-RoPE keys ``[B, H_kv, S, D]``."""
        if not self.training:
            return psi_features(key, *self.inference_weights().psi)
        return (F.gelu(F.gelu(self.dropout(key.float() @ self.psi_w1)) @ self.psi_w2) @ self.psi_mix()).abs()

    @torch.no_grad()
    def inference_weights(self) -> InferenceWeights:
        """The weights as ``phi_features`` and ``psi_features`` take them (detached; made once by a cache, whose
        kernels are frozen while it uses them)."""
        phi, psi = (self.phi_w1.detach(), self.phi_w2.detach()), (self.psi_w1.detach(), self.psi_w2.detach())
        return InferenceWeights(phi, (*psi, self.psi_mix()))

    def psi_mix(self) -> torch.Tensor:
        """``[H_kv, R, R]``: ψ's last steps as one matrix. With ``g = GELU(h W2)``, ``u = |s1| ⊙ g`` and
        ``u + (u W3) ⊙ s2 = u (I + W3 diag(s2)) = g diag(|s1|) (I + W3 diag(s2))``, so ``ψ = |g M|`` with
        ``M = diag(|s1|) (I + W3 diag(s2))``."""
        eye = torch.eye(self.rank, dtype=self.psi_w3.dtype, device=self.psi_w3.device)
        return self.psi_s1.abs().transpose(-1, -2) * (eye + self.psi_w3 * self.psi_s2)

    @torch.no_grad()
    def psi_is_zero(self) -> bool:
        """Whether ψ is identically zero because ``psi_mix`` is (``zero_kernels``); one host read."""
        return not bool(self.psi_mix().any())


# One layer's kernels as inference takes them: φ's ``(W1, W2)`` and ψ's ``(W1, W2, M)`` (``psi_mix``).
InferenceWeights = namedtuple("InferenceWeights", "phi psi")


def phi_features(query: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """φ without dropout, ``|GELU(GELU(q W1) W2)|`` ``[B, H, S, R]``, of queries ``[B, H, S, D]`` (per-head weights)."""
    return _heads_second(phi_head_major(query, w1, w2), query)


def phi_head_major(query: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``phi_features`` heads first, ``[H, B S, R]``, as the products leave it (a decoding step takes it so)."""
    return head_major_mlp(query, w1, w2).abs_()


def psi_features(key: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """ψ without dropout: ``|GELU(GELU(k W1) W2) M|`` ``[B, H, S, R]`` for keys ``[B, H, S, D]`` and per-head weights
    (``M``: ``LayerKernels.psi_mix``); the heads may be several layers' stacked."""
    return _heads_second(torch.bmm(head_major_mlp(key, w1, w2), mix).abs_(), key)


def head_major_mlp(inputs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``GELU(GELU(x W1) W2)`` ``[H, B S, R]`` of ``inputs`` ``[B, H, S, D]`` with per-head ``w1`` ``[H, D, hidden]``
    and ``w2`` ``[H, hidden, R]``: two 3D matmuls batched over the heads (a broadcast 4D matmul costs more than its
    arithmetic when decoding). On a CPU a decoding step's row-times-matrix ``x W1`` (one row per head) takes about two
    thirds of the time of ``W1ᵀ xᵀ`` (MKL, one thread, W1 in the cache or not), so W1 is taken as trained. The GELUs
    run on PyTorch's own CPU kernel (``_gelu``)."""
    batch, heads, length, dim = inputs.shape
    rows = inputs.float().transpose(0, 1).reshape(heads, batch * length, dim)  # a view for one sequence
    return _gelu(torch.bmm(_gelu(torch.bmm(rows, w1)), w2))


def _gelu(inputs: torch.Tensor) -> torch.Tensor:
    """The exact GELU of ``inputs`` ``[H, m, n]`` on PyTorch's own kernel: on a CPU, PyTorch hands a contiguous
    float32 tensor to oneDNN, whose setup per call costs several times a decoding step's few hundred elements, and
    a transposed view (the same memory; the result keeps its layout, so it comes back contiguous) to its own."""
    return F.gelu(inputs.transpose(0, -1)).transpose(0, -1)


def _heads_second(features: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[H, B S, R]`` -> ``[B, H, S, R]`` (a view) for inputs shaped ``like`` ``[B, H, S, D]``."""
    batch, heads, length, _ = like.shape
    return features.view(heads, batch, length, -1).transpose(0, 1)


@dataclass(eq=False)
class LessKernels:
    """The kernels of every layer of one model, with their metadata (``meta``: model shape, base policy, training)."""

    layers: list[LayerKernels]
    meta: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Path:
        """Write ``meta.json`` and one file per layer (``dtype=torch.float16`` halves the size)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        first = self.layers[0]
        meta = dict(self.meta, format=KERNEL_FORMAT, num_layers=len(self.layers), rank=first.rank, hidden=first.hidden)
        write_atomically(directory / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for index, layer in enumerate(self.layers):
            save_layer(directory, index, layer, dtype=dtype)
        return directory


def save_layer(
    directory: str | os.PathLike[str],
    index: int,
    layer: LayerKernels,
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write one layer's kernels (whole or not at all)."""
    state = {name: tensor.detach().to(dtype).clone() for name, tensor in layer.state_dict().items()}
    shape = {name: getattr(layer, name) for name in SHAPE}
    payload = {"format": KERNEL_FORMAT, "layer": index, "shape": shape, "state_dict": state, **(extra or {})}
    return write_atomically(layer_file(directory, index), lambda path: torch.save(payload, path))


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} is not a LESS kernel directory (no {META_FILE}); kernels are written by "
            "`python -m kvcompress.train.less --out DIR`"
        )
    return load_json(path, "a LESS kernel index", KERNEL_REMEDY)


def load_layer(directory: str | os.PathLike[str], index: int) -> tuple[LayerKernels, dict[str, Any]]:
    """One layer's kernels (float32, eval mode) and the rest of its file (training history, ...)."""
    path = layer_file(directory, index)
    payload = require_keys(
        load_tensors(path, KERNEL_FILE, KERNEL_REMEDY), ("shape", "state_dict"), path, KERNEL_FILE, KERNEL_REMEDY
    )
    try:
        layer = LayerKernels(**payload["shape"])
        layer.load_state_dict({name: tensor.float() for name, tensor in payload["state_dict"].items()})
    except (TypeError, RuntimeError, AttributeError, ValueError) as error:
        raise damaged(path, KERNEL_FILE, KERNEL_REMEDY, error) from None
    return layer.eval(), {k: v for k, v in payload.items() if k != "state_dict"}


SHIPPED = shipped_folder("less")  # kernels that come with the package


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
    layers = [
        zero_kernels(**{name: meta[name] for name in SHAPE}) if index in missing else load_layer(directory, index)[0]
        for index in range(count)
    ]
    return LessKernels(layers=layers, meta=dict(meta, missing_layers=missing))


def load_kernels_once(directory: str | os.PathLike[str]) -> LessKernels:
    """``load_kernels``, read once per process for a directory's current files (inference only: every cache built
    from the same directory shares these read-only modules)."""
    path = resolve_kernels(directory)
    return _load_kernels_at(str(path), (path / META_FILE).stat().st_mtime_ns)


@lru_cache(maxsize=4)
def _load_kernels_at(path: str, mtime_ns: int) -> LessKernels:
    return load_kernels(path)


def zero_kernels(q_heads: int, kv_heads: int, head_dim: int, rank: int = 8, hidden: int = 128) -> LayerKernels:
    """Kernels with ``s1 = s2 = 0``, so ψ ≡ 0: the state stays empty and LESS is exactly its base policy."""
    return LayerKernels(q_heads, kv_heads, head_dim, rank, hidden, scalar_init=0.0).eval()


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
