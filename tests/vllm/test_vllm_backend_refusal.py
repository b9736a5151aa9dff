"""Every attention backend but CPU_ATTN refuses a configured policy, naming itself, as vLLM selects it (no engine).

A GPU selection is simulated on this CPU machine: vLLM's own selector (``get_attn_backend``) is run with the
platform's choice replaced by what a GPU platform returns (the backend's registered path), under an engine
configuration holding a policy as ``vllm.LLM(additional_config=...)`` passes it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import torch  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention import selector  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from kvcompress.vllm import register  # noqa: E402

POLICY = {"kvcompress": {"method": "h2o", "budget": 512}}
UNADAPTED = [m.name for m in AttentionBackendEnum if m.value and m.name != "CPU_ATTN"]


@pytest.fixture(autouse=True)
def plugin():
    register()  # what vLLM does in every process (idempotent)
    selector._cached_get_attn_backend.cache_clear()
    yield
    selector._cached_get_attn_backend.cache_clear()


def _config(additional: dict | None) -> VllmConfig:
    return VllmConfig(additional_config=additional or {})


@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"])
def test_vllms_selector_picking_a_gpu_backend_refuses_the_policy_naming_it(name, monkeypatch):
    from vllm.platforms import current_platform

    path = AttentionBackendEnum[name].get_path()  # what CUDA's get_attn_backend_cls returns for it
    monkeypatch.setattr(type(current_platform), "get_attn_backend_cls", classmethod(lambda cls, *a, **k: path))
    with set_current_vllm_config(_config(POLICY)), pytest.raises(ValueError) as error:
        selector.get_attn_backend(64, torch.float32, None)
    message = str(error.value)
    assert message.startswith("kvcompress: the h2o policy runs only on vLLM's CPU_ATTN attention backend; ")
    assert f"selected the {name} attention backend" in message and "\n" not in message


@pytest.mark.parametrize("name", UNADAPTED)
def test_every_unadapted_backend_refuses_a_policy_from_the_config_or_the_environment(name, monkeypatch):
    with set_current_vllm_config(_config(POLICY)), pytest.raises(ValueError, match=f"selected the {name} attention"):
        AttentionBackendEnum[name].get_class()
    monkeypatch.setenv("KVCOMPRESS_VLLM", '{"method": "streaming", "budget": 512}')
    with set_current_vllm_config(_config(None)), pytest.raises(ValueError, match=f"streaming policy .* {name} "):
        AttentionBackendEnum[name].get_class()


def test_without_a_policy_a_backend_is_vllms_and_a_cached_one_still_refuses_at_the_layer():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend  # imports on CPU, unlike the GPU backends

    with set_current_vllm_config(_config(None)):
        backend = AttentionBackendEnum.CPU_MLA.get_class()
        assert issubclass(backend, CPUMLABackend) and backend.__name__ == "CPUMLABackend"
        assert backend.get_name() == CPUMLABackend.get_name()
        assert backend.get_impl_cls() is CPUMLABackend.get_impl_cls()
    with set_current_vllm_config(_config(POLICY)), pytest.raises(ValueError, match="selected the CPU_MLA attention"):
        backend.get_impl_cls()  # what the attention layer asks for, whatever vLLM's selection cache held


def test_cpu_attention_stays_the_plugins_backend():
    with set_current_vllm_config(_config(POLICY)):
        assert AttentionBackendEnum.CPU_ATTN.get_class().__name__ == "KVCompressCPUBackend"
