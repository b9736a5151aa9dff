"""Data for LESS kernel training: where kernels go, which text windows, and the attention inputs they produce."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.progress import track
from torch import nn

from kvcompress.eval.data import data_root, load_documents, text_files
from kvcompress.files import write_atomically
from kvcompress.methods.less.masked import CaptureRun, less_attention
from kvcompress.models import model_info

DEFAULT_OUT_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcompress" / "less"


def default_out_dir(model_name: str, base: str, budget_tokens: int, window: int) -> Path:
    return DEFAULT_OUT_ROOT / f"{model_name}-{base}-{budget_tokens}of{window}"


def default_data_files() -> list[Path]:
    """The data folder's Gutenberg books and ``wikitext-2/valid.txt``."""
    root = data_root()
    return sorted((root / "gutenberg").glob("*.txt")) + [root / "wikitext-2" / "valid.txt"]


def data_record(paths: Sequence[Path]) -> list[dict[str, str]]:
    """What a kernel set's ``meta.json`` records of its training texts, the same on every machine: each given file's
    or folder's name and a SHA-256 (a file's of its bytes, as ``sha256sum`` prints it; a folder's over its text
    files' relative paths and bytes, in order), so that a resumed training refuses changed texts, not moved ones."""
    record = []
    for path in map(Path, paths):
        digest = hashlib.sha256()
        for file in text_files(path):
            if path.is_dir():
                digest.update(f"{file.relative_to(path)}\0".encode())
            digest.update(file.read_bytes())
        record.append({"name": path.name, "sha256": digest.hexdigest()})
    return record


def budget_tokens(budget: float | int, window: int, base: str) -> int:
    """Tokens kept per KV head: an int as is, a float in (0, 1) as a share of the window (rounded down to an even
    count for H2O so heavy hitters and recent tokens split evenly, as in the paper's Table 1)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(f"budget must be a token count >= 1 or a share of the window in (0, 1), got {budget!r}")
    if isinstance(budget, float) and budget < 1:
        tokens = int(budget * window)
        if base == "h2o":
            tokens -= tokens % 2
    else:
        tokens = int(budget)
    if not 1 <= tokens < window:
        raise ValueError(f"budget gives {tokens} tokens; it must be in [1, window={window})")
    return tokens


def sample_windows(
    tokenizer: Any, files: Sequence[Path], window: int, count: int, seed: int
) -> tuple[torch.Tensor, list[str]]:
    """``count`` windows ``[count, window]`` of token ids, starts drawn uniformly over all documents' positions."""
    docs = []
    for file in files:
        if Path(file).resolve().name == "test.txt" and "wikitext" in str(Path(file).resolve()):
            raise ValueError(f"{file}: WikiText-2 test is the evaluation set; never train on it")
        for doc in load_documents(file):
            ids = tokenizer(doc.text, add_special_tokens=False, return_tensors="pt").input_ids[0]
            if ids.numel() > window:
                docs.append((doc.name, ids))
    if not docs:
        raise ValueError(f"no training document is longer than window={window} tokens")
    starts = [ids.numel() - window for _, ids in docs]
    total = sum(starts)
    rng = random.Random(seed)
    windows, names = [], []
    for _ in range(count):
        pick = rng.randrange(total)
        for (name, ids), span in zip(docs, starts, strict=True):
            if pick < span:
                windows.append(ids[pick : pick + window])
                names.append(f"{name}:{pick}")
                break
            pick -= span
    return torch.stack(windows), names


def attention_modules(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers")
    return [layer.self_attn for layer in layers]


@torch.no_grad()
def collect_attention_inputs(
    model: nn.Module, windows: torch.Tensor, directory: Path, batch_size: int = 4, progress: bool = False
) -> None:
    """One frozen forward over ``windows``: write each layer's attention input (float16) and RoPE tables."""
    modules = attention_modules(model)
    inputs: list[list[torch.Tensor]] = [[] for _ in modules]
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(index):
        def record(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            inputs[index].append(hidden.detach().to(torch.float16))
            if index not in rope:
                cos, sin = kwargs["position_embeddings"]
                rope[index] = (cos[:1].detach().clone(), sin[:1].detach().clone())

        return record

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        starts = range(0, windows.shape[0], batch_size)
        for start in track_if(starts, "collecting attention inputs", progress):
            model(input_ids=windows[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    directory.mkdir(parents=True, exist_ok=True)
    for index, parts in enumerate(inputs):
        payload = {"hidden": torch.cat(parts), "cos": rope[index][0], "sin": rope[index][1]}
        write_atomically(directory / f"layer_{index:03d}.pt", lambda path, payload=payload: torch.save(payload, path))


def track_if(iterable, description: str, enabled: bool):
    if not enabled:
        return iterable
    return track(iterable, description=description, transient=True)


@torch.no_grad()
def layer_tensors(model: nn.Module, layer_idx: int, saved: dict[str, torch.Tensor], chunk: int = 8) -> dict:
    """Recompute a layer's post-RoPE ``q, k, v`` and its output after ``W_O`` from its saved attention input."""
    module = attention_modules(model)[layer_idx]
    hidden = saved["hidden"]
    parts: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": [], "o": []}
    with less_attention(model):
        for start in range(0, hidden.shape[0], chunk):
            x = hidden[start : start + chunk].float()
            cos = saved["cos"].expand(x.shape[0], -1, -1)
            sin = saved["sin"].expand(x.shape[0], -1, -1)
            run = CaptureRun()
            out = module(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None, less_run=run)[0]
            q, k, v = run.records[layer_idx]
            for name, tensor in zip("qkvo", (q, k, v, out), strict=True):
                parts[name].append(tensor.float())
    return {name: torch.cat(tensors) for name, tensors in parts.items()}


def model_shape(model: nn.Module) -> dict[str, int]:
    info = model_info(model)
    return {
        "num_layers": info["num_layers"],
        "q_heads": info["num_attention_heads"],
        "kv_heads": info["num_key_value_heads"],
        "head_dim": info["head_dim"],
    }
