"""Driver of test_opening_kill_start33: a recording run (a direct store and an OTLP export, as
``kvtrace replay --db S --otlp-endpoint URL`` records) that sends its opening record, emits spans
past its first export, then waits to be killed with -9 (no record at its end).

argv: STORE ENDPOINT RUN_NAME"""

from __future__ import annotations

import sys
import time

from kvtrace.instrument import recording
from kvtrace.store.schema import created_now
from kvtrace.store.writer import Store
from tests.support.synthetic_spans import synthetic_steps


def main() -> None:
    db, endpoint, name = sys.argv[1:4]
    record = {"trace_source": "big2.jsonl", "trace_digest": "td-start33",
              "config": {"block_size": 16, "percentiles": [25.0, 99.9], "capacity_blocks": 512},
              "behaviours": ["prefix_caching"], "mode": "cache-only/lru", "created": created_now()}
    with Store.open(db, hold=True) as store:
        run_id = store.create_run(name, **record)
        with recording(store=store, run_id=run_id, otlp_endpoint=endpoint, seed=1, background=True,
                       export_run_id=f"{run_id}-export") as inst:
            inst.open_run({"name": name, **record})
            for i, batch in enumerate(synthetic_steps(1200, seed=6)):
                inst(batch)
                if i == 600:
                    inst.flush()
                    print("emitted", flush=True)
                    time.sleep(600)  # (killed here)


if __name__ == "__main__":
    main()
