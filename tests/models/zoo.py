"""Tiny randomly initialised models of every architecture family the library claims (no download).

Each has 2 to 4 layers, hidden 64, vocab 128 (token ids as ``tiny_tokenizer``), weights from a fixed seed, fp32,
eval mode. The families differ in what the cache must get right: grouped KV heads, q/k/v biases, a sliding window
on every layer, partial rotary dimensions, hybrid sliding + global layers with two RoPE bases, RoPE scaling
(llama3, yarn with an attention factor), and no RoPE at all.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedModel,
    Qwen2Config,
)

SLIDING_WINDOW = 8  # Mistral's and Gemma-3's sliding layers: shorter than the test prompts
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _configs() -> dict[str, Any]:
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    return {
        "llama-gqa": LlamaConfig(**COMMON, rope_parameters=ROPE),
        "qwen2": Qwen2Config(**COMMON, rope_parameters=ROPE, use_sliding_window=False),
        "mistral-sliding": MistralConfig(**COMMON, rope_parameters=ROPE, sliding_window=SLIDING_WINDOW),
        "phi3-partial": Phi3Config(
            **{**COMMON, "num_key_value_heads": 4},
            rope_parameters={**ROPE, "partial_rotary_factor": 0.5},
        ),
        "neox-rotary-pct": GPTNeoXConfig(
            **{k: v for k, v in COMMON.items() if k != "num_key_value_heads"},
            rope_parameters={**ROPE, "partial_rotary_factor": 0.25},
            use_parallel_residual=True,
        ),
        "gemma3-hybrid": Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        ),
        "llama3-scaling": LlamaConfig(**COMMON, rope_parameters=llama3),
        "yarn-scaling": LlamaConfig(**COMMON, rope_parameters=yarn),
        "gpt2-no-rope": GPT2Config(
            vocab_size=128,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            initializer_range=0.2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    }


ARCHITECTURES = tuple(_configs())


def zoo_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """The tiny model of architecture ``kind`` (one of ``ARCHITECTURES``), SDPA attention."""
    config = _configs()[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()
