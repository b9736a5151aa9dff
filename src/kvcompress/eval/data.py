"""Text data for the evaluation tasks: any text file or folder, and the shared offline corpora.

The data root is resolved, first match wins, from an explicit ``data`` argument (the ``--data`` option), then the
``KVCOMPRESS_DATA`` environment variable, then ``./data`` in the working directory. It holds ``gutenberg/``,
``paul_graham_essays/`` and ``wikitext-2/``; the corpora are read in place and never copied.

Project Gutenberg books carry a licence header and footer around the text; ``strip_gutenberg`` keeps what lies
between the ``*** START OF ...`` and ``*** END OF ...`` markers (spelt with and without spaces, the title possibly
wrapped over several lines). Files are read as UTF-8 with an optional byte-order mark; line endings are normalised
to ``\\n``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DATA_ENV = "KVCOMPRESS_DATA"
DEFAULT_DATA_ROOT = Path("data")

# "*** START OF THIS PROJECT GUTENBERG EBOOK TITLE ***", "***START OF THE PROJECT GUTENBERG EBOOK TITLE\nWRAPPED***"
_START = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG[^*]*\*{3}[ \t]*$", re.M | re.I)
_END = re.compile(r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG[^*]*\*{3}", re.M | re.I)
# The closing line before the END marker ("End of the Project Gutenberg EBook of ...", "End of Project
# Gutenberg's ..."); some older books have only this line and no END marker.
_END_PLAIN = re.compile(r"^End of (?:the |this )?Project Gutenberg", re.M | re.I)
_TRAILER_CHARS = 2000  # the plain closing line is looked for only this close to the end


@dataclass(frozen=True)
class Document:
    """One text: ``name`` is the file stem, ``text`` the content (Gutenberg licence stripped)."""

    name: str
    text: str


def data_root(data: str | os.PathLike[str] | None = None) -> Path:
    """The data folder: ``data`` if given, else ``$KVCOMPRESS_DATA``, else ``./data``."""
    env = os.environ.get(DATA_ENV)
    root = Path(data) if data is not None else Path(env) if env else DEFAULT_DATA_ROOT
    if not root.is_dir():
        raise FileNotFoundError(
            f"data folder {str(root)!r} does not exist (pass --data or set ${DATA_ENV} to a folder with "
            "gutenberg/, paul_graham_essays/, wikitext-2/)"
        )
    return root


def read_text(path: str | os.PathLike[str]) -> str:
    """Read a UTF-8 file (a byte-order mark is dropped) with ``\\n`` line endings."""
    text = Path(path).read_text(encoding="utf-8-sig")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def strip_gutenberg(text: str) -> str:
    """The book between the Gutenberg ``*** START OF`` and ``*** END OF`` markers; other text is returned as is."""
    start = _START.search(text)
    if start is not None:
        text = text[start.end() :]
    end = _END.search(text)
    if end is not None:
        text = text[: end.start()]
    elif start is not None:
        licence = text.find("*** START: FULL LICENSE ***")
        if licence >= 0:
            text = text[:licence]
    if start is not None or end is not None:
        tail = len(text) - _TRAILER_CHARS
        plain = _END_PLAIN.search(text, max(0, tail))
        if plain is not None:
            text = text[: plain.start()]
    return text.strip("\n")


def load_documents(path: str | os.PathLike[str], pattern: str = "*.txt") -> list[Document]:
    """Every text under ``path`` (a file, or a folder searched recursively for ``pattern``), sorted by path."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob(pattern) if p.is_file())
    else:
        raise FileNotFoundError(f"no such file or folder: {str(path)!r}")
    if not files:
        raise FileNotFoundError(f"no {pattern} files under {str(path)!r}")
    return [Document(name=file.stem, text=strip_gutenberg(read_text(file))) for file in files]


def _corpus(default_subdir: str, path: str | os.PathLike[str] | None, data: str | os.PathLike[str] | None):
    return load_documents(path if path is not None else data_root(data) / default_subdir)


def gutenberg_books(path=None, data=None) -> list[Document]:
    """The Gutenberg books (licence stripped): ``path`` if given, else ``<data root>/gutenberg``."""
    return _corpus("gutenberg", path, data)


def essays(path=None, data=None) -> list[Document]:
    """The Paul Graham essays: ``path`` if given, else ``<data root>/paul_graham_essays``."""
    return _corpus("paul_graham_essays", path, data)


def wikitext_test(path=None, data=None) -> str:
    """WikiText-2 raw test split as one string: ``path`` if given, else ``<data root>/wikitext-2/test.txt``."""
    return "\n".join(doc.text for doc in _corpus("wikitext-2/test.txt", path, data))
