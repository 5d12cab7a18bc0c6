"""Threads of one process sharing a chdb store (a dashboard's sessions are threads) each
get their own query's answer: the shared chdb session takes their queries in turn."""

from __future__ import annotations

import threading

from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client

THREADS = 6
QUERIES = 30


def test_threads_sharing_a_chdb_session_get_their_own_answers(tmp_path):
    target = clickhouse_target(f"chdb:{tmp_path / 'store'}")
    answers: dict[int, list] = {i: [] for i in range(THREADS)}
    failures: list[str] = []

    def reader(i: int) -> None:
        with client.connect(target) as con:
            for j in range(QUERIES):
                try:  # a value and a row count of this thread's own
                    frame = con.ch_frame("SELECT {x:Int64} AS v FROM numbers({n:UInt64})",
                                         {"x": i * 1000 + j, "n": i + 1})
                except Exception as err:  # (another thread's parameters were missing: "not set")
                    failures.append(str(err))
                    continue
                answers[i].append(frame["v"].to_list())

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:3]
    for i in range(THREADS):
        assert answers[i] == [[i * 1000 + j] * (i + 1) for j in range(QUERIES)], i
