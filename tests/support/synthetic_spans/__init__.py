"""The one synthetic span generator of the tests and benchmarks.

Everything here produces real cache and engine event objects (``StepBatch`` per step),
seeded, without a clock; spans are always made from them by kvtrace's own span path
(``SpanBatchBuilder``, the instrumentor, the DuckDB exporter), so no test or benchmark
hand-builds span rows that could drift from what kvtrace writes. Three workloads:

- ``synthetic_steps``: a light mix, every event kind, about 12 cache events a step (the
  instrument tests and ``bench/span_path.py``);
- ``HeavyMix``: the store benchmarks' mix, about ``SPANS_PER_STEP`` spans a step, built
  with numpy: 2 lookups, 14 evictions and 18 publishes of 1..4 blocks (most published
  block ids were just evicted, lookups mostly miss on recently evicted hashes, hashes
  Zipf-distributed, so eviction attribution has real chains), 8 frees, 2 CoW copies,
  2 finished requests with 8..120 inter-token gaps, rare stale hashes and divergent
  tokens (``fill_store``; ``bench/store_append.py``, ``store_queries.py``,
  ``dashboard_pages.py``);
- ``simulate`` / ``write_runs``: a small hybrid prefix cache (group 0 attention, group 1
  Mamba state every ``ALIGN`` blocks) under LRU, serving requests that share a few
  system prompts, with ``transient-checkpoint-retention`` on and off: off leaves stale
  hashes and divergent outputs (the dashboard tests' ``stale_db``); the run summary is
  computed from the same numbers.

Benchmarks import this module with the repository root on ``sys.path``.
"""

from tests.support.synthetic_spans.mixes import (
    SPANS_PER_STEP,
    STEP_NS,
    HeavyMix,
    fill_store,
    heavy_steps,
    synthetic_steps,
)
from tests.support.synthetic_spans.span_path import span_batches, spans_table, write_steps
from tests.support.synthetic_spans.story import simulate, write_runs

__all__ = [
    "SPANS_PER_STEP",
    "STEP_NS",
    "HeavyMix",
    "fill_store",
    "heavy_steps",
    "simulate",
    "span_batches",
    "spans_table",
    "synthetic_steps",
    "write_runs",
    "write_steps",
]
