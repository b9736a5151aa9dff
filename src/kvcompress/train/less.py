"""Training LESS kernels φ, ψ, one layer at a time (the paper's §3.2 training, sized for a CPU).

Protocol (the paper's, with our CPU-sized defaults):

1. Windows: ``windows`` token windows of ``window`` tokens sampled (seeded, length-weighted over the documents)
   from the training texts: by default the data folder's Gutenberg books and ``wikitext-2/valid.txt``
   (never ``wikitext-2/test.txt``, which is the evaluation set; passing it raises). 90/10 train/validation split.
2. Collection, once for all layers: one teacher-forced forward of the frozen full-cache model over every window
   records each layer's attention input (after the input norm, float16 on disk, one file per layer) and RoPE
   tables; a layer's post-RoPE ``Q, K, V`` and its output after ``W_O`` (the target) are recomputed from that input
   by the layer's own attention module when the layer trains. The paper re-runs the model per layer; here every
   layer is collected in one pass.
3. Per layer, independently (so layers can be trained in any order, resumed, or spread over runs): the base
   policy's evictions are simulated once on the layer's own queries and keys (``eviction_times``: the generation
   rule, what decoding will do); the sparse part (softmax over cached tokens) is constant and computed once; each
   step computes the low-rank part with the cumulative-state form of the masked LESS attention
   (``low_rank_parallel``), applies the frozen ``W_O`` and takes the MSE to the full layer's output over positions
   from the first eviction on. Adam, lr 1e-3 halved at 1/4, 1/2 and 3/4 of the epochs (the paper's StepLR(10, 0.5)
   over 40 epochs, scaled), batches of 2 windows, dropout 0.3, fixed seeds; the best validation epoch is kept.
4. Each finished layer is written to ``<out>/layer_XXX.pt`` (kernels, MSE history, Baseline and Baseline+
   validation MSE, time, tokens); a rerun of the same command skips finished layers, so training is resumable
   layer by layer. ``<out>/meta.json`` records the settings; a rerun with other settings into the same directory
   is refused. The activations are deleted once every layer is done (``keep_activations=True`` keeps them).

Entry point: ``python -m kvcompress.train.less --model smollm2-135m --base h2o --budget 0.1 --out DIR``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvcompress.files import load_tensors, write_atomically
from kvcompress.methods.less import LessConfig, baseline_plus
from kvcompress.methods.less.kernels import KERNEL_FORMAT, META_FILE, init_kernels, layer_file, read_meta, save_layer
from kvcompress.methods.less.masked import eviction_times, low_rank_parallel, sparse_attention
from kvcompress.methods.less.policy import mix_low_rank
from kvcompress.models import load_model
from kvcompress.train.less_data import (
    attention_modules,
    budget_tokens,
    collect_attention_inputs,
    data_record,
    default_data_files,
    default_out_dir,
    layer_tensors,
    model_shape,
    sample_windows,
    track_if,
)

logger = logging.getLogger(__name__)


def _mse(pred: torch.Tensor, target: torch.Tensor, start: int) -> torch.Tensor:
    return ((pred[:, start:] - target[:, start:]) ** 2).mean()


@torch.no_grad()
def _sparse_parts(q, k, v, evict_at, scaling, chunk: int = 8):
    lses, outs = [], []
    for start in range(0, q.shape[0], chunk):
        part = slice(start, start + chunk)
        lse, out = sparse_attention(q[part], k[part], v[part], evict_at[part], scaling)
        lses.append(lse)
        outs.append(out)
    return torch.cat(lses), torch.cat(outs)


def _project(o_proj: nn.Module, heads_out: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` attention output -> ``[B, S, hidden]`` after ``W_O``."""
    return o_proj(heads_out.transpose(1, 2).flatten(2))


@torch.no_grad()
def _projected_mse(o_proj, heads_out, target, start, chunk: int = 8) -> float:
    total = 0.0
    for s in range(0, heads_out.shape[0], chunk):
        err = _project(o_proj, heads_out[s : s + chunk]) - target[s : s + chunk]
        total += float((err[:, start:] ** 2).sum())
    return total / (heads_out.shape[0] * (target.shape[1] - start) * target.shape[2])


def train_layer(
    model: nn.Module,
    layer_idx: int,
    saved: dict[str, torch.Tensor],
    base_config: Any,
    plus_config: Any,
    settings: dict[str, Any],
) -> tuple[Any, dict[str, Any]]:
    """Train one layer's kernels; returns ``(best LayerKernels, record)``."""
    started = time.perf_counter()
    seed = settings["seed"]
    torch.manual_seed(seed * 1000 + layer_idx)
    module = attention_modules(model)[layer_idx]
    scaling = module.scaling
    t = layer_tensors(model, layer_idx, saved)
    q, k, v, target = t["q"], t["k"], t["v"], t["o"]
    count, q_heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    with torch.no_grad():
        evict_at = base_config_evictions(base_config, layer_idx, q, k, v, scaling)
    start = int(evict_at.min())  # first row that has lost a token; the loss covers rows start..S-1
    lse_s, out_s = _sparse_parts(q, k, v, evict_at, scaling)
    lse_s, out_s, target = lse_s[:, :, start:], out_s[:, :, start:], target[:, start:]  # the loss rows only
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(count * settings["val_fraction"]))
    val, train = order[:n_val], order[n_val:]
    with torch.no_grad():  # Baseline+ (reference only): on the validation windows
        evict_plus = base_config_evictions(plus_config, layer_idx, q[val], k[val], v[val], scaling)
    out_plus = _sparse_parts(q[val], k[val], v[val], evict_plus, scaling)[1][:, :, start:]
    prep_s = time.perf_counter() - started
    o_proj = module.o_proj
    baseline = {
        "val": _projected_mse(o_proj, out_s[val], target[val], 0),
        "train": _projected_mse(o_proj, out_s[train], target[train], 0),
    }
    baseline_plus = _projected_mse(o_proj, out_plus, target[val], 0)

    kernels = init_kernels(
        q_heads,
        kv_heads,
        head_dim,
        settings["rank"],
        settings["hidden"],
        seed=seed,
        layer_idx=layer_idx,
        dropout=settings["dropout"],
    )
    optimizer = torch.optim.Adam(kernels.parameters(), lr=settings["lr"])
    step_size = max(1, round(settings["epochs"] / 4))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=0.5)
    for p in o_proj.parameters():
        p.requires_grad_(False)

    def forward(idx: torch.Tensor) -> torch.Tensor:
        num, den = low_rank_parallel(kernels.phi(q[idx, :, start:]), kernels.psi(k[idx]), v[idx], evict_at[idx])
        return _project(o_proj, mix_low_rank(lse_s[idx], out_s[idx], num, den))

    history = []
    best_val, best_state, best_epoch = math.inf, copy.deepcopy(kernels.state_dict()), 0
    shuffler = torch.Generator().manual_seed(seed * 1000 + layer_idx)
    batch = settings["batch_size"]
    for epoch in range(1, settings["epochs"] + 1):
        kernels.train()
        perm = train[torch.randperm(train.numel(), generator=shuffler)]
        losses = []
        for s in range(0, perm.numel(), batch):
            idx = perm[s : s + batch]
            loss = _mse(forward(idx), target[idx], 0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        lr_now = optimizer.param_groups[0]["lr"]
        scheduler.step()
        kernels.eval()
        with torch.no_grad():
            val_mse = (
                sum(
                    float(_mse(forward(val[i : i + batch]), target[val[i : i + batch]], 0)) * len(val[i : i + batch])
                    for i in range(0, val.numel(), batch)
                )
                / val.numel()
            )
        history.append({"epoch": epoch, "train_mse": sum(losses) / len(losses), "val_mse": val_mse, "lr": lr_now})
        logger.info(
            "layer %d epoch %d: train %.6f val %.6f (baseline %.6f, baseline+ %.6f)",
            layer_idx,
            epoch,
            history[-1]["train_mse"],
            val_mse,
            baseline["val"],
            baseline_plus,
        )
        if val_mse < best_val:
            best_val, best_state, best_epoch = val_mse, copy.deepcopy(kernels.state_dict()), epoch
    kernels.load_state_dict(best_state)
    kernels.eval()
    record = {
        "history": history,
        "best_epoch": best_epoch,
        "best_val_mse": best_val,
        "baseline_val_mse": baseline["val"],
        "baseline_train_mse": baseline["train"],
        "baseline_plus_val_mse": baseline_plus,
        "loss_start": start,
        "train_windows": int(train.numel()),
        "val_windows": int(val.numel()),
        "train_tokens": int(train.numel()) * length,
        "prep_s": prep_s,
        "time_s": time.perf_counter() - started,
    }
    return kernels, record


def base_config_evictions(config: Any, layer_idx: int, q, k, v, scaling) -> torch.Tensor:
    return eviction_times(config.policy(layer_idx), q, k, v, scaling)


def train_less(
    model: str | nn.Module = "smollm2-135m",
    base: str = "h2o",
    budget: float | int = 0.1,
    data: Sequence[str | os.PathLike[str]] | None = None,
    out: str | os.PathLike[str] | None = None,
    *,
    tokenizer: Any = None,
    window: int = 512,
    windows: int = 64,
    val_fraction: float = 0.1,
    epochs: int = 10,
    batch_size: int = 2,
    lr: float = 1e-3,
    rank: int = 8,
    hidden: int = 128,
    dropout: float = 0.3,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    threads: int | None = 1,
    keep_activations: bool = False,
    progress: bool = True,
) -> Path:
    """Train (or resume training) LESS kernels for ``model`` with ``base`` at ``budget``; returns the kernel directory.

    ``model`` is a registry name / path (loaded with ``kvcompress.models.load_model``) or a model object (then give
    ``tokenizer``). ``budget``: tokens per KV head, or a float in (0, 1) = share of ``window``. ``data``: text files
    or folders (default: Gutenberg books + WikiText-2 valid). ``out``: default
    ``~/.cache/kvcompress/less/<model>-<base>-<tokens>of<window>``. ``layers``: train only these (default all).
    The result loads with ``LessConfig(base=..., budget=..., kernels=out)``.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    model_name = model if isinstance(model, str) else getattr(model.config, "name_or_path", "model") or "model"
    if isinstance(model, str):
        model, tokenizer = load_model(model)
    elif tokenizer is None:
        raise ValueError("give tokenizer= with a model object")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tokens = budget_tokens(budget, window, base)
    base_config = LessConfig(base=base, budget=tokens).base_config
    plus_config = baseline_plus(base_config, rank)
    shape = model_shape(model)
    files = [Path(f) for f in data] if data is not None else default_data_files()
    settings = {
        "window": window,
        "windows": windows,
        "val_fraction": val_fraction,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "rank": rank,
        "hidden": hidden,
        "dropout": dropout,
        "seed": seed,
        "data": data_record(files),
    }
    meta = {
        "format": KERNEL_FORMAT,
        "model": str(Path(str(model_name)).name),
        **shape,
        "rank": rank,
        "hidden": hidden,
        "base": {"name": base_config.name, "budget": tokens, "params": _plain(dataclasses.asdict(base_config))},
        "training": settings,
    }
    out = Path(out) if out is not None else default_out_dir(meta["model"], base, tokens, window)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "meta.json").is_file():
        old = read_meta(out)
        keys = ("model", "num_layers", "q_heads", "kv_heads", "head_dim", "rank", "hidden", "base", "training")
        changed = [key for key in keys if old.get(key) != meta.get(key)]
        if changed:
            raise ValueError(
                f"{out} holds a LESS training run with other settings ({', '.join(changed)} differ); "
                "resume it with the same settings or give another --out"
            )
    else:
        write_atomically(out / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")

    todo = [
        i for i in (layers if layers is not None else range(shape["num_layers"])) if not layer_file(out, i).exists()
    ]
    if not todo:
        logger.info("all requested layers are trained in %s", out)
        _cleanup(out, shape["num_layers"], keep_activations)
        return out
    activations = out / "activations"
    ids_path = out / "windows.pt"
    if ids_path.is_file():
        ids = load_tensors(ids_path, "the LESS training windows", f"delete it to sample them again in {out}")["ids"]
    else:
        ids, names = sample_windows(tokenizer, files, window, windows, seed)
        torch.save({"ids": ids, "names": names}, ids_path)
    if not all((activations / f"layer_{i:03d}.pt").is_file() for i in todo):
        started = time.perf_counter()
        collect_attention_inputs(model, ids, activations, progress=progress)
        logger.info("collected %d windows x %d tokens in %.0f s", ids.shape[0], window, time.perf_counter() - started)
    for layer_idx in track_if(todo, f"training {len(todo)} layers", progress):
        if layer_file(out, layer_idx).exists():  # finished meanwhile by another process on the same directory
            continue
        saved = load_tensors(activations / f"layer_{layer_idx:03d}.pt", "attention inputs", f"delete {activations}")
        kernels, record = train_layer(model, layer_idx, saved, base_config, plus_config, settings)
        save_layer(out, layer_idx, kernels, extra=record)
        logger.info(
            "layer %d done in %.0f s: val MSE %.6f (baseline %.6f, baseline+ %.6f), best epoch %d",
            layer_idx,
            record["time_s"],
            record["best_val_mse"],
            record["baseline_val_mse"],
            record["baseline_plus_val_mse"],
            record["best_epoch"],
        )
    _cleanup(out, shape["num_layers"], keep_activations)
    return out


def _cleanup(out: Path, num_layers: int, keep_activations: bool) -> None:
    if keep_activations or not all(layer_file(out, i).exists() for i in range(num_layers)):
        return
    shutil.rmtree(out / "activations", ignore_errors=True)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.train.less", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name or path")
    parser.add_argument("--base", default="h2o", help="evicting method (h2o, streaming = Λ, tova, ...)")
    parser.add_argument("--budget", type=float, default=0.1, help="tokens per KV head, or a share of --window (<1)")
    parser.add_argument("--data", nargs="*", default=None, help="training text files/folders")
    parser.add_argument("--out", default=None, help="kernel directory (default under ~/.cache/kvcompress/less)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="train only these layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep-activations", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)  # also under `kvcompress train less`, whose CLI configured WARNING
    budget: float | int = int(args.budget) if args.budget >= 1 else args.budget
    out = train_less(
        args.model,
        args.base,
        budget,
        args.data,
        args.out,
        window=args.window,
        windows=args.windows,
        val_fraction=args.val_fraction,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        rank=args.rank,
        hidden=args.hidden,
        dropout=args.dropout,
        layers=args.layers,
        seed=args.seed,
        threads=args.threads,
        keep_activations=args.keep_activations,
        progress=not args.no_progress,
    )
    print(out)


if __name__ == "__main__":
    main()
