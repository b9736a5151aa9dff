"""Files a user hands to kvcompress: a crafted pickle that would run code is refused before any of it runs, and a
damaged file (cut short, overwritten, NaN) is one ``ValueError`` naming the file and how to get a good one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcompress
from kvcompress.files import load_tensors, write_atomically
from kvcompress.generation import prefill
from kvcompress.methods.less.kernels import LessKernels, init_kernels, load_kernels
from kvcompress.methods.pod.grouping import load_similarity
from kvcompress.train.pod_adapt import load_adapted

REPO = Path(__file__).resolve().parents[2]


class RunsCode:
    """Unpickling this calls ``open(marker, "w")``: a file appears where nothing should have run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def crafted(path: Path, marker: Path, payload: dict | None = None) -> Path:
    torch.save({**(payload or {}), "trap": RunsCode(marker)}, path)
    return path


def loaders(tmp_path: Path, tiny_llama):
    """(name, the file to craft, a call that loads it)."""
    kernels = tmp_path / "kernels"
    LessKernels(layers=[init_kernels(4, 2, 16, 8, 16)] * 2, meta={"num_layers": 2}).save(kernels)
    return [
        ("similarity", tmp_path / "sim.pt", lambda p: load_similarity(p)),
        ("less kernels", kernels / "layer_001.pt", lambda p: load_kernels(p.parent)),
        ("pod-adapt weights", tmp_path / "final.pt", lambda p: load_adapted(tiny_llama, p)),
        ("any tensor file", tmp_path / "any.pt", lambda p: load_tensors(p, "a file", "rewrite it")),
    ]


def test_a_crafted_pickle_is_refused_by_every_loader_and_runs_nothing(tmp_path, tiny_llama):
    marker = tmp_path / "code-ran"
    for name, path, load in loaders(tmp_path, tiny_llama):
        crafted(path, marker, {"sim": torch.ones(2, 2, 2), "params": {}})
        with pytest.raises(ValueError, match=re.escape(str(path)) + ".*could run code"):
            load(path)
        assert not marker.exists(), f"{name}: the file's code ran"


def test_the_crafted_file_would_run_code_without_weights_only(tmp_path):
    """The trap is real: the unsafe load the loaders avoid creates the marker."""
    marker = tmp_path / "code-ran"
    path = crafted(tmp_path / "x.pt", marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_no_unsafe_load_in_the_package_or_the_scripts():
    """Every ``torch.load`` goes through ``kvcompress.files.load_tensors`` or says ``weights_only=True``; no pickle,
    ``eval`` or ``exec`` of file contents."""
    unsafe = re.compile(
        r"torch\.load\((?![^)]*weights_only=True)|pickle\.loads?\(|(?<![.\w])(?<!def )(eval|exec)\(|allow_pickle=True"
    )
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for folder in ("src", "experiments", "scripts")
        for path in (REPO / folder).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if unsafe.search(line)
    ]
    assert found == []


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_truncated_less_kernel_file_names_the_file_and_the_fix(tmp_path):
    directory = tmp_path / "kernels"
    LessKernels(layers=[init_kernels(4, 2, 16, 8, 16)] * 2, meta={"num_layers": 2}).save(directory)
    truncate(directory / "layer_001.pt")
    with pytest.raises(ValueError, match=re.escape(str(directory / "layer_001.pt")) + ".*damaged.*retrain"):
        load_kernels(directory)
    (directory / "meta.json").write_text('{"format": ')
    with pytest.raises(ValueError, match=re.escape(str(directory / "meta.json")) + ".*not valid JSON"):
        load_kernels(directory)


def test_a_kernel_file_of_other_contents_names_the_file(tmp_path):
    directory = tmp_path / "kernels"
    LessKernels(layers=[init_kernels(4, 2, 16, 8, 16)] * 2, meta={"num_layers": 2}).save(directory)
    torch.save({"shape": {"q_heads": 4}, "state_dict": {}}, directory / "layer_000.pt")
    with pytest.raises(ValueError, match=re.escape(str(directory / "layer_000.pt")) + ".*damaged"):
        load_kernels(directory)
    torch.save([1, 2], directory / "layer_000.pt")
    with pytest.raises(ValueError, match=re.escape(str(directory / "layer_000.pt")) + ".*not a dict"):
        load_kernels(directory)


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "damaged"),  # truncated
        ({"sim": torch.full((2, 2, 2), float("nan"))}, "8 of 8 similarities are NaN"),
        ({"sim": torch.ones(2, 3)}, r"shape \[2, 3\]"),
        ({"kv_heads": 2}, "no sim"),
    ],
)
def test_a_bad_similarity_file_names_the_file_and_the_command(tmp_path, tiny_llama, content, problem):
    path = tmp_path / "sim.pt"
    torch.save({"sim": torch.ones(2, 2, 2), "kv_heads": 2} if content is None else content, path)
    if content is None:
        truncate(path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + f".*{problem}.*pod-calibrate"):
        kvcompress.cache_for(tiny_llama, "pod", similarity=str(path), delta=0.5)


def test_a_bad_json_similarity_file_names_the_file(tmp_path, tiny_llama):
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"sim": [[[float("nan")] * 2] * 2] * 2}))  # NaN is valid JSON to Python
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*NaN"):
        kvcompress.cache_for(tiny_llama, "pod", similarity=str(path), delta=0.5)
    path.write_text('{"sim": [[1, 2], [3')
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*not valid JSON"):
        kvcompress.cache_for(tiny_llama, "pod", similarity=str(path), delta=0.5)


def test_the_cli_answers_a_crafted_similarity_file_with_one_line(tmp_path):
    marker = tmp_path / "code-ran"
    path = crafted(tmp_path / "sim.pt", marker, {"sim": torch.ones(30, 30, 30)})
    args = ["generate", "hi", "-m", "pod", "-p", f"similarity={path}", "--model", "no-model-needed"]
    run = subprocess.run(
        [sys.executable, "-c", "from kvcompress.cli import main; main()", *args], capture_output=True, text=True
    )
    assert run.returncode == 2 and not marker.exists()
    assert len(run.stderr.strip().splitlines()) == 1 and str(path) in run.stderr and "run code" in run.stderr


def test_a_write_interrupted_leaves_the_former_file_whole_and_no_partial_file(tmp_path, tiny_llama):
    """``write_atomically`` (kernel sets, head patterns, calibrations): a write that fails midway (here: after part
    of the file is out) leaves the file that was there as it was (a saved cache here), and nothing else."""
    cache = kvcompress.cache_for(tiny_llama, "h2o", budget=8)
    with torch.no_grad():
        prefill(tiny_llama, torch.arange(3, 23)[None], cache)
    path = kvcompress.save_cache(cache, tmp_path / "cache.safetensors")
    before = path.read_bytes()

    def half_then_fail(temporary: Path) -> None:
        temporary.write_bytes(before[: len(before) // 2])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, half_then_fail)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["cache.safetensors"]
    write_atomically(path, lambda temporary: temporary.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["cache.safetensors"]
