"""Speed and memory benchmarks: ``cache-op`` (one cache update, Cascading KV Table 4 setup), ``decode`` (step time
vs logical context) and ``prefill`` (one pass vs chunked). Each returns rows (list of dicts); ``*_table`` renders
them as markdown, ``kvcompress.bench.plots`` draws them. Run as ``python -m kvcompress.bench.<name> --help``.
"""

import importlib

_EXPORTS = {
    "run_cache_op": "cache_op",
    "cache_op_table": "cache_op",
    "run_decode": "decode",
    "decode_table": "decode",
    "run_prefill": "prefill",
    "prefill_table": "prefill",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    # lazy, so ``python -m kvcompress.bench.<name>`` does not import its own module twice
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kvcompress.bench.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvcompress.bench' has no attribute {name!r}")
