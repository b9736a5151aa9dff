import json

from experiments.less import report


def _row(variant, ppl, budget=50, mode="masked", windows=16, kernels=None):
    return {
        "key": json.dumps([variant, budget, mode, windows, kernels]),
        "policy": "h2o",
        "variant": variant,
        "budget": None if variant == "full" else budget,
        "train_budget": 50 if variant == "less" else None,
        "kernels": kernels,
        "missing_layers": [],
        "mode": mode,
        "windows": windows,
        "window": 512,
        "ppl": ppl,
    }


def test_report_states_gap_closed_and_ordering(tmp_path):
    path = tmp_path / "less.jsonl"
    rows = [
        _row("full", 20.0),
        _row("baseline", 30.0),
        _row("baseline+", 28.0),
        _row("less", 25.0, kernels="/k/set-a"),
        _row("less", 29.0, kernels="/k/set-b"),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report(path)
    assert "| Full cache | 20.000 |" in text
    assert "| LESS (50, `set-a`) | 25.000 |" in text
    assert "B = 50, LESS(50, `set-a`): closes 50.0% of the Baseline-to-full gap, 37.5% of the Baseline+-to-full gap; " \
        "LESS < Baseline+ < Baseline: yes" in text  # fmt: skip
    assert "B = 50, LESS(50, `set-b`): closes 10.0%" in text and text.rstrip().endswith("no")


def test_report_keeps_decode_and_smaller_runs_in_their_own_tables(tmp_path):
    path = tmp_path / "less.jsonl"
    rows = [_row("full", 20.0), _row("baseline", 30.0), _row("baseline", 31.0, mode="decode", windows=2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report(path)
    assert "**h2o, masked form** (token perplexity, 16 x 512)" in text
    assert "**h2o, decode form** (token perplexity, 2 x 512)" in text
    assert "| Baseline | 31.000 |" in text
