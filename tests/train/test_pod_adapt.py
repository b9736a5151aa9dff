"""PoD adaptation: the schedule, training through the PoD cache, the dense control, resuming."""

from __future__ import annotations

import json

import pytest
import torch

from kvcompress.methods.pod import PoDConfig
from kvcompress.models import tiny_model
from kvcompress.train.pod_adapt import AdaptConfig, adapt, lm_loss, load_adapted, lr_at, trainable_parameters

POD = PoDConfig(block_size=2, n_sink=2, n_recent=6)


def test_schedule_warms_up_then_decays_to_the_floor():
    config = AdaptConfig(steps=100, lr=1e-4, warmup=0.1, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(1e-5)
    assert lr_at(9, config) == pytest.approx(1e-4)
    assert lr_at(99, config) == pytest.approx(1e-5, rel=0.05)
    assert all(lr_at(s, config) >= lr_at(s + 1, config) for s in range(10, 99))


def test_pod_loss_differs_from_dense_and_trains_the_block_start_keys():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    trainable_parameters(model, "all")
    dense = lm_loss(model, ids, None)
    pod = lm_loss(model, ids, POD)
    assert abs(dense.item() - pod.detach().item()) > 1e-4
    pod.backward()
    start_k = model.model.layers[0].self_attn.k_proj.weight.grad
    assert start_k is not None and float(start_k.abs().sum()) > 0


def test_attention_variant_trains_projections_only():
    model = tiny_model("llama")
    chosen = trainable_parameters(model, "attention")
    assert chosen and all(any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj")) for name in chosen)
    assert not model.model.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("pod", [POD, None])
def test_resumed_run_equals_uninterrupted_run(tmp_path, pod):
    windows = torch.randint(3, 128, (8, 24), generator=torch.Generator().manual_seed(1))
    config = AdaptConfig(steps=3, batch=2, length=24, lr=1e-3, save_every=1, trainable="attention")
    whole = tiny_model("llama")
    adapt(whole, windows, pod, config, tmp_path / "whole")
    split = tiny_model("llama")
    assert adapt(split, windows, pod, config, tmp_path / "split", stop_after=2) is None
    resumed = tiny_model("llama")
    final = adapt(resumed, windows, pod, config, tmp_path / "split")
    loaded = load_adapted(tiny_model("llama"), final)
    for (name, a), (_, b) in zip(whole.named_parameters(), loaded.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert not torch.equal(
        loaded.model.layers[0].self_attn.q_proj.weight, tiny_model("llama").model.layers[0].self_attn.q_proj.weight
    )


def test_resume_with_other_settings_is_refused(tmp_path):
    windows = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    adapt(tiny_model("llama"), windows, POD, AdaptConfig(steps=1, batch=1, length=16), tmp_path)
    with pytest.raises(ValueError, match="other settings"):
        adapt(tiny_model("llama"), windows, POD, AdaptConfig(steps=2, batch=1, length=16), tmp_path)


def test_resume_drops_log_lines_after_the_checkpoint(tmp_path):
    """A run killed between checkpoints logged steps it redoes on resume: the log keeps one line per step."""
    windows = torch.randint(3, 128, (6, 16), generator=torch.Generator().manual_seed(3))
    config = AdaptConfig(steps=3, batch=1, length=16, save_every=1, trainable="attention")
    assert adapt(tiny_model("llama"), windows, POD, config, tmp_path, stop_after=1) is None
    log = tmp_path / "log.jsonl"
    log.write_text(log.read_text() + json.dumps({"step": 2, "loss": 9.0}) + "\n")  # logged, never checkpointed
    adapt(tiny_model("llama"), windows, POD, config, tmp_path)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["loss"] != 9.0 and all(r["cpu_s"] >= 0 for r in records)


def test_training_steps_leave_no_pod_cache_alive(tmp_path):
    """The PoD cache's layers form reference cycles that hold the step's autograd graph; left to the cyclic GC
    they piled up (an OOM kill at 13 GB on SmolLM2). Every step must free its cache."""
    import gc

    from kvcompress.methods.pod.layer import PoDLayer

    windows = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(4))
    gc.collect()
    gc.disable()
    try:
        adapt(tiny_model("llama"), windows, POD, AdaptConfig(steps=3, batch=1, length=16), tmp_path)
        alive = [o for o in gc.get_objects() if isinstance(o, PoDLayer)]
    finally:
        gc.enable()
    assert alive == []
