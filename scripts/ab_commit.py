"""One method's forwards with this checkout's code against the same method at an earlier commit, in one process.

Two runs of the speed benchmark on this shared machine differ by more than a few percent (a chunk of 512 tokens
varies by up to 1.6x from one to the next), so "no slower than before" is measured here with both versions of the
method in the same process, on the same model and token ids, their forwards interleaved (the order alternating):
the package at ``--commit`` is extracted with ``git archive`` into a temporary folder as ``kvcompress_at_<commit>``
(its imports and the attention function's registered name rewritten), both caches take the same ``--prefill``
tokens in 512-token chunks, then ``--forwards`` forwards of ``--tokens`` tokens each (1: decoding steps; more: the
steps of a chunked prefill). Prints the median ratio of CPU times (this checkout over the commit) with its
interquartile range; one torch thread.

    python scripts/ab_commit.py --commit 390a389 [--method cascade] [--tokens 32] [--forwards 80] [--prefill 1024]
        [--budget 512] [--model smollm2-135m]
    python scripts/ab_commit.py --commit 898b3b5 --method kvzip --prefill 4096 --prompts 4

``--prompts N`` times whole prompts instead: N ``prefill`` calls of each version over the ``--prefill`` tokens in one
forward, each into a fresh cache, interleaved (a one-shot method's compression, KVzip's reconstruction included).
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from kvcompress.bench.common import bench_cache, load_bench_model, random_prompt, set_threads
from kvcompress.bench.pairs import use_attention
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import prefill

ROOT = Path(__file__).resolve().parents[1]


def extract(commit: str, into: Path) -> str:
    """The package at ``commit`` as an importable ``kvcompress_at_<sha>`` under ``into``; returns its name."""
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, capture_output=True, text=True, check=True)
    name = f"kvcompress_at_{sha.stdout.strip()}"
    archive = subprocess.run(["git", "archive", commit, "src/kvcompress"], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    package = into / name
    (into / "src" / "kvcompress").rename(package)
    for path in package.rglob("*.py"):
        text = re.sub(r"\bkvcompress\.", f"{name}.", path.read_text())
        text = re.sub(r"\b(from|import) kvcompress\b", rf"\1 {name}", text)
        text = text.replace('ATTENTION_NAME = "kvcompress"', f'ATTENTION_NAME = "{name}"')
        path.write_text(text)
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--method", default="cascade")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per timed forward")
    parser.add_argument("--forwards", type=int, default=80, help="timed forwards of each version")
    parser.add_argument("--prefill", type=int, default=1024, help="prompt tokens before the timed forwards")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=0, help="time this many whole prompts instead of forwards")
    args = parser.parse_args()
    set_threads(1)
    model, shown = load_bench_model(args.model)
    with tempfile.TemporaryDirectory() as folder:
        name = extract(args.commit, Path(folder))
        sys.path.insert(0, folder)
        old_common = importlib.import_module(f"{name}.bench.common")
        old_prefill = importlib.import_module(f"{name}.generation").prefill
        old_attention = importlib.import_module(f"{name}.core.attention").ATTENTION_NAME
        ids = random_prompt(model, args.prefill + args.forwards * args.tokens, seed=0)
        sides = {
            "this": (bench_cache(model, args.method, args.budget), ATTENTION_NAME, prefill),
            "then": (old_common.bench_cache(model, args.method, args.budget), old_attention, old_prefill),
        }
        ratios = []
        if args.prompts:
            makers = {"this": bench_cache, "then": old_common.bench_cache}
            with torch.no_grad():
                for i in range(args.prompts):
                    times = {}
                    for side in ("this", "then") if i % 2 else ("then", "this"):
                        _, attention, fill = sides[side]
                        cache = makers[side](model, args.method, args.budget)
                        use_attention(model, attention)
                        begin = time.process_time()
                        fill(model, ids[:, : args.prefill], cache)
                        times[side] = time.process_time() - begin
                    ratios.append(times["this"] / times["then"])
                    print(f"prompt {i}: this {times['this']:.2f} s, then {times['then']:.2f} s", flush=True)
            print(
                f"{shown}, {args.method} at budget {args.budget}, {args.prompts} prompts of {args.prefill} tokens: "
                f"this checkout / {args.commit} CPU time median {statistics.median(ratios):.3f} "
                f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
            )
            return
        with torch.no_grad():
            for cache, attention, fill in sides.values():
                use_attention(model, attention)
                fill(model, ids[:, : args.prefill], cache, chunk_size=512)
            for i in range(args.forwards):
                start = args.prefill + i * args.tokens
                piece, positions = ids[:, start : start + args.tokens], torch.arange(start, start + args.tokens)[None]
                times = {}
                for side in ("this", "then") if i % 2 else ("then", "this"):
                    cache, attention, _ = sides[side]
                    use_attention(model, attention)
                    begin = time.process_time()
                    model(input_ids=piece, past_key_values=cache, position_ids=positions, use_cache=True)
                    times[side] = time.process_time() - begin
                if i >= 4:  # (the first forwards warm both up)
                    ratios.append(times["this"] / times["then"])
    low, _, high = statistics.quantiles(ratios, n=4)
    print(
        f"{shown}, {args.method} at budget {args.budget}, {args.forwards} forwards of {args.tokens} tokens after "
        f"{args.prefill}: this checkout / {args.commit} CPU time median {statistics.median(ratios):.3f} "
        f"(IQR {low:.3f}-{high:.3f}, {len(ratios)} pairs)"
    )


if __name__ == "__main__":
    main()
