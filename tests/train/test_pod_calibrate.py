"""PoD calibration: Jensen-Shannon arithmetic, the similarity of a tiny model against eager attention, windows."""

from __future__ import annotations

import pytest
import torch

from kvcompress.methods.pod.grouping import head_similarity, load_similarity, starts_from_similarity
from kvcompress.train.pod_calibrate import calibrate, pairwise_js, save_similarity, token_windows


def test_js_is_zero_for_identical_one_for_disjoint_and_symmetric():
    rows = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    js = pairwise_js(rows.double()[:, None, None])[..., 0, 0]
    assert js[0, 3] == 0 and js[0, 1] == 1 and torch.equal(js, js.T)
    assert float(js[0, 2]) == pytest.approx(0.811278 - 0.5, abs=1e-6)  # H(M) - (H(P) + H(Q)) / 2


def eager_rows(model, ids, last):
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # per layer [B, H, n, n]
    model.set_attn_implementation("sdpa")
    return torch.stack([a[0, :, -last:] for a in attentions])  # [L, H, q, n]


def test_similarity_matches_eager_attention_rows(tiny_llama):
    windows = torch.randint(3, 128, (3, 40), generator=torch.Generator().manual_seed(0))
    result = calibrate(tiny_llama, windows, last_queries=5)
    reference = torch.stack([pairwise_js(eager_rows(tiny_llama, w[None], 5).double()).mean(-1) for w in windows])
    expected = 1 - reference.mean(0).permute(2, 0, 1)
    torch.testing.assert_close(result["sim"].double(), expected, rtol=1e-4, atol=1e-5)
    sim = result["sim"]
    assert sim.shape == (4, 2, 2) and result["kv_heads"] == 2
    assert torch.allclose(sim.diagonal(dim1=1, dim2=2), torch.ones(4, 2))
    assert torch.equal(sim, sim.transpose(1, 2)) and bool(((sim >= 0) & (sim <= 1)).all())


def test_saved_file_round_trips_to_blocks(tiny_llama, tmp_path):
    windows = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    result = calibrate(tiny_llama, windows, last_queries=4)
    save_similarity(result, tmp_path / "sim.pt", tmp_path / "sim.json")
    for name in ("sim.pt", "sim.json"):
        data = load_similarity(tmp_path / name)
        torch.testing.assert_close(
            head_similarity(data, "kv_head").float(), result["sim"].view(2, 2, 2, 2).mean(1), atol=1e-5, rtol=1e-4
        )
        assert starts_from_similarity(data, 0.0, None) == ((0, 0), (0, 0))
        assert starts_from_similarity(data, 1.01, None) == ((0, 0), (1, 1))


def test_token_windows_cut_the_joined_files(tmp_path):
    from kvcompress.models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    (tmp_path / "a.txt").write_text("abcdefghij" * 5)
    (tmp_path / "b.txt").write_text("klmnopqrst" * 5)
    windows = token_windows(tokenizer, [tmp_path / "a.txt", tmp_path / "b.txt"], 16)
    assert windows.shape == (6, 16)  # 50 + 1 EOS + 50 + 1 EOS = 102 tokens
    picked = token_windows(tokenizer, [tmp_path / "a.txt", tmp_path / "b.txt"], 16, count=2)
    assert torch.equal(picked, windows[[0, 5]])
