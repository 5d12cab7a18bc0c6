"""``kvtrace curve --capacities`` at its bounds (sweep33).

- A capacity of more than 4,300 digits was a ValueError traceback (Python's int() limit on
  the digits it converts), where sweep's --param and replay's --capacity-blocks say one line.
- In engine mode a capacity past cache-only's bound (4,194,302) was refused with cache-only's
  words, "say inf for the unbounded cache", advice engine mode refuses, where replay and
  sweep take the engine's own bound (4,194,304) and say it.
"""

from __future__ import annotations

import pytest

from kvtrace.errors import ConfigError
from kvtrace.replay.curve import parse_capacities, run_curve
from kvtrace.replay.run import RunSpec
from kvtrace.replay.sweep import run_sweep
from tests.cli.support import assert_one_line, run

HUGE = "1" * 5000


@pytest.mark.parametrize("mode", ["cache-only", "engine"])
def test_a_capacity_of_thousands_of_digits_is_one_line(capsys, tmp_path, mode):
    db = tmp_path / "c.duckdb"
    code, _, err = run(["curve", "gen:mixed", "--mode", mode, "--capacities", f"40,{HUGE}", "--db", str(db)], capsys)
    assert_one_line(code, err, "--capacities")
    assert not db.exists()
    with pytest.raises(ConfigError, match="--capacities"):
        parse_capacities(HUGE)


def test_engine_mode_takes_the_engines_bound_and_never_advises_inf(tmp_path):
    spec = RunSpec("gen:mixed", mode="engine")
    with pytest.raises(ConfigError) as curve_err:
        run_curve(spec, "40,4194305", db=tmp_path / "c.duckdb")
    with pytest.raises(ConfigError) as sweep_err:
        run_sweep(spec, [("capacity_blocks", [40, 4194305])], db=tmp_path / "s.duckdb")
    text = str(curve_err.value)
    assert "inf" not in text.replace("infinite", ""), text  # (engine mode refuses the unbounded cache)
    assert "4,194,304" in text, text  # the bound replay and sweep say in engine mode
    assert str(sweep_err.value).partition(": ")[2].partition(": ")[2] == text.partition(": ")[2].partition(": ")[2]
    assert not (tmp_path / "c.duckdb").exists()
    with pytest.raises(ConfigError, match="at most 4,194,304"):
        run_curve(spec, f"40,{HUGE}")


def test_cache_only_keeps_its_bound_and_its_advice():
    with pytest.raises(ConfigError, match=r"at most 4,194,302 blocks .*say inf"):
        parse_capacities("4194303")
    assert parse_capacities("4194302,inf") == [4194302, None]


@pytest.mark.parametrize("flag", ["--param", "--sweep"])
def test_a_swept_integer_of_too_many_digits_is_not_called_no_integer(flag):
    """``--param capacity_blocks=<41 digits>`` said 'capacity_blocks values must be integers'
    of an integer (the parser reads at most 40 digits)."""
    from kvtrace.replay.sweep import parse_param

    for value in ("1" * 41, HUGE):
        with pytest.raises(ConfigError) as err:
            parse_param(f"capacity_blocks=40,{value}", flag=flag)
        assert "must be integers (or inf)" not in str(err.value), str(err.value)
        assert "at most 40 digits" in str(err.value), str(err.value)
        assert str(err.value).startswith(f"{flag}: capacity_blocks=")
    with pytest.raises(ConfigError, match="capacity_blocks values must be integers"):
        parse_param("capacity_blocks=40,4x", flag=flag)
