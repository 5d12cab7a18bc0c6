"""A ``kvtrace.run`` record whose digest contradicts its own summary's (probe 35): it was
taken (200), the run complete, and `diff` printed digest=deadbeef beside summary.digest=73b5...
Both collector paths read records with ``run_rules.run_record``."""

from __future__ import annotations

import json

import pytest

from kvtrace.store.clickhouse.run_rules import RecordRefused, run_record
from kvtrace.store.schema import RUN_RECORD_PREFIX


def _record(**fields) -> dict:
    return {f"{RUN_RECORD_PREFIX}{k}": v for k, v in fields.items()}


@pytest.mark.parametrize("key", ["digest", "trace_digest"])
def test_a_digest_its_summary_contradicts_is_refused(key):
    summary = json.dumps({"requests": 1, key: "73b56e"})
    with pytest.raises(RecordRefused, match=rf"^{RUN_RECORD_PREFIX}{key}: 'deadbeef' is not the summary's {key} "):
        run_record(_record(status="complete", summary=summary, **{key: "deadbeef"}))
    taken = run_record(_record(status="complete", summary=summary, **{key: "73b56e"}))
    assert taken[key] == "73b56e"
    assert run_record(_record(status="complete", summary=json.dumps({"requests": 1}), **{key: "x"}))[key] == "x"
