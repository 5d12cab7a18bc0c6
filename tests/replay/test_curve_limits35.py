"""``kvtrace curve`` on a request no pool holds (probe 35): a 52-byte Azure row of 16,777,216
tokens at ``--trace-block-size 1`` (its hash ids at the curve's block size, so never
re-blocked and never bounded) took the automatic capacities past 60 s and 5 GB, with a
point at 16,777,216 blocks where ``--capacities`` refuses more than a bounded pool's limit."""

from __future__ import annotations

from kvtrace.replay import curve
from kvtrace.workload import TraceRequest
from tests.cli.support import assert_one_line, run


def test_a_request_no_pool_holds_is_one_line(tmp_path, capsys):
    trace = tmp_path / "one.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,16777216,1\n")
    code, _, err = run(["curve", str(trace), "--trace-block-size", "1", "--json"], capsys)
    assert_one_line(code, err, "request r0 (16,777,216 tokens) is 16,777,216 blocks of 1 tokens",
                    "more than a pool holds (4,194,304)")


def test_automatic_capacities_stop_at_the_largest_bounded_pool(monkeypatch):
    monkeypatch.setattr(curve, "MAX_CAPACITY_BLOCKS", 100)
    reqs = [TraceRequest(f"q{i}", i, 64 * 60, 1, hash_ids=tuple(range(i * 60, i * 60 + 60)), hash_block_size=64)
            for i in range(5)]  # 300 distinct blocks, 60 the largest request
    caps = curve.auto_capacities(reqs, 64)
    assert caps[0] == 60 and caps[-1] == 100 and all(60 <= c <= 100 for c in caps), caps
    monkeypatch.setattr(curve, "MAX_CAPACITY_BLOCKS", 50)  # (the largest request past it: that pool alone)
    assert curve.auto_capacities(reqs, 64) == [50]
