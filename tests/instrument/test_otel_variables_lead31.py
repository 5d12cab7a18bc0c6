"""OTEL_* variables the SDK would take and then fail on, or log and drop in part, are refused
first in one line naming the variable: a timeout of 1e10 s passed the check and then every
span failed ('timestamp out of range for platform time_t'); an OTEL_RESOURCE_ATTRIBUTES item
without '=' (or an empty one, or an empty key) printed the SDK's warning lines mid-run and was
left out of every span's resource."""

from __future__ import annotations

import logging

import pytest

from kvtrace.errors import ConfigError
from kvtrace.instrument.pipeline import check_otlp_settings, check_resource_variable, make_resource


@pytest.mark.parametrize("timeout", ["1e10", "86401", "1e300"])
def test_a_timeout_past_a_day_is_refused(monkeypatch, timeout) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", timeout)
    with pytest.raises(ConfigError, match=r"OTEL_EXPORTER_OTLP_TIMEOUT: .*at most 86,400"):
        check_otlp_settings("http://127.0.0.1:4318")


def test_a_timeout_of_a_day_is_taken(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "86400")
    check_otlp_settings("http://127.0.0.1:4318")


@pytest.mark.parametrize("text", ["a", "=x", "a=1,,b=2", ",a=1", "a=1,", " =1"])
def test_a_resource_pair_the_sdk_would_drop_is_refused(monkeypatch, caplog, text) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", text)
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match=r"^OTEL_RESOURCE_ATTRIBUTES: "):
        make_resource("r1")
    assert not caplog.records  # (refused before the SDK read it)


def test_pairs_the_sdk_reads_are_kept(monkeypatch, caplog) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=kv, zone = eu%20west,empty=")
    check_resource_variable()
    with caplog.at_level(logging.WARNING):
        attrs = make_resource("r1").attributes
    assert (attrs["team"], attrs["zone"], attrs["empty"]) == ("kv", "eu west", "")
    assert not caplog.records


def test_a_refused_resource_variable_records_no_run(monkeypatch, tmp_path) -> None:
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    db = tmp_path / "s.duckdb"
    run_replay(RunSpec("gen:chat", limit=2, mode="cache-only", capacity_blocks=64), db=db)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=kv,,zone=eu")
    with pytest.raises(ConfigError, match="OTEL_RESOURCE_ATTRIBUTES"):
        run_replay(RunSpec("gen:chat", limit=2, mode="cache-only", capacity_blocks=64), db=db)
    assert len(read.runs(db)) == 1  # (it was made, and marked failed)
