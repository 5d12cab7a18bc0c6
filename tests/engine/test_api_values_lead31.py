"""An API caller's hostile value is one KVTraceError line wherever the engine, its configs or
the cache's config refuse it: a value whose repr raises, a repr of 300,000 characters over
100,000 lines, an int past Python's 4,300 printable digits. Each was quoted with ``!r`` (or
``:,``), so the refusal itself raised (RuntimeError, ValueError) or wrote the whole repr."""

from __future__ import annotations

import dataclasses

import pytest

from kvtrace.cache.config import CacheConfig, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.engine.clock import COEFFICIENTS, CostModel
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.engine import Engine
from kvtrace.engine.presets import get_preset
from kvtrace.errors import KVTraceError, check_limit, check_option, check_seed
from kvtrace.metrics import parse_percentiles
from kvtrace.names import shown_count
from kvtrace.workload import TraceRequest


class ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class HugeRepr:
    def __repr__(self) -> str:
        return "x\n" * 100_000


class IdRaises(str):  # (a str the engine takes as an id, whose repr raises)
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


VALUES = {"repr raises": ReprRaises(), "huge repr": HugeRepr(), "5,001-digit int": 10**5000}


def _request(**given) -> TraceRequest:
    fields = {"request_id": "a", "arrival_ns": 0, "input_length": 16, "output_length": 2, "hash_ids": (1,),
              "hash_block_size": 16, **given}
    return TraceRequest(**fields)


def _cache(**given) -> CacheConfig:
    return CacheConfig(**{"groups": (FullAttentionSpec(16), MambaSpec(16)), "num_gpu_blocks": 64,
                          "hash_block_size": 16, **given})


def _cost(**given) -> CostModel:
    return dataclasses.replace(get_preset("kimi-hybrid").cost_model, **given)


ENTRIES = {
    **{f"request {f}": (lambda v, f=f: Engine("kimi-hybrid").run([_request(**{f: v})]))
       for f in ("request_id", "arrival_ns", "input_length", "output_length", "namespace", "cache_salt",
                 "hash_block_size")},
    **{f"Engine {k}": (lambda v, k=k: Engine(**({} if k == "preset" else {"preset": "kimi-hybrid"}), **{k: v}))
       for k in ("preset", "backend", "content", "verify", "audit_interval", "cpu_threads", "cost_model",
                 "cache_config", "scheduler_config", "percentiles")},
    **{f"CacheConfig {k}": (lambda v, k=k: _cache(**{k: v}))
       for k in ("hash_block_size", "num_gpu_blocks", "hash_fn", "retention_interval", "num_speculative_blocks",
                 "num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment")},
    "CacheConfig groups": lambda v: _cache(groups=(FullAttentionSpec(16), v)),
    "FullAttentionSpec block_size": lambda v: _cache(groups=(FullAttentionSpec(v),)),
    "SlidingWindowSpec sliding_window": lambda v: _cache(groups=(FullAttentionSpec(16), SlidingWindowSpec(16, v))),
    "MambaSpec num_lanes": lambda v: _cache(groups=(FullAttentionSpec(16), MambaSpec(16, v))),
    **{f"SchedulerConfig {f.name}": (lambda v, k=f.name: SchedulerConfig(**{k: v}))
       for f in dataclasses.fields(SchedulerConfig)},
    **{f"CostModel {k}": (lambda v, k=k: _cost(**{k: v})) for k in COEFFICIENTS},
}


@pytest.mark.parametrize("value", VALUES.values(), ids=VALUES.keys())
@pytest.mark.parametrize("entry", ENTRIES.values(), ids=ENTRIES.keys())
def test_a_hostile_value_is_one_short_line(entry, value) -> None:
    try:
        entry(value)
    except KVTraceError as err:
        line = str(err)
        assert "\n" not in line and len(line) < 400, line[:400]
    else:  # (a count with no upper bound, e.g. max_num_seqs, takes any int; nothing else is taken)
        assert type(value) is int


def test_a_request_id_whose_repr_raises_is_named_by_its_type() -> None:
    with pytest.raises(KVTraceError, match="IdRaises whose repr raised"):
        Engine("kimi-hybrid").run([_request(request_id=IdRaises("a"), arrival_ns=1.5)])


@pytest.mark.parametrize("value", VALUES.values(), ids=VALUES.keys())
def test_a_hostile_percentile_is_one_short_line(value) -> None:
    with pytest.raises(ValueError) as err:  # (each caller turns it into its ConfigError at --percentiles)
        parse_percentiles([value])
    line = str(err.value)
    assert "\n" not in line and len(line) < 400, line[:400]


def test_a_count_is_quoted_with_separators_and_a_huge_one_by_its_size() -> None:
    assert shown_count(33_554_432) == "33,554,432"
    assert shown_count(10**5000) == "<int of about 5,001 digits>"


@pytest.mark.parametrize("value", [*VALUES.values(), -(10**5000)], ids=[*VALUES.keys(), "-5,001-digit int"])
@pytest.mark.parametrize("check", [check_seed, check_limit, lambda v: check_option("--x", v, 0, 10)],
                         ids=["check_seed", "check_limit", "check_option"])
def test_a_flags_check_quotes_an_api_callers_value_as_one_short_line(check, value) -> None:
    try:  # (str(value) raised, or wrote it whole)
        check(value)
    except KVTraceError as err:
        line = str(err)
        assert "\n" not in line and len(line) < 400, line[:400]
    else:  # (--limit takes any count >= 1)
        assert check is check_limit and type(value) is int and value > 0


def test_a_refused_value_reaches_an_api_caller_without_a_raw_escape() -> None:
    from kvtrace.replay.run import RunSpec, run_replay

    with pytest.raises(KVTraceError) as err:  # (the CLI's error() cleaned it; an API caller got it raw)
        run_replay(RunSpec("gen:chat", mode="\x1b[2J"))
    assert "\x1b" not in str(err.value) and "\\x1b[2J" in str(err.value)
