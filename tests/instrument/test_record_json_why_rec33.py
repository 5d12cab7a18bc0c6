"""A ``kvtrace.run`` record's summary, config or behaviours that is no JSON the store holds is
refused saying why (one line, the key named): one nested deeper than Python's JSON reader goes,
a NaN or a lone surrogate was told "expected a JSON object as a string" of what was one (4f9b342,
b3d00a4), on both collector paths, which share the rule (``run_rules.run_record``)."""

from __future__ import annotations

import pytest

from kvtrace.store.clickhouse.run_rules import RecordRefused, run_record

_DEEP = "[" * 5000 + "]" * 5000
_CASES = {  # field, value, what the refusal says
    "a summary nested too deep": ("summary", '{"x": ' + _DEEP + "}", "expected a JSON object as a string (nested "
                                  "deeper than Python's JSON reader goes)"),
    "a config nested too deep": ("config", '{"x": ' + _DEEP + "}", "expected a JSON object as a string (nested "
                                 "deeper than Python's JSON reader goes)"),
    "behaviours nested too deep": ("behaviours", _DEEP, "expected a JSON list of names as a string (nested deeper "
                                   "than Python's JSON reader goes)"),
    "a summary with NaN": ("summary", '{"x": NaN}', "expected a JSON object as a string (NaN is no JSON value)"),
    "a config with a lone surrogate": ("config", '{"x": "\\ud800"}', "expected a JSON object as a string (a lone "
                                       "surrogate is no Unicode text)"),
    "a summary that is no JSON": ("summary", "{", "expected a JSON object as a string (Expecting property name "
                                  "enclosed in double quotes: line 1 column 2 (char 1))"),
    "a summary that is a list": ("summary", "[1]", "expected a JSON object as a string"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_a_record_field_of_no_storable_json_is_refused_saying_why(case):
    field, value, said = _CASES[case]
    with pytest.raises(RecordRefused) as refused:
        run_record({"kvtrace.run.status": "complete", f"kvtrace.run.{field}": value})
    assert str(refused.value) == f"kvtrace.run.{field}: {said}"
