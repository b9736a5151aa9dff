import json

from kvcompress.bench.model_cli import add_run_options, method_names, model_bench_parser, publish


def test_parser_has_common_options_and_defaults():
    parser = model_bench_parser("decode", "Decode benchmark.\nmore", ["full", "h2o"])
    add_run_options(parser, "decode")
    args = parser.parse_args(["--budget", "64"])
    assert (args.model, args.methods, args.budget, args.threads, args.seed, args.out) == (
        "smollm2-135m", "full,h2o", 64, 1, 0, None
    )  # fmt: skip
    assert method_names("full,,h2o,") == ["full", "h2o"]


def test_publish_prints_and_writes_rows_table_and_plot(tmp_path, capsys):
    parser = model_bench_parser("prefill", "Prefill benchmark.", ["full"])
    add_run_options(parser, "prefill")
    args = parser.parse_args(["--model", "m", "--out", str(tmp_path)])
    plotted = []
    publish("prefill", args, [{"method": "full", "time_s": 1.0}], "| table |", lambda p, m: plotted.append((p, m)))
    out = capsys.readouterr().out
    assert out.startswith("prefill: m, budget 512;") and "| table |" in out
    saved = json.loads((tmp_path / "prefill.json").read_text())
    assert saved["rows"] == [{"method": "full", "time_s": 1.0}]
    assert saved["meta"]["benchmark"] == "prefill" and saved["meta"]["model"] == "m"
    assert (tmp_path / "prefill.md").read_text() == "| table |\n"
    assert plotted == [(tmp_path / "prefill.png", saved["meta"]["machine"])]


def test_publish_without_out_writes_nothing(tmp_path, capsys):
    parser = model_bench_parser("decode", "Decode.", ["full"])
    add_run_options(parser, "decode")
    publish("decode", parser.parse_args([]), [], "t", lambda p, m: (_ for _ in ()).throw(AssertionError("plotted")))
    assert "t" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
