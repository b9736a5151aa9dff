"""The ``kvcompress`` model for lm-evaluation-harness: lm-eval's Hugging Face model with a compressed KV cache.

    kvcompress lm-eval --model kvcompress --model_args pretrained=smollm2-135m,method=h2o,budget=256 \\
        --tasks kvc_needle,kvc_wikitext --limit 10

Model arguments: ``pretrained`` (a kvcompress registry name such as ``smollm2-135m``, a local directory, a
``.gguf`` file or a Hub id; default ``smollm2-135m``), ``method`` (a kvcompress method, default ``full``),
``chunk_size`` (tokens per forward when feeding prompts and scored text, default 128; ``None``: one forward),
``dtype`` (default ``float32``), the method's own parameters by name (``budget=256``, ``window=32``, ...), and
every argument of lm-eval's ``hf`` model (``batch_size``, ``max_length``, ...).

What is compressed when, per request (each request gets a fresh cache):

* ``generate_until``: the prompt but its last token is prefilled in chunks of ``chunk_size`` (evicting methods
  evict between chunks, one-shot methods compress once after the prompt), then the model's own ``generate``
  feeds the last prompt token and decodes through the same cache, which evicts after every step. The question
  of a task is part of the prompt, so this is the query-aware setting.
* ``loglikelihood`` / ``loglikelihood_rolling``: see ``kvcompress.lmeval.scoring``: the context is prefilled in
  chunks, then the continuation is scored ``chunk_size`` tokens per forward through the compressed cache.

The KV bytes stored after each request (per batch row) are recorded; their mean and maximum are written into
the results file under ``config.kvcompress``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.lmeval.scoring import score_batch
from kvcompress.models import DEFAULT_MODEL, load_model
from kvcompress.params import method_fields, method_params

DEFAULT_CHUNK = 128
logger = logging.getLogger(__name__)


@register_model("kvcompress")
class KVCompressLM(HFLM):
    """lm-eval's ``HFLM`` whose every request runs through a fresh kvcompress cache."""

    def __init__(
        self,
        pretrained: Any = DEFAULT_MODEL,
        method: str = "full",
        chunk_size: int | None = DEFAULT_CHUNK,
        dtype: str = "float32",
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> None:
        fields = method_fields(method)
        given = {key: _text(kwargs.pop(key)) for key in list(kwargs) if key in fields}
        self.method_config = kvcompress.make_config(method, **method_params(method, given))
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
            raise ValueError(f"chunk_size must be an integer >= 1 or None; got {chunk_size!r}")
        self.chunk_size = chunk_size
        _warn_if_chunks_fill_the_budget(self.method_config, chunk_size)
        if isinstance(pretrained, str):
            pretrained, tokenizer = load_model(pretrained, dtype)
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, **kwargs)
        self.kv_bytes: list[int] = []

    def new_cache(self) -> kvcompress.CompressedCache:
        """A fresh cache applying this model's method."""
        return kvcompress.cache_for(self.model, self.method_config)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = self.new_cache()
        mask = generation_kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(context)
            generation_kwargs["attention_mask"] = mask
        if context.shape[1] > 1:
            prefill(self.model, context[:, :-1], cache, mask[:, :-1], self.chunk_size)
        output = super()._model_generate(
            context, max_length, stop, **cache_argument(self.model, cache), **generation_kwargs
        )
        self.kv_bytes.extend([cache.nbytes() // context.shape[0]] * context.shape[0])
        return output

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        size = override_bs or (self.batch_size if isinstance(self.batch_size, int) else 1)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        answers: dict[int, tuple[float, bool]] = {}
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="kvcompress loglikelihood")
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            pairs = [(requests[i][1], requests[i][2]) for i in batch]
            scored = score_batch(
                self.model, self.new_cache, pairs, self.max_length, self.chunk_size, self.tokenizer.pad_token_id or 0
            )
            for index, result in zip(batch, scored, strict=True):
                answers[index] = (result.logprob, result.greedy)
                self.kv_bytes.append(result.kv_bytes)
                if requests[index][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], answers[index])
            bar.update(len(batch))
        bar.close()
        return [answers[i] for i in range(len(requests))]

    def get_model_info(self) -> dict[str, Any]:
        info = super().get_model_info()
        info["kvcompress"] = {
            "method": self.method_config.name,
            "params": kvcompress_params(self.method_config),
            "chunk_size": self.chunk_size,
            "requests": len(self.kv_bytes),
            "kv_bytes_mean": sum(self.kv_bytes) / len(self.kv_bytes) if self.kv_bytes else None,
            "kv_bytes_max": max(self.kv_bytes, default=None),
            "version": kvcompress.__version__,
        }
        return info


def kvcompress_params(config: kvcompress.MethodConfig) -> dict[str, Any]:
    """The method's parameters as plain values (for the results file)."""
    return {name: getattr(config, name) for name in method_fields(config.name)}


def _text(value: Any) -> str:
    """lm-eval parses ``key=value`` model arguments itself; give them back as text for kvcompress's typed parser."""
    return "none" if value is None else str(value)


def _warn_if_chunks_fill_the_budget(config, chunk_size: int | None) -> None:
    """A method that evicts while reading never evicts the tokens of the forward it processes while they fit in its
    budget: with chunks as long as the budget, each chunk replaces everything before it (the method keeps what
    ``window`` keeps)."""
    budget = getattr(config, "budget", None)
    if config.policy(0).one_shot or not isinstance(budget, int) or budget <= 0:
        return
    if chunk_size is None or chunk_size >= budget:
        logger.warning(
            "chunk_size=%s with budget=%d: every forward fills the budget, so %s keeps only the last chunk, as window "
            "would; pass chunk_size below the budget (e.g. chunk_size=%d) to let the method choose",
            chunk_size,
            budget,
            config.name,
            max(1, budget // 4),
        )
