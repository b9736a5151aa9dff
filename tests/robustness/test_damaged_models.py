"""A damaged model cache or GGUF file: a converted model cut short is found and converted again, damage its sizes do
not show is refused naming the folder and what to do, and a truncated GGUF names the file instead of failing with a
reshape error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcompress import models
from kvcompress.models import gguf, load_model, model_cache_dir
from kvcompress.models.testing import tiny_model
from tests.test_models import _same_weights, fake_smollm2  # noqa: F401 (a fixture)


@pytest.fixture
def converted(tmp_path: Path, monkeypatch, fake_smollm2):  # noqa: F811
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    load_model("smollm2-135m")
    assert len(fake_smollm2) == 1
    return model_cache_dir("smollm2-135m"), fake_smollm2


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_converted_model_is_converted_again(converted):
    directory, conversions = converted
    cut(directory / "model.safetensors")
    model, _ = load_model("smollm2-135m")
    assert len(conversions) == 2
    assert _same_weights(model, tiny_model("llama", seed=11))


def test_damage_the_sizes_do_not_show_is_refused_with_the_instruction(converted):
    directory, conversions = converted
    marker = directory / "kvcompress.json"
    written = json.loads(marker.read_text())
    del written["files"]  # a cache converted before the sizes were recorded
    marker.write_text(json.dumps(written))
    cut(directory / "model.safetensors")
    pattern = f"the converted smollm2-135m in {re.escape(str(directory))} cannot be loaded.*delete that folder"
    with pytest.raises(ValueError, match=pattern):
        load_model("smollm2-135m")
    assert len(conversions) == 1


def test_a_truncated_gguf_names_the_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 12)  # a header cut short
    with pytest.raises(ValueError, match=re.escape(str(path)) + " cannot be read as a GGUF model.*again"):
        load_model(str(path))


def test_a_registry_gguf_that_fails_to_convert_names_the_reinstall(tmp_path, monkeypatch, fake_smollm2):  # noqa: F811
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))

    def truncated(gguf_path: Path, out_dir: Path) -> None:
        raise RuntimeError("cannot reshape array of size 1000 into shape (576,49152)")

    monkeypatch.setattr(gguf, "_convert_gguf", truncated)
    with pytest.raises(ValueError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf cannot be read.*reinstall it with: pip"):
        load_model("smollm2-135m")
