"""Quantized storage (issue 49) against transformers' ``QuantizedCache`` and the full-precision cache
(docs/results/quantization.md; the decoding step is ``python -m kvcompress.bench.speed`` with method specs).

    python -m experiments.quantization vs-transformers [--prompt 512] [--steps 64]   # needs optimum-quanto

``vs-transformers``: SmolLM2-135M, a prompt from a shipped book in one forward then ``--steps`` tokens of the book
fed one at a time (teacher forcing), through (a) ``DynamicCache``, (b) transformers' ``QuantizedCache`` on the quanto
backend with KIVI's axes (keys per channel: ``axis_key=-1``, values per token: ``axis_value=0``), (c) kvcompress's
``full`` at the same bits, group and residual. Prints the largest and mean absolute logit difference of each pair
and how often the top-1 tokens agree.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

import kvcompress
from kvcompress.eval.data import gutenberg_books
from kvcompress.generation import cache_argument
from kvcompress.models import load_model


def book_ids(tokenizer, length: int) -> torch.Tensor:
    text = gutenberg_books()[1].text
    ids = tokenizer(text[len(text) // 3 :], return_tensors="pt", add_special_tokens=False).input_ids
    return ids[:, :length]


def forced_logits(model, ids: torch.Tensor, cache, prompt: int) -> torch.Tensor:
    with torch.no_grad():
        out = [model(ids[:, :prompt], **cache_argument(model, cache), use_cache=True).logits[:, -1]]
        for step in range(prompt, ids.shape[1]):
            out.append(model(ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True).logits[:, -1])
    return torch.stack(out, 1).float()


def vs_transformers(prompt: int, steps: int, bits: int, group: int, residual: int) -> None:
    from transformers.cache_utils import QuantizedCache  # the quanto backend imports optimum-quanto

    model, tokenizer = load_model("smollm2-135m")
    ids = book_ids(tokenizer, prompt + steps)
    model.set_attn_implementation("sdpa")
    exact = forced_logits(model, ids, DynamicCache(config=model.config), prompt)
    hf = QuantizedCache(
        "quanto", model.config, nbits=bits, axis_key=-1, axis_value=0, q_group_size=group, residual_length=residual
    )
    theirs = forced_logits(model, ids, hf, prompt)
    ours_cache = kvcompress.cache_for(model, "full", kv_bits=bits, kv_group=group, kv_residual=residual)
    ours = forced_logits(model, ids, ours_cache, prompt)
    print(f"SmolLM2-135M, prompt {prompt} + {steps} forced steps, {bits} bits, group {group}, residual {residual}")
    print("| pair | max abs logit diff | mean abs logit diff | top-1 agreement |")
    print("|---|---|---|---|")
    for name, a, b in (
        ("transformers QuantizedCache (quanto) vs DynamicCache", theirs, exact),
        ("kvcompress full kv_bits vs DynamicCache", ours, exact),
        ("kvcompress vs transformers QuantizedCache", ours, theirs),
    ):
        diff = (a - b).abs()
        agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        print(f"| {name} | {float(diff.max()):.3f} | {float(diff.mean()):.4f} | {agree:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("vs-transformers",))
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--residual", type=int, default=128)
    args = parser.parse_args()
    vs_transformers(args.prompt, args.steps, args.bits, args.group, args.residual)


if __name__ == "__main__":
    main()
