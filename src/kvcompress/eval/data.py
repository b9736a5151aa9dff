"""Text data for the evaluation tasks: the books shipped with the package, any text file or folder, and a data
folder of your own.

With nothing configured every task reads the five public-domain books shipped inside the package
(``kvcompress/data/books``, gzip-compressed, about 3 MB of text): ``pip install kvcompress`` is enough to run
``kvcompress eval``. A data folder, given by the ``data`` argument (the ``--data`` option) or else the
``KVCOMPRESS_DATA`` environment variable, replaces them: its ``paul_graham_essays/`` (the haystack of the public
needle-in-a-haystack test) becomes the prose of the question-answering tasks, its ``gutenberg/`` the books of
``stream-ppl``, and its ``wikitext-2/test.txt`` is what the ``ppl`` task needs (WikiText-2 is not shipped).
Files are read in place and never copied.

Project Gutenberg books carry a licence header and footer around the text; ``strip_gutenberg`` keeps what lies
between the ``*** START OF ...`` and ``*** END OF ...`` markers (spelt with and without spaces, the title possibly
wrapped over several lines). Files are read as UTF-8 with an optional byte-order mark; line endings are normalised
to ``\\n``.
"""

from __future__ import annotations

import gzip
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DATA_ENV = "KVCOMPRESS_DATA"
BOOKS = Path(str(resources.files("kvcompress") / "data" / "books"))  # shipped with the package

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


def configured_root(data: str | os.PathLike[str] | None = None) -> Path | None:
    """The data folder the user chose: ``data`` if given, else ``$KVCOMPRESS_DATA``, else ``None`` (shipped books).

    A chosen folder that does not exist raises ``FileNotFoundError`` naming it."""
    env = os.environ.get(DATA_ENV)
    if data is None and not env:
        return None
    root = Path(data) if data is not None else Path(env)
    if not root.is_dir():
        source = "--data" if data is not None else f"${DATA_ENV}"
        raise FileNotFoundError(f"{source}: data folder {str(root)!r} does not exist")
    return root


def data_root(data: str | os.PathLike[str] | None = None) -> Path:
    """The data folder the user chose (see ``configured_root``); an error when none is, for work that needs one
    (training LESS kernels, calibrating PoD, WikiText-2 perplexity)."""
    root = configured_root(data)
    if root is None:
        raise FileNotFoundError(
            f"this needs a data folder: pass --data or set ${DATA_ENV} to a folder holding gutenberg/, "
            "paul_graham_essays/ or wikitext-2/"
        )
    return root


def read_text(path: str | os.PathLike[str]) -> str:
    """Read a UTF-8 file, gzip-compressed if it ends in ``.gz`` (a byte-order mark is dropped), with ``\\n``
    line endings."""
    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    text = raw.decode("utf-8-sig")
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


def text_files(path: str | os.PathLike[str], patterns: tuple[str, ...] = ("*.txt", "*.txt.gz")) -> list[Path]:
    """``path`` if a file, else every file under the folder ``path`` matching ``patterns`` (recursively), sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no such file or folder: {str(path)!r}")
    files = sorted({p for pattern in patterns for p in path.rglob(pattern) if p.is_file()})
    if not files:
        raise FileNotFoundError(f"no {' or '.join(patterns)} files under {str(path)!r}")
    return files


def load_documents(path: str | os.PathLike[str], patterns: tuple[str, ...] = ("*.txt", "*.txt.gz")) -> list[Document]:
    """Every text under ``path`` (a file, or a folder searched recursively for ``patterns``), sorted by path."""
    return [
        Document(name=file.name.split(".")[0], text=strip_gutenberg(read_text(file)))
        for file in text_files(path, patterns)
    ]


def _corpus(subdir: str, path, data) -> list[Document]:
    """``path`` if given, else ``<chosen data folder>/subdir``, else the shipped books."""
    if path is not None:
        return load_documents(path)
    root = configured_root(data)
    return load_documents(BOOKS if root is None else root / subdir)


def gutenberg_books(path=None, data=None) -> list[Document]:
    """Books (licence stripped): ``path`` if given, else ``<data folder>/gutenberg``, else the shipped books."""
    return _corpus("gutenberg", path, data)


def prose(path=None, data=None) -> list[Document]:
    """The prose of the question-answering tasks (haystacks, documents, passages): ``path`` if given, else
    ``<data folder>/paul_graham_essays``, else the shipped books."""
    return _corpus("paul_graham_essays", path, data)


def wikitext_test(path=None, data=None) -> str:
    """WikiText-2 raw test split as one string: ``path`` if given, else ``<data folder>/wikitext-2/test.txt``
    (not shipped: a data folder is needed)."""
    source = Path(path) if path is not None else data_root(data) / "wikitext-2" / "test.txt"
    return "\n".join(doc.text for doc in load_documents(source))
