"""Experiment scripts behind the result documents in docs/results (run with python -m)."""
