"""Sweep and curve, re-probed (session 27): the settings a cache-only curve has no use for."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtrace.errors import ConfigError
from kvtrace.replay.curve import run_curve
from kvtrace.replay.run import RunSpec
from tests.conftest import MOONCAKE


@pytest.mark.parametrize(("setting", "flag"), [({"name": "mine"}, "--name"), ({"name": ""}, "--name"),
                                               ({"percentiles": (50.0,)}, "--percentiles"),
                                               ({"seed": 3}, "--seed")])
def test_a_cache_only_curve_refuses_a_setting_it_has_no_use_for(tmp_path, setting, flag):
    """`kvtrace curve TRACE --name X`, `--percentiles 50` and `--seed 3` (a trace file) were taken
    and did nothing: the curve stores no run and has no clock, and the seed only moved the
    curve's id (the same points recorded twice in a store). Refused at the flag, as --workers
    is, before a store is made."""
    db = tmp_path / "c.duckdb"
    spec = replace(RunSpec(str(MOONCAKE), mode="cache-only", limit=20), **setting)
    with pytest.raises(ConfigError) as caught:
        run_curve(spec, "100,inf", db=db)
    assert caught.value.source == flag and "cache-only curve" in caught.value.what
    assert not db.exists()


def test_what_a_cache_only_curve_uses_is_still_taken():
    """The defaults said again, and a generated workload's seed (it picks the requests), are
    no refusal; an engine curve's runs still take a name and percentiles."""
    base = RunSpec(str(MOONCAKE), mode="cache-only", limit=20)
    assert run_curve(replace(base, percentiles=(50, 90, 99), seed=0), "100").points
    gen = RunSpec("gen:chat", mode="cache-only", limit=3)
    ids = {run_curve(replace(gen, seed=seed), "100").curve_id for seed in (3, 4)}
    assert len(ids) == 2  # (other requests: other curves)
    engine = RunSpec("gen:chat", limit=3, content=False, name="mine", percentiles=(50.0,))
    assert run_curve(engine, "3000", workers=1).points


def test_an_engine_curve_with_an_external_tier_says_its_hit_rate_is_the_local_caches():
    """With `--external-blocks` the curve drew the local cache's hit rate (vLLM's
    prefix_cache_hit_rate), its note silent on the tier: at 59 blocks 55.5% read as the hit
    rate where the tier served another 10% of the tokens."""
    from kvtrace.replay.curve import CurvePoint, CurveResult

    spec = RunSpec("gen:mixed", limit=8, content=False, external_capacity_blocks=4096)
    curve = run_curve(spec, "60", workers=1)
    assert curve.external_tier and "the external tier's hits are not in it" in curve.method_note()
    without = run_curve(replace(spec, external_capacity_blocks=None), "60", workers=1)
    assert not without.external_tier and "external" not in without.method_note()
    point = CurvePoint(10, "lru", 1, 2, 1, 2, "one-pass")  # (a cache-only curve has no tier to name)
    assert "external" not in CurveResult("c", "t", "cache-only", 16, [point]).method_note()


def test_a_sweeps_table_shows_the_external_tiers_hit_rate_where_a_run_had_a_tier():
    """A sweep of external_capacity_blocks closed with prefix_cache_hit_rate and its hits, the
    local cache's, equal in every row (+0.00 pp), the tier's own hit rate nowhere: a tier
    of 10 blocks read as one of 4,096. A sweep without a tier shows no such column."""
    from kvtrace.replay.sweep import run_sweep, sweep_table

    spec = RunSpec("gen:mixed", limit=30, content=False, capacity_blocks=60)
    result = run_sweep(spec, [("external_capacity_blocks", [10, 4096])], workers=1)
    header, *body = sweep_table(result)
    column = header.index("external_prefix_cache_hit_rate")
    rates = [r.summary["external_prefix_cache_hit_rate"] for r in result.runs]
    assert rates[0] < rates[1]  # (the tier is what moved)
    assert body[1][column].startswith(f"{rates[1]:.2%}") and "pp)" in body[1][column]
    plain = run_sweep(replace(spec, limit=5, capacity_blocks=None), [("capacity_blocks", [60, 100])], workers=1)
    assert "external_prefix_cache_hit_rate" not in sweep_table(plain)[0]
