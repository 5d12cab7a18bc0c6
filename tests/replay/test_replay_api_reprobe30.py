"""``run_replay`` and ``RunSpec`` given values of other types than the CLI gives (the Python
API, re-probe 30): each is one ConfigError line naming its flag before anything is recorded,
where ``db=0`` made a DuckDB file named "0" in the current directory (``True``, "True"), an
endpoint of 5 was an AttributeError inside urllib, a store or spans_to that is none an
AttributeError (spans_to's after the whole run), a list as the preset an unhashable TypeError,
and a numpy array anywhere its truth ValueError."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvtrace.errors import ConfigError
from kvtrace.replay.run import RunSpec, run_replay

SPEC = RunSpec("gen:mixed", limit=2, content=False)


@pytest.mark.parametrize("db", [0, True, 1.5, b"x.duckdb", ["x.duckdb"], np.array(["x.duckdb"])])
def test_a_db_that_is_no_path_is_refused_and_no_file_made(tmp_path, monkeypatch, db):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^--db: .*expected a store's path or URL, a string$"):
        run_replay(SPEC, db=db)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("endpoint", [5, 1.5, True, b"http://x", ("http://x",)])
def test_an_endpoint_that_is_no_string_is_refused(endpoint):
    with pytest.raises(ConfigError, match=r"^--otlp-endpoint: .*expected a collector's URL, a string$"):
        run_replay(SPEC, otlp_endpoint=endpoint)


@pytest.mark.parametrize("store", ["x.duckdb", 0, object(), {}])
def test_a_store_that_is_none_is_refused(store):
    with pytest.raises(ConfigError, match=r"^store: .*expected an open kvtrace Store"):
        run_replay(SPEC, store=store)


@pytest.mark.parametrize("sink", ["x", 0, [], object()])
def test_a_spans_sink_without_its_methods_is_refused_before_the_run(sink):
    with pytest.raises(ConfigError, match=r"^spans_to: .*expected an object with append_spans"):
        run_replay(SPEC, spans_to=sink)


@pytest.mark.parametrize("flag", ["progress", "export"])
def test_a_flag_that_is_no_bool_is_refused(flag):
    with pytest.raises(ConfigError, match=rf"^{flag}: .*expected True or False$"):
        run_replay(SPEC, **{flag: np.array([True, False])})


@pytest.mark.parametrize(("field", "value"), [
    ("preset", ["kimi-hybrid"]), ("preset", {"a": 1}), ("preset", np.array(["a", "b"])), ("mode", np.array(["a", "b"])),
    ("policy", np.array(["lru", "belady"])), ("backend", np.array(["kvtrace", "vllm"])), ("trace_format", 5),
    ("mode", None), ("config_file", np.array(["a.toml", "b.toml"])), ("config_file", 5),
    ("capacity_blocks", np.array([50, 99])),
])
def test_a_spec_field_of_another_type_is_refused_at_its_flag(field, value):
    with pytest.raises(ConfigError, match=r"^--[a-z-]+: .*expected"):
        run_replay(dataclasses.replace(SPEC, **{field: value}))


def test_the_types_the_cli_gives_still_replay(tmp_path):
    result = run_replay(dataclasses.replace(SPEC, preset="dense-attention", config_file=None), db=tmp_path / "s.duckdb",
                        otlp_endpoint=None, progress=False, export=False)
    assert result.summary["requests"] == 2 and result.run_id == "r1"
