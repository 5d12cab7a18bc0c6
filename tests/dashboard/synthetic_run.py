"""The dashboard tests' synthetic runs: the hybrid-cache story of the one synthetic span
generator (tests/support/synthetic_spans/story.py), under the name these tests import.

``simulate`` returns the story's steps (real events) and its summary; ``_table`` makes
their spans with kvtrace's own span builder; ``write_steps`` records steps into a run;
``write_runs`` records both runs.
"""

from tests.support.synthetic_spans import simulate, write_runs, write_steps
from tests.support.synthetic_spans import spans_table as _table

__all__ = ["_table", "simulate", "write_runs", "write_steps"]
