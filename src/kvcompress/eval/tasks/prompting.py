"""Prompt building and answer generation shared by the question-answering tasks.

Prompts are split in two token sequences: the *context* (chat header, instructions, the long text) and the
*question* (the question, the end of the user turn, the assistant header and an answer prefix such as
``The pass key is``). The two are tokenised separately and concatenated, so both modes see the same tokens:

- ``agnostic`` (query-agnostic): the context is prefilled and compressed first; the question is then fed
  against the compressed cache by ``generate``.
- ``aware`` (query-aware): the whole prompt but its last token is prefilled (the question is inside what gets
  compressed), then ``generate`` feeds the last token and decodes.

Prefill runs in chunks of ``chunk_size`` tokens with eviction between chunks, so decode-time methods (window,
H2O, TOVA, ...) are really bounded while reading the prompt; one-shot methods (SnapKV) compress once at the
end of the prefill. A one-pass prefill would let every prompt token attend to the whole prompt and only evict
afterwards.

SmolLM2-135M-Instruct is an instruct model: prompts use its chat template and end with an answer prefix in the
assistant turn, so the answer is the first thing generated. Tokenizers without a chat template (the tiny test
tokenizer) get a plain ``context\\n\\nquestion\\nprefix`` layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch.nn import functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from kvcompress.core.cache import CompressedCache
from kvcompress.generation import cache_argument, positions_from_mask, prefill

MODES = ("agnostic", "aware")


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> torch.Tensor:
    """``[1, T]`` token ids of ``text`` without special tokens added."""
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def split_prompt(
    tokenizer: PreTrainedTokenizerBase, context: str, question: str, answer_prefix: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(context_ids, question_ids)`` of a one-turn chat prompt whose user message is
    ``context + "\\n\\n" + question`` and whose assistant turn starts with ``answer_prefix``."""
    user = context + "\n\n" + question
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        text += answer_prefix
    else:
        text = user + "\n" + answer_prefix
    cut = text.index(user) + len(context)
    return encode(tokenizer, text[:cut]), encode(tokenizer, text[cut:])


@torch.no_grad()
def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor,
    cache: CompressedCache,
    mode: str,
    chunk_size: int | None,
    max_new_tokens: int,
    stop_when_found: list[str] | None = None,
    fill: Callable[..., object] = prefill,
) -> str:
    """Greedy answer to the prompt through ``cache`` in ``mode`` (``agnostic`` or ``aware``); the decoded text.

    ``stop_when_found``: stop decoding once every one of these strings is in the answer. For scores that only
    check containment (RULER's) this changes no score and saves decoding time. ``fill`` puts the prompt into the
    cache (``kvcompress.generation.prefill``'s signature).
    """
    prompt = prefill_prompt(model, context_ids, question_ids, cache, mode, chunk_size, fill)
    return decode_answer(model, tokenizer, prompt, cache, max_new_tokens, stop_when_found)


@torch.no_grad()
def prefill_prompt(
    model: PreTrainedModel,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor,
    cache: CompressedCache,
    mode: str,
    chunk_size: int | None,
    fill: Callable[..., object] = prefill,
) -> torch.Tensor:
    """The first half of ``answer``: prefill what ``mode`` compresses into ``cache``; return the whole prompt.

    ``agnostic``: the context; ``aware``: the prompt but its last token. ``decode_answer`` feeds the rest.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    prompt = torch.cat([context_ids, question_ids], dim=1)
    fill(model, context_ids if mode == "agnostic" else prompt[:, :-1], cache, chunk_size=chunk_size)
    return prompt


@torch.no_grad()
def decode_answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: torch.Tensor,
    cache: CompressedCache,
    max_new_tokens: int,
    stop_when_found: list[str] | None = None,
) -> str:
    """The second half of ``answer``: feed the part of ``prompt`` the cache has not seen, decode greedily."""
    output = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        **cache_argument(model, cache),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        stopping_criteria=StoppingCriteriaList([_AllFound(tokenizer, prompt.shape[1], stop_when_found)])
        if stop_when_found
        else None,
    )
    return tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True)


@torch.no_grad()
def answer_nll(
    model: PreTrainedModel,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor,
    answer_ids: torch.Tensor,
    cache: CompressedCache,
    mode: str,
    chunk_size: int | None,
    fill: Callable[..., object] = prefill,
) -> float:
    """Mean negative log-likelihood (nats per token) of ``answer_ids`` (``[1, A]``), teacher-forced after the
    prompt went into ``cache`` in ``mode`` as ``answer`` puts it there: a graded retrieval score (lower is better)
    that separates methods whose greedy answers are all wrong (or all right). ``prefill_prompt``, then
    ``continuation_nll``."""
    prompt = prefill_prompt(model, context_ids, question_ids, cache, mode, chunk_size, fill)
    return continuation_nll(model, prompt, answer_ids, cache)


@torch.no_grad()
def continuation_nll(
    model: PreTrainedModel, prompt: torch.Tensor, answer_ids: torch.Tensor, cache: CompressedCache
) -> float:
    """The second half of ``answer_nll``: one forward feeds the part of ``prompt`` the cache has not seen (the
    last prompt token in ``aware`` mode, the question in ``agnostic`` mode) and ``answer_ids`` but its last token;
    it attends to the compressed cache and to its own tokens, as a decoding step does, and the cache evicts after
    it as its method says. Returns the mean cross-entropy of ``answer_ids`` (nats per token)."""
    seen = cache.get_seq_length()
    ids = torch.cat([prompt, answer_ids], dim=1)
    mask = torch.ones_like(ids)
    logits = model(
        input_ids=ids[:, seen:-1],
        attention_mask=mask[:, :-1],
        position_ids=positions_from_mask(mask)[:, seen:-1],
        **cache_argument(model, cache),
        use_cache=True,
    ).logits[0, -answer_ids.shape[1] :]
    return F.cross_entropy(logits.float(), answer_ids[0]).item()


class _AllFound(StoppingCriteria):
    """Stop once every expected string appears (case-insensitive) in the generated text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_length: int, expected: list[str]) -> None:
        self.tokenizer, self.prompt_length = tokenizer, prompt_length
        self.expected = [e.lower() for e in expected]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.prompt_length :], skip_special_tokens=True).lower()
        done = all(e in text for e in self.expected)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    """Split prose into sentences (on ``.``, ``!``, ``?`` followed by white space), whitespace normalised."""
    return [s for s in (" ".join(part.split()) for part in _SENTENCE_END.split(text)) if s]


def take_sentences(tokenizer: PreTrainedTokenizerBase, pieces: list[str], tokens: int, start: int = 0) -> list[str]:
    """Consecutive sentences from ``pieces`` (wrapping around) starting at ``start`` whose total token count
    (each sentence tokenised with a leading space) stays within ``tokens``."""
    chosen: list[str] = []
    total = 0
    index = start
    while len(chosen) < 100_000:
        piece = pieces[index % len(pieces)]
        size = count_tokens(tokenizer, " " + piece)
        if total + size > tokens:
            break
        chosen.append(piece)
        total += size
        index += 1
    return chosen
