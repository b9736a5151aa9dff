"""A compressed cache saved to disk and loaded back: a context compressed once, reused in later sessions.

>>> kvcompress.save_cache(cache, "context.safetensors")
>>> cache = kvcompress.load_cache("context.safetensors", model)            # or: ..., model, "keydiff", ratio=0.5

The file is one safetensors file: every tensor the cache holds (keys, values, positions, the method's statistics)
as the raw bytes of its storage, so tensors that share memory (views of one buffer) share it again once loaded,
and in its metadata a JSON description of the cache's state: the method's registry name and parameters, the
architecture of the model it was made for, and the cache's objects as plain values (numbers, text, lists,
dictionaries), each object named by its kvcompress class.

Loading runs no code from the file: tensors are read by safetensors, the description by ``json``; the method's
config is rebuilt by ``make_config`` from its name and parameters (validated as any config), the cache by
``cache_for``, and an object of the state only of a class of an already imported ``kvcompress`` module (created
without calling any of its code, its attributes then set); anything else is refused. A file made for another model
(another architecture or configuration: the fields ``kvcompress.core.model_spec`` compares, or another dtype) or,
when the caller names one, for another method or other parameters, is refused with one ``ValueError`` naming the
file and the difference. All tensors are loaded onto one device, the model's unless ``device`` is given.

An object's class may name attributes a file does not hold (``NOT_SAVED``): what the object rebuilds from its
config when it needs it, and holds otherwise as tensors (LESS's kernel modules, whose weights its policy holds as
tensors: those are saved, so a loaded cache continues with the kernels it was made with); they load as ``None``.
What cannot be saved, refused at ``save_cache`` with the reason: a cache holding modules or other objects outside
kvcompress, tensors that require gradients, or per-layer observers (functions).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file
from transformers import PreTrainedModel

from kvcompress.core.attention import prepare_model
from kvcompress.core.cache import CompressedCache
from kvcompress.core.contract import MethodConfig, method_fields
from kvcompress.core.model_spec import ModelCheck, ModelSpec, architecture
from kvcompress.files import damaged
from kvcompress.registry import make_config

# a file holds the cache objects' own attributes: the number changes whenever they do, so a file written by a
# kvcompress whose objects differ is refused with one line instead of loading into objects that miss what they need
FORMAT = "kvcompress-cache/2"
WHAT = "a kvcompress cache file"
REMEDY = "save the cache again with kvcompress.save_cache(cache, path)"
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
)}  # fmt: skip


class _Writer:
    """Turns the cache's object graph into JSON values and a table of storages (one uint8 tensor each)."""

    def __init__(self, cache: CompressedCache) -> None:
        self.cache = cache
        self.objects: list[Any] = []  # the table of objects, containers and configs, by index
        self.ids: dict[int, int] = {}
        self.keep: list[Any] = []  # what the ids refer to stays alive while writing
        self.storages: dict[tuple[str, int], str] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def value(self, obj: Any, where: str) -> Any:
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return {"float": repr(obj)}  # inf and nan too
        if type(obj) is tuple:
            return {"tuple": [self.value(item, f"{where}[{i}]") for i, item in enumerate(obj)]}
        if isinstance(obj, tuple):  # a named tuple of kvcompress's
            items = [self.value(item, f"{where}[{i}]") for i, item in enumerate(obj)]
            return {"named": {"class": self.class_name(obj, where), "items": items}}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": True}
        if isinstance(obj, ModelCheck):
            return {"model_check": True}
        if isinstance(obj, ModelSpec):
            return {"model_spec": True}
        return {"ref": self.ref(obj, where)}

    def ref(self, obj: Any, where: str) -> int:
        if id(obj) in self.ids:
            return self.ids[id(obj)]
        index = self.ids[id(obj)] = len(self.objects)
        self.objects.append(None)
        self.keep.append(obj)
        self.objects[index] = self.entry(obj, where)
        return index

    def entry(self, obj: Any, where: str) -> dict:
        if isinstance(obj, torch.Tensor):  # (in the table: a tensor held twice is one tensor again once loaded)
            attributes = {  # what kvcompress sets on a tensor (the layer its keys belong to)
                name: self.value(item, f"{where}.{name}") for name, item in vars(obj).items()
            }
            return {"tensor": self.tensor(obj, where), "attributes": attributes}
        if isinstance(obj, np.ndarray):  # host-side bookkeeping (ragged storage's block placement)
            if obj.dtype.kind not in "biuf" or obj.dtype.byteorder == ">":
                self.refuse(obj, where)
            copy = torch.from_numpy(np.ascontiguousarray(obj)).clone()
            self.keep.append(copy)  # its storage's address stays its own while the file is written
            return {"ndarray": self.tensor(copy, where)}
        if type(obj) is list:
            return {"list": [self.value(item, f"{where}[{i}]") for i, item in enumerate(obj)]}
        if type(obj) is set:
            return {"set": [self.value(item, f"{where}{{}}") for item in obj]}
        if type(obj) is dict:
            return {"dict": [[self.value(k, where), self.value(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
        if isinstance(obj, MethodConfig):
            fields = {f.name: self.value(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)}
            return {"config": obj.name, "params": fields}
        if not hasattr(obj, "__dict__") or callable(obj) or isinstance(obj, torch.nn.Module):
            self.refuse(obj, where)
        skipped = getattr(type(obj), "NOT_SAVED", ())
        attributes = {
            name: self.value(item, f"{where}.{name}") for name, item in vars(obj).items() if name not in skipped
        }
        return {"class": self.class_name(obj, where), "attributes": attributes}

    def class_name(self, obj: Any, where: str) -> str:
        kind = type(obj)
        if kind.__module__.split(".")[0] != "kvcompress":
            self.refuse(obj, where)
        return f"{kind.__module__}:{kind.__qualname__}"

    def refuse(self, obj: Any, where: str) -> None:
        kind = type(obj)
        raise ValueError(
            f"cannot save a {self.cache.config.name!r} cache: {where} holds a {kind.__module__}.{kind.__qualname__}, "
            "which a cache file cannot hold (tensors, plain values and kvcompress objects only)"
        )

    def tensor(self, tensor: torch.Tensor, where: str) -> dict:
        if tensor.requires_grad:
            raise ValueError(f"cannot save a cache whose {where} requires gradients: save it under torch.no_grad()")
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in self.storages or storage.nbytes() == 0:
            name = self.storages[key] = f"storage.{len(self.tensors)}"
            raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            self.tensors[name] = raw.detach().cpu().clone()
        return {
            "storage": self.storages[key],
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "stride": list(tensor.stride()),
            "offset": tensor.storage_offset(),
        }


def save_cache(cache: CompressedCache, path: str | os.PathLike[str]) -> Path:
    """Write ``cache`` (a ``CompressedCache``, compressed or not) to the safetensors file ``path``; returns it."""
    if not isinstance(cache, CompressedCache):
        raise ValueError(f"cache must be a kvcompress CompressedCache; got {type(cache).__name__}")
    for index, layer in enumerate(cache.compressed_layers):
        if layer.observers:
            raise ValueError(
                f"cannot save a cache with observers (layer {index} has {len(layer.observers)}): remove them"
            )
    writer = _Writer(cache)
    root = writer.ref(cache, "cache")
    description = {
        "format": FORMAT,
        "method": writer.value(cache.config, "cache.config")["ref"],
        "architecture": [list(field) for field in cache.model_check.fields],
        "model": cache.model_spec.describe(),
        "dtype": _cache_dtype(cache),
        "root": root,
        "objects": writer.objects,
    }
    path = Path(path).expanduser()
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save the cache to {str(path)!r}: no folder {str(path.parent)!r}")
    # (safetensors writes a temporary file beside ``path`` and renames it: an interrupted save leaves no half file)
    save_file(writer.tensors, str(path), metadata={"kvcompress": json.dumps(description)})
    return path


def _cache_dtype(cache: CompressedCache) -> str | None:
    for layer in cache.compressed_layers:
        dtype = getattr(layer, "dtype", None)  # the model's (quantized storage holds uint8 codes)
        if isinstance(dtype, torch.dtype):
            return str(dtype).removeprefix("torch.")
        storage = getattr(layer, "slots", None)
        if storage is None:
            storage = getattr(layer, "pool", None)  # ragged storage (per-head budgets)
        if storage is not None:
            return str(storage.keys.dtype).removeprefix("torch.")
    return None


def load_cache(
    path: str | os.PathLike[str],
    model: PreTrainedModel,
    method: str | MethodConfig | None = None,
    device: str | torch.device | None = None,
    **params: object,
) -> CompressedCache:
    """The cache saved in ``path`` by ``save_cache``, ready to continue with ``model``; ``method`` (with its
    ``params``), when given, must be the file's method and parameters. Refusals are one ``ValueError`` each."""
    path = Path(path).expanduser()
    device = torch.device(device) if device is not None else model.device
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            metadata = handle.metadata() or {}
            # copied into memory of PyTorch's own allocation: a buffer safetensors returns may be aligned otherwise,
            # which changes the order of vectorised sums in attention (logits then differ in their last bits)
            storages = {name: handle.get_tensor(name).clone() for name in handle.keys()}  # noqa: SIM118
    except FileNotFoundError:
        raise ValueError(f"{path} ({WHAT}) does not exist; {REMEDY}") from None
    except (SafetensorError, OSError, RuntimeError) as error:
        raise damaged(path, WHAT, REMEDY, error) from None
    try:
        description = json.loads(metadata["kvcompress"])
        if description["format"] != FORMAT:
            raise ValueError(f"{path} is {description['format']!r}, this kvcompress reads {FORMAT!r}; {REMEDY}")
    except (KeyError, TypeError, json.JSONDecodeError):
        raise damaged(path, WHAT, REMEDY, "no kvcompress description in its metadata") from None
    expected = None if method is None else make_config(method, **params)
    try:
        _check_model(path, description, model)
        reader = _Reader(path, description["objects"], storages, device)
        config = reader.config(description["method"])
        if expected is not None and expected != config:
            raise ValueError(f"{path} was saved by {_describe(config)}, not {_describe(expected)}")
        cache = CompressedCache(prepare_model(model), config)
        reader.fresh = cache
        reader.restore(description["root"], cache)
    except (KeyError, TypeError, IndexError, AttributeError) as error:  # a description not written by save_cache
        raise damaged(path, WHAT, REMEDY, f"malformed description ({type(error).__name__}: {error})") from None
    return cache


def _describe(config: MethodConfig) -> str:
    changed = [f"{f.name}={getattr(config, f.name)!r}" for f in method_fields(type(config)) if f.compare]
    return f"{config.name}({', '.join(changed)})"


def _check_model(path: Path, description: dict, model: PreTrainedModel) -> None:
    saved = [tuple(field) for field in description["architecture"]]
    fields = architecture(model.config)
    differ = [f"{a[0]} {a[1]} vs {b[1]}" for a, b in zip(saved, fields, strict=False) if a != b]
    if differ or len(saved) != len(fields):
        raise ValueError(
            f"{path} was saved for {description['model']}, not {ModelSpec.of(model).describe()} "
            f"({'; '.join(differ[:3])}): a cache file continues only the model it was made with"
        )
    dtype = description["dtype"]
    if dtype is not None and dtype != str(model.dtype).removeprefix("torch."):
        raise ValueError(f"{path} holds {dtype} keys and values, the model runs in {model.dtype}: load it in {dtype}")


class _Reader:
    """Rebuilds the objects of a description: kvcompress classes only, no code of theirs called."""

    def __init__(self, path: Path, objects: list, storages: dict[str, torch.Tensor], device: torch.device) -> None:
        self.path, self.table, self.storages, self.device = path, objects, storages, device
        self.built: dict[int, Any] = {}
        self.fresh: CompressedCache | None = None

    def refuse(self, what: str) -> ValueError:
        return damaged(self.path, WHAT, REMEDY, what)

    def config(self, index: int) -> MethodConfig:
        entry = self.table[index]
        if not isinstance(entry, dict) or "config" not in entry:
            raise self.refuse(f"object {index} is no method config")
        if index not in self.built:
            params = {name: self.value(item) for name, item in entry["params"].items()}
            try:
                self.built[index] = make_config(entry["config"], **params)
            except ValueError as error:
                raise ValueError(f"{self.path} holds a method config kvcompress refuses: {error}") from None
        return self.built[index]

    def value(self, encoded: Any) -> Any:
        if encoded is None or isinstance(encoded, (bool, int, str)):
            return encoded
        if not isinstance(encoded, dict) or len(encoded) != 1:
            raise self.refuse(f"unexpected value {str(encoded)[:80]}")
        ((kind, item),) = encoded.items()
        if kind == "float":
            return float(item)
        if kind == "tuple":
            return tuple(self.value(x) for x in item)
        if kind == "named":
            cls = self.kvcompress_class(item["class"])
            if not issubclass(cls, tuple):
                raise self.refuse(f"{item['class']!r} is no named tuple")
            return tuple.__new__(cls, [self.value(x) for x in item["items"]])
        if kind == "dtype":
            if item not in DTYPES:
                raise self.refuse(f"unknown dtype {item!r}")
            return DTYPES[item]
        if kind == "device":
            return self.device
        if kind == "model_check":
            return self.fresh.model_check
        if kind == "model_spec":
            return self.fresh.model_spec
        if kind == "ref":
            return self.ref(item)
        raise self.refuse(f"unknown value kind {kind!r}")

    def ref(self, index: int, into: Any = None) -> Any:
        if index in self.built:
            return self.built[index]
        if not isinstance(index, int) or not 0 <= index < len(self.table):
            raise self.refuse(f"reference {index!r} out of range")
        entry = self.table[index]
        if "config" in entry:
            return self.config(index)
        if "tensor" in entry:
            self.built[index] = made = self.tensor(entry["tensor"])
            for name, item in self.attributes(entry["attributes"]).items():
                setattr(made, name, item)
            return made
        if "ndarray" in entry:
            self.built[index] = made = self.tensor(entry["ndarray"]).cpu().numpy().copy()
            return made
        if "list" in entry:
            self.built[index] = made = []
            made.extend(self.value(x) for x in entry["list"])
        elif "set" in entry:
            self.built[index] = made = set()
            made.update(self.value(x) for x in entry["set"])
        elif "dict" in entry:
            self.built[index] = made = {}
            for key, item in entry["dict"]:
                made[self.value(key)] = self.value(item)
        else:
            made = into if into is not None else object.__new__(self.kvcompress_class(entry.get("class")))
            self.built[index] = made
            made.__dict__.update(self.attributes(entry["attributes"]))
            made.__dict__.update(dict.fromkeys(getattr(type(made), "NOT_SAVED", ())))
        return made

    def attributes(self, encoded: dict) -> dict[str, Any]:
        if any(not isinstance(name, str) or name.startswith("__") for name in encoded):
            raise self.refuse("an attribute name is no plain name")
        return {name: self.value(item) for name, item in encoded.items()}

    def restore(self, root: int, cache: CompressedCache) -> None:
        entry = self.table[root]
        if entry.get("class") != f"{CompressedCache.__module__}:{CompressedCache.__qualname__}":
            raise self.refuse("its root is no CompressedCache")
        config = self.config_index(entry)
        if config is not None:
            self.built[config] = cache.config  # the policies share the cache's own config
        self.ref(root, into=cache)

    @staticmethod
    def config_index(entry: dict) -> int | None:
        found = entry["attributes"].get("config")
        return found["ref"] if isinstance(found, dict) and "ref" in found else None

    def kvcompress_class(self, name: Any) -> type:
        """A class named ``module:qualname`` of an already imported kvcompress module (nothing is imported)."""
        module_name, _, qualname = str(name).partition(":")
        module = sys.modules.get(module_name) if module_name.split(".")[0] == "kvcompress" else None
        found = module
        for part in qualname.split(".") if module is not None else ():
            found = getattr(found, part, None)
        if module is None or not isinstance(found, type) or found.__module__ != module_name:
            raise self.refuse(f"it names {str(name)[:80]!r}, not a kvcompress class this session has loaded")
        return found

    def tensor(self, spec: dict) -> torch.Tensor:
        if "dtype" not in spec or spec["dtype"] not in DTYPES:
            raise self.refuse(f"tensor {str(spec)[:80]}: unknown dtype")
        try:
            raw = self.storages[spec["storage"]]
            dtype = DTYPES[spec["dtype"]]
            typed = raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype, device=self.device)
            return typed.as_strided(spec["shape"], spec["stride"], spec["offset"])
        except (KeyError, RuntimeError, TypeError) as error:
            raise self.refuse(f"tensor {str(spec)[:80]}: {error}") from None
