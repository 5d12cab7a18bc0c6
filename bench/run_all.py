"""Run every benchmark in bench/ one after another (``make bench``).

Benchmarks print their own figures; this only sequences them so their timings don't
compete for the two cores. Pass names to run a subset: ``python bench/run_all.py cache_ops``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = [
    "cache_ops",  # issue 2: manager vs bare OrderedDict LRU
    "cache_only",  # issue 3: cache-only replay vs bare LRU
    "conformance",  # issue 12: kvtrace's manager vs vLLM 0.33's own (needs make vllm)
    "engine_replay",  # issue 3: engine mode, kimi-hybrid, whole Mooncake trace
    "cold_start",  # issue 16: a user error in < 0.5 s, torch not imported
    "span_path",  # issue 4: spans/s end to end and exporter alone
    "store_append",  # issue 4: bulk Arrow insert rate
    "store_open",  # what an open of a store costs: a new DuckDB instance vs a kept one
    "store_queries",  # issue 5: every read query on a 10M-span store
    "dashboard_pages",  # issue 5: every page render on a 10M-span store
    "demo",  # issue 6: kvtrace demo wall time
    "clickhouse_collector",  # the ClickHouse path: an insert through kvtrace's views, a new chdb store
    "sweep_curve",  # issue 17: sweep on 2 workers vs sequential; one-pass curve vs 8 replays
    "peer_dynamo",  # issue 16: kvtrace beside Dynamo's mocker on the same trace
    "vllm_backend",  # issue 13: the engine around vLLM 0.33's own KVCacheManager vs kvtrace's (needs make vllm)
]


def main(argv: list[str]) -> int:
    names = argv or [n for n in ORDER if (HERE / f"{n}.py").exists()]
    failed = []
    for name in names:
        print(f"\n=== bench/{name}.py ===", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / f"{name}.py")])
        if rc:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
