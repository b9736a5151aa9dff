"""kvcompress: KV-cache compression as real ``transformers`` caches.

>>> cache = kvcompress.cache_for(model, "streaming", budget=256)
>>> model.generate(input_ids, cache=cache, max_new_tokens=64)  # transformers < 5.24: past_key_values=cache
"""

from __future__ import annotations

from transformers import PreTrainedModel

from kvcompress.core.attention import prepare_model
from kvcompress.core.cache import CompressedCache
from kvcompress.core.layer import CompressedLayer
from kvcompress.machine import VERSION
from kvcompress.persist import load_cache, save_cache
from kvcompress.registry import METHODS, MethodConfig, make_config

__version__ = VERSION


def cache_for(model: PreTrainedModel, method: str | MethodConfig = "full", **params: object) -> CompressedCache:
    """Prepare ``model`` for kvcompress attention and return an empty cache applying ``method`` to every layer.

    ``method`` is a registry name (see ``kvcompress.METHODS``) with its parameters as keywords, e.g.
    ``cache_for(model, "h2o", budget=512)``, or a method config object. Use a fresh cache per generation (or
    ``cache.reset()`` it): a second ``generate`` on a cache an earlier one filled is refused.
    """
    config = make_config(method, **params)
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"model must be a transformers causal language model (a PreTrainedModel); got {type(model).__name__}"
        )
    prepare_model(model)
    return CompressedCache(model, config)


__all__ = [
    "METHODS",
    "CompressedCache",
    "CompressedLayer",
    "MethodConfig",
    "cache_for",
    "load_cache",
    "make_config",
    "prepare_model",
    "save_cache",
]
