"""The answering path of the question-answering tasks, on the token ids really fed to the model: the agnostic /
aware prompt split, chunked prefill, decoding that stops once the expected strings are found, and docqa through
``run_task`` with a model made to decode a chosen answer."""

from __future__ import annotations

import math

import pytest

from kvcompress.eval.configs import EvalConfig
from kvcompress.eval.tasks import make_task, run_task
from kvcompress.models import tiny_model, tiny_tokenizer

FULL = EvalConfig("full")


class Scripted:
    """Wraps a model's ``forward``: records the token ids of every forward and, once the last prompt token has been
    fed, makes greedy decoding emit ``script`` (one token per forward). Positions are counted per cache object."""

    def __init__(self, model, monkeypatch, prompt_length: int, script: list[int]) -> None:
        self.calls: list[list[int]] = []
        self.prompt_length, self.script = prompt_length, script
        self._cache, self._fed = None, 0
        original = model.forward

        def forward(*args, **kwargs):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            cache = kwargs.get("cache")
            if cache is None:
                cache = kwargs.get("past_key_values")
            if cache is not self._cache:
                self._cache, self._fed = cache, 0
            self.calls.append(ids[0].tolist())
            out = original(*args, **kwargs)
            self._fed += ids.shape[1]
            step = self._fed - self.prompt_length
            if 0 <= step < len(self.script):
                out.logits[:, -1, :] = -1e4
                out.logits[:, -1, self.script[step]] = 0.0
            return out

        monkeypatch.setattr(model, "forward", forward)


@pytest.fixture
def model():
    return tiny_model("llama", seed=3)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("chunk_size", [1000, 16])
@pytest.mark.parametrize("mode", ["agnostic", "aware"])
def test_agnostic_prefills_the_context_and_aware_all_but_the_last_token(model, monkeypatch, mode, chunk_size):
    """agnostic: the context is prefilled (in chunks of ``chunk_size``), then the question is fed in one forward;
    aware: the prompt but its last token is prefilled, then the last token. Decoding then feeds back each answer
    token but the last."""
    tokenizer = tiny_tokenizer()
    params = dict(seed=5, length=100, chunk_size=chunk_size, modes=(mode,), nll=False)  # the answering path only
    [sample] = make_task("passkey", model, tokenizer, **params).build_samples(1)
    context, question = sample.inputs["context_ids"][0].tolist(), sample.inputs["question_ids"][0].tolist()
    prompt = context + question
    answer = f" {sample.inputs['key']}."
    script = _ids(tokenizer, answer)
    task = make_task("passkey", model, tokenizer, max_new_tokens=len(script), **params)
    scripted = Scripted(model, monkeypatch, len(prompt), script)
    [row] = run_task(task, [FULL], [sample])

    prefilled, first = (context, question) if mode == "agnostic" else (prompt[:-1], prompt[-1:])
    chunks = math.ceil(len(prefilled) / chunk_size)
    calls = scripted.calls
    assert [token for call in calls[:chunks] for token in call] == prefilled
    assert all(1 <= len(call) <= chunk_size for call in calls[:chunks])
    assert calls[chunks] == first
    assert calls[chunks + 1 :] == [[token] for token in script[:-1]]
    assert row["extra"]["prediction"] == answer
    assert row["scores"]["accuracy"] == 1.0
    assert row["tokens_seen"] == len(prompt) + len(script) - 1


def test_decoding_stops_once_every_expected_string_is_found(model, corpus, monkeypatch):
    tokenizer = tiny_tokenizer()
    task = make_task("niah", model, tokenizer, seed=6, length=220, haystack=str(corpus), subtasks=("multivalue",))
    [sample] = task.build_samples(1)
    values = sample.inputs["answers"]
    assert len(values) == 4 and sample.inputs["max_new_tokens"] == 44
    found = " " + ", ".join(values)
    script = _ids(tokenizer, found + " and then some more text that goes on and on.")
    prompt_length = sample.inputs["context_ids"].shape[1] + sample.inputs["question_ids"].shape[1]
    Scripted(model, monkeypatch, prompt_length, script)
    rows = list(run_task(task, [FULL], [sample]))
    assert [row["mode"] for row in rows] == ["agnostic", "aware"]
    for row in rows:
        assert row["extra"]["prediction"] == found  # stopped at the last digit of the fourth value
        assert row["scores"]["score"] == 1.0
        assert row["tokens_seen"] == prompt_length + len(found) - 1
    cache = task.new_cache(FULL)
    assert task.generate(sample, cache, "aware", 12) == tokenizer.decode(script[:12])  # no stop strings: all 12
    cache = task.new_cache(FULL)
    assert task.generate(sample, cache, "aware", 40, [values[1]]) == found[: found.index(values[1]) + 7]


@pytest.mark.parametrize(("answer", "accuracy"), [(" {answer}.", 1.0), (" The code word is not known.", 0.0)])
def test_docqa_through_run_task_scores_what_the_model_decodes(model, corpus, monkeypatch, answer, accuracy):
    tokenizer = tiny_tokenizer()
    params = dict(seed=7, documents=3, doc_tokens=30, corpus=str(corpus), modes=("agnostic", "aware"))
    [sample] = make_task("docqa", model, tokenizer, **params).build_samples(1)
    text = answer.format(answer=sample.inputs["answer"])
    script = _ids(tokenizer, text)
    task = make_task("docqa", model, tokenizer, max_new_tokens=len(script), **params)
    prompt_length = sample.info["prompt_tokens"]
    Scripted(model, monkeypatch, prompt_length, script)
    rows = list(run_task(task, [FULL, EvalConfig("window", (), 16)], [sample]))
    assert [(row["mode"], row["method"]) for row in rows] == [
        ("agnostic", "full"),
        ("agnostic", "window"),
        ("aware", "full"),
        ("aware", "window"),
    ]
    for row in rows:
        assert row["extra"]["prediction"] == text
        assert row["scores"] == {"accuracy": accuracy}
        assert row["info"]["answer"] == sample.inputs["answer"]
        assert row["tokens_seen"] == prompt_length + len(script) - 1
        stored = 16 if row["method"] == "window" else row["tokens_seen"]
        assert row["tokens_stored"] == [stored, stored]
        assert row["kv_bytes"] == stored * 2 * 2 * 2 * 16 * 4  # K+V, layers, KV heads, head_dim, fp32
