"""RULER's synthetic tasks (Hsieh et al., 2024, arXiv:2404.06654), generated offline at any context length.

The eleven synthetic tasks of RULER's ``synthetic.yaml``, with RULER's templates, answer prefixes, needle formats,
word lists, insertion rules, generation lengths and metric:

==================  =========================================================================================
``niah_single_1``   one needle, word key, 7-digit value, in the "noise" haystack (the grass is green ...)
``niah_single_2``   the same in real prose
``niah_single_3``   real prose, the value a UUID
``niah_multikey_1`` real prose, 4 needles with different keys, one asked for
``niah_multikey_2`` the haystack is needles with random keys ("needle" haystack), one asked for
``niah_multikey_3`` "needle" haystack, keys and values UUIDs
``niah_multivalue`` real prose, 4 values under one key, all asked for
``niah_multiquery`` real prose, 4 keys, all asked for
``vt``              variable tracking: a chain of 4 hops ``VAR B = VAR A`` in the noise haystack, one short
                    worked example first
``cwe``             common words extraction: a numbered list where 10 words appear 30 times (6 below 4K tokens)
                    and the others 3 times (1); the 10 common ones are asked for; one worked example first
``fwe``             frequent words extraction: coded 6-letter words drawn from a Zipf (alpha 2) law over a
                    vocabulary of ``length // 50`` words; the three most frequent are asked for
==================  =========================================================================================

RULER's two QA tasks (``qa_1`` SQuAD, ``qa_2`` HotpotQA) need those datasets: the ``dataset`` task reads files
that RULER's own scripts wrote.

Score: RULER's ``string_match_all``, the fraction of expected strings found anywhere in the answer
(case-insensitive), per sample; the task's headline is its mean. Keys, common words and adjective-noun keys are
drawn from the ``wonderwords`` lists, as RULER draws them; sample ``i`` is task ``i mod (number of tasks)``. Like
RULER, the haystack size is found by binary search so that the whole prompt (chat template included) holds at
most ``length`` tokens.

Prose (``data.prose``): the books shipped with the package, or the Paul Graham essays of a data folder (RULER's own
haystack). Like RULER, every sample's prose starts at the beginning of that text.

The prompt is split where RULER's question begins: what lies before it is the *context* (compressed first in the
``agnostic`` mode, kvpress's protocol), the question and answer prefix follow (see ``prompting``).

Choices RULER leaves to its code and that are made here:

- Sentences are split with ``prompting.sentences`` (RULER uses NLTK's ``sent_tokenize``).
- ``vt``'s worked example uses 10 noise sentences, 3-letter names and its own random value (RULER's example is
  generated the same way at a length its binary search picks).
- The generation length is RULER's per task (niah 128, vt 30, cwe 120, fwe 50 tokens); decoding stops once every
  expected string has appeared, which changes no score.
- ``length`` counts the prompt's tokens; RULER's ``max_seq_length`` also counts the tokens to generate.
"""

from __future__ import annotations

import random
import string
import uuid
from functools import cached_property
from importlib import resources

import torch

from kvcompress.eval.data import prose
from kvcompress.eval.tasks.base import Result, Sample, check_positive_int
from kvcompress.eval.tasks.niah import string_match_all
from kvcompress.eval.tasks.prompting import sentences, split_prompt
from kvcompress.eval.tasks.qa import QATask

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # numpy.round(linspace(0, 100, 40)), RULER's needle depths

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the {type_needle_v} afterwards.\n{context}\n"
    "@@What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    "@@ The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "@@Question: Find all variables that are assigned the value {query} in the text above."
    "@@ Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
    "the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n{context}\n@@Question: What are the 10 most common words in the above list?"
    "@@ Answer: The top 10 words that appear most often in the list are:"
)
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\n@@Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
    "@@ Answer: According to the coded text above, the three most frequently appeared words are:"
)
SEP = "@@"  # where the templates above split into context, question and answer prefix

# RULER's synthetic.yaml: haystack, key type, value type, keys, values per key, keys asked for
NIAH = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}
TASK_NAMES = (*NIAH, "vt", "cwe", "fwe")
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}


def _wordlist(name: str) -> list[str]:
    return (resources.files("wonderwords.assets") / name).read_text(encoding="utf-8").split()


class RulerTask(QATask):
    name = "ruler"
    metrics = ("score",)
    description = "RULER's 11 synthetic tasks (needles, variable tracking, common/frequent words); string_match_all"
    defaults = {
        "length": 4096,
        "tasks": TASK_NAMES,
        "modes": ("agnostic",),
        "chunk_size": None,  # None: the context in one forward, then compressed (kvpress's protocol)
        "haystack": None,  # a text file or folder for the prose haystack; default: data.prose
        "data": None,
    }

    def validate(self) -> None:
        super().validate()
        check_positive_int(self.params["length"], "length", 256)
        for task in self.params["tasks"]:
            if task not in TASK_NAMES:
                raise ValueError(f"tasks must be drawn from {', '.join(TASK_NAMES)}; got {task!r}")

    # --- word lists and haystacks ---------------------------------------------------------------------------
    @cached_property
    def _key_parts(self) -> tuple[list[str], list[str]]:
        """RULER's needle keys are the adjective-noun pairs of the wonderwords lists, drawn uniformly: an adjective
        and a noun drawn independently."""
        return sorted(set(_wordlist("adjectivelist.txt"))), sorted(set(_wordlist("nounlist.txt")))

    @cached_property
    def _words(self) -> list[str]:
        """RULER's common-words vocabulary: nouns, adjectives and verbs, deduplicated, sorted."""
        return sorted(set(_wordlist("nounlist.txt") + _wordlist("adjectivelist.txt") + _wordlist("verblist.txt")))

    @cached_property
    def _prose_words(self) -> list[str]:
        return " ".join(doc.text for doc in prose(self.params["haystack"], self.params["data"])).split()

    # --- the tasks (each: rng, haystack size -> (template text with SEP, answers)) ----------------------------
    def _random(self, rng: random.Random, kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(1_000_000, 9_999_999))
        if kind == "words":
            adjectives, nouns = self._key_parts
            return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def _niah(self, task: str, rng: random.Random, size: int) -> tuple[str, list[str]]:
        haystack, type_k, type_v, num_k, num_v, num_q = NIAH[task]
        num_k = max(num_k, num_q)
        keys, values, needles = [], [], []
        for _ in range(num_k):
            keys.append(self._random(rng, type_k))
            values.append([self._random(rng, type_v) for _ in range(num_v)])
            needles += [NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=v) for v in values[-1]]
        rng.shuffle(needles)
        if haystack == "essay":
            words = self._prose_words
            text = " ".join((words * (size // len(words) + 1))[:size])
            sents = sentences(text)
            cuts = [0, *sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))), len(sents)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if haystack == "noise":
                lines = [NOISE] * size
            else:
                lines = [
                    NEEDLE.format(type_needle_v=type_v, key=self._random(rng, type_k), value=self._random(rng, type_v))
                    for _ in range(size)
                ]
            for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles, strict=True):
                lines.insert(index, needle)
            context = "\n".join(lines)
        asked = rng.sample(range(num_k), num_q)
        queries = [keys[i] for i in asked]
        answers = [v for i in asked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, type_name = NIAH_TEMPLATE, type_v
        if num_q * num_v == 1:  # RULER's singular form
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            type_name = type_v[:-1]
        return template.format(type_needle_v=type_name, context=context, query=query), answers

    def _vt(self, rng: random.Random, size: int) -> tuple[str, list[str]]:
        def chain(letters: int, value: str) -> tuple[list[str], list[str]]:
            names: list[str] = []
            while len(names) < 5:  # RULER's one chain of 4 hops: 5 variables
                name = "".join(rng.choices(string.ascii_uppercase, k=letters))
                if name not in names:
                    names.append(name)
            return names, [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]

        def instance(noises: int, letters: int) -> tuple[str, list[str]]:
            value = str(rng.randint(10000, 99999))
            names, links = chain(letters, value)
            lines = [NOISE] * noises
            for offset, position in enumerate(sorted(rng.sample(range(noises), len(links)))):
                lines.insert(position + offset, links[offset])
            context = "\n".join(lines).replace(". \n", ".\n")
            return VT_TEMPLATE.format(context=context, query=value, num_v=len(names)), names

        example, example_names = instance(10, 3)
        shot = example.replace(SEP, "") + " ".join(example_names) + "\n"
        text, names = instance(size, 5)
        return shot + text, names

    def _cwe(self, rng: random.Random, size: int) -> tuple[str, list[str]]:
        def instance(count: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
            chosen = rng.sample(self._words, count)
            common, uncommon = chosen[:10], chosen[10:]
            words = common * common_repeats + uncommon * uncommon_repeats
            rng.shuffle(words)
            return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), common

        long = self.params["length"] >= 4096  # RULER's frequencies below and from 4K tokens
        example, example_answer = instance(40, 10, 3) if long else instance(20, 3, 1)
        shot = CWE_TEMPLATE.format(context=example).replace(SEP, "")
        shot += " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_answer))
        if size > len(self._words):
            raise ValueError(f"length {self.params['length']} needs more distinct words than cwe's word list holds")
        context, answer = instance(size, 30, 3) if long else instance(size, 6, 1)
        return shot + "\n" + CWE_TEMPLATE.format(context=context), answer

    def _fwe(self, rng: random.Random, size: int) -> tuple[str, list[str]]:
        vocab_size = max(4, self.params["length"] // 50)
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
        words = sorted(vocab)
        rng.shuffle(words)
        words[0] = "..."  # RULER: the most frequent "word" is noise
        zeta = float(torch.special.zeta(torch.tensor(2.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)))
        counts = [int(size * k**-2.0 / zeta) for k in range(1, len(words) + 1)]
        text = [w for w, c in zip(words, counts, strict=True) for _ in range(c)]
        rng.shuffle(text)
        return FWE_TEMPLATE.format(context=" ".join(text)), words[1:4]

    def _build(self, task: str, seed: int, size: int) -> tuple[str, list[str]]:
        rng = random.Random(seed)
        if task in NIAH:
            return self._niah(task, rng, size)
        return {"vt": self._vt, "cwe": self._cwe, "fwe": self._fwe}[task](rng, size)

    def _split(self, text: str):
        context, question, prefix = text.split(SEP)
        return split_prompt(self.tokenizer, context.rstrip("\n"), question, prefix.lstrip())

    def build_sample(self, index: int, rng: random.Random) -> Sample:
        """Sample ``index``: task ``index mod (number of tasks)``, the largest haystack that fits ``length``."""
        task = self.params["tasks"][index % len(self.params["tasks"])]
        seed = rng.getrandbits(32)

        def tokens(size: int) -> int:
            context_ids, question_ids = self._split(self._build(task, seed, size)[0])
            return context_ids.shape[1] + question_ids.shape[1]

        smallest = {"cwe": 11, "vt": 5}.get(task, 4)  # haystack units that hold every needle (10 common words)
        low, high = smallest, 2 * smallest
        while tokens(high) <= self.params["length"]:
            low, high = high, high * 2
        while high - low > 1:  # tokens(low) fits (or low is the smallest haystack), tokens(high) does not
            mid = (low + high) // 2
            low, high = (mid, high) if tokens(mid) <= self.params["length"] else (low, mid)
        text, answers = self._build(task, seed, low)
        context_ids, question_ids = self._split(text)
        if context_ids.shape[1] + question_ids.shape[1] > self.params["length"]:
            raise ValueError(f"length {self.params['length']} is too short for ruler task {task!r}")
        family = "niah" if task in NIAH else task
        return Sample(
            id=f"ruler-{task}-{index:03d}",
            inputs={
                "context_ids": context_ids,
                "question_ids": question_ids,
                "answers": answers,
                "max_new_tokens": TOKENS_TO_GENERATE[family],
            },
            info={
                "subtask": task,
                "prompt_tokens": context_ids.shape[1] + question_ids.shape[1],
                "context_tokens": context_ids.shape[1],
                "answers": answers,
                "haystack_size": low,
            },
        )

    def evaluate(self, sample, config, cache, mode):
        text = self.generate(sample, cache, mode, sample.inputs["max_new_tokens"], sample.inputs["answers"])
        return Result(scores=self.score_text(sample, text), extra={"prediction": text})

    def score_text(self, sample, text):
        return {"score": string_match_all(text, sample.inputs["answers"])}
