from __future__ import annotations

import pytest

from kvcompress.eval import data
from tests.helpers import needs_shared_data

HEADER = (
    "The Project Gutenberg EBook of Test, by Someone\r\n\r\nLicence words here.\r\n\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK TEST ***\r\n\r\n"
)
FOOTER = (
    "\r\n\r\nEnd of the Project Gutenberg EBook of Test, by Someone\r\n\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK TEST ***\r\n\r\nMore licence.\r\n"
    "*** START: FULL LICENSE ***\r\nTHE FULL LICENSE\r\n"
)
BODY = "CHAPTER I\r\n\r\nIt was a dark night.\r\nThe end of the story came soon."


def test_strip_gutenberg_keeps_only_the_text_between_markers():
    text = data.strip_gutenberg((HEADER + BODY + FOOTER).replace("\r\n", "\n"))
    assert text == BODY.replace("\r\n", "\n")


def test_strip_gutenberg_handles_unspaced_markers_with_wrapped_title():
    raw = (
        "Header\n***START OF THE PROJECT GUTENBERG EBOOK THE LOG SCHOOL-HOUSE ON THE\nCOLUMBIA***\n\n"
        "Body line.\n\n***END OF THE PROJECT GUTENBERG EBOOK THE LOG SCHOOL-HOUSE ON THE\nCOLUMBIA***\nLicence"
    )
    assert data.strip_gutenberg(raw) == "Body line."


def test_strip_gutenberg_leaves_plain_text_alone():
    assert data.strip_gutenberg("Just an essay.\nThe end of the project is near.") == (
        "Just an essay.\nThe end of the project is near."
    )


def test_read_text_drops_bom_and_crlf(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + BODY + FOOTER).encode("utf-8"))
    text = data.read_text(path)
    assert not text.startswith("\ufeff") and "\r" not in text
    [doc] = data.load_documents(path)
    assert doc.name == "book" and doc.text == BODY.replace("\r\n", "\n")


def test_data_root_prefers_argument_then_env_then_working_directory(tmp_path, monkeypatch):
    env_dir, arg_dir = tmp_path / "env", tmp_path / "arg"
    env_dir.mkdir()
    arg_dir.mkdir()
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(data.DATA_ENV, str(env_dir))
    assert data.data_root(arg_dir) == arg_dir
    assert data.data_root() == env_dir
    monkeypatch.delenv(data.DATA_ENV)
    assert data.data_root().resolve() == (tmp_path / "data").resolve()
    with pytest.raises(FileNotFoundError, match="KVCOMPRESS_DATA"):
        data.data_root(tmp_path / "missing")


def test_load_documents_reads_a_folder_sorted(corpus):
    docs = data.load_documents(corpus)
    assert [d.name for d in docs] == ["essay0", "essay1", "essay2"]


@needs_shared_data
def test_shared_gutenberg_books_are_stripped():
    books = data.gutenberg_books()
    assert len(books) == 5
    for book in books:
        assert "PROJECT GUTENBERG EBOOK" not in book.text.upper()[:3000]
        assert "FULL LICENSE" not in book.text
        assert "\r" not in book.text and not book.text.startswith("\ufeff")
        assert len(book.text) > 200_000
