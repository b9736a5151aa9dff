"""Timing, memory and environment helpers shared by the benchmarks.

Timings on a shared CPU are noisy: benchmarks time every call separately and report medians (and the 10th/90th
percentiles), and compare methods by ratios measured in the same run. Torch's thread count is always set
explicitly (``set_threads``): on a loaded 2-core machine two threads ran single-token decoding 5-15x slower than one.

Peak memory is the process's resident-set high-water mark (``VmHWM``), reset before each measurement by writing
``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), after handing freed heap memory back to the OS (``malloc_trim``).
Where that is not possible (other systems, restricted containers) ``resource.getrusage`` gives the lifetime peak and
``PeakMemory.resettable`` is False.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import kvcompress
from kvcompress.machine import machine_description, versions
from kvcompress.models import load_model
from kvcompress.params import parse_method_spec

MIB = 1 << 20

# What the timing benchmarks run by default: ``full`` (no eviction, the reference) and the methods that stay
# bounded while decoding, in the order their rows are listed.
DECODE_TIME_METHODS: tuple[str, ...] = (
    "full",
    "window",
    "streaming",
    "h2o",
    "tova",
    "scissorhands",
    "random",
    "knorm",
    "buzz",
)


def check_int(value: object, name: str, low: int = 1) -> None:
    """Raise ``ValueError`` unless ``value`` (the parameter called ``name``) is an integer >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_methods(methods: Sequence[str], known: Sequence[str]) -> None:
    """Raise ``ValueError`` naming every entry of ``methods`` that is not in ``known`` (the accepted names)."""
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"methods must be among {', '.join(known)}; got {', '.join(unknown)}")


def set_threads(threads: int) -> None:
    """Set torch's intra-op thread count (an integer >= 1); benchmarks never run with the default."""
    check_int(threads, "threads")
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class Timing:
    """Summary of repeated timings, in seconds."""

    median: float
    p10: float
    p90: float
    count: int
    cpu_median: float | None = None  # median CPU time of this process per call (robust to other processes' load)
    cpu_mean: float | None = None  # mean CPU time per call: the amortised cost of methods that evict in bursts

    @classmethod
    def of(cls, samples: Sequence[float], cpu_samples: Sequence[float] | None = None) -> Timing:
        if not samples:
            raise ValueError("no timing samples")
        ordered = sorted(samples)

        def quantile(q: float) -> float:
            return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

        cpu = statistics.median(cpu_samples) if cpu_samples else None
        cpu_mean = statistics.fmean(cpu_samples) if cpu_samples else None
        return cls(statistics.median(ordered), quantile(0.1), quantile(0.9), len(ordered), cpu, cpu_mean)


def time_calls(fn: Callable[[int], object], count: int, warmup: int = 0) -> Timing:
    """Call ``fn(i)`` ``warmup`` times untimed, then ``count`` times, timing each call; returns the summary.

    Each call's wall time and this process's CPU time are both recorded: on a shared, overloaded machine the wall
    time includes waiting for a core, the CPU time (with one torch thread) does not.
    """
    for i in range(warmup):
        fn(i)
    samples, cpu_samples = [], []
    for i in range(warmup, warmup + count):
        cpu_start, start = time.process_time(), time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - start)
        cpu_samples.append(time.process_time() - cpu_start)
    return Timing.of(samples, cpu_samples)


# --- memory ---------------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    """Resident set size now, in bytes (``VmRSS``; falls back to the lifetime peak where /proc is missing)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else _rusage_peak()


def _rusage_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def release_free_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Without this, memory freed by an earlier run stays resident in malloc's arenas and a later run reusing it never
    raises the RSS, so its peak would read as (near) zero.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def map_large_allocations(threshold: int = 1 << 20) -> bool:
    """Give every heap allocation of ``threshold`` bytes or more its own memory mapping (glibc ``mallopt``), so it
    goes back to the OS the moment it is freed. The resident set then follows the live tensors instead of how
    fragmented malloc's heap happens to be: without it the same one-pass prefill read 610 to 1,072 MiB in different
    runs. glibc keeps the threshold fixed from then on (its adaptive threshold is off for good), and a mapping
    costs page faults on first touch, which would tilt timings: call it first thing in a process that only
    measures memory (``kvcompress.bench.prefill_peaks``). Returns False where it is not possible (not glibc)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def reset_peak_rss() -> bool:
    """Release free memory, then reset the resident-set high-water mark to the current RSS.

    Returns False where the reset is not possible (the peak is then the process's lifetime peak).
    """
    release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


def peak_rss() -> int:
    """Resident-set high-water mark in bytes since the last ``reset_peak_rss`` (or since the process started)."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else _rusage_peak()


class PeakMemory:
    """Context manager measuring the peak RSS of a block: ``peak`` (bytes) and ``extra`` (peak minus RSS at entry).

    >>> with PeakMemory() as memory:
    ...     work()
    >>> memory.extra
    """

    def __enter__(self) -> PeakMemory:
        self.resettable = reset_peak_rss()
        self.baseline = current_rss()
        self.peak = self.extra = 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = peak_rss()
        self.extra = max(0, self.peak - self.baseline)


# --- environment ----------------------------------------------------------------------------------------------


def environment(threads: int) -> dict[str, object]:
    """Facts recorded beside every benchmark result."""
    return {
        "machine": machine_description(threads),
        "threads": threads,
        **versions(),
        "cpu_count": os.cpu_count(),
    }


def load_bench_model(
    model: str | PreTrainedModel, device: str = "cpu", dtype: str = "float32", random_weights: bool = False
) -> tuple[PreTrainedModel, str]:
    """A loaded model on ``device`` in ``dtype`` and its display name: a registry name / path / HF id is loaded
    with ``load_model``; with ``random_weights`` a local folder needs only its ``config.json`` (timings do not
    depend on the weights: the model's shapes are what a speed benchmark measures)."""
    if isinstance(model, str):
        name = model
        if random_weights:
            config = AutoConfig.from_pretrained(model)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
            name += " (random weights)"
        else:
            model = load_model(model, dtype)[0]
        return model.to(device), name
    return model, getattr(model.config, "name_or_path", "") or type(model).__name__


def random_prompt(model: PreTrainedModel, length: int, seed: int) -> torch.Tensor:
    """``(1, length)`` random token ids for ``model``, seeded by ``seed``: timings do not depend on the text.

    Ids start at 100 (or the last id of a smaller vocabulary), above the special tokens of most tokenizers.
    """
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(100, vocab - 1), vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(model.device)


def touch_weights(model: PreTrainedModel) -> None:
    """Run one short forward so every weight page is resident before memory is measured.

    Weights loaded from safetensors are memory-mapped and read in on first use: without this, the first measured
    run in a process would count hundreds of MiB of weights as its own peak memory.
    """
    with torch.no_grad():  # the mode generate runs in (inference_mode spares small ops more)
        model(input_ids=torch.ones(1, 8, dtype=torch.long, device=model.device), use_cache=False)


def bench_cache(model, spec: str, budget: int):
    """A method's cache in the speed benchmarks: ``spec`` is a method name, or a name with parameters beside the
    budget, ``name:key=value`` (``cascade:prefill=chunked``)."""
    name, params = parse_method_spec(spec)
    return kvcompress.cache_for(model, name, **{**bench_params(name, budget), **params})


def bench_params(method: str, budget: int) -> dict[str, object]:
    """A method's parameters in the speed benchmarks: ``budget`` tokens (none for ``full``)."""
    if method == "full":
        return {}
    return {"budget": budget, **({"budget_kind": "peak"} if method == "buzz" else {})}  # buzz: k + w + T = budget
