"""The OpenAI-compatible server with a policy: started on 127.0.0.1, one completion answered, stopped; the modules a
started server loads include every engine module the refusal tests check were never loaded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

from tests.vllm.conftest import ENGINE_MODULES, module_recorder, recorded_modules  # noqa: E402
from tests.vllm.engine import SERVER_ENV  # noqa: E402

# Hang guards only, not timings: an engine start takes 1-3 minutes on 2 idle cores and several times that on a shared,
# loaded machine, and what the test checks (a completion answered under the policy) does not depend on how long.
STARTUP_SECONDS = 1800
ANSWER_SECONDS = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=ANSWER_SECONDS) as response:
        return json.load(response)


def _wait_until_healthy(base: str, server: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"the server did not answer /health within {STARTUP_SECONDS} s")


def test_serve_answers_a_completion_with_a_policy_on_loopback(model_dir, tmp_path):
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "kvcompress.vllm.serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--policy",
        json.dumps({"method": "streaming", "budget": 512}),
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
        "--enforce-eager",
    ]
    log_path = tmp_path / "server.log"
    log = log_path.open("w")
    recorder, record = module_recorder(tmp_path)  # what a started server loads (the refusal tests' markers)
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}, **SERVER_ENV, **recorder}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(base, server, log_path)
        answer = _post(
            f"{base}/v1/completions",
            {"model": model_dir, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=ANSWER_SECONDS)
        log.close()
    assert answer["choices"][0]["text"].strip()
    assert answer["usage"]["completion_tokens"] == 8
    assert "kvcompress: streaming, 4 blocks of 128 tokens per request" in log_path.read_text()
    # vLLM's server and engine core each recorded their modules at exit: the engine modules that the refusal tests
    # (``test_vllm_policy_checks``) check were never loaded are loaded by a server that started
    assert set(ENGINE_MODULES) <= recorded_modules(record)
