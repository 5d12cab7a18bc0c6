"""The engine's fast paths change nothing: every event and output is the same with them off.

Each workload runs twice, once with every fast path on (the default) and once with all of
them off (the cache manager's ``allocate_slots`` general path for every decode token),
and the two runs must agree on every step's events (cache and engine, in order, with
their virtual times), on the summary and on every request record. The workloads are
chosen to cross what the fast paths must notice: block and hash boundaries during
decode, preemption and resume, copy-on-write of a partial tail, external-tier loads,
pinned shared prefixes, and the behaviours switched off (stale hashes, divergent
outputs), on the hybrid, attention-only and sliding-window layouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.cache import (
    CacheConfig,
    ExternalTierConfig,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    SlidingWindowSpec,
)
from kvtrace.cache import manager as manager_module
from kvtrace.cache.config import BEHAVIOURS
from kvtrace.engine import Engine, Worker
from kvtrace.replay.digest import encode_event
from kvtrace.replay.generate import WORKLOADS, study_workload
from kvtrace.replay.run import RunSpec, engine_preset, open_workload
from tests.engine.workloads import external_continuation, hybrid_cache, mixed_sessions, preset

MOONCAKE = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl")
# The study workloads' settings are read from the generator (kvtrace.compare.study would
# load the store, DuckDB and Polars: bench/gpu_check.sh runs these tests with a few wheels).


def _replay_case(trace: str, **settings):
    """The preset and workload ``kvtrace replay`` runs for these settings."""
    spec = RunSpec(trace, **settings)
    return engine_preset(spec), list(open_workload(spec).requests)


def _cases():
    hybrid = dict(num_gpu_blocks=(48, 16), external=ExternalTierConfig(400))
    yield "hybrid-all-on", preset(hybrid_cache(**hybrid), batch=128, seqs=8), mixed_sessions()
    yield "hybrid-dense-retention", preset(hybrid_cache(**hybrid, retention_interval=None), batch=96, seqs=8), \
        mixed_sessions(seed=9)
    yield "attention-partial-hits", preset(
        CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=80, hash_block_size=16, enable_partial_hits=True),
        batch=96, seqs=8), mixed_sessions(seed=9)
    yield "attention-swa-mamba", preset(
        CacheConfig(groups=(FullAttentionSpec(16), SlidingWindowSpec(16, 64), MambaSpec(16)),
                    num_gpu_blocks=(60, 60, 16), hash_block_size=16, retention_interval=0, enable_partial_hits=True),
        batch=96, seqs=8), mixed_sessions(seed=9)
    work, cache = external_continuation()
    yield "external-continuation", preset(cache), work
    yield "kimi-mixed-small", *_replay_case("gen:mixed", capacity_blocks=40, external_capacity_blocks=4096, limit=80)
    yield "dense-mixed", *_replay_case("gen:mixed", preset="dense-attention", capacity_blocks=1200, limit=60)
    yield "kimi-mooncake-preempting", *_replay_case(MOONCAKE, capacity_blocks=300, limit=60)
    for behaviour in BEHAVIOURS:
        for off in (False, True):
            hints = WORKLOADS[study_workload(behaviour)].hints
            yield f"study-{behaviour}-{'off' if off else 'on'}", *_replay_case(
                f"gen:study-{behaviour}", **hints, without=(behaviour,) if off else ())


def _run(engine_preset, work, fast: bool, monkeypatch) -> tuple:
    monkeypatch.setattr(manager_module, "DECODE_FAST_PATH", fast)  # (a compiled class cannot be patched)
    monkeypatch.setattr(Worker, "decode_fast_path", fast)
    lines: list[str] = []

    def record(batch) -> None:
        lines.append(encode_event(batch.step))
        lines.extend(encode_event(e) for e in batch.cache_events)
        lines.extend(encode_event(e) for e in batch.engine_events)

    res = Engine(engine_preset, audit_interval=7).run(work, [record])
    return res.summary, res.requests, lines


@pytest.mark.parametrize("name,engine_preset,work", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_fast_paths_give_the_same_events_and_outputs(name, engine_preset, work, monkeypatch):
    taken = [0]  # worker decode batches
    real_write = Worker._decode_write

    def counted_write(self, *args):
        taken[0] += 1
        return real_write(self, *args)

    monkeypatch.setattr(Worker, "_decode_write", counted_write)
    managers: list[KVCacheManager] = []  # each run's, to read its fast-path count
    real_manager = Engine._manager
    monkeypatch.setattr(Engine, "_manager", lambda self: managers.append(real_manager(self)) or managers[-1])
    fast = _run(engine_preset, work, True, monkeypatch)
    fast_slots = managers[0].num_fast_decode_slots
    if name == "external-continuation":  # 2-token blocks: every decode token fills or opens one
        assert fast_slots == 0
    else:
        assert fast_slots > 0, "the workload never took the manager's decode fast path"
    if name != "attention-swa-mamba":  # a sliding window: the worker's general path only
        assert taken[0] > 0, "the workload never took the worker's decode path"
    slow = _run(engine_preset, work, False, monkeypatch)
    assert managers[1].num_fast_decode_slots == 0, "the general run took the fast path"
    assert fast[0] == slow[0]
    assert fast[1] == slow[1]
    assert len(fast[2]) == len(slow[2])
    for i, (a, b) in enumerate(zip(fast[2], slow[2])):
        assert a == b, f"event {i} differs"


@pytest.mark.parametrize("name,engine_preset,work", [c for c in _cases() if c[0] in (
    "hybrid-all-on", "kimi-mooncake-preempting", "dense-mixed", "study-transient-checkpoint-retention-off")],
    ids=lambda v: v if isinstance(v, str) else "")
def test_a_run_of_decodes_in_one_manager_call_is_the_same_as_one_call_each(name, engine_preset, work, monkeypatch):
    """The scheduler hands its runs of decode steps to ``allocate_decode_slots``; one
    ``allocate_slots`` call per request (as with another backend) must give every event."""
    from kvtrace.engine.scheduler import Scheduler

    batched = _run(engine_preset, work, True, monkeypatch)
    real_init = Scheduler.__init__

    def one_call_each(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._decode_run = None

    monkeypatch.setattr(Scheduler, "__init__", one_call_each)
    single = _run(engine_preset, work, True, monkeypatch)
    assert batched[0] == single[0] and batched[1] == single[1]
    assert batched[2] == single[2]
