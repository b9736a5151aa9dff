"""Policies checked before an engine starts, and block SnapKV's budget exact at block granularity (no engine)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

from kvcompress.vllm import LLM  # noqa: E402
from kvcompress.vllm.config import BlockPolicyConfig, check_engine, parse_policy  # noqa: E402
from kvcompress.vllm.policies import make_policy  # noqa: E402
from tests.vllm.conftest import ENGINE_MODULES, module_recorder, recorded_modules  # noqa: E402

BLOCK = 128


@pytest.mark.parametrize(
    "policy,message",
    [
        ('{"method": "snapkv", "budget": 512', "is not valid JSON"),
        ('["snapkv", 512]', "must be a JSON object"),
        ({"method": "snapkv", "budget": "512"}, "budget must be an integer (tokens or blocks), got '512'"),
        ({"method": "streaming", "budget": True}, "budget must be an integer"),
        ({"method": "streaming", "budget": 512, "window": 2.5}, "window must be an integer"),
        ({"method": "tova", "budget": 512}, "unknown method 'tova'"),
        ({"method": "snapkv", "budget": 512, "kernel": 4}, "kernel must be an odd integer"),
        ({"method": "snapkv", "budget": 512, "ratio": 2}, "unknown policy parameter(s) ['ratio']"),
        ({"method": "buzz", "budget": 640, "stride": 2}, "stride must be >= 3 blocks"),
        (
            {"method": "h2o", "budget": 512, "scoring": "fast"},
            "scoring must be one of one_pass, second_pass, got 'fast'",
        ),
    ],
)
def test_a_malformed_policy_is_one_line_naming_what_is_wrong(policy, message):
    with pytest.raises(ValueError) as error:
        parse_policy(policy)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_budget_below_what_the_method_needs_is_refused_at_the_block_size():
    with pytest.raises(ValueError, match=r"budget 100 is 0 block\(s\) of 128 tokens; window needs at least 1"):
        check_engine(parse_policy({"method": "window", "budget": 100}))
    check_engine(parse_policy({"method": "window", "budget": 100}), block_size=32)  # 3 blocks of 32: fine
    with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
        check_engine(parse_policy({"method": "streaming", "budget": 512}), enable_prefix_caching=True)
    with pytest.raises(ValueError, match="only on vLLM's CPU_ATTN attention backend, not FLASH_ATTN"):
        check_engine(parse_policy({"method": "snapkv", "budget": 512}), attention_backend="FLASH_ATTN")
    check_engine(parse_policy({"method": "full"}), enable_prefix_caching=True, attention_backend="FLASH_ATTN")


SERVE_CASES = {
    "malformed JSON": (["--policy", '{"method": "snapkv", "budget": 512'], "is not valid JSON"),
    "string budget": (["--policy", '{"method": "snapkv", "budget": "512"}'], "budget must be an integer"),
    "budget below a block": (["--policy", '{"method": "window", "budget": 64}'], "0 block(s) of 128 tokens"),
    "prefix caching": (
        ["--policy", '{"method": "streaming", "budget": 512}', "--enable-prefix-caching"],
        "--no-enable-prefix-caching",
    ),
    "GPU backend": (
        ["--policy", '{"method": "streaming", "budget": 512}', "--attention-backend", "FLASHINFER"],
        "not FLASHINFER",
    ),
}


def loaded_modules(command: list[str], tmp_path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``command`` (this interpreter), returning its result and the modules it had loaded when it exited."""
    recorder, record = module_recorder(tmp_path)
    # The timeout only stops a hung child: whether an engine started is read from what it loaded, not from the
    # clock, which a loaded machine stretches (an engine start takes minutes here, but so can an import).
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, **recorder})
    return done, recorded_modules(record)


@pytest.mark.parametrize("case", sorted(SERVE_CASES))
def test_serve_refuses_a_bad_policy_in_one_line_with_status_2_before_any_engine(case, model_dir, tmp_path):
    args, message = SERVE_CASES[case]
    command = [sys.executable, "-m", "kvcompress.vllm.serve", "--model", model_dir, "--port", "1", *args]
    done, modules = loaded_modules(command, tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("kvcompress.vllm.serve: error: kvcompress: "), done.stderr
    assert message in lines[0]
    assert "kvcompress.vllm.serve" in modules or "kvcompress.vllm.config" in modules  # the recorder ran
    started = sorted(m for m in ENGINE_MODULES if m in modules)
    # before any engine: none of them loaded (``test_vllm_serve`` checks that a started server loads them all)
    assert not started, f"refused only after vLLM loaded {started}"


def test_python_llm_raises_before_building_an_engine(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", lambda *args, **kwargs: pytest.fail("an engine was started"))
    with pytest.raises(ValueError, match="budget must be an integer"):
        LLM("any-model", {"method": "snapkv", "budget": "1024"})
    with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
        LLM("any-model", '{"method": "snapkv", "budget": 1024}', enable_prefix_caching=True)
    with pytest.raises(ValueError, match="snapkv needs at least 3 blocks"):
        LLM("any-model", {"method": "snapkv", "budget": 200})


def _kept_blocks(policy, prompt_len):
    lo, hi = policy.scheduler_range(prompt_len + 1, prompt_len)  # after the first decode step
    return -(-prompt_len // BLOCK) - (hi - lo)


@pytest.mark.parametrize("window", [1, 32, 128])
def test_snapkv_keeps_exactly_its_budget_in_blocks_or_the_whole_prompt(window):
    for budget_blocks in range(3, 12):
        policy = make_policy(BlockPolicyConfig("snapkv", budget_blocks * BLOCK, window=window), BLOCK)
        for prompt_len in range(1, 14 * BLOCK, 7):
            assert _kept_blocks(policy, prompt_len) == min(-(-prompt_len // BLOCK), budget_blocks), (
                budget_blocks,
                prompt_len,
            )


def test_a_1200_token_prompt_under_a_1280_token_snapkv_budget_is_left_whole():
    policy = make_policy(BlockPolicyConfig("snapkv", 1280), BLOCK)
    lo, hi = policy.scheduler_range(1201, 1200)
    assert lo == hi
    assert _kept_blocks(policy, 1200) == 10


@pytest.mark.parametrize("reselect", [1, 2, 5])
@pytest.mark.parametrize("window", [32, 128])
def test_snapkv_reselection_bounds_generation_and_scheduler_follows_worker(reselect, window):
    import torch

    budget_blocks = 4
    config = BlockPolicyConfig("snapkv", budget_blocks * BLOCK, window=window, reselect_blocks=reselect)
    policy = make_policy(config, BLOCK)
    for prompt_len in (200, 600, 639, 640, 641, 1000):
        held, selections, stashed = [], [], []
        for context in range(prompt_len, prompt_len + 12 * BLOCK):  # the decode steps
            lo, worker_hi = policy.worker_range(context, prompt_len)
            freed_lo, freed_hi = policy.scheduler_range(context, prompt_len)
            # never frees a block this step reads (at the prompt's end: the prefill's range, inside the worker's)
            assert freed_hi <= freed_lo or (lo <= freed_lo and freed_hi <= worker_hi)
            assert policy.scheduler_range(context + 1, prompt_len) == (lo, worker_hi)  # frees it after the step
            held.append(-(-(context + 1) // BLOCK) - (freed_hi - freed_lo))
            c, p = torch.tensor([context]), torch.tensor([prompt_len])
            if context > prompt_len and policy.reselects(c, p).item():
                assert context % BLOCK == 0 and worker_hi > policy.worker_range(context - 1, prompt_len)[1]
                selections.append(context)
            elif context > prompt_len:
                assert worker_hi == policy.worker_range(context - 1, prompt_len)[1]
            if policy.stashes(c, p).item():
                stashed.append(context)
        assert selections, prompt_len
        for at in selections:  # the window queries are exactly the `window` decode steps before each selection
            assert [s for s in stashed if at - window <= s < at] == list(range(at - window, at))
        # From the step after the prompt's selection (the first decode step), whatever the number generated: the
        # budget plus R blocks, plus the block a selecting step starts before its selection frees any.
        assert max(held[1:]) == budget_blocks + reselect + 1
        for at in selections[:-1]:
            assert held[at - prompt_len] == budget_blocks + reselect + 1
            assert held[at + 1 - prompt_len] == budget_blocks + 1


@pytest.mark.parametrize("window", [32, 128])
@pytest.mark.parametrize("chunk", [64, 256, 300, 512])
def test_snapkv_prefill_in_steps_holds_the_budget_plus_one_step_and_keeps_the_window(chunk, window):
    """A prompt prefilled ``chunk`` tokens a step: after each step the worker evicts down to ``budget - 1`` front
    blocks + the blocks of the last ``window`` tokens; the scheduler frees what the worker stopped reading, the
    prompt's final range contains the prefill's, and the observation window is never evicted."""
    budget_blocks = 4
    policy = make_policy(BlockPolicyConfig("snapkv", budget_blocks * BLOCK, window=window), BLOCK)
    for prompt_len in (700, 1000, 1153, 2000):
        starts = list(range(0, prompt_len, chunk))
        peak = 0
        for start in starts:
            end = min(start + chunk, prompt_len)
            lo, hi = policy.worker_range(start, 0)  # the kernel of the step starting at `start` (not compressed)
            freed = policy.scheduler_range(start, prompt_len if start >= prompt_len else 0)
            assert freed == (lo, hi)  # the scheduler freed exactly what the worker stopped reading
            peak = max(peak, -(-end // BLOCK) - (hi - lo))  # blocks held while the step writes
            assert lo == budget_blocks - 1
        assert peak <= budget_blocks + -(-chunk // BLOCK) + 2
        if prompt_len == 2000:
            assert peak < -(-prompt_len // BLOCK)  # not the prompt
        prefill = policy.worker_range(prompt_len, 0)  # what the prompt's last step left
        assert prefill[1] <= policy.window_start_block(prompt_len) or prefill[1] == prefill[0]  # the window stays
        final = policy.worker_range(prompt_len, prompt_len)
        assert final[0] <= prefill[0] and (prefill[1] <= final[1] or prefill[1] == prefill[0])
        assert policy.scheduler_range(prompt_len, prompt_len) == prefill  # freed once the prompt's selection ran:
        assert policy.scheduler_range(prompt_len + 1, prompt_len) == final
        assert -(-prompt_len // BLOCK) - (final[1] - final[0]) == budget_blocks  # exactly the budget after it


def _manager(policy: dict):
    import torch
    from vllm.v1.core.block_pool import BlockPool

    from kvcompress.vllm.manager import BlockEvictionManager
    from kvcompress.vllm.spec import KVCompressSpec

    spec = KVCompressSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32, policy=parse_policy(policy)
    )
    pool = BlockPool(num_gpu_blocks=64, enable_caching=False, hash_block_size=BLOCK)
    return BlockEvictionManager(
        spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=BLOCK
    )


@pytest.mark.parametrize("reselect", [0, 1])
def test_after_a_preemption_the_scheduler_frees_what_the_worker_evicts(reselect):
    """vLLM recomputes a preempted request's prompt (1000 tokens) and 300 generated tokens in one step; the worker
    selects at the prompt's end after that step's attention (``snapkv_state``: the selection point is the prompt's
    end, as in the first run), and the scheduler must free exactly the blocks the worker stops reading."""
    policy = {"method": "snapkv", "budget": 4 * BLOCK, "reselect_blocks": reselect}
    manager, worker = _manager(policy), make_policy(parse_policy(policy), BLOCK)
    prompt_len, resumed = 1000, 1300
    manager.allocate_new_blocks("r", resumed, resumed)
    manager.remove_skipped_blocks("r", 0, prompt_len)  # the recompute step, from scratch: nothing evicted
    assert worker.worker_range(0, prompt_len) == (worker.prefill_front, worker.prefill_front)
    for context in range(resumed, resumed + 3 * BLOCK):  # decode steps after it
        manager.remove_skipped_blocks("r", context, prompt_len)
        manager.allocate_new_blocks("r", context + 1, context + 1)
        lo, hi = worker.worker_range(context, prompt_len)  # what the worker reads this step: all but [lo, hi)
        live = {i for i, block in enumerate(manager.req_to_blocks["r"]) if not block.is_null}
        blocks = -(-(context + 1) // BLOCK)
        assert live >= set(range(lo)) | set(range(hi, blocks))  # nothing this step reads is freed
        # what the worker stopped reading in the step before (the recompute's own selection, first) is freed
        assert live == set(range(lo)) | set(range(worker.worker_range(context - 1, prompt_len)[1], blocks))


@pytest.mark.parametrize("module", ["kvcompress.vllm.bench", "kvcompress.vllm.needles"])
def test_bench_and_needles_refuse_a_bad_policy_in_one_line_with_status_2(module):
    command = [sys.executable, "-m", module, "--model", "m", "--policies", '{"method": "window", "budget": 64}']
    if module.endswith("needles"):
        command += ["--data", "d"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"{module}: error: kvcompress: budget 64 is 0 block(s)")
