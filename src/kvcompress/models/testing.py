"""Tiny randomly initialised models and a character tokenizer for tests (no download)."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config

TINY_KINDS = ("llama", "qwen2", "llama-mha")


def tiny_model(kind: str = "llama", seed: int = 0) -> PreTrainedModel:
    """A tiny randomly initialised causal LM for unit tests (fp32, eval mode, SDPA attention, no download).

    Shapes: 2 layers, hidden 64, head_dim 16, vocab 128, 8192 positions; ``"llama"``: 4 query / 2 KV
    heads (GQA), ``"llama-mha"``: 4 / 4, ``"qwen2"``: Qwen2 with 4 / 2 heads and q/k/v biases. Token ids
    0, 1, 2 are pad, bos, eos (matching ``tiny_tokenizer``). Weights depend only on ``(kind, seed)``;
    the caller's global RNG state is left untouched. Initialised with std 0.2 (not 0.02) so attention is
    clearly non-uniform, which eviction tests need.
    """
    common: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if kind == "llama":
        config = LlamaConfig(num_key_value_heads=2, **common)
    elif kind == "llama-mha":
        config = LlamaConfig(num_key_value_heads=4, **common)
    elif kind == "qwen2":
        # Qwen2 always has biases on q/k/v projections; head_dim is hidden_size / heads (= 16).
        del common["head_dim"]
        config = Qwen2Config(num_key_value_heads=2, use_sliding_window=False, **common)
    else:
        raise ValueError(f"kind={kind!r} is not a tiny model kind; allowed: {', '.join(TINY_KINDS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer matching ``tiny_model``'s vocabulary of 128 (no download).

    Ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, 3 ``<unk>``, then tab, newline and printable ASCII.
    Pads on the left.
    """
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = ["\t", "\n"] + [chr(c) for c in range(32, 127)]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )
