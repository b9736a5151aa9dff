"""PoD stage 2 (arXiv:2412.02252 §2.2): continued next-token training of the
model *with PoD attention*, and the matching control (the same data, steps and optimiser with dense attention).

The PoD forward is the library's own: every step runs the model through a fresh ``PoDCache`` (``use_cache=True``),
so training, teacher-forced evaluation and decoding share one attention implementation (tests check that decoding
equals teacher forcing). Gradients flow into the block-start layers' queries and keys from every layer that reads
them (no detach). The control (``--control``) trains with plain SDPA attention and no cache.

Defaults are a small-scale recipe where the paper is silent: AdamW (β = 0.9/0.95, weight decay 0.1), gradient
clipping 1.0, linear warm-up over 5 % of the steps then cosine decay to 10 % of the peak, next-token cross-entropy
on every token, windows of ``length`` tokens cut from the training text (the data folder's Gutenberg books;
evaluation uses WikiText-2 test and the essays, never these), fp32 on CPU. The paper trains all parameters at lr
1e-5 on 5B tokens; at 10^5 tokens 1e-5 barely moves a model, so the default peak lr is 1e-4. ``trainable="attention"``
(q/k/v/o projections only) is the cheaper variant: it skips the MLP and embedding weight gradients and keeps
optimiser state small.

Resumable: ``OUT/checkpoint.pt`` (trainable weights, optimiser, step, data order) is written every
``save_every`` steps and at the end; rerunning the same command continues from it. ``OUT/log.jsonl`` has one line
per step; ``OUT/final.pt`` the trained weights (trainable parameters only; load with ``load_adapted``).

    python -m kvcompress.train.pod_adapt --similarity ~/.cache/kvcompress/pod/smollm2-135m-similarity.pt \\
        --delta 0.5 --n-sink 16 --n-recent 64 --length 512 --steps 200 --out ~/.cache/kvcompress/pod/adapt-d05
    python -m kvcompress.train.pod_adapt --control --length 512 --steps 200 --out ~/.cache/kvcompress/pod/control
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from kvcompress.core.attention import prepare_model
from kvcompress.core.cache import CompressedCache
from kvcompress.files import load_tensors, require_keys, write_atomically
from kvcompress.generation import cache_argument
from kvcompress.methods.pod import PoDConfig
from kvcompress.models import load_model
from kvcompress.train.pod_calibrate import default_output, default_training_files, token_windows

logger = logging.getLogger(__name__)
ATTENTION_PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class AdaptConfig:
    """Hyper-parameters of one adaptation run (saved in the checkpoint; a resume must use the same)."""

    steps: int = 200  # optimiser steps
    batch: int = 2  # windows per step
    length: int = 512  # tokens per window
    lr: float = 1e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of the peak
    warmup: float = 0.05  # fraction of steps with linear warm-up
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0  # gradient-norm clipping
    trainable: str = "all"  # "all" (paper) or "attention" (q/k/v/o projections)
    seed: int = 0  # data order
    save_every: int = 25  # steps between checkpoints


def lr_at(step: int, config: AdaptConfig) -> float:
    """Linear warm-up, then cosine from ``lr`` to ``lr * min_lr_ratio`` at the last step."""
    warm = max(1, round(config.warmup * config.steps))
    if step < warm:
        return config.lr * (step + 1) / warm
    progress = (step - warm) / max(1, config.steps - warm)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def trainable_parameters(model: PreTrainedModel, which: str) -> dict[str, torch.nn.Parameter]:
    if which not in ("all", "attention"):
        raise ValueError(f"trainable must be 'all' or 'attention'; got {which!r}")
    chosen = {}
    for name, param in model.named_parameters():
        use = which == "all" or any(f".{part}." in name for part in ATTENTION_PARAMS)
        param.requires_grad_(use)
        if use:
            chosen[name] = param
    return chosen


def lm_loss(model: PreTrainedModel, input_ids: torch.Tensor, pod: PoDConfig | None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``input_ids`` ``[B, n]`` with PoD attention (a fresh cache) or dense."""
    if pod is None:
        model.set_attn_implementation("sdpa")
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    prepare_model(model)
    cache = CompressedCache(model, pod)
    return model(input_ids=input_ids, labels=input_ids, use_cache=True, **cache_argument(model, cache)).loss


def _save(path: Path, payload: dict) -> None:
    write_atomically(path, lambda temporary: torch.save(payload, temporary))


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines of steps after ``step`` (a run stopped between checkpoints redoes them on resume)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))


def adapt(
    model: PreTrainedModel,
    windows: torch.Tensor,
    pod: PoDConfig | None,
    config: AdaptConfig,
    out: str | os.PathLike[str],
    stop_after: int | None = None,
) -> Path | None:
    """Train ``model`` in place on ``windows`` ``[N, length]`` with PoD attention (``pod``) or dense (``None``).

    Resumes from ``out/checkpoint.pt`` when present; ``stop_after`` ends this call (with a checkpoint) after that
    many steps, to split a run across sessions. Returns the path of ``out/final.pt`` (``None`` if stopped early).
    """
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    params = trainable_parameters(model, config.trainable)
    optimizer = torch.optim.AdamW(
        list(params.values()), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(config.seed))
    needed = config.steps * config.batch
    if needed > len(windows):  # more than one epoch: repeat the permutation
        order = order.repeat(math.ceil(needed / len(windows)))
    step = 0
    checkpoint_path = out / "checkpoint.pt"
    if checkpoint_path.exists():
        state = load_tensors(checkpoint_path, "a pod-adapt checkpoint", f"delete it to start over in {out}")
        if state["config"] != asdict(config):
            raise ValueError(f"{checkpoint_path} was written with other settings: {state['config']}")
        model.load_state_dict(state["params"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        logger.info("resuming %s at step %d", out, step)
        _truncate_log(out / "log.jsonl", step)
    (out / "run.json").write_text(
        json.dumps({"adapt": asdict(config), "pod": None if pod is None else repr(pod)}, indent=1) + "\n"
    )
    model.train()
    log = (out / "log.jsonl").open("a")
    first = step
    while step < config.steps and (stop_after is None or step - first < stop_after):
        started, cpu_started = time.perf_counter(), time.process_time()
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = windows[order[step * config.batch : (step + 1) * config.batch]]
        loss = lm_loss(model, batch, pod)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss_value = float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), config.clip)
        optimizer.step()
        del loss
        gc.collect()  # the PoD cache's layers reference each other: free this step's graph now, not at gen-2 GC
        step += 1
        record = {
            "step": step,
            "loss": round(loss_value, 5),
            "lr": lr,
            "grad_norm": round(float(norm), 4),
            "tokens": step * config.batch * config.length,
            "time_s": round(time.perf_counter() - started, 2),
            "cpu_s": round(time.process_time() - cpu_started, 2),
        }
        log.write(json.dumps(record) + "\n")
        log.flush()
        last = step == config.steps or (stop_after is not None and step - first == stop_after)
        if step % config.save_every == 0 or last:
            _save(
                checkpoint_path,
                {
                    "config": asdict(config),
                    "step": step,
                    "params": {name: p.detach() for name, p in params.items()},
                    "optimizer": optimizer.state_dict(),
                },
            )
    log.close()
    model.eval()
    if step < config.steps:
        return None
    final = out / "final.pt"
    _save(final, {"config": asdict(config), "params": {name: p.detach() for name, p in params.items()}})
    return final


def load_adapted(model: PreTrainedModel, path: str | os.PathLike[str]) -> PreTrainedModel:
    """Load the weights of an adaptation run (``final.pt`` or ``checkpoint.pt``) into ``model``; returns it."""
    state = load_tensors(path, "pod-adapt weights", "use the final.pt or checkpoint.pt of `kvcompress train pod-adapt`")
    state = require_keys(state, ("params",), path, "pod-adapt weights", "re-run `kvcompress train pod-adapt`")
    missing = set(state["params"]) - {name for name, _ in model.named_parameters()}
    if missing:
        raise ValueError(f"{path} has parameters the model lacks: {sorted(missing)[:3]}")
    model.load_state_dict(state["params"], strict=False)
    return model.eval()


def pod_adapt(
    out: str,
    model_name: str = "smollm2-135m",
    data: Sequence[str] | None = None,
    similarity: str | None = None,
    delta: float = 0.5,
    target_saving: float | None = None,
    n_sink: int = 16,
    n_recent: int = 64,
    query_source: str = "block_start",
    control: bool = False,
    threads: int = 1,
    stop_after: int | None = None,
    **hyper: object,
) -> Path | None:
    """Command-line entry as a function: load the model and data, build the PoD config (or none for the
    control), train. ``hyper`` are ``AdaptConfig`` fields."""
    torch.set_num_threads(threads)
    config = AdaptConfig(**hyper)  # type: ignore[arg-type]
    model, tokenizer = load_model(model_name)
    pod = None
    if not control:
        similarity = similarity or str(default_output(model_name))
        pod = PoDConfig(
            similarity=similarity,
            delta=delta,
            target_saving=target_saving,
            n_sink=n_sink,
            n_recent=n_recent,
            query_source=query_source,
        )
    files = list(data) if data else default_training_files()
    windows = token_windows(tokenizer, files, config.length)
    logger.info("training on %d windows of %d tokens from %d files", len(windows), config.length, len(files))
    return adapt(model, windows, pod, config, out, stop_after)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PoD adaptation: continued LM training with PoD attention.")
    parser.add_argument("--out", required=True, help="run folder (outside the repository), resumable")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", nargs="*", default=None, help="training text files (default: Gutenberg books)")
    parser.add_argument("--similarity", default=None, help="pod-calibrate file (default: the model's in the cache)")
    parser.add_argument("--delta", type=float, default=0.5)
    parser.add_argument("--target-saving", type=float, default=None)
    parser.add_argument("--n-sink", type=int, default=16)
    parser.add_argument("--n-recent", type=int, default=64)
    parser.add_argument("--query-source", choices=("block_start", "own"), default="block_start")
    parser.add_argument("--control", action="store_true", help="dense attention: the same-extra-training control")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop-after", type=int, default=None, help="end this call after that many steps")
    defaults = AdaptConfig()
    for name in ("steps", "batch", "length", "seed", "save_every"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in ("lr", "min_lr_ratio", "warmup", "weight_decay", "clip"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    parser.add_argument("--trainable", choices=("all", "attention"), default=defaults.trainable)
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO)
    out = args.pop("out")
    fixed = {
        k: args.pop(k)
        for k in (
            "model",
            "data",
            "similarity",
            "delta",
            "target_saving",
            "n_sink",
            "n_recent",
            "query_source",
            "control",
            "threads",
            "stop_after",
        )
    }
    fixed["model_name"] = fixed.pop("model")
    path = pod_adapt(out, **fixed, **args)
    print(f"wrote {path}" if path is not None else f"stopped early; rerun the same command to resume from {out}")


if __name__ == "__main__":
    main()
