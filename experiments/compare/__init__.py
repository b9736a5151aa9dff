"""Side by side with NVIDIA's kvpress (docs/vs-kvpress.md): same samples, same budgets, kept sets compared.

kvpress 0.5.5 pins ``transformers<5.3`` and kvcompress needs 5.23, so the two run in separate environments and
exchange JSON files: ``samples`` writes the niah samples (token ids, answers) and budgets, the kvpress side
(``scripts/vs_kvpress_side.py``, kvpress environment) and ``ours`` (this environment) each write one row per
sample x method x budget (prediction, prefill CPU time, kept context indices per layer and KV head), and
``report`` scores both, compares the kept sets of counterpart methods and writes the tables.

    python -m experiments.compare samples --out runs/vs-kvpress
    /work/kvpress-venv/bin/python scripts/vs_kvpress_side.py runs/vs-kvpress/samples.json runs/vs-kvpress/kvpress.jsonl
    python -m experiments.compare ours --out runs/vs-kvpress
    python -m experiments.compare report --out runs/vs-kvpress --doc-data docs/results/vs-kvpress-data
"""
