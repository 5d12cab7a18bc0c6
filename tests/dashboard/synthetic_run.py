"""The dashboard tests' synthetic runs: the hybrid-cache story of the one synthetic span
generator (tests/support/synthetic_spans/story.py), under the name these tests import.

``simulate`` returns the story's steps (real events) and its summary; ``_table`` makes
their spans with kvtrace's own span builder; ``write_steps`` records steps into a run;
``write_runs`` records both runs; ``write_collected_run`` one run as ``kvtrace collect``
records it (mode otlp: no config, the sender's times).
"""

from tests.support.synthetic_spans import simulate, write_runs, write_steps
from tests.support.synthetic_spans import spans_table as _table

__all__ = ["_table", "simulate", "write_collected_run", "write_runs", "write_steps"]


def write_collected_run(db: str, n_requests: int = 6) -> str:
    """A run of the story's spans recorded as a collector records one; returns its id."""
    from kvtrace.store.writer import Store

    with Store.open(db) as store:
        run = store.create_run("collected", mode="otlp")
        steps, _ = simulate(True, n_requests=n_requests)
        write_steps(store, run, steps)
    return run
