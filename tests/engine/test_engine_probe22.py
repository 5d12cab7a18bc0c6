"""Workloads the Python API hands the engine that no trace reader makes (the readers refuse
them), which the engine took and then lost a request over, or refused for the wrong reason:
a request id already in flight, a first arrival before time 0, a prompt of no tokens, and an
``input_length`` other than the prompt's token count."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvtrace.engine import Engine, get_preset
from kvtrace.errors import KVTraceError
from kvtrace.workload import TraceRequest

BOTH = pytest.mark.parametrize("content", [True, False], ids=["content", "no-content"])


def _req(rid: str, arrival: int, prompt: int, output: int = 3, tokens: int | None = None) -> TraceRequest:
    n = prompt if tokens is None else tokens
    return TraceRequest(rid, arrival, prompt, output, token_ids=np.arange(1, n + 1, dtype=np.int64))


@BOTH
def test_a_request_id_already_in_flight_is_refused(content):
    """Two requests of one id at once: without content the second replaced the first, which
    never finished (2 requests in, 1 out, no word); with content the worker's table of it
    broke (a ValueError, a traceback at the CLI)."""
    work = [_req("a", 0, 100), _req("a", 1, 100)]
    with pytest.raises(KVTraceError, match=re.escape(
            "workload: request 'a' arrives while an earlier request of that id is still in flight; "
            "expected unique request ids")):
        Engine("dense-attention", content=content).run(work)


@BOTH
def test_an_id_used_again_after_its_request_finished_still_runs(content):
    work = [_req("a", 0, 100, 1), _req("a", 10**9, 100, 1)]
    res = Engine("dense-attention", content=content).run(work)
    assert [r.request_id for r in res.requests] == ["a", "a"]
    assert res.summary["requests"] == 2


@BOTH
def test_a_first_request_before_time_zero_is_named_as_such(content):
    # (it was "arrives before the previous one": there is none)
    with pytest.raises(KVTraceError, match=re.escape("workload: request 'a' arrives at -5 ns; expected a time >= 0")):
        Engine("dense-attention", content=content).run([_req("a", -5, 10)])


@BOTH
def test_a_prompt_of_no_tokens_is_refused_as_such(content):
    # (it was "request z (0 prompt tokens) cannot be scheduled: it needs more KV blocks than the
    # pool holds (num_gpu_blocks 53760)", of the preset's whole pool)
    with pytest.raises(KVTraceError, match=re.escape("workload: request 'z' has a prompt of 0 tokens; "
                                                     "expected at least 1")):
        Engine("dense-attention", content=content).run([_req("z", 0, 0)])


@BOTH
def test_an_input_length_other_than_the_prompts_is_refused(content):
    """max_model_len is held against input_length: a prompt of 199 tokens said to be 10 passed
    a max_model_len of 64 and ended as "no request cannot be scheduled: it needs more KV
    blocks than the pool holds"; one of 3 tokens said to be 10 ran and recorded 3."""
    preset = get_preset("dense-attention", scheduler={"max_model_len": 64})
    for tokens in (199, 3):
        with pytest.raises(KVTraceError, match=re.escape(
                f"workload: request 'm' has input_length 10 and {tokens} prompt token ids; expected as many")):
            Engine(preset, content=content).run([_req("m", 0, 10, 2, tokens=tokens)])


@pytest.mark.parametrize("limit", [0, True, -1])
def test_a_generated_workloads_limit_is_held_as_a_files_is(limit):
    """run_replay of ``gen:NAME`` (a sweep's, a study's, the API's) took a limit of 0 and
    recorded an empty run, and True as 1 request, where a trace file's reader refuses both."""
    from kvtrace.errors import ConfigError
    from kvtrace.replay.run import RunSpec, run_replay

    with pytest.raises(ConfigError, match=re.escape(f"--limit: {limit}: expected a number of requests >= 1")):
        run_replay(RunSpec("gen:chat", limit=limit, content=False))


@pytest.mark.parametrize(("percentiles", "what"), [
    ((150,), "--percentiles: 150: percentile 150 is outside 0..100"),
    ((50, "90"), "--percentiles: 50,90: percentile '90' is not a number"),
    ((), "--percentiles: : no percentiles given"),
])
def test_a_run_specs_percentiles_are_held_before_the_run(percentiles, what):
    """The CLI parses --percentiles; a RunSpec's (the API's, a sweep's) went unchecked to the
    summary, which raised a ValueError or numpy's TypeError after the whole replay."""
    from kvtrace.errors import ConfigError
    from kvtrace.replay.run import RunSpec, run_replay

    with pytest.raises(ConfigError, match=re.escape(what)):
        run_replay(RunSpec("gen:chat", limit=2, content=False, percentiles=percentiles))


@pytest.mark.parametrize(("percentiles", "what"), [
    ("50,90", "--percentiles: '50,90': expected a tuple of numbers"),  # (its characters were read one by one)
    ((p for p in (50, 90)), "expected a tuple of numbers"),  # (a generator, used up by the first check)
])
def test_a_run_specs_percentiles_are_a_sequence_of_numbers(percentiles, what):
    from kvtrace.errors import ConfigError
    from kvtrace.replay.run import RunSpec, run_replay

    with pytest.raises(ConfigError, match=re.escape(what)):
        run_replay(RunSpec("gen:chat", limit=2, content=False, percentiles=percentiles))


def test_numpy_percentiles_run_and_a_repeated_one_is_recorded_once_as_the_cli_records_it(tmp_path):
    """3e5a43c refused numpy's numbers (np.int64(50) "is not a number"), which ran before
    with the same digest; (50, 50, 99) was recorded [50, 50, 99], the CLI's [50.0, 99.0]."""
    import numpy as np

    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    plain = run_replay(RunSpec("gen:chat", limit=3, content=False, percentiles=(50, 90)))
    numpy = run_replay(RunSpec("gen:chat", limit=3, content=False, percentiles=tuple(np.array([50, 90]))))
    array = run_replay(RunSpec("gen:chat", limit=3, content=False, percentiles=np.array([50, 90])))
    assert numpy.summary == plain.summary == array.summary
    run_replay(RunSpec("gen:chat", limit=3, content=False, percentiles=(50, 50, 99)), db=tmp_path / "s.duckdb")
    assert read.run(tmp_path / "s.duckdb", "r1")["config"]["percentiles"] == [50.0, 99.0]


@pytest.mark.parametrize(("setting", "what"), [
    ({"capacity_blocks": 3.5}, "--capacity-blocks: 3.5: expected a number of blocks, or inf (cache-only mode)"),
    ({"block_size": 16.0}, "--block-size: 16.0: expected a whole number"),
    ({"capacity_tokens": 100.5}, "--capacity-tokens: 100.5: expected a whole number"),
    ({"external_capacity_blocks": 2.5}, "--external-blocks: 2.5: expected a whole number"),
    ({"seed": 1.5}, "--seed: 1.5: expected a whole number"),
    ({"without": "shared-prefix-pinning"}, "--without: shared-prefix-pinning: expected a sequence of behaviour names"),
])
def test_a_run_specs_counts_are_whole_numbers(setting, what):
    """A RunSpec's float counts (the API's; the CLI's are ints) broke in the presets with a
    TypeError ('float' object is not iterable), or ran truncated (a seed of 1.5 as 1); a
    --without of one string was read letter by letter."""
    from kvtrace.errors import ConfigError
    from kvtrace.replay.run import RunSpec, run_replay

    with pytest.raises(ConfigError, match=re.escape(what)):
        run_replay(RunSpec("gen:chat", limit=2, content=False, preset="dense-attention", **setting))


def test_a_run_spec_of_one_pool_per_group_still_runs():
    from kvtrace.replay.run import RunSpec, run_replay

    res = run_replay(RunSpec("gen:chat", limit=2, content=False, capacity_blocks=(300, 300)))
    assert res.summary["requests"] == 2 and res.summary["capacity_blocks"] == 299


def test_the_summary_table_shows_evictions_by_reason():
    """`kvtrace replay`'s table left out every dict of the summary: evictions 56 showed, and
    which reasons they were (lru 41, moved 15) only with --json."""
    import io

    from rich.console import Console

    from kvtrace.replay.report import summary_table

    summary = {"evictions": 56, "evictions_by_reason": {"lru": 41, "moved": 15}, "steps": 48}
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(summary_table(summary))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.getvalue().splitlines()
            if line.count("│") == 3}
    assert rows == {"evictions": "56", "evictions_by_reason.lru": "41", "evictions_by_reason.moved": "15",
                    "steps": "48"}


def _api_request(**fields):
    import numpy as np

    from kvtrace.workload import TraceRequest

    base = {"request_id": "b", "arrival_ns": 5, "input_length": 10, "output_length": 3,
            "token_ids": np.arange(1, 11, dtype=np.int64)}
    return TraceRequest(**{**base, **fields})


@pytest.mark.parametrize(("fields", "what"), [
    ({"arrival_ns": float("nan")}, "request 'b' arrives at nan ns; expected a whole number of ns"),  # (it hung)
    ({"arrival_ns": float("inf")}, "request 'b' arrives at inf ns"),  # (an OverflowError traceback)
    ({"request_id": 7}, "a request id 7; expected a string"),  # (a TypeError)
    ({"token_ids": None}, "request 'b' gives neither of token_ids and hash_ids"),  # (a bare AssertionError)
    ({"input_length": 1000, "token_ids": None, "hash_ids": (1, 2), "hash_block_size": 16},
     "request 'b' has 2 hash_ids for input_length 1,000 at 16 tokens each; expected 63"),  # (the worker's ValueError)
    ({"token_ids": None, "hash_ids": (1,), "hash_block_size": 0},
     "request 'b' has hash_block_size 0"),  # (a ZeroDivisionError)
    # full blocks only: the worker's ValueError with content, a shorter prompt without (the reF re-probe)
    ({"input_length": 1000, "token_ids": None, "hash_ids": tuple(range(62)), "hash_block_size": 16},
     "request 'b' has 62 hash_ids for input_length 1,000 at 16 tokens each; expected 63"),
    ({"arrival_ns": 2**63}, "request 'b' arrives at 9,223,372,036,854,775,808 ns; expected a time below 2^62"),
    ({"input_length": 10.5}, "request 'b' has input_length 10.5; expected an int"),
    ({"output_length": None}, "request 'b' has output_length None; expected an int"),
    ({"cache_salt": 5}, "request 'b' has cache_salt 5; expected a string"),
    ({"token_ids": None, "hash_ids": ("x",), "hash_block_size": 16}, "request 'b' has hash_ids of tuple; expected"),
    ({"token_ids": None, "hash_ids": [1], "hash_block_size": 16}, "request 'b' has hash_ids of list; expected"),
])
@pytest.mark.parametrize("content", [True, False])
def test_an_api_request_the_readers_would_refuse_is_one_workload_line(fields, what, content):
    """The Engine API took requests no reader makes: a NaN arrival hung the run for good, and
    the rest were tracebacks (or, without content, a run of another prompt, unsaid)."""
    from kvtrace.engine import Engine
    from kvtrace.errors import KVTraceError

    first = _api_request(request_id="a", arrival_ns=0)
    with pytest.raises(KVTraceError, match=re.escape(f"workload: {what}")):
        Engine("dense-attention", content=content).run([first, _api_request(**fields)])


def test_float32_percentiles_are_recorded_as_the_numbers_they_print(tmp_path):
    """np.float32(99.9) widened to 99.9000015258789: the run's summary keys and recorded
    percentiles said p99.9000015..., where the CLI's --percentiles 99.9 says p99.9."""
    import numpy as np

    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    plain = run_replay(RunSpec("gen:chat", limit=3, content=False, percentiles=(50, 99.9)))
    for given in ((np.float32(50), np.float32(99.9)), np.array([50, 99.9], dtype=np.float32),
                  np.array([50, 99.9], dtype=np.float16)):
        assert run_replay(RunSpec("gen:chat", limit=3, content=False, percentiles=given)).summary == plain.summary
    run_replay(RunSpec("gen:chat", limit=3, content=False, percentiles=np.array([99.9], dtype=np.float32)),
               db=tmp_path / "s.duckdb")
    assert read.run(tmp_path / "s.duckdb", "r1")["config"]["percentiles"] == [99.9]
