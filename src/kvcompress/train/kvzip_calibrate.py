"""KVzip's head scores for a model (``kvcompress train kvzip-calibrate``): the scores ``kvzip`` ``level="head"``
ranks KV heads by (``kvcompress.methods.kvzip.head``).

As the official code (github.com/snu-mllab/KVzip: ``test.py --save_head_score``, ``load_head_score``): each
calibration context is put after a system prompt, prefilled, and scored by KVzip's reconstruction (this package's
``kvzip`` pair-level scoring, ``kvcompress.methods.kvzip.reconstruct``: each pair's largest attention probability
from a reconstruction query of its KV head's group); a (layer, KV head)'s score for that context is the maximum over
the context's tokens (the system prompt is not scored), and its score over the contexts is the maximum over them.

Choices where this differs from or fills in for the official code:

- The contexts: ``--samples`` windows of ``--length`` tokens cut evenly from the books shipped with kvcompress
  (``kvcompress.eval.data``, the windows ``duo-calibrate`` cuts; ``--data`` a folder of text files instead). The
  official code scores one SCBench ``scbench_qa_eng`` context (English question answering over a long text) per
  saved file and recommends adding an ``scbench_repoqa`` one for code: a download this command does not make.
- The system prompt: the official code's question-answering template (system message "You are a helpful
  assistant.", then the user turn opening with "Given the context, answer to the following question or request
  without explanation." and a blank line), written by the model's own chat template: the text the template puts
  before the user turn's content (a tokenizer without a template: its BOS token, then that sentence). Its tokens
  are ``kvzip``'s ``prefix`` (not reconstructed, not scored) and its ``n_sink`` (the reconstruction's softmax counts
  them, as the official code's counts its system prompt).
- The reconstruction: ``kvzip``'s defaults (chunks of 2,048 tokens, its prompts), in float32 (the official code
  takes the softmax in the model's dtype).

The file written is JSON in DuoAttention's pattern layout with the format ``kvcompress-kvzip-head-scores``
(``kvcompress.methods.duo.patterns``): the scores ``[layers][KV heads]``, the sizes a streaming head keeps (128 sinks
and 256 recent tokens: ``duo``'s, see ``kvcompress.methods.kvzip.head``) and how it was made. The files shipped
(``kvcompress/data/kvzip``):

    kvcompress train kvzip-calibrate --model smollm2-135m --samples 8 --length 2048 \
        --out src/kvcompress/data/kvzip/smollm2-135m.json
    kvcompress train kvzip-calibrate --model qwen2.5-coder-0.5b --samples 4 --length 2048 \
        --out src/kvcompress/data/kvzip/qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvcompress
from kvcompress.eval.data import BOOKS, load_documents
from kvcompress.generation import cache_argument
from kvcompress.methods.duo.patterns import DuoPattern, write_pattern
from kvcompress.methods.kvzip.head import KIND
from kvcompress.methods.kvzip.reconstruct import reconstruction_scores
from kvcompress.models import load_model
from kvcompress.train.duo_calibrate import RECENT_SIZE, SINK_SIZE, calibration_windows

logger = logging.getLogger(__name__)
SYSTEM = "You are a helpful assistant."
INSTRUCTION = "Given the context, answer to the following question or request without explanation.\n\n"


def default_output(model_name: str) -> Path:
    root = Path(os.environ.get("KVCOMPRESS_CACHE", Path.home() / ".cache" / "kvcompress"))
    return root / "kvzip" / f"{Path(model_name).name.replace('/', '--')}.json"


def system_prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids put before each context (see the module docstring)."""
    if tokenizer.chat_template is None:
        text = (tokenizer.bos_token or "") + INSTRUCTION
    else:
        marker = "@@context@@"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": INSTRUCTION + marker}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False).split(marker)[0]
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def context_head_scores(model: PreTrainedModel, header: list[int], context: torch.Tensor, tokenizer_path: str):
    """``[layers, kv_heads]``: each head's largest reconstruction score over the context's tokens (one context)."""
    ids = torch.cat([torch.tensor(header, dtype=context.dtype), context])[None].to(model.device)
    cache = kvcompress.cache_for(
        model, "kvzip", ratio=1.0, prefix=len(header), n_sink=len(header), tokenizer=tokenizer_path
    )
    model(input_ids=ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    scores = reconstruction_scores(cache.config, model, cache, ids, None)
    return torch.stack([score[0, :, len(header) :].amax(-1) for score in scores]).double().cpu().numpy()


def kvzip_calibrate(
    model_name: str,
    data: str | None = None,
    samples: int = 8,
    length: int = 2048,
    out: str | None = None,
    threads: int = 1,
) -> Path:
    if samples < 1 or length < 1:
        raise ValueError(f"--samples and --length must be >= 1; got {samples}, {length}")
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name)
    documents = load_documents(Path(data) if data else BOOKS)
    windows = calibration_windows(tokenizer, [doc.text for doc in documents], samples, length)
    header = system_prompt_ids(tokenizer)
    path = getattr(model.config, "name_or_path", "") or ""
    scores = None
    for index, window in enumerate(windows):
        logger.info("context %d/%d", index + 1, len(windows))
        found = context_head_scores(model, header, window, path)
        scores = found if scores is None else np.maximum(scores, found)  # (the official load_head_score's amax)
    meta = {
        "model": model_name,
        "calibration": "KVzip head scores (arXiv 2505.23416; official test.py --save_head_score): per context the "
        "max over its tokens of the reconstruction scores, then the max over contexts",
        "data": "kvcompress shipped books" if not data else str(data),
        "documents": [doc.name for doc in documents],
        "samples": samples,
        "length": length,
        "system_prompt_tokens": len(header),
    }
    return write_pattern(DuoPattern(scores, SINK_SIZE, RECENT_SIZE, meta), out or default_output(model_name), KIND)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="KVzip head scores (the paper's context-independent head level).")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=None, help="a folder of text files (default: the books kvcompress ships)")
    parser.add_argument("--samples", type=int, default=8, help="calibration contexts")
    parser.add_argument("--length", type=int, default=2048, help="context length in tokens")
    parser.add_argument("--out", default=None, help="output .json (default ~/.cache/kvcompress/kvzip/MODEL.json)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = kvzip_calibrate(args.model, args.data, args.samples, args.length, args.out, args.threads)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
