"""Reading the files a user hands to kvcompress: tensors and plain values only, never code, and every failure one
``ValueError`` naming the file, what is wrong with it and how to get a good one; and writing the files kvcompress
makes whole or not at all (``write_atomically``).

``torch.load`` is always called with ``weights_only=True``: a pickle that would import or call anything (a crafted
checkpoint running a shell command) is refused before any of it runs. JSON files are read as JSON.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections.abc import Callable
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

REFUSED = "Weights only load failed"  # the start of torch.load's message when a pickle asks for more than tensors


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], object] | str) -> Path:
    """Make ``path`` with ``write(temporary)`` (or this text), a file beside it renamed over ``path`` once complete:
    no reader and no interrupted run sees half a file, and a file ``path`` held before stays whole until then."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        if isinstance(write, str):
            temporary.write_text(write, encoding="utf-8")
        else:
            write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def load_tensors(path: str | os.PathLike[str], what: str, remedy: str) -> Any:
    """The contents of the ``torch.save`` file ``path`` (``what`` it should be, e.g. "a LESS kernel file"), loaded
    on the CPU with ``weights_only=True``; ``remedy`` says how to get a good file (rewrite it, re-run the command)."""
    path = Path(path).expanduser()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{path} ({what}) does not exist; {remedy}") from None
    except IsADirectoryError:
        raise ValueError(f"{path} ({what}) is a folder, not a file; {remedy}") from None
    except pickle.UnpicklingError as error:
        if str(error).startswith(REFUSED):
            raise ValueError(
                f"{path} ({what}) holds Python objects besides tensors and plain values, which could run code when "
                f"loaded, so it is refused; {remedy}"
            ) from None
        raise damaged(path, what, remedy, error) from None
    except (EOFError, RuntimeError, zipfile.BadZipFile, OSError, ValueError) as error:
        raise damaged(path, what, remedy, error) from None


def load_json(path: str | os.PathLike[str], what: str, remedy: str) -> Any:
    """The JSON value in ``path``, or a ``ValueError`` naming the file, the line and the remedy."""
    path = Path(path).expanduser()
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} ({what}) does not exist; {remedy}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} ({what}) is not valid JSON (line {error.lineno}: {error.msg}); {remedy}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} ({what}) is not UTF-8 text; {remedy}") from None


def damaged(path: Path, what: str, remedy: str, error: BaseException | str) -> ValueError:
    """The error for a file that cannot be read as ``what`` (cut short, overwritten, another format)."""
    reason = " ".join(str(error).split()) or type(error).__name__
    return ValueError(f"{path} ({what}) is damaged or not such a file ({reason[:200]}); {remedy}")


def require_keys(data: Any, keys: tuple[str, ...], path: str | os.PathLike[str], what: str, remedy: str) -> dict:
    """``data`` when it is a dict with every key in ``keys``, else the ``damaged`` error."""
    if not isinstance(data, dict):
        raise damaged(Path(path), what, remedy, f"holds a {type(data).__name__}, not a dict")
    missing = [key for key in keys if key not in data]
    if missing:
        raise damaged(Path(path), what, remedy, f"no {', '.join(missing)}")
    return data


def shipped_folder(kind: str) -> Path:
    """The folder of the files of one kind that come with the package (``kvcompress/data/<kind>``)."""
    return Path(str(resources.files("kvcompress") / "data" / kind))


@lru_cache(maxsize=8)
def shipped_json_meta(kind: str) -> dict[str, dict]:
    """Name -> ``meta`` entry of each JSON file shipped in ``data/<kind>`` (a calibration's model description)."""
    folder = shipped_folder(kind)
    if not folder.is_dir():
        return {}
    return {path.stem: json.loads(path.read_text())["meta"] for path in sorted(folder.glob("*.json"))}


def shipped_json(kind: str, name: str) -> Path | None:
    """The shipped JSON file ``data/<kind>/<name>.json`` (e.g. ``"smollm2-135m"``), or ``None``."""
    path = shipped_folder(kind) / f"{name}.json"
    return path if path.is_file() else None
