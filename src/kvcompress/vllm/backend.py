"""Worker side: vLLM's CPU attention backend with a metadata builder that hides evicted blocks from the kernel.

The worker's block table is append-only: blocks the scheduler freed keep their old ids there (and may already
hold another request's KV). Every step, the builder computes each request's evicted range ``[lo, hi)`` (the same
arithmetic as the scheduler, ``kvcompress.vllm.policies``), removes it from the block table the kernel reads and
shortens the sequence lengths by as many tokens, in one vectorised gather with no host synchronisation. The
kernel then attends to the kept blocks only; its causal mask stays right because the evicted blocks all precede
the step's queries. Slot mapping (where new keys are written) is computed by vLLM from the uncompacted table, so
writes are untouched. With no policy configured the backend is vLLM's, unchanged.

GPU backends need the same two hooks, which are all this file adds to the CPU backend (none of this can be
tested on a CPU machine; read from vLLM 0.32's builders):

* ``customize_spec``: return ``KVCompressSpec`` for full-attention layers (shared code, backend-independent);
* the metadata builder's ``build``: call ``compact_block_table`` on the ``CommonAttentionMetadata`` before the
  backend's own ``build``, and do the same in ``update_block_table`` where a backend sets
  ``supports_update_block_table`` (metadata reused across KV cache groups). Per backend:

  - FlashAttention (``FlashAttentionMetadataBuilder``) and Triton / ROCm (``TritonAttentionMetadataBuilder``,
    ``RocmAttentionMetadataBuilder``) pass ``block_table_tensor`` and ``seq_lens`` straight to the kernel;
    ``seq_lens_cpu_upper_bound`` (FlashAttention's ``max_seq_len``, its AOT schedule) stays a valid bound.
  - FlashInfer (``FlashInferMetadataBuilder``) plans on the host from ``seq_lens_cpu_upper_bound`` (else
    ``seq_lens.cpu()``): its ``paged_kv_indptr/indices/last_page_len`` come from it, so that copy must be
    shortened by the same evicted lengths.
  - FlexAttention (``FlexAttentionMetadataBuilder``) builds its block mask from the two fields; its persistent
    ``seq_lens`` buffer receives the compacted values.

  Under CUDA graphs the compacted table must be written into the builder's persistent buffer (as vLLM's
  ``StaticSinkAttention`` does), and cascade attention, which reads a prefix shared by the requests' tables,
  must stay off. Block SnapKV's key read-back (``kvcompress.vllm.layout``) also needs each backend's KV layout
  (its ``get_kv_cache_shape`` and stride order); the scoring and the block copies are plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvcompress.vllm.carry import CarryBook, CarryStep, LayerCarry
from kvcompress.vllm.config import BlockPolicyConfig, check_engine, policy_from_vllm_config
from kvcompress.vllm.layout import KeyLayout
from kvcompress.vllm.policies import make_policy
from kvcompress.vllm.rows import RequestRows
from kvcompress.vllm.scores import BlockScores, H2OReplay, RefillRow, ScoredStep
from kvcompress.vllm.snapkv import ObservationStash, SnapKVStep, run_prefill_step, run_step
from kvcompress.vllm.snapkv_state import SnapKVTracker
from kvcompress.vllm.spec import KVCompressSpec


@dataclass
class KVCompressCPUMetadata(CPUAttentionMetadata):
    snapkv: SnapKVStep | None = None  # block SnapKV work of this step, if any
    scored: ScoredStep | None = None  # block H2O work of this step, if any


def compact_block_table(common: CommonAttentionMetadata, lo, hi, block_size: int) -> CommonAttentionMetadata:
    """``common`` with each request's logical blocks ``[lo, hi)`` cut out of its block table and sequence length."""
    table = common.block_table_tensor
    num_reqs, width = table.shape
    evicted = (torch.as_tensor(hi) - lo).expand(num_reqs)
    columns = torch.arange(width, device=table.device).unsqueeze(0)
    source = columns + (columns >= torch.as_tensor(lo).reshape(-1, 1)) * evicted.unsqueeze(1)
    compacted = table.gather(1, source.clamp_(max=width - 1))
    seq_lens = common.seq_lens - (evicted * block_size).to(common.seq_lens.dtype)
    return replace(common, block_table_tensor=compacted, seq_lens=seq_lens)


class KVCompressCPUBuilder(CPUAttentionMetadataBuilder):
    """CPU metadata builder that applies the layer group's block policy (see the module docstring)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.policy = None
        self.snapkv = None
        self.layout = None
        self.rows = None
        self.carry = None
        if isinstance(kv_cache_spec, KVCompressSpec):
            self.policy = make_policy(kv_cache_spec.policy, kv_cache_spec.block_size)
            if self.policy.one_shot or self.policy.scored:  # learn the key layout now (an unreadable one: refused)
                self.layout = KeyLayout(
                    self.isa, kv_cache_spec.dtype, self.num_kv_heads, self.block_size, kv_cache_spec.head_size
                )
                self.rows = RequestRows()  # request ids and prompt lengths, from vLLM's runner
                self.carry = CarryBook(self.block_size)  # kept blocks carried over preemptions
            if self.policy.one_shot:
                self.snapkv = SnapKVTracker(self.policy, self.layout)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build=False):
        if self.policy is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        common = common_attn_metadata
        num_reqs = common.num_reqs
        query_lens = common.query_start_loc[1:] - common.query_start_loc[:-1]
        context = (common.seq_lens[:num_reqs] - query_lens[:num_reqs]).long()
        step = None
        prompt_len = torch.zeros_like(context)
        requests, carry = None, None
        if self.rows is not None:
            requests = self.rows.ids(num_reqs)
            ends = context + query_lens[:num_reqs].long()
            starts = common.query_start_loc_cpu[: num_reqs + 1]
            replayable = self.snapkv.compressed if self.snapkv is not None else (lambda key: True)
            carry = self.carry.step(
                requests,
                context,
                ends,
                starts,
                common.block_table_tensor,
                self.rows.alive,
                lambda request, key: replayable(key),
            )
        if self.snapkv is not None:
            prompt_lens = torch.from_numpy(self.rows.prompt_lens(num_reqs))
            step, prompt_len = self.snapkv.track(common, context, prompt_lens, requests, carry)
        lo, hi = self.policy.worker_range(context, prompt_len)
        scored = None
        if self.policy.scored:
            scored = self._scored_step(common, context, query_lens[:num_reqs].long(), requests, carry)
        metadata = super().build(common_prefix_len, compact_block_table(common, lo, hi, self.block_size), fast_build)
        fields_ = {f.name: getattr(metadata, f.name) for f in fields(metadata)}
        return KVCompressCPUMetadata(**fields_, snapkv=step, scored=scored)

    def _scored_step(self, common, context, query_lens, requests, carry: CarryStep) -> ScoredStep:
        """Block H2O: which requests move blocks out of their window at the end of this step (``H2OBlocks``), and
        the requests leaving the batch or recomputed after a preemption (``kvcompress.vllm.carry``)."""
        policy = self.policy
        hi, hi_after = policy.leaving_hi(context), policy.leaving_hi(context + query_lens)
        step = ScoredStep(policy, self.layout, common.num_reqs, [], carry, policy.config.scoring == "one_pass")
        replayed = carry.rows()  # recomputed rows: no refill of their own (``kvcompress.vllm.carry``)
        for i in (hi_after > hi).nonzero().flatten().tolist():  # requests passing a block boundary over the budget
            if i in replayed:
                continue
            blocks = common.block_table_tensor[i].long()
            step.refill.append(
                RefillRow(
                    blocks[policy.first_sink_blocks : policy.sink_blocks],
                    blocks[hi[i] : hi_after[i]],
                    requests[i],
                    policy.first_sink_blocks,
                    int(hi[i]),
                )
            )
        for departure in carry.departures:
            step.departures_kept[departure.request] = departure.blocks[self._kept(departure.count)]
        for replay in carry.replays:
            step.replays.append(self._h2o_replay(replay))
        step.recomputing = list(carry.recomputing)
        return step

    def _kept(self, count: int) -> torch.Tensor:
        """Block H2O: the logical blocks kept once ``count`` tokens are cached (sinks, heavy slots, recent)."""
        lo, hi = (int(v) for v in self.policy.worker_range(count, 0))
        return torch.cat([torch.arange(lo), torch.arange(hi, -(-count // self.block_size))])

    def _h2o_replay(self, replay) -> H2OReplay:
        """The last step of a recompute: its tokens past the first run's ``count`` attend to the blocks kept at
        ``count`` and those written since, as the first run's next step would have; a block boundary they cross
        refills by score."""
        policy, count, length, blocks = self.policy, replay.count, replay.length, replay.blocks
        lo, hi = (int(v) for v in policy.worker_range(count, 0))
        leaving, leaving_end = int(policy.leaving_hi(count)), int(policy.leaving_hi(length))
        refill = None
        if leaving_end > leaving:
            slots = blocks[policy.first_sink_blocks : policy.sink_blocks]
            refill = RefillRow(slots, blocks[leaving:leaving_end], replay.request, policy.first_sink_blocks, leaving)
        return H2OReplay(
            replay.request,
            replay.row,
            blocks,
            self._kept(count),
            (replay.start + count - replay.context, replay.end),
            torch.cat([blocks[:lo], blocks[hi:]]),
            length - (hi - lo) * self.block_size,
            refill,
            replay,
        )


# The policy of the model this worker builds. ``customize_spec`` runs where no vLLM config is current, so the
# attention layers record it when they are built (inside the config's context, before any spec is asked for).
_worker_policy = BlockPolicyConfig()
_worker_in_flight_tokens = 0


class KVCompressCPUImpl(CPUAttentionBackendImpl):
    """CPU attention with the layer's block SnapKV work before vLLM's kernel, and the scored policies' attention (one
    torch pass for output and scores, or vLLM's kernel and a second pass), if any."""

    def __init__(self, *args, **kwargs) -> None:
        global _worker_policy, _worker_in_flight_tokens
        super().__init__(*args, **kwargs)
        config = get_current_vllm_config()
        _worker_policy = policy_from_vllm_config(config)  # checked as the model is built, before its weights load
        _worker_in_flight_tokens = config.max_in_flight_tokens
        check_engine(_worker_policy, config.cache_config.block_size, config.cache_config.enable_prefix_caching)
        unscored = self.logits_soft_cap or self.alibi_slopes is not None or self.sinks is not None
        if _worker_policy.method in ("h2o", "cascade", "buzz") and unscored:
            raise ValueError(
                f"kvcompress: the {_worker_policy.method} policy recomputes attention probabilities without logit "
                "soft-capping, ALiBi or attention-sink logits, which this model uses; choose streaming, window or "
                "snapkv"
            )
        self.stash: ObservationStash | None = None
        self.carry = LayerCarry()  # block SnapKV's front slots by request, carried over preemptions
        self.block_scores = BlockScores()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        scored = getattr(attn_metadata, "scored", None)
        if scored is not None:
            return self._scored_forward(
                scored, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
            )
        step = getattr(attn_metadata, "snapkv", None)
        if step is not None:
            if self.stash is None:
                self.stash = ObservationStash(step.policy.config.window)
            queries = query[: attn_metadata.num_actual_tokens].view(-1, self.num_heads, self.head_size)
            run_step(step, self.stash, queries, kv_cache, self.scale, self.carry)
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if step is not None and (step.prefill_select or step.cross or step.replays or step.recomputing):
            run_prefill_step(step, self.stash, queries, kv_cache, self.scale, self.carry)
        return output

    def _scored_forward(self, scored, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        """Block H2O, cascade and BUZZ: the attention output and the attention mass per block in one torch pass
        (``one_pass``), or vLLM's kernel then a second pass for the mass (``kvcompress.vllm.scores``)."""
        tokens = attn_metadata.num_actual_tokens
        queries = query[:tokens].view(-1, self.num_heads, self.head_size)
        one_pass = scored.one_pass and attn_metadata.causal is True and attn_metadata.dynamic_causal is None
        if one_pass:
            target = output[:tokens].view(-1, self.num_heads, self.head_size)
            self.block_scores.step(scored, queries, kv_cache, attn_metadata, self.scale, target)
            return output
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        self.block_scores.step(scored, queries, kv_cache, attn_metadata, self.scale)
        return output


class KVCompressCPUBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` backend with kvcompress's block policies (registered in its place by the plugin)."""

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        if not _worker_policy.active:
            return spec
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            window = f" (sliding window {spec.sliding_window})" if getattr(spec, "sliding_window", None) else ""
            raise ValueError(
                f"kvcompress: the {_worker_policy.method} policy evicts blocks of full-attention layers only; "
                f"this model has {type(spec).__name__} layers{window}"
            )
        make_policy(_worker_policy, spec.block_size)  # validate the budget against the block size, in the worker
        return KVCompressSpec.from_full(spec, _worker_policy, _worker_in_flight_tokens)

    @staticmethod
    def get_impl_cls():
        return KVCompressCPUImpl

    @staticmethod
    def get_builder_cls():
        return KVCompressCPUBuilder
