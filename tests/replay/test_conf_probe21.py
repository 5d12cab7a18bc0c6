"""Probe 21 of ``kvtrace conformance`` and the bench scripts beside it: what a report says of
a disagreement on a set-valued field, of a switch that never acted, and what the benches
count and accept."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvtrace.cache import EXTERNAL_HIT_RUNNING_COW
from kvtrace.replay import conformance
from kvtrace.replay.conformance import ConformanceSpec, format_report, run_conformance
from tests.cli.support import run_main

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}_probe21", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main(module, argv: list[str], capsys) -> tuple[int, str, str]:
    return run_main(module.main, module.__file__, argv, capsys)


def test_an_events_disagreement_counts_what_each_side_alone_holds(vllm_api, monkeypatch):
    """It printed the first 8 entries of each side's difference as ``vLLM: [...]`` and
    ``kvtrace: []``, which read as kvtrace having no events at all, and never said how many
    entries differed."""
    import kvtrace.engine.backends.vllm as backend

    monkeypatch.setattr(backend, "kvtrace_event_keys", lambda events, convert: [])  # kvtrace's events lost
    result = run_conformance(ConformanceSpec("gen:chat", preset="dense-attention", limit=2, capacity_blocks=(4000,)),
                             api=vllm_api)
    (run,) = result.runs
    first, shown = run.first, conformance.SHOWN
    assert first is not None and (first.field, first.step) == ("events", 1)
    assert first.only is not None
    stored, kvtrace_only = first.only
    assert kvtrace_only == 0 and stored > shown and len(first.vllm) == shown and first.kvtrace == []
    assert {op for op, _, _ in first.vllm} == {"stored"}
    assert first.as_dict()["only_in"] == {"vllm": stored, "kvtrace": 0}
    report = "\n".join(format_report(result))
    assert f"    only in vLLM:    {stored:,} event entries (operation, group, hash) ({shown} shown: [" in report
    assert "    only in kvtrace: 0 event entries (operation, group, hash)\n" in report


def test_a_cached_keys_disagreement_counts_both_sides(vllm_api, monkeypatch):
    init = conformance._Driver.__init__

    def wrong_groups(self, *args, **kwargs):  # kvtrace's keys read under another group's suffix
        init(self, *args, **kwargs)
        self.group_suffix = [(7).to_bytes(4, "big")] * len(self.group_suffix)

    monkeypatch.setattr(conformance._Driver, "__init__", wrong_groups)
    result = run_conformance(ConformanceSpec("gen:chat", preset="dense-attention", limit=2, capacity_blocks=(4000,)),
                             api=vllm_api)
    first, shown = result.runs[0].first, conformance.SHOWN
    assert first is not None and first.field == "cached_keys" and first.only is not None
    theirs, ours = first.only
    assert theirs == ours > shown
    assert {g for g, _ in first.vllm} == {0} and {g for g, _ in first.kvtrace} == {7}
    report = "\n".join(format_report(result))
    assert f"only in vLLM:    {theirs:,} cached keys (group, hash) ({shown} shown" in report
    assert f"only in kvtrace: {ours:,} cached keys (group, hash) ({shown} shown" in report


def test_a_switched_off_behaviour_that_never_acted_is_named(vllm_api):
    """Without an external tier the external-hit switch has nothing to act on: the run
    agreed, and the report said only ``agree`` beside ``switched off: ...``, as if the old
    behaviour conformed to vLLM."""
    spec = ConformanceSpec("gen:study-external-hit-running-cow", preset="kimi-hybrid",
                           without=(EXTERNAL_HIT_RUNNING_COW,), limit=30)
    result = run_conformance(spec, api=vllm_api)
    (run,) = result.runs
    assert result.agree and run.never_acted == [EXTERNAL_HIT_RUNNING_COW]
    assert run.as_dict()["never_acted"] == [EXTERNAL_HIT_RUNNING_COW]
    report = format_report(result)
    assert ("  never acted here (switched off, but the old code took no other path): "
            f"{EXTERNAL_HIT_RUNNING_COW}") in report
    # with the tier as the connector it acts: not named so, and it explains the disagreement
    acting = run_conformance(replace(spec, limit=None, capacity_blocks=(25,), external_capacity_blocks=4096),
                             api=vllm_api)
    (run,) = acting.runs
    assert not acting.agree and run.never_acted == []
    assert [e["behaviour"] for e in run.explained_by] == [EXTERNAL_HIT_RUNNING_COW]
    assert not any("never acted" in line for line in format_report(acting))
    # every behaviour on: nothing switched off, nothing named
    assert run_conformance(replace(spec, without=()), api=vllm_api).runs[0].never_acted == []


def test_a_run_stopped_at_a_disagreement_names_no_switch_as_never_acting(vllm_api):
    """Stopped at step 1 by the pinning switch, it named the checkpoint switch as never
    acting, which acts later in the same trace."""
    from kvtrace.cache.config import SHARED_PREFIX_PINNING, TRANSIENT_CHECKPOINT_RETENTION

    spec = ConformanceSpec("gen:mixed", preset="kimi-hybrid", limit=60,
                           without=(SHARED_PREFIX_PINNING, TRANSIENT_CHECKPOINT_RETENTION))
    (run,) = run_conformance(spec, api=vllm_api).runs
    assert run.stopped and run.never_acted == []
    alone = run_conformance(replace(spec, limit=None, without=(TRANSIENT_CHECKPOINT_RETENTION,)), api=vllm_api)
    assert alone.runs[0].never_acted == []  # (it acts on the trace)


def test_the_max_output_tokens_help_says_it_caps_the_traces_length(capsys):
    """It read "Decode steps per request at most (the trace's output length otherwise)": the
    default 4 always caps the trace's length, and N counts output tokens, the first of which
    ends the prefill step (a cap of 1 gives no decode step)."""
    from tests.cli.support import run

    code, out, _ = run(["conformance", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0
    assert ("--max-output-tokens N Output tokens per request: the trace's output length (at least 1), capped at N "
            "(each token after the first is a decode step). [default: 4; x>=1]") in text


def test_the_conformance_bench_compares_keys_not_events(vllm_api, capsys):
    """It printed vLLM's and kvtrace's event counts side by side (3,774 against 1,120 on 400
    requests), which group keys differently; the keys each stored and removed are equal."""
    code, out, _ = _main(_bench("conformance"), ["--limit", "200", "--repeat", "1"], capsys)
    keys = [int(n) for n in re.findall(r"stored/removed keys (\d+)", out)]
    hits = [int(n) for n in re.findall(r"hit tokens (\d+)", out)]
    assert len(keys) == 2 and keys[0] == keys[1] > 0, out
    assert len(hits) == 2 and hits[0] == hits[1] > 0, out
    assert "the managers differ" not in out
    assert code in (0, 1)  # (1: the speed budget, which 200 requests on a shared box may miss)


@pytest.mark.parametrize("bench, argv, flag", [
    ("conformance", ["--repeat", "0"], "--repeat"),  # printed "inf s" and a "nanx" ratio
    ("conformance", ["--limit", "0"], "--limit"),  # replayed the whole trace
    ("conformance", ["--blocks", "1"], "--blocks"),
    ("vllm_backend", ["--repeat", "0"], "--repeat"),  # a KeyError traceback after every run
    ("vllm_backend", ["--limit", "0"], "--limit"),  # a ConfigError traceback
    ("vllm_backend", ["--preset", "nope"], "--preset"),  # a ConfigError traceback
])
def test_the_benches_refuse_counts_they_cannot_run(capsys, bench, argv, flag):
    code, out, err = _main(_bench(bench), argv, capsys)
    assert code == 2 and out == "", out
    assert f"error: argument {flag}: " in err and "Traceback" not in err, err


def test_a_key_reads_alike_in_events_and_cached_keys(vllm_api):
    """The key kvtrace alone published (its transient-checkpoint switch off) is the one it
    alone holds: the events showed its hash as vLLM's events carry it (an int, the low 64
    bits), the cached keys as the first 8 bytes in hex, so the two could not be matched."""
    from kvtrace.cache import TRANSIENT_CHECKPOINT_RETENTION

    result = run_conformance(ConformanceSpec("gen:mixed", preset="kimi-hybrid", limit=40,
                                             without=(TRANSIENT_CHECKPOINT_RETENTION,)), api=vllm_api)
    by_field = result.runs[0].first_by_field
    events, keys = by_field["events"], by_field["cached_keys"]
    assert events.step == keys.step and events.only == keys.only == (0, 1)
    ((op, group, event_hash),) = events.kvtrace
    assert op == "stored" and keys.kvtrace == [(group, event_hash)]


def test_a_pool_size_given_twice_is_refused_before_vllm_loads(capsys):
    """(probe 35: `--capacity-blocks 40 --capacity-blocks 40` ran the same comparison twice, where a
    sweep refuses a value given twice)"""
    from kvtrace.errors import ConfigError
    from tests.cli.support import assert_one_line, run

    with pytest.raises(ConfigError, match=r"^--capacity-blocks: 40: is given twice"):
        run_conformance(ConformanceSpec("gen:chat", limit=2, capacity_blocks=(40, 80, 40)))
    code, _, err = run(["conformance", "gen:chat", "--limit", "2", "--capacity-blocks", "40",
                        "--capacity-blocks", "40"], capsys)
    assert_one_line(code, err, "--capacity-blocks: 40: is given twice")
