"""kvtrace.compare: run comparison, the isolated A/B measurement of a cache-policy change.

Two runs of the same trace (A baseline, B candidate; every delta is B - A) become a
``RunDiff``: summary deltas, per-request hit changes, eviction shifts, correctness counts
and TTFT/ITL percentile shifts with paired bootstrap CIs. Public API, by module:

- ``model``: the records (``RunDiff``, ``MetricDelta``, ``PercentileShift``, ``CountShift``,
  ``RequestChange``, ``RequestHitDiff``), ``metric_direction`` and the pure builders
  ``diff_summaries``, ``metric_deltas``, ``request_hit_diff``, ``count_shifts``.
- ``bootstrap``: ``latency_shifts``, ``percentile_shifts``, ``resample_counts``,
  ``chunked_weighted_percentiles``.
- ``source``: ``diff_runs(db, run_a, run_b)``, reading through ``kvtrace.store.read``.
- ``gates``: ``check_fail_if`` and ``parse_gate`` (``kvtrace diff --fail-if``).
- ``options``: the diff's settings and their bounds, ``check_diff_options`` (standard
  library only: the CLI checks them before the comparison's imports).
- ``render``: ``to_json``, ``to_markdown``, ``tables``, ``render``, ``to_text``.
- ``study``: ``run_study`` (one behaviour on and off); ``demo``: ``run_demo``.

Imports store, replay (for the studies), errors and numeric; ``study`` also takes the
behaviour names from their one home, ``kvtrace.cache.config``. Only the CLI, notebooks,
tests and benchmarks import this package. Nothing is re-exported here, so that
``kvtrace diff`` does not import the replay engine.
"""
