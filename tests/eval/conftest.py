from __future__ import annotations

import pytest
import torch

from kvcompress.models import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Llama and its character-level tokenizer (no chat template: plain prompt layout)."""
    return tiny_model("llama"), tiny_tokenizer()


@pytest.fixture
def corpus(tmp_path):
    """A small essay-like folder (sentences with distinct words) usable as haystack or corpus."""
    folder = tmp_path / "essays"
    folder.mkdir()
    for i in range(3):
        text = " ".join(f"Essay {i} sentence {j} talks about topic {i * 100 + j}." for j in range(60))
        (folder / f"essay{i}.txt").write_text(text)
    return folder
