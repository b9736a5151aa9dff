"""Contexts compressed once and reused: ``cache.fork()`` and ``save_cache`` / ``load_cache``.

A fork and a cache loaded from its file give the next-token logits of the original, step after step (bit for bit:
the same operations on the same numbers), forks continue independently of each other and of the original, and a
file made for another model, method or dtype, a damaged file or one naming a class outside kvcompress is refused
with one ``ValueError`` naming the file.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import safe_open, save_file

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.snapkv import SnapKVConfig
from tests.helpers import duo_pattern_file, kvzip_head_file, tiny_tokenizer_dir

# one-shot scorers (uniform and per-head budgets), KVzip, decode-time methods (H2O evicts all layers together at a
# decoding step: views of one stacked buffer), the cascade's rings, PoD's shared layers
METHODS = {
    "compactor": {"ratio": 0.5, "chunk_size": 8},
    "keydiff-adakv": {"ratio": 0.5, "allocation": "adakv"},
    "kvzip": {"ratio": 0.5},
    "h2o": {"budget": 12},
    "tova": {"budget": 10},
    "cascade": {"budget": 12},
    "nacl": {"budget": 12},
    "expected_attention": {"ratio": 0.5},
    "pod": {"block_size": 2, "n_recent": 4, "n_sink": 2, "base": SnapKVConfig(budget=12, window=4)},
    "duo": {"pattern": duo_pattern_file(), "sink_size": 2, "recent_size": 8},
    "kvzip-head": {"ratio": 0.5, "level": "head", "pattern": kvzip_head_file(), "sink_size": 2, "recent_size": 8},
    "less": {"budget": 12},  # (the low-rank state, and the kernels' weights as tensors)
}
CONTEXT = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
QUESTIONS = torch.randint(3, 128, (2, 2, 5), generator=torch.Generator().manual_seed(1))  # [question, batch, tokens]


def compressed(model, key: str):
    name = key.split("-")[0]
    params = dict(METHODS[key])
    if name == "kvzip" and params.get("level", "pair") == "pair":  # (the head level reconstructs nothing)
        params["tokenizer"] = tiny_tokenizer_dir()
    cache = kvcompress.cache_for(model, name, **params)
    with torch.no_grad():
        prefill(model, CONTEXT, cache)
    return cache


@torch.no_grad()
def continued(model, cache, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Next-token logits after a 3-token forward, then after each of the remaining tokens alone (decoding)."""
    logits = [model(input_ids=tokens[:, :3], **cache_argument(model, cache), use_cache=True).logits[:, -1]]
    for step in range(3, tokens.shape[1]):
        forward = model(input_ids=tokens[:, step : step + 1], **cache_argument(model, cache), use_cache=True)
        logits.append(forward.logits[:, -1])
    return logits


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: largest difference {(a - b).abs().max().item()}"


@pytest.mark.parametrize("key", sorted(METHODS))
def test_forks_continue_as_the_original_and_independently(key, tiny_llama):
    cache = compressed(tiny_llama, key)
    first, second = cache.fork(), cache.fork()
    assert first.nbytes() == cache.nbytes() and first.tokens_stored() == cache.tokens_stored()
    allocated = sum(layer.allocated_nbytes() for layer in first.compressed_layers)
    assert allocated == sum(layer.allocated_nbytes() for layer in cache.compressed_layers)
    # each fork answers its own question as a cache compressed for that question alone would
    got_second = continued(tiny_llama, second, QUESTIONS[1])
    got_first = continued(tiny_llama, first, QUESTIONS[0])
    assert_same(got_first, continued(tiny_llama, compressed(tiny_llama, key), QUESTIONS[0]))
    assert_same(got_second, continued(tiny_llama, compressed(tiny_llama, key), QUESTIONS[1]))
    # the original has not moved: it still answers the first question as the first fork did
    assert first.tokens_seen() == cache.tokens_seen() + QUESTIONS.shape[-1]
    assert_same(continued(tiny_llama, cache, QUESTIONS[0]), got_first)


@pytest.mark.parametrize("key", sorted(METHODS))
def test_a_saved_cache_loads_back_and_continues_as_the_original(key, tiny_llama, tmp_path):
    cache = compressed(tiny_llama, key)
    with torch.no_grad():
        tiny_llama(input_ids=QUESTIONS[1][:, :2], **cache_argument(tiny_llama, cache), use_cache=True)  # mid-way too
    path = kvcompress.save_cache(cache, tmp_path / "context.safetensors")
    loaded = kvcompress.load_cache(path, tiny_llama)
    assert loaded.nbytes() == cache.nbytes() and loaded.tokens_seen() == cache.tokens_seen()
    assert_same(continued(tiny_llama, loaded, QUESTIONS[0]), continued(tiny_llama, cache, QUESTIONS[0]))


def storage_groups(cache) -> list[list[str]]:
    """The paths of the tensors in ``cache``'s layers, grouped by the memory they share (the partition only)."""
    groups: dict[int, list[str]] = {}
    seen: set[int] = set()

    def walk(obj, path: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            groups.setdefault(obj.untyped_storage().data_ptr(), []).append(path)
        elif isinstance(obj, (list, tuple)):
            for index, item in enumerate(obj):
                walk(item, f"{path}[{index}]")
        elif isinstance(obj, dict):
            for name, item in obj.items():
                walk(item, f"{path}[{name!r}]")
        elif type(obj).__module__.startswith("kvcompress"):
            for name, item in vars(obj).items():
                walk(item, f"{path}.{name}")

    walk(cache.layers, "layers")
    return sorted(sorted(paths) for paths in groups.values())


@pytest.mark.parametrize("key", ["h2o", "cascade"])
def test_tensors_sharing_memory_share_it_again_once_loaded(key, tiny_llama, tmp_path):
    cache = compressed(tiny_llama, key)  # H2O's layers evict together: their statistics are views of one buffer
    with torch.no_grad():
        tiny_llama(input_ids=QUESTIONS[0][:, :1], **cache_argument(tiny_llama, cache), use_cache=True)
    loaded = kvcompress.load_cache(kvcompress.save_cache(cache, tmp_path / "c.safetensors"), tiny_llama)
    groups = storage_groups(cache)
    assert any(len(paths) > 1 for paths in groups)
    assert storage_groups(loaded) == groups


def test_loading_for_another_model_method_or_dtype_is_refused(tiny_llama, tiny_qwen2, tmp_path):
    path = kvcompress.save_cache(compressed(tiny_llama, "keydiff-adakv"), tmp_path / "keydiff.safetensors")
    with pytest.raises(ValueError, match=r"keydiff\.safetensors was saved for LlamaForCausalLM .* not Qwen2"):
        kvcompress.load_cache(path, tiny_qwen2)
    with pytest.raises(ValueError, match=r"keydiff\.safetensors was saved by keydiff\(.*\), not h2o\(budget=12"):
        kvcompress.load_cache(path, tiny_llama, "h2o", budget=12)
    with pytest.raises(ValueError, match=r"was saved by keydiff\(ratio=0\.5.*allocation='adakv'.*not keydiff\("):
        kvcompress.load_cache(path, tiny_llama, "keydiff", ratio=0.5)
    assert kvcompress.load_cache(path, tiny_llama, "keydiff", ratio=0.5, allocation="adakv").nbytes() > 0
    half = kvcompress.models.tiny_model("llama", seed=0).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"holds float32 keys and values, the model runs in torch\.bfloat16"):
        kvcompress.load_cache(path, half)


def test_damaged_files_and_foreign_classes_are_refused_without_running_them(tiny_llama, tmp_path):
    path = kvcompress.save_cache(compressed(tiny_llama, "h2o"), tmp_path / "h2o.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"broken\.safetensors \(a kvcompress cache file\) is damaged"):
        kvcompress.load_cache(broken, tiny_llama)
    with pytest.raises(ValueError, match=r"missing\.safetensors \(a kvcompress cache file\) does not exist"):
        kvcompress.load_cache(tmp_path / "missing.safetensors", tiny_llama)
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        description = json.loads(handle.metadata()["kvcompress"])
    for entry in description["objects"]:
        if "class" in entry and entry["class"].endswith(":SlotBuffers"):
            entry["class"] = "os:system"  # a file naming a callable outside kvcompress
    crafted = tmp_path / "crafted.safetensors"
    save_file(tensors, str(crafted), metadata={"kvcompress": json.dumps(description)})
    with pytest.raises(ValueError, match=r"crafted\.safetensors .* names 'os:system', not a kvcompress class"):
        kvcompress.load_cache(crafted, tiny_llama)


def test_a_cache_recorded_for_a_backward_pass_is_refused_at_fork_in_one_line(tiny_llama):
    """A forward with gradients enabled leaves keys and values with autograd history, which PyTorch cannot copy:
    ``fork`` says so and what to do, as ``save_cache`` does."""
    ids = torch.randint(3, tiny_llama.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    cache = kvcompress.cache_for(tiny_llama, "h2o", budget=12)
    tiny_llama(ids, **cache_argument(tiny_llama, cache))
    with pytest.raises(ValueError, match=r"^cannot fork a cache .* under torch.no_grad\(\)") as refused:
        cache.fork()
    assert "\n" not in str(refused.value)
    with torch.no_grad():
        cache = kvcompress.cache_for(tiny_llama, "h2o", budget=12)
        tiny_llama(ids, **cache_argument(tiny_llama, cache))
    cache.fork()  # the same cache filled without gradients forks


def test_a_less_cache_file_holds_the_kernels_it_was_made_with(tiny_llama, tmp_path):
    """A LESS cache's file holds its kernels' weights (tensors), not their modules: the loaded cache continues with
    those weights, rebuilding nothing from its config."""
    cache = compressed(tiny_llama, "less")
    loaded = kvcompress.load_cache(kvcompress.save_cache(cache, tmp_path / "less.safetensors"), tiny_llama)
    continued(tiny_llama, loaded, QUESTIONS[0])
    for got, want in zip(loaded.compressed_layers, cache.compressed_layers, strict=True):
        assert got.policy.kernels is None and want.policy.kernels is not None
        pairs = zip(
            (*got.policy.weights.phi, *got.policy.weights.psi),
            (*want.policy.weights.phi, *want.policy.weights.psi),
            strict=True,
        )
        assert all(torch.equal(a, b) for a, b in pairs)


def test_a_save_into_a_missing_folder_names_it_and_writes_nothing(tiny_llama, tmp_path):
    cache = kvcompress.cache_for(tiny_llama, "h2o", budget=12)
    with torch.no_grad():
        prefill(tiny_llama, CONTEXT, cache)
    target = tmp_path / "missing" / "cache.safetensors"
    with pytest.raises(FileNotFoundError, match=r"^cannot save the cache to .*: no folder '.*missing'$"):
        kvcompress.save_cache(cache, target)
    assert list(tmp_path.iterdir()) == []


def test_caches_holding_modules_are_refused_at_save(tiny_llama, tmp_path):
    """LESS kernels given as modules (not a directory or a seed) are part of the method's config: refused in one
    line naming them (a cache of kernels named by directory or seed saves their weights: ``METHODS["less"]``)."""
    from kvcompress.methods.less.kernels import LessKernels, init_kernels

    kernels = LessKernels([init_kernels(4, 2, 16, layer_idx=i).eval() for i in range(2)])
    cache = kvcompress.cache_for(tiny_llama, "less", budget=12, kernels=kernels)
    with torch.no_grad():
        prefill(tiny_llama, CONTEXT, cache)
    module = r"config\.kernels\.layers\[0\] holds a kvcompress\.methods\.less\.kernels\.LayerKernels, which"
    with pytest.raises(ValueError, match=rf"^cannot save a 'less' cache: .*{module}"):
        kvcompress.save_cache(cache, tmp_path / "less.safetensors")
    fork = cache.fork()  # a fork copies them
    assert_same(continued(tiny_llama, fork, QUESTIONS[0]), continued(tiny_llama, cache, QUESTIONS[0]))
