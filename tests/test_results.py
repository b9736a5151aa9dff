from kvcompress.results import append_row, done_keys, read_rows


def test_missing_file_has_no_rows(tmp_path):
    path = tmp_path / "none.jsonl"
    assert read_rows(path) == []
    assert done_keys(path) == set()


def test_rows_round_trip_in_order_and_keys_mark_them_done(tmp_path):
    path = tmp_path / "sub" / "results.jsonl"
    rows = [{"key": "a", "ppl": 1.5}, {"key": "b", "ppl": 2.0, "extra": [1, 2]}]
    for row in rows:
        append_row(row, path)
    assert read_rows(path) == rows
    assert done_keys(path) == {"a", "b"}


def test_a_truncated_last_line_is_skipped(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"key": "a"}\n{"key": "b", "ppl"')
    assert read_rows(path) == [{"key": "a"}]
