"""Count the lines of ``core/`` and ``methods/``, split by whether the behaviour existed when issue 50 was filed.

Issue 50 (core v3) asks for "``core/`` plus ``methods/`` at least 20 % fewer lines than today's 9.5K with the same
behaviour". The 9.5K is the physical lines (``wc -l``) of every ``.py`` file under ``src/kvcompress/core`` and
``src/kvcompress/methods`` at commit ``BASE`` (3837815, 2026-11-28 15:39 UTC: 9,476 lines; the first-parent commits
of main from 180a5c7 to 3837815 all count 9,476, the next merges add 201 (robust) and 684 (scorers) lines, and the
first commit naming issue 50 comes after them). Behaviour has been added since, so a fair comparison splits today's
files in two:

(a) modules implementing behaviour that existed at ``BASE``, rewritten or not, renamed or not (``forward.py``
    replaces ``forward_cache.py`` and ``layer_batch.py``; ``joint_eviction.py`` is the old ``LayerBatch``'s joint
    eviction; cascade's ``schedule.py``, ``executor.py`` and ``ring_decode.py``'s moves replace ``ring_angles.py``,
    ``ring_insert.py``, ``ring_group.py``). Hooks that shared modules (``cache.py``, ``contract.py``, ...) grew for
    the new behaviour stay counted here, which favours ``BASE``;
(b) modules added for behaviour that did not exist at ``BASE``, listed in ``NEW_BEHAVIOUR`` with the reason.

A file in neither list at ``BASE`` nor in ``NEW_BEHAVIOUR`` counts in (a). The target is (a) <= 0.8 x 9,476. Beside
the physical lines, (a)'s code lines (not blank, not only a comment, not in a docstring) against ``BASE``'s: the
docstrings state the papers' open choices (a project rule), so the code lines say how much logic there is.

    python scripts/count_core_lines.py [--base 3837815]    # run from the repository root
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

BASE = "3837815"
ROOTS = ("src/kvcompress/core", "src/kvcompress/methods")

# Path (relative to src/kvcompress; a folder means every file under it) -> the behaviour it adds since BASE.
NEW_BEHAVIOUR = {
    "core/capacity.py": "issue 50's own new requirement: capacity given back after evicting, allocated bytes",
    "core/fused_attention.py": "KVzip's reconstruction: fused attention with each row's log-normaliser (53152ad)",
    "core/kivi.py": "quantized storage (kv_bits < 16): KIVI's quantizer",
    "core/quantized_slots.py": "quantized storage: slots holding codes",
    "core/quantized_layer.py": "quantized storage: the slot layer over quantized slots",
    "core/quantized_attention.py": "quantized storage: attention from codes",
    "core/ragged_quantized.py": "quantized storage: the ragged per-head pool holding codes",
    "methods/cascade/quantized.py": "quantized storage: the cascade's rings and streaming's circular ring",
    "methods/pod/quantized.py": "quantized storage: PoD's layer over quantized slots",
    "core/ragged.py": "ragged per-head storage (adakv, kvzip global/layer): the block pool",
    "core/ragged_layer.py": "ragged per-head storage: the layer moved into the pool",
    "core/ragged_stream.py": "ragged per-head storage: positions and ranks per cache",
    "methods/allocation.py": "budget allocation (uniform, pyramid, adakv) for the one-shot scorers",
    "methods/compactor.py": "new method: Compactor (kvpress)",
    "methods/duo": "new method: DuoAttention",
    "methods/expected_attention.py": "new method: expected attention (kvpress)",
    "methods/keydiff.py": "new method: KeyDiff",
    "methods/kvzip": "new method: KVzip",
    "methods/periodic.py": "new method: periodic (kvpress's DecodingPress)",
}


def python_sources(ref: str | None) -> dict[str, str]:
    """``{path under src/kvcompress: text}`` for the working tree (``ref`` None) or a commit."""
    if ref is None:
        return {
            str(path.relative_to("src/kvcompress")): path.read_text()
            for root in ROOTS
            for path in sorted(Path(root).rglob("*.py"))
        }
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", ref, *ROOTS], check=True, capture_output=True, text=True
    ).stdout.split()
    return {
        name.removeprefix("src/kvcompress/"): subprocess.run(
            ["git", "show", f"{ref}:{name}"], check=True, capture_output=True, text=True
        ).stdout
        for name in names
        if name.endswith(".py")
    }


def code_lines(text: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def reason(path: str) -> str | None:
    """Why ``path`` is new behaviour, or None when it implements behaviour that existed at BASE."""
    for prefix, why in NEW_BEHAVIOUR.items():
        if path == prefix or path.startswith(prefix + "/"):
            return why
    return None


def by_folder(counts: dict[str, int]) -> dict[str, int]:
    """Lines per top folder (``core``, ``methods/pod``, a simple method counted in ``methods``)."""
    folders: dict[str, int] = {}
    for path, lines in counts.items():
        parts = path.split("/")
        key = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        folders[key] = folders.get(key, 0) + lines
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BASE, help="the commit issue 50's 9.5K was counted at")
    args = parser.parse_args()
    base_text, now_text = python_sources(args.base), python_sources(None)
    base = {path: len(text.splitlines()) for path, text in base_text.items()}
    now = {path: len(text.splitlines()) for path, text in now_text.items()}
    same = {path: lines for path, lines in now.items() if reason(path) is None}
    new = {path: lines for path, lines in now.items() if reason(path) is not None}
    base_total = sum(base.values())
    print(f"at {args.base} (issue 50 filed): {base_total} lines in {len(base)} files")
    print(f"today: {sum(now.values())} lines in {len(now)} files")
    print(
        f"(a) behaviour that existed at {args.base}: {sum(same.values())} lines "
        f"({sum(same.values()) / base_total - 1:+.1%} against {base_total}; target <= {int(0.8 * base_total)})"
    )
    same_code = sum(code_lines(now_text[path]) for path in same)
    base_code = sum(code_lines(text) for text in base_text.values())
    print(f"    of which code (no blank, comment or docstring line): {same_code}, against {base_code} at {args.base}")
    print(f"(b) behaviour added since: {sum(new.values())} lines")
    for path, lines in sorted(new.items()):
        print(f"    {lines:5d}  {path}: {reason(path)}")
    print("(a) per folder, then and now:")
    then, today = by_folder(base), by_folder(same)
    for folder in sorted(set(then) | set(today)):
        print(f"    {folder:22s} {then.get(folder, 0):5d} -> {today.get(folder, 0):5d}")


if __name__ == "__main__":
    main()
