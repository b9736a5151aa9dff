"""RULER-style needle-in-a-haystack tasks (Hsieh et al., 2024, arXiv:2404.06654) over real prose.

Subtasks, following RULER's templates (``niah_single_2``, ``niah_multikey_1``, ``niah_multivalue``,
``niah_multiquery``, ``vt``) with real prose as haystack (``data.prose``: the shipped books, or the Paul Graham
essays of a data folder):

- ``single``: one needle "One of the special magic numbers for {key} is: {value}." (7-digit value, word key);
- ``multikey``: 4 needles with different keys; one is asked for, the others are distractors;
- ``multivalue``: 4 needles with the same key and different values; all values are asked for;
- ``multiquery``: 4 needles with different keys; all 4 are asked for;
- ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of ``hops`` assignments spread
  through the text; the answer is every variable holding the value.

Score: RULER's ``string_match_all``: the fraction of expected strings (values or variable names) found, case
insensitive, anywhere in the generated text (``string_match_part``, the best single match, is not used by these
subtasks). Sample ``i`` is subtask ``i mod 5``; needles sit at random depths, each at a sentence boundary.

Both settings of the issue are evaluated on the same prompts: ``agnostic`` (the context, with RULER's opening
instruction but not the question, is compressed first; the question then meets the compressed cache) and
``aware`` (the question is inside the compressed prompt). See ``prompting``.

Tuning for SmolLM2-135M (tuned format and length, not the metric): contexts are 1K tokens by default (the
model is unreliable at retrieval beyond a few thousand tokens); the question is RULER's, and RULER's answer
prefix ("The special magic number for {key} mentioned in the provided text is") starts the assistant turn.
"""

from __future__ import annotations

import random

from kvcompress.eval.data import prose
from kvcompress.eval.tasks.base import Result, Sample, check_positive_int
from kvcompress.eval.tasks.prompting import MODES, count_tokens, sentences, split_prompt, take_sentences
from kvcompress.eval.tasks.qa import QATask

SUBTASKS = ("single", "multikey", "multivalue", "multiquery", "vt")

# Keys are adjective-noun pairs like RULER's (which draws them from the wonderwords lists).
ADJECTIVES = (
    "ancient bitter brave calm clever crimson curious dusty eager faint fierce fragile gentle golden grumpy "
    "hollow humble icy jolly lazy lively lonely loud lucky mellow misty noble odd pale polite proud quiet "
    "rapid rusty shiny silent silly sleepy sour spicy steady stormy sturdy sweet tame tender tidy tiny "
    "vivid wary wicked witty young zealous"
).split()
NOUNS = (
    "anchor apple badger banjo basket beacon cactus candle canyon castle cello comet cookie crayon dolphin "
    "falcon feather fiddle garden glacier harbor helmet island jacket kettle ladder lantern lemon meadow "
    "mirror muffin needle oyster paddle pebble pepper piano pillow pocket rabbit ribbon saddle scooter "
    "spider teapot tiger tulip tunnel turtle velvet violin walrus wagon window"
).split()

INTRO = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards."
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What {is_are} {all_}the special magic {kind} for {query} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic {kind} for {query} mentioned in the provided text {is_are}"

VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_ANSWER_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
    "assigned the value {value}, they are:"
)


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's score: the fraction of ``references`` contained in ``prediction`` (case-insensitive)."""
    if not references:
        raise ValueError("references must not be empty")
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER's QA score: 1 if any reference is contained in ``prediction`` (case-insensitive), else 0."""
    text = prediction.lower()
    return float(any(ref.lower() in text for ref in references))


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


class NiahTask(QATask):
    name = "niah"
    metrics = ("score",)
    description = "RULER needle tasks over real prose; string_match_all"
    defaults = {
        "length": 1024,
        "subtasks": SUBTASKS,
        "modes": MODES,
        "chunk_size": 64,
        "needles": 4,  # needles of multikey / multivalue / multiquery (RULER's 4)
        "hops": 4,  # variable tracking: assignments after the first (RULER's 4: 5 variables)
        "haystack": None,  # a text file or folder; default: data.prose (the shipped books)
        "data": None,
    }

    def validate(self) -> None:
        super().validate()
        check_positive_int(self.params["length"], "length", 128)
        check_positive_int(self.params["needles"], "needles", 2)
        check_positive_int(self.params["hops"], "hops", 1)
        for sub in self.params["subtasks"]:
            if sub not in SUBTASKS:
                raise ValueError(f"subtasks must be drawn from {', '.join(SUBTASKS)}; got {sub!r}")

    # --- building ----------------------------------------------------------------------------------------
    def _haystack(self) -> list[str]:
        if not hasattr(self, "_sentences"):
            docs = prose(self.params["haystack"], self.params["data"])
            self._sentences = [s for doc in docs for s in sentences(doc.text)]
        return self._sentences

    def _keys(self, rng: random.Random, count: int) -> list[str]:
        keys: list[str] = []
        while len(keys) < count:
            key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
            if key not in keys:
                keys.append(key)
        return keys

    def build_case(self, subtask: str, rng: random.Random) -> dict:
        """Needle sentences, intro, question, answer prefix, expected strings and generation length."""
        value = lambda: str(rng.randint(1_000_000, 9_999_999))  # noqa: E731
        n = self.params["needles"]
        if subtask == "vt":
            start = str(rng.randint(10000, 99999))
            names: list[str] = []
            while len(names) < self.params["hops"] + 1:
                name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                if name not in names:
                    names.append(name)
            needles = [f"VAR {names[0]} = {start}."] + [
                f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))
            ]
            return {
                "intro": VT_INTRO,
                "needles": needles,
                "ordered": True,
                "question": VT_QUESTION.format(value=start),
                "prefix": VT_ANSWER_PREFIX.format(count=len(names), value=start),
                "answers": names,
                "max_new_tokens": 6 * len(names) + 4,
            }
        if subtask == "single":
            keys, values = self._keys(rng, 1), [value()]
            pairs, asked = list(zip(keys, values, strict=True)), keys
        elif subtask == "multikey":
            keys, values = self._keys(rng, n), [value() for _ in range(n)]
            pairs, asked = list(zip(keys, values, strict=True)), keys[:1]
            values = values[:1]
        elif subtask == "multivalue":
            keys, values = self._keys(rng, 1), [value() for _ in range(n)]
            pairs, asked = [(keys[0], v) for v in values], keys
        else:  # multiquery
            keys, values = self._keys(rng, n), [value() for _ in range(n)]
            pairs, asked = list(zip(keys, values, strict=True)), keys
        plural = len(values) > 1
        kind = "numbers" if plural else "number"
        fields = {
            "kind": kind,
            "query": _join(asked),
            "is_are": "are" if plural else "is",
            "all_": "all " if plural else "",
        }
        return {
            "intro": INTRO.format(kind="numbers"),
            "needles": [NEEDLE.format(key=k, value=v) for k, v in pairs],
            "ordered": False,
            "question": QUESTION.format(**fields),
            "prefix": ANSWER_PREFIX.format(kind=kind, query=fields["query"], is_are=fields["is_are"]),
            "answers": values,
            "max_new_tokens": 10 * len(values) + 4,
        }

    def build_sample(self, index: int, rng: random.Random) -> Sample:
        """Sample ``index``: subtask ``index mod (number of subtasks)``, needles at random sentence boundaries."""
        subtask = self.params["subtasks"][index % len(self.params["subtasks"])]
        case = self.build_case(subtask, rng)
        haystack = self._haystack()
        fixed = count_tokens(self.tokenizer, " ".join([case["intro"], *case["needles"]]))
        fixed += count_tokens(self.tokenizer, case["question"] + " " + case["prefix"]) + 40
        filler = take_sentences(self.tokenizer, haystack, self.params["length"] - fixed, rng.randrange(len(haystack)))
        slots = sorted(rng.randint(0, len(filler)) for _ in case["needles"])
        needles = case["needles"] if case["ordered"] else rng.sample(case["needles"], len(case["needles"]))
        parts = list(filler)
        for offset, (slot, needle) in enumerate(zip(slots, needles, strict=True)):
            parts.insert(slot + offset, needle)
        context = case["intro"] + "\n" + " ".join(parts)
        context_ids, question_ids = split_prompt(self.tokenizer, context, case["question"], case["prefix"])
        return Sample(
            id=f"niah-{subtask}-{index:03d}",
            inputs={
                "context_ids": context_ids,
                "question_ids": question_ids,
                "answers": case["answers"],
                "max_new_tokens": case["max_new_tokens"],
            },
            info={
                "subtask": subtask,
                "depths": [round(s / max(1, len(filler)), 3) for s in slots],
                "prompt_tokens": context_ids.shape[1] + question_ids.shape[1],
                "answers": case["answers"],
            },
        )

    def evaluate(self, sample, config, cache, mode):
        text = self.generate(sample, cache, mode, sample.inputs["max_new_tokens"], sample.inputs["answers"])
        return Result(scores=self.score_text(sample, text), extra={"prediction": text})

    def score_text(self, sample, text):
        return {"score": string_match_all(text, sample.inputs["answers"])}
