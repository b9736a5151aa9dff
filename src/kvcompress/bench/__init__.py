"""Speed and memory benchmarks: ``cache-op`` (one cache update, Cascading KV Table 4 setup), ``decode`` (step time
vs logical context) and ``prefill`` (one pass vs chunked). Each returns rows (list of dicts); ``*_table`` renders
them as markdown, ``kvcompress.bench.plots`` draws them. Run as ``python -m kvcompress.bench.<name> --help``.
"""

from kvcompress.bench.cache_op import cache_op_table, run_cache_op
from kvcompress.bench.decode import decode_table, run_decode
from kvcompress.bench.prefill import prefill_table, run_prefill

__all__ = ["cache_op_table", "decode_table", "prefill_table", "run_cache_op", "run_decode", "run_prefill"]
