"""The kvpress side of the DuoAttention comparison (docs/results/frontier.md, "DuoAttention"). Runs in the kvpress
environment (scripts/vs_kvpress_env.sh); it never imports kvcompress.

    /work/kvpress-venv/bin/python scripts/vs_kvpress_duo.py runs/duo/inputs.json runs/duo/kvpress.json

Reads the inputs written by ``python -m experiments.compare_duo inputs`` (the local model directory, calibration
windows as token ids, a context's token ids, and the head scores of kvcompress's shipped pattern) and writes:

- ``scores``: kvpress 0.5.5's ``duo_attention_on_the_fly(model, num_samples=N, q_len)`` over the same windows. The
  function samples BookSum chapters (a download) and tokenises them; here ``load_dataset`` gives it N placeholder
  chapters and the tokenizer it builds returns each window's ids, so it scores exactly those windows.
- ``kept``: ``[layer][KV head]`` context indices ``DuoAttentionPress(head_compression_ratio)`` leaves unmasked after
  prefilling the context the way kvpress's pipeline does (``model.model(input_ids=..., past_key_values=cache)``
  under ``with press(model)``), with its head scores taken from the input (``load_attention_pattern`` replaced) and
  the sizes given (kvpress's on-the-fly sizes: 128 sinks, 256 recent).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from vs_kvpress_kept import kept_by_masks  # this script's folder: run as python scripts/vs_kvpress_duo.py


class WindowTokenizer:
    """Stands in for the tokenizer kvpress builds: the "text" of placeholder chapter ``i`` is window ``i``'s ids."""

    def __init__(self, windows: list[list[int]]) -> None:
        self.windows = windows

    def __call__(self, text: str, return_tensors: str = "pt"):
        from transformers import BatchEncoding

        return BatchEncoding({"input_ids": torch.tensor([self.windows[int(text)]])})


class Chapters:
    def __init__(self, count: int) -> None:
        self.count = count

    def to_pandas(self):
        import pandas

        return pandas.DataFrame({"chapter": [str(i) for i in range(self.count)]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import kvpress.presses.duo_attention_press as duo
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    spec = json.loads(args.inputs.read_text())
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    windows = spec["windows"]
    duo.load_dataset = lambda *a, **k: Chapters(len(windows))
    duo.AutoTokenizer.from_pretrained = staticmethod(lambda *a, **k: WindowTokenizer(windows))
    with torch.no_grad():
        scores = duo.duo_attention_on_the_fly(model, num_samples=len(windows), q_len=spec["q_len"])
    pattern = np.array(spec["pattern_scores"], dtype=float)
    sizes = spec["sink_size"], spec["recent_size"]
    duo.DuoAttentionPress.load_attention_pattern = staticmethod(lambda model: (*sizes, pattern))
    press = duo.DuoAttentionPress(head_compression_ratio=spec["head_compression_ratio"])
    context = torch.tensor([spec["context_ids"]])
    with torch.no_grad(), press(model):
        model.model(input_ids=context, past_key_values=DynamicCache())
    kept = kept_by_masks(model, context.shape[1])
    env = {"kvpress": "0.5.5", "transformers": transformers.__version__, "torch": torch.__version__}
    row = {"scores": np.asarray(scores).tolist(), "kept": kept, "streaming": press.streaming_mask.tolist(), "env": env}
    row["compression_ratio"] = press.compression_ratio
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row) + "\n")
    print(f"wrote {args.out}: {int(press.streaming_mask.sum())} streaming heads", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
