"""Preemption with recompute gives back the first run's kept blocks (``kvcompress.vllm.carry``), in a tiny pool.

Three requests of 2-3 blocks generate 400 tokens each in a pool of 9 usable blocks (see ``PROMPTS``): vLLM preempts
requests that have made eviction decisions and recomputes them. The test watches the first
attention layer through the worker (the engine runs in this process): when a request leaves the batch, the keys of
every block it keeps, per KV head, in kept order; after its recompute, the same read of its new blocks. Layer 0's
keys depend only on the token and its position (no attention below them), so the recompute writes each token's keys
again as they were, and the kept keys match if and only if every KV head keeps the same logical blocks in the same
slots. Without the carry, block H2O would score the recompute with full causal attention and SnapKV would re-select
by the recompute's queries, and the kept blocks would differ. The scored policies' scores of the kept blocks, read
from the layer when the request leaves and once its recompute has restored them, are equal too.

Each case runs twice: with vLLM's default step (the recompute is one prefill step) and with steps of 256 tokens
(``max_num_batched_tokens``), where the recompute of 500-750 tokens is split over several prefill steps, between
which the policy's arithmetic evicts as during any chunked prefill and each step copies the origin blocks it
completed into their slots (``kvcompress.vllm.carry``).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from kvcompress.vllm import backend, scores, snapkv  # noqa: E402
from tests.vllm.engine import close, make_llm, manager, prompt, trace_blocks  # noqa: E402

BLOCK = 128
# Prompts of 2, 3 and 4 blocks, all admitted (9 of 9 blocks). Requests 1 and 2 decode at their 3-block budget (a
# policy bounds them: a pool is outgrown only by what it does not bound), while the test holds back the blocks
# request 0 frees, as full attention would: request 0 grows a block every 128 tokens, and vLLM preempts the others
# (after their first eviction decisions), then recomputes them in one step when request 0 has finished.
PROMPTS = [(0, 130), (200, 380), (600, 500)]
GENERATED = 400
# vLLM's step size (max_num_batched_tokens). Half a block: the last step of a recompute holds at most 63 tokens, so the
# blocks the front slots hold are completed, and copied into their slots, by the earlier steps of the recompute.
STEPS = {"one-step": None, "several-steps": BLOCK // 2}
POLICIES = {
    "h2o": {"method": "h2o", "budget": 3 * BLOCK},
    "cascade": {"method": "cascade", "budget": 3 * BLOCK},
    # One sink, a middle of one slot, a window of one block: the slot holds the heavier of blocks 1 and 2 per KV
    # head (BUZZ's first eviction; with T = 1 its later evictions keep that old block).
    "buzz": {"method": "buzz", "budget": 3 * BLOCK},
    # Re-selecting at every generated block: the kept blocks depend on the decode steps' own queries.
    "snapkv-reselect": {"method": "snapkv", "budget": 3 * BLOCK, "reselect_blocks": 1},
}


def _kept_keys(layout, kv_cache, blocks: torch.Tensor, logical: torch.Tensor, count: int):
    """``[H_kv, kept tokens, D]``: keys of the logical blocks ``logical`` (ids ``blocks``), first ``count`` tokens,
    and the cache slot of each of those tokens."""
    keys = layout.read_blocks(kv_cache, blocks[logical])  # [H_kv, len(logical) * BLOCK, D]
    tokens = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in logical.tolist()])
    slots = (blocks[logical].unsqueeze(1) * BLOCK + torch.arange(BLOCK)).flatten()
    return keys[:, tokens < count], slots[tokens < count]


def _kept_logical(policy, count: int, prompt_len: int) -> torch.Tensor:
    """The logical blocks a request keeps after the step that left ``count`` tokens cached."""
    if policy.scored:  # h2o: refilled at the end of that step
        lo, hi = (int(v) for v in policy.worker_range(count, 0))
    else:  # snapkv: selected at its start
        lo, hi = (int(v) for v in policy.worker_range(count - 1, prompt_len))
    return torch.cat([torch.arange(lo), torch.arange(hi, -(-count // BLOCK))])


@pytest.mark.parametrize("steps", sorted(STEPS))
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_recomputed_request_keeps_the_blocks_of_its_first_run(name, steps, short_model_dir, monkeypatch):
    ids = AutoTokenizer.from_pretrained(short_model_dir)(prompt(1400, seed=41)).input_ids
    prompts = [{"prompt_token_ids": ids[start : start + length]} for start, length in PROMPTS]
    first, again = {}, defaultdict(list)  # request -> layer 0's kept keys when it left / once its recompute restored
    left_scores, restored_scores = {}, []  # layer 0's scores of the kept blocks when it left / once restored
    recompute_steps = defaultdict(int)  # request -> recompute steps before the one reaching its first run's count
    original = backend.KVCompressCPUImpl.forward
    now = {}  # the layer running

    def watched(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs):
        now["layer"] = layer.layer_name
        watching = layer.layer_name.startswith("model.layers.0.") and metadata is not None
        step = getattr(metadata, "scored", None) or getattr(metadata, "snapkv", None)
        carry = step.carry if watching and step is not None else None
        if carry is not None:
            # vLLM writes the step's new keys before the layer's attention: a freed block handed to another request in
            # this step already holds that request's keys in its written slots, which the comparison leaves out.
            written = metadata.slot_mapping[: metadata.num_actual_tokens]
            for departure in carry.departures:
                logical = _kept_logical(step.policy, departure.count, _prompt_len(departure.request))
                keys, slots = _kept_keys(step.layout, kv_cache, departure.blocks, logical, departure.count)
                first[departure.request] = (keys, ~torch.isin(slots, written))
                if step.policy.scored:  # read before this step's first writes can reset a reused block's score
                    left_scores[departure.request] = self.block_scores.scores[departure.blocks[logical]].clone()
            for recompute in carry.recomputing:
                recompute_steps[recompute.request] += 1
        return original(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs)

    def restored(step, replay, kv_cache, block_scores=None):
        """Layer 0, right after the last step of a recompute restored the kept blocks (before a re-selection or
        refill that the first run's next step would make changes them): their keys, and scores."""
        if not now["layer"].startswith("model.layers.0."):
            return
        logical = _kept_logical(step.policy, replay.count, _prompt_len(replay.request))
        keys, _ = _kept_keys(step.layout, kv_cache, replay.blocks, logical, replay.count)
        again[replay.request].append((first.get(replay.request), keys, replay.count, logical.tolist()))
        if block_scores is not None:
            kept_scores = block_scores.scores[replay.blocks[logical]].clone()
            restored_scores.append((left_scores.get(replay.request), kept_scores))

    original_scored, original_snapkv = scores.BlockScores._restore, snapkv.restore_replay

    def restore_scored(self, step, replay, kv_cache):
        done = original_scored(self, step, replay, kv_cache)
        if done:
            restored(step, replay.carried, kv_cache, self)
        return done

    def restore_snapkv(step, replay, stash, kv_cache, carry):
        done = original_snapkv(step, replay, stash, kv_cache, carry)
        if done:
            restored(step, replay.carried, kv_cache)
        return done

    def _prompt_len(request: str) -> int:
        return len(prompts[int(request.rsplit("-", 1)[0])]["prompt_token_ids"])

    monkeypatch.setattr(backend.KVCompressCPUImpl, "forward", watched)
    monkeypatch.setattr(scores.BlockScores, "_restore", restore_scored)
    monkeypatch.setattr(snapkv, "restore_replay", restore_snapkv)
    step_tokens = STEPS[steps]
    kwargs = {"max_num_batched_tokens": step_tokens, "max_num_seqs": 4, "max_model_len": 1280} if step_tokens else {}
    llm = make_llm(short_model_dir, POLICIES[name], num_gpu_blocks_override=10, **kwargs)
    group = manager(llm)
    free = group.remove_skipped_blocks
    group.remove_skipped_blocks = lambda request, *args: None if request.startswith("0-") else free(request, *args)
    try:
        trace = trace_blocks(llm, prompts, max_tokens=GENERATED)
    finally:
        close(llm)
    assert trace.preemptions > 0
    assert all(len(out) == GENERATED for out in trace.outputs.values()) and len(trace.outputs) == 3
    replays = [(request, pair) for request, pairs in again.items() for pair in pairs]
    assert replays, "no request was recomputed after a preemption"
    counts = [(count, recompute_steps[request] + 1) for request, (_, _, count, _) in replays]
    print(f"{name}, {steps}: {trace.preemptions} preemption(s); replayed (tokens, recompute steps): {counts}")
    if step_tokens:  # the recomputes really were split over several steps
        assert all(n >= 2 for _, n in counts), counts
    else:
        assert all(n == 1 for _, n in counts), counts
    for _, ((before, unwritten), after, count, logical) in replays:
        assert before.shape == after.shape and unwritten.float().mean() > 0.9
        differ = ((after != before).any(dim=2).any(dim=0) & unwritten).nonzero().flatten().tolist()
        positions = [b * BLOCK + t for b in logical for t in range(BLOCK) if b * BLOCK + t < count]
        assert not differ, f"{count} tokens, kept blocks {logical}: keys differ at {[positions[i] for i in differ]}"
    if POLICIES[name]["method"] != "snapkv":
        assert restored_scores
        for left, now_scores in restored_scores:
            assert left is not None and torch.equal(now_scores, left)  # bit for bit the first run's
