from experiments.results_file import append_row, done_keys, load_rows


def test_missing_file_has_no_rows(tmp_path):
    path = tmp_path / "none.jsonl"
    assert load_rows(path) == []
    assert done_keys(path) == set()


def test_rows_round_trip_in_order_and_keys_mark_them_done(tmp_path):
    path = tmp_path / "sub" / "results.jsonl"
    rows = [{"key": "a", "ppl": 1.5}, {"key": "b", "ppl": 2.0, "extra": [1, 2]}]
    for row in rows:
        append_row(row, path)
    assert load_rows(path) == rows
    assert done_keys(path) == {"a", "b"}
