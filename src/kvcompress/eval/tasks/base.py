"""What every evaluation task shares: samples, results, the task contract and the loop over configurations.

A task builds its samples once (text, token ids, answers), then evaluates each sample with each cache
configuration, in each of its modes. Everything that does not depend on the method (tokenisation, the
full-cache reference of ``summary``) is computed once per sample and reused. ``run_task`` drives the loop and
turns each evaluation into a row: scores, what the cache held at the end (tokens seen, tokens stored per layer,
stored key/value bytes), the wall time and the process CPU time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvcompress
from kvcompress.core.cache import CompressedCache
from kvcompress.eval.configs import EvalConfig


@dataclass
class Sample:
    """One evaluation item. ``inputs`` holds tensors and answers; ``info`` is JSON-safe and goes in every row."""

    id: str
    inputs: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    """Scores of one sample under one configuration; ``extra`` holds JSON-safe details (prediction, curve)."""

    scores: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)


class Task:
    """Base of every task. Subclasses set the class attributes and implement ``build_sample`` (or, for samples
    that draw no random numbers, ``build_samples``) and ``evaluate``.

    ``params`` are the task's options (context length, chunk size, ...); ``__init__`` rejects unknown ones and
    fills in defaults from ``defaults``. ``modes`` lists the variants each sample is evaluated in (e.g. the
    query-agnostic and query-aware settings of ``niah``); ``None`` when the task has a single setting.
    """

    name: ClassVar[str] = ""
    timings: dict[str, float]  # the current evaluation's timed parts (set afresh for each by run_task)
    metrics: ClassVar[tuple[str, ...]] = ()  # score names; the first is the headline
    plot_metrics: ClassVar[tuple[str, ...]] = ()  # drawn side by side against the budget; empty: the headline
    higher_is_better: ClassVar[bool] = True
    defaults: ClassVar[dict[str, Any]] = {}
    description: ClassVar[str] = ""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, seed: int = 0, **params: Any
    ) -> None:
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {', '.join(unknown)} for task {self.name!r}; "
                f"its parameters are {', '.join(sorted(self.defaults)) or 'none'}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self.timings = {}
        given = {k: v for k, v in params.items() if v is not None}
        for key, value in given.items():  # list parameters given one value ("modes=aware") become 1-tuples
            if isinstance(self.defaults[key], tuple):
                given[key] = (value,) if isinstance(value, str) else tuple(value)
        self.params: dict[str, Any] = {**self.defaults, **given}
        self.validate()

    @property
    def modes(self) -> tuple[str | None, ...]:
        return (None,)

    def validate(self) -> None:
        """Raise ``ValueError`` naming a bad parameter and its allowed range."""

    def record_params(self) -> dict[str, Any]:
        """The task parameters as written in every row (JSON-safe). ``modes`` is left out: it only says which
        modes to run, each row names its own mode, and a row's result does not depend on the other modes run
        (so ``--param modes=aware`` and ``--param modes=agnostic`` can run side by side and resume each other)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(self.params.items()) if k != "modes"}

    def build_samples(self, count: int) -> list[Sample]:
        """Samples ``0`` to ``count - 1`` from ``build_sample``, in order, sharing one ``random.Random(seed)``."""
        rng = random.Random(self.seed)
        return [self.build_sample(index, rng) for index in range(count)]

    def build_sample(self, index: int, rng: random.Random) -> Sample:
        """Sample number ``index``; ``rng`` is the generator shared by all samples (the earlier ones drew first)."""
        raise NotImplementedError

    def evaluate(self, sample: Sample, config: EvalConfig, cache: CompressedCache, mode: str | None) -> Result:
        raise NotImplementedError

    def compressed_tokens(self, sample: Sample, mode: str | None) -> int:
        """How many of ``sample``'s tokens the cache compresses in ``mode`` (what a kept ratio is a fraction of)."""
        raise ValueError(f"task {self.name!r} does not take kept ratios; give budgets in tokens")

    def new_cache(self, config: EvalConfig, sample: Sample | None = None, mode: str | None = None) -> CompressedCache:
        """A fresh cache for ``config``; a kept ratio of a method with a budget only is sized for ``sample``."""
        needs_count = isinstance(config.budget, float) and sample is not None
        count = self.compressed_tokens(sample, mode) if needs_count else None
        return kvcompress.cache_for(self.model, config.method, **config.cache_params(count))


def van_der_corput(index: int) -> float:
    """The ``index``-th point of the base-2 van der Corput sequence: 0, 0.5, 0.25, 0.75, 0.125, ...

    Spreads sample depths evenly over [0, 1) whatever the sample count, and the first ``n`` points do not change
    when more samples are asked for, so a resumed run with a larger ``--samples`` keeps its earlier samples.
    """
    value, denominator = 0.0, 1.0
    while index:
        denominator *= 2
        index, bit = divmod(index, 2)
        value += bit / denominator
    return value


def check_positive_int(value: object, name: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_fraction(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def row_identity(task: Task, sample: Sample, mode: str | None, config: EvalConfig) -> dict[str, Any]:
    """The fields that identify one row (what a resumed run compares)."""
    return {
        "task": task.name,
        "mode": mode,
        "sample": sample.id,
        "method": config.method,
        "params": config.param_dict,
        "budget": config.budget,
    }


def run_task(
    task: Task,
    configs: Iterable[EvalConfig],
    samples: list[Sample],
    skip: Callable[[dict[str, Any]], bool] | None = None,
) -> Iterator[dict[str, Any]]:
    """Evaluate every sample x mode x configuration not skipped; yield one row each.

    ``skip`` receives a row's identity (see ``row_identity``) and returns True for rows already done. Rows hold
    the identity, the task parameters, ``scores``, ``tokens_seen``, ``tokens_stored`` (per layer), ``kv_bytes``,
    ``time_s`` (wall), ``cpu_s`` (process CPU time), what the task timed in ``task.timings`` (the question-answering
    tasks: ``prefill_s``, wall seconds of the prefill and compression, ``decode_s`` and ``new_tokens``) and the
    sample's ``info`` and the result's ``extra``.
    """
    configs = list(configs)
    for sample in samples:
        for mode in task.modes:
            for config in configs:
                identity = row_identity(task, sample, mode, config)
                if skip is not None and skip(identity):
                    continue
                cache = task.new_cache(config, sample, mode)
                task.timings = {}
                start, cpu_start = time.perf_counter(), time.process_time()
                result = task.evaluate(sample, config, cache, mode)
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                yield {
                    **identity,
                    "label": config.label,
                    "seed": task.seed,
                    "task_params": task.record_params(),
                    "scores": result.scores,
                    "tokens_seen": cache.tokens_seen() if cache.compressed_layers[0].is_initialized else 0,
                    "tokens_stored": cache.tokens_stored(),
                    "kv_bytes": cache.nbytes(),
                    "kv_bytes_allocated": cache.allocated_nbytes(),
                    "time_s": round(elapsed, 4),
                    "cpu_s": round(cpu, 4),
                    **{name: round(value, 4) for name, value in task.timings.items()},
                    "info": sample.info,
                    "extra": result.extra,
                }
