"""PoD stage 1 (arXiv:2412.02252 §2.1): inter-layer attention similarity of a dense model.

For each of ``samples`` windows of ``length`` tokens, the attention rows of the last ``last_queries`` queries are
taken at every layer and query head (the core's last-rows statistics: SDPA plus one ``q x L`` block per layer, no
``L x L`` matrix), and the Jensen-Shannon divergence (log base 2, in ``[0, 1]``) between every pair of layers is
accumulated per head on the fly; only one window's rows are ever in memory. Eq. 2's "average JS divergence" is
read as a similarity ``1 - mean JS`` (``"1-sqrt(js)"``, one minus the mean JS distance, is the option).

The file written (``torch.save``; ``--json`` also writes a JSON copy) holds ``sim`` ``[H_q, L, L]`` (float32,
symmetric, 1 on the diagonal), ``js`` (the mean divergence), ``kv_heads`` and ``meta`` (model, data, sizes).
``kvcompress.methods.pod.grouping`` and ``PoDConfig(similarity=...)`` read it.

    python -m kvcompress.train.pod_calibrate --model smollm2-135m --samples 8 --length 1024
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvcompress.core.attention import prepare_model
from kvcompress.core.cache import CompressedCache
from kvcompress.core.contract import MethodConfig, Policy, StatsRequest
from kvcompress.eval.data import data_root, read_text, strip_gutenberg
from kvcompress.files import write_atomically
from kvcompress.generation import cache_argument
from kvcompress.models import load_model

logger = logging.getLogger(__name__)
SIMILARITIES = ("1-js", "1-sqrt(js)")


def default_output(model_name: str) -> Path:
    root = Path(os.environ.get("KVCOMPRESS_CACHE", Path.home() / ".cache" / "kvcompress"))
    return root / "pod" / f"{model_name.replace('/', '--')}-similarity.pt"


def default_training_files() -> list[Path]:
    """The training text (calibrate on the post-training distribution): the data folder's Gutenberg books."""
    return sorted((data_root() / "gutenberg").glob("*.txt"))


def token_windows(
    tokenizer: PreTrainedTokenizerBase, files: Sequence[str | os.PathLike[str]], length: int, count: int | None = None
) -> torch.Tensor:
    """``[N, length]`` windows cut from the concatenated files (documents joined by EOS). ``count`` windows spaced
    evenly over the stream (all windows if ``None``)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for file in files:
        text = strip_gutenberg(read_text(file))
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    total = len(ids) // length
    if total == 0:
        raise ValueError(f"the data holds {len(ids)} tokens, fewer than one window of length={length}")
    windows = torch.tensor(ids[: total * length], dtype=torch.long).view(total, length)
    if count is None or count >= total:
        return windows
    return windows[torch.linspace(0, total - 1, count).round().long()]


class _RowsPolicy(Policy):
    """Keeps everything; remembers the last rows of the last forward for the calibration to read."""

    def __init__(self, config: _RowsConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.stats = StatsRequest(last_queries=config.last_queries)
        self.rows: torch.Tensor | None = None

    def observe(self, layer, stats):
        self.rows = stats.last


@dataclass(frozen=True)
class _RowsConfig(MethodConfig):
    last_queries: int = 16
    policy_class = _RowsPolicy


def entropy2(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits over the last dimension (``0 log 0 = 0``)."""
    return -(p * torch.log2(p.clamp_min(1e-30))).sum(-1)


def pairwise_js(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[L, H, q, n]`` (probability rows) -> ``[L, L, H, q]`` Jensen-Shannon divergences in bits."""
    layers = rows.shape[0]
    own = entropy2(rows)  # [L, H, q]
    out = rows.new_zeros(layers, layers, *rows.shape[1:3])
    for a in range(layers):
        mixed = entropy2((rows[a][None] + rows[a:]) / 2)  # [L - a, H, q]
        js = (mixed - (own[a][None] + own[a:]) / 2).clamp(0, 1)
        out[a, a:] = js
        out[a:, a] = js
    return out


@torch.no_grad()
def calibrate(
    model: PreTrainedModel,
    windows: torch.Tensor,
    last_queries: int = 16,
    similarity: str = "1-js",
) -> dict:
    """Per-head layer similarity ``[H_q, L, L]`` of ``model`` over ``windows`` ``[N, n]`` (Eq. 1-2)."""
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {', '.join(SIMILARITIES)}; got {similarity!r}")
    if not 1 <= last_queries <= windows.shape[1]:
        raise ValueError(f"last_queries must be in [1, {windows.shape[1]}] (window length); got {last_queries}")
    prepare_model(model)
    config = _RowsConfig(last_queries=last_queries)
    total_js = total_dist = None
    for index, window in enumerate(windows):
        cache = CompressedCache(model, config)
        model(input_ids=window[None], use_cache=True, logits_to_keep=1, **cache_argument(model, cache))
        rows = torch.stack([layer.policy.rows[0].flatten(0, 1) for layer in cache.compressed_layers])  # [L,H,q,n]
        js = pairwise_js(rows.double())
        js_mean, dist_mean = js.mean(-1), js.sqrt().mean(-1)
        total_js = js_mean if total_js is None else total_js + js_mean
        total_dist = dist_mean if total_dist is None else total_dist + dist_mean
        logger.info("calibration window %d/%d", index + 1, len(windows))
    count = len(windows)
    js = (total_js / count).permute(2, 0, 1)  # [H, L, L]
    dist = (total_dist / count).permute(2, 0, 1)
    sim = 1 - (js if similarity == "1-js" else dist)
    text_config = model.config.get_text_config()
    return {
        "sim": sim.float(),
        "js": js.float(),
        "kv_heads": int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads),
        "meta": {
            "similarity": similarity,
            "samples": count,
            "length": int(windows.shape[1]),
            "last_queries": last_queries,
            "layers": int(sim.shape[1]),
            "heads": int(sim.shape[0]),
        },
    }


def save_similarity(
    result: dict, path: str | os.PathLike[str], json_path: str | os.PathLike[str] | None = None
) -> None:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda temporary: torch.save(result, temporary))
    if json_path is not None:
        data = {
            "sim": [[[round(float(v), 5) for v in row] for row in head] for head in result["sim"]],
            "kv_heads": result["kv_heads"],
            "meta": result["meta"],
        }
        write_atomically(json_path, json.dumps(data, separators=(",", ":")) + "\n")


def pod_calibrate(
    model_name: str = "smollm2-135m",
    data: Sequence[str] | None = None,
    samples: int = 8,
    length: int = 1024,
    last_queries: int = 16,
    similarity: str = "1-js",
    out: str | None = None,
    json_out: str | None = None,
    threads: int = 1,
) -> Path:
    """Load a model, calibrate on ``data`` (default: the data folder's Gutenberg books), save; returns the path."""
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name)
    files = list(data) if data else default_training_files()
    windows = token_windows(tokenizer, files, length, samples)
    result = calibrate(model, windows, last_queries, similarity)
    result["meta"].update(model=model_name, data=[Path(f).name for f in files])
    path = Path(out).expanduser() if out else default_output(model_name)
    save_similarity(result, path, json_out)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PoD calibration: per-head inter-layer attention similarity.")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", nargs="*", default=None, help="text files (default: shared Gutenberg books)")
    parser.add_argument("--samples", type=int, default=8, help="windows N")
    parser.add_argument("--length", type=int, default=1024, help="window length n in tokens")
    parser.add_argument("--last-queries", type=int, default=16, help="q: last queries whose rows are compared")
    parser.add_argument("--similarity", choices=SIMILARITIES, default="1-js")
    parser.add_argument("--out", default=None, help="output .pt (default ~/.cache/kvcompress/pod/MODEL-similarity.pt)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write a JSON copy here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = pod_calibrate(
        args.model,
        args.data,
        args.samples,
        args.length,
        args.last_queries,
        args.similarity,
        args.out,
        args.json_out,
        args.threads,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
