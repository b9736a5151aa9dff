"""Models: the offline registry, loading (with GGUF conversion), shape facts, and tiny models for tests."""

from kvcompress.models.loading import list_models, load_model, model_info
from kvcompress.models.registry import (
    CACHE_ENV,
    DEFAULT_MODEL,
    MODELS,
    GGUFPart,
    ModelInfo,
    ModelNotInstalledError,
    ModelSpec,
    cache_root,
    is_cached,
    model_cache_dir,
)
from kvcompress.models.testing import TINY_KINDS, tiny_model, tiny_tokenizer

__all__ = [
    "CACHE_ENV",
    "DEFAULT_MODEL",
    "MODELS",
    "TINY_KINDS",
    "GGUFPart",
    "ModelInfo",
    "ModelNotInstalledError",
    "ModelSpec",
    "cache_root",
    "is_cached",
    "list_models",
    "load_model",
    "model_cache_dir",
    "model_info",
    "tiny_model",
    "tiny_tokenizer",
]
