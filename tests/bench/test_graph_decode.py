"""``python -m kvcompress.bench.graph_decode``: its rows (on the CPU with ``make_fx`` traces) and its user errors."""

from __future__ import annotations

import pytest
import torch

from kvcompress.bench.graph_decode import generate_row, graph_rows, graph_tables, main
from kvcompress.models import tiny_model


def test_graph_and_eager_rows_and_an_end_to_end_row_on_traced_replays():
    model = tiny_model("llama")
    with torch.inference_mode():
        rows = graph_rows(model, "h2o", prompt=40, budget=16, steps=2, chunk=16, seed=0, capture="trace")
        rows.append(generate_row(model, "streaming", 24, 2, 8, 4, 8, _Args()))
    assert [(row["section"], row.get("mode")) for row in rows] == [
        ("graph", "graphed"),
        ("graph", "eager"),
        ("generate", None),
    ]
    assert all(row["pairs"] >= 1 and row["cpu_ratio"] > 0 for row in rows)
    assert rows[0]["stored_tokens"] == 16
    table = graph_tables(rows)
    assert "| h2o | graphed | 40 | 16 |" in table and "| streaming | 24 | 2 |" in table


class _Args:
    seed, capture, rounds = 0, "trace", 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "cascade"], "--methods / --generate-methods: cascade cannot be replayed"),
        (["--device", "cpu"], "--capture cuda needs --device cuda, got --device cpu"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
