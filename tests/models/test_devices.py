"""Device and dtype cleanliness of every method's prefill and decoding steps, in float32, bfloat16 and float16.

No GPU is lent here, so the check makes any tensor the library creates without naming the model's device visible
on the CPU: the whole ``generate`` runs with ``meta`` as PyTorch's default device, and a dispatch mode flags every
op whose output is not on the model's device (a factory call without ``device=`` lands on ``meta``) and every
CPU-only private op (``*_for_cpu``). On a GPU the same code would have created those tensors on the CPU and mixed
devices. The dtypes run the model in half precision end to end: a float32 tensor meeting a half-precision weight
raises, and the cache must store keys and values in the model's dtype.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kvcompress
import kvcompress.methods.pod.attention as pod_attention
from kvcompress.methods.window import WindowConfig, WindowPolicy
from kvcompress.models import tiny_model
from tests.helpers import cache_logits
from tests.test_cache import EVICTING, HEAD_SPLIT, PREFILLED, method_of

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DeviceCheck(TorchDispatchMode):
    """Records ops whose outputs are not on ``device`` and CPU-only private ops, with the library frame that
    called them."""

    def __init__(self, device: torch.device, cpu_only_allowed: bool) -> None:
        super().__init__()
        self.device, self.cpu_only_allowed = device, cpu_only_allowed
        self.problems: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        wrong = [t.device for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device != self.device]
        if wrong or ("_for_cpu" in name and not self.cpu_only_allowed):
            self.problems.append(f"{name} -> {wrong} at {_library_frame()}")
        return out


# the package's own files: matched by location, not by a "/kvcompress/" in the path, which a checkout or virtual
# environment inside a folder of that name (a clone's .venv/lib/.../torch) would also match
PACKAGE = str(Path(kvcompress.__file__).resolve().parent) + os.sep


def _library_frame() -> str:
    frames = [f for f in traceback.extract_stack() if str(Path(f.filename).resolve()).startswith(PACKAGE)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "transformers"


def test_frames_are_attributed_by_the_packages_location_not_by_a_folder_name():
    """A virtual environment inside a checkout named kvcompress (a fresh clone's .venv) is no library frame."""
    namespace = {"_library_frame": _library_frame}
    exec(
        compile("def torch_internal():\n    return _library_frame()\n", "/x/kvcompress/.venv/torch/f.py", "exec"),
        namespace,
    )
    assert namespace["torch_internal"]() == "transformers"  # (no package frame on this stack)


@pytest.fixture(scope="module")
def models():
    return {dtype: tiny_model("llama", seed=0).to(dtype) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key", sorted(EVICTING | PREFILLED | HEAD_SPLIT))
def test_every_step_stays_on_the_models_device_and_dtype(key, dtype, models):
    model = models[dtype]
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    cache = kvcompress.cache_for(model, method_of(key), **(EVICTING | PREFILLED | HEAD_SPLIT)[key])
    check = DeviceCheck(torch.device("cpu"), cpu_only_allowed=True)
    with torch.device("meta"), check:
        logits, _ = cache_logits(model, ids, cache, new_tokens=3)
    assert check.problems == [], "\n".join(check.problems[:5])
    assert bool(logits.isfinite().all())
    for layer in cache.compressed_layers:
        assert layer.keys.dtype == dtype and layer.keys.device == model.device


class DevicelessState(WindowPolicy):
    """A deliberately wrong policy: its per-token state is created without ``device=``."""

    def init_state(self, layer, keys):
        return {"age": torch.zeros(keys.shape[:3])}


@dataclass(frozen=True)
class DevicelessConfig(WindowConfig):
    policy_class = DevicelessState


def test_the_check_catches_a_tensor_created_without_the_models_device(models):
    model = models[torch.float32]
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = kvcompress.cache_for(model, DevicelessConfig(budget=8))
    check = DeviceCheck(torch.device("cpu"), cpu_only_allowed=True)
    with torch.device("meta"), check:
        cache_logits(model, ids, cache, new_tokens=2)
    assert any("[device(type='meta')]" in problem for problem in check.problems)


def test_pods_device_generic_path_equals_the_cpu_kernel(models, monkeypatch):
    """Off the CPU PoD takes its fused-SDPA path (the CPU kernel returning the log-normaliser has no GPU twin) and,
    decoding on its ring, explicit attention parts with their log-sum-exp."""
    model = models[torch.float32]
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    params = EVICTING["pod-snapkv"]
    reference, _ = cache_logits(model, ids, kvcompress.cache_for(model, "pod", **params), new_tokens=8)
    monkeypatch.setattr(pod_attention, "FLASH", None)
    cache = kvcompress.cache_for(model, "pod", **params)
    generic, _ = cache_logits(model, ids, cache, new_tokens=8)
    assert any(layer.ring is not None for layer in cache.compressed_layers)
    torch.testing.assert_close(generic, reference, rtol=1e-4, atol=1e-4)


def test_less_kernels_move_to_the_models_device():
    from kvcompress.methods.less.config import LessConfig

    policy = LessConfig(budget=8).policy(0)
    kernels = policy.layer_kernels(4, 2, 16, torch.device("meta"))
    assert {p.device.type for p in kernels.parameters()} == {"meta"}
    assert kernels.phi(torch.empty(1, 4, 3, 16, device="meta")).device.type == "meta"
