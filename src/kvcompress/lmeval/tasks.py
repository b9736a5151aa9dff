"""Local lm-eval tasks (YAML + JSON lines) built from the offline corpora; no Hub access needed.

    python -m kvcompress.lmeval.tasks OUT_DIR [--data DATA] [--samples 50] [--words 700]

writes into ``OUT_DIR`` (then ``lm_eval --include_path OUT_DIR``; ``kvcompress lm-eval`` builds and includes them
itself):

* ``kvc_needle`` (``generate_until``): the passkey needle ("The pass key is 12345. Remember it. ...") hidden at
  depth ``i``-th van der Corput point of ``words`` words of real prose (``kvcompress.eval.data.prose``); the
  prompt ends with the question and "The pass key is", the first number generated is compared with the key
  (``exact_match``).
* ``kvc_needle_ll`` (``loglikelihood``): the same documents, the key scored as the continuation: ``acc`` (greedy
  decoding would give the key) and ``perplexity`` (exp of the mean summed negative log-likelihood of the key), a
  graded score that moves before the exact match does.
* ``kvc_wikitext`` (``loglikelihood_rolling``): lm-eval's ``wikitext`` task (its YAML and its
  ``preprocess_wikitext`` functions, copied from the installed lm-eval) on the articles of the local WikiText-2
  test split, each cut to its first ``words_per_page`` whitespace-separated words to keep CPU runs short.

The files depend only on the arguments and the corpora (fixed seed), so a rebuild gives the same tasks.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

from lm_eval.tasks.wikitext import preprocess_wikitext

from kvcompress.eval.data import configured_root, prose, wikitext_test
from kvcompress.eval.tasks.base import van_der_corput
from kvcompress.eval.tasks.passkey import ANSWER_PREFIX, INTRO, NEEDLE, QUESTION

TASK_NAMES = ("kvc_needle", "kvc_needle_ll", "kvc_wikitext")
_HEADING = re.compile(r"^ = [^=].* = $")

_NEEDLE_COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{prompt}}}}"
"""
_NEEDLE_GEN = """task: kvc_needle
{common}output_type: generate_until
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
_NEEDLE_LL = """task: kvc_needle_ll
{common}output_type: loglikelihood
doc_to_target: " {{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: perplexity
metadata:
  version: 1.0
"""
_WIKITEXT = """task: kvc_wikitext
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: !function preprocess_wikitext.wikitext_detokenizer
process_results: !function preprocess_wikitext.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def needle_docs(haystack: str, samples: int, words: int, seed: int = 0) -> list[dict[str, object]]:
    """``samples`` needle documents: ``prompt`` (ending in "The pass key is"), ``answer`` (the key), ``depth``."""
    pool = haystack.split()
    if len(pool) < words:
        raise ValueError(f"words={words} is more than the haystack's {len(pool)} words")
    rng = random.Random(seed)
    docs = []
    for index in range(samples):
        key = str(rng.randint(10000, 99999))
        start = rng.randrange(len(pool) - words + 1)
        filler = pool[start : start + words]
        depth = van_der_corput(index)
        cut = round(depth * words)
        text = " ".join([*filler[:cut], NEEDLE.format(key=key), *filler[cut:]])
        prompt = f"{INTRO}\n\n{text}\n\n{QUESTION} {ANSWER_PREFIX}"
        docs.append({"prompt": prompt, "answer": key, "depth": depth})
    return docs


def wikitext_pages(text: str, words_per_page: int) -> list[dict[str, str]]:
    """WikiText-2 articles (split at `` = Title = `` headings), each cut to ``words_per_page`` words."""
    pages, current = [], []
    for line in text.split("\n"):
        if _HEADING.match(line) and current:
            pages.append("\n".join(current))
            current = []
        current.append(line)
    pages.append("\n".join(current))
    return [{"page": _first_words(page, words_per_page)} for page in pages if page.strip()]


def _first_words(page: str, count: int) -> str:
    """``page`` up to the end of its ``count``-th whitespace-separated word (original spacing kept)."""
    ends = [word.end() for word in islice(re.finditer(r"\S+", page), count)]
    return page[: ends[-1]] if ends else page


def build_tasks(
    out_dir: str | Path, data: str | Path | None = None, samples: int = 50, words: int = 700, words_per_page: int = 800
) -> Path:
    """Write the local tasks' YAML and JSON-lines files into ``out_dir``; return it."""
    for name, value in (("samples", samples), ("words", words), ("words_per_page", words_per_page)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    haystack = " ".join(doc.text for doc in prose(data=data))
    needle = _write_jsonl(out / "kvc_needle.jsonl", needle_docs(haystack, samples, words))
    common = _NEEDLE_COMMON.format(data=json.dumps(str(needle)))
    (out / "kvc_needle.yaml").write_text(_NEEDLE_GEN.format(common=common))
    (out / "kvc_needle_ll.yaml").write_text(_NEEDLE_LL.format(common=common))
    if configured_root(data) is None:  # WikiText-2 is not shipped: kvc_wikitext needs a data folder
        return out
    pages = _write_jsonl(out / "kvc_wikitext.jsonl", wikitext_pages(wikitext_test(data=data), words_per_page))
    (out / "kvc_wikitext.yaml").write_text(_WIKITEXT.format(data=json.dumps(str(pages))))
    shutil.copyfile(preprocess_wikitext.__file__, out / "preprocess_wikitext.py")
    return out


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.lmeval.tasks", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument(
        "--data", help="data folder (else $KVCOMPRESS_DATA, else the shipped books; kvc_wikitext needs one)"
    )
    parser.add_argument("--samples", type=int, default=50, help="needle documents")
    parser.add_argument("--words", type=int, default=700, help="haystack words per needle document")
    parser.add_argument("--words-per-page", type=int, default=800, help="WikiText words kept per article")
    args = parser.parse_args(argv)
    print(build_tasks(args.out_dir, args.data, args.samples, args.words, args.words_per_page))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
