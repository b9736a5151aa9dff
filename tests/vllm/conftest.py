"""Fixtures of the vLLM plugin suite: the converted SmolLM2 folder and vLLM's outputs without the plugin.

The suite runs in the environment of ``scripts/vllm_env.sh`` (``bash scripts/test_vllm.sh``); in the main
environment, without vLLM, every test module skips itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE_SCRIPT = Path(__file__).with_name("engine.py")


@pytest.fixture(scope="session")
def model_dir() -> str:
    """SmolLM2-135M converted to a safetensors folder (converted here on first use, as vLLM needs a folder)."""
    from kvcompress.models import ModelNotInstalledError, is_cached, load_model, model_cache_dir

    if not is_cached("smollm2-135m"):
        try:
            load_model("smollm2-135m")
        except ModelNotInstalledError as error:
            pytest.skip(f"the SmolLM2 wheel is missing: {error}")
    return str(model_cache_dir("smollm2-135m"))


def reference_outputs(model: str, batches: list[list[str]], max_tokens: int, tmp_path: Path) -> list:
    """Greedy outputs of vLLM without the plugin (``VLLM_PLUGINS=""``, a separate process) for each batch."""
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps({"model": model, "batches": batches, "max_tokens": max_tokens}))
    env = {**os.environ, "VLLM_PLUGINS": ""}
    subprocess.run([sys.executable, str(ENGINE_SCRIPT), str(out_path), str(spec_path)], env=env, check=True,
                   timeout=300, stdout=subprocess.DEVNULL)
    return json.loads(out_path.read_text())
