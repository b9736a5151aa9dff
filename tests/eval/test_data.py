from __future__ import annotations

import pytest

from kvcompress.eval import data

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


def test_data_folder_is_the_argument_then_the_environment_else_the_shipped_books(tmp_path, monkeypatch):
    env_dir, arg_dir = tmp_path / "env", tmp_path / "arg"
    env_dir.mkdir()
    arg_dir.mkdir()
    (tmp_path / "data").mkdir()  # a ./data folder is not picked up by itself
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(data.DATA_ENV, str(env_dir))
    assert data.data_root(arg_dir) == arg_dir
    assert data.data_root() == env_dir
    monkeypatch.delenv(data.DATA_ENV)
    assert data.configured_root() is None
    with pytest.raises(FileNotFoundError, match="--data or set \\$KVCOMPRESS_DATA"):
        data.data_root()
    with pytest.raises(FileNotFoundError, match="--data: data folder .*missing"):
        data.data_root(tmp_path / "missing")
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="KVCOMPRESS_DATA: data folder .*gone"):
        data.prose()


def test_without_a_data_folder_every_corpus_is_the_shipped_books(monkeypatch):
    monkeypatch.delenv(data.DATA_ENV, raising=False)
    books = data.gutenberg_books()
    assert [b.name for b in data.prose()] == [b.name for b in books]
    assert len(books) == 5
    for book in books:
        assert "gutenberg" not in book.text.lower()  # licence and transcriber's notes removed
        assert "\r" not in book.text and len(book.text) > 200_000
    with pytest.raises(FileNotFoundError, match="needs a data folder"):
        data.wikitext_test()


def test_a_data_folder_replaces_the_shipped_books(corpus, monkeypatch):
    monkeypatch.setenv(data.DATA_ENV, str(corpus.parent))
    (corpus.parent / "paul_graham_essays").mkdir(exist_ok=True)
    (corpus.parent / "paul_graham_essays" / "mine.txt").write_text("My own essay.")
    assert [d.text for d in data.prose()] == ["My own essay."]


def test_gzip_texts_are_read(tmp_path):
    import gzip

    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"First.\r\nSecond."))
    (tmp_path / "b.txt").write_text("Plain.")
    docs = data.load_documents(tmp_path)
    assert [(d.name, d.text) for d in docs] == [("a", "First.\nSecond."), ("b", "Plain.")]


def test_load_documents_reads_a_folder_sorted(corpus):
    docs = data.load_documents(corpus)
    assert [d.name for d in docs] == ["essay0", "essay1", "essay2"]
