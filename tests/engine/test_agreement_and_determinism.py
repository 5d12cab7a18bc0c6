"""Worker/Core agreement with every behaviour on, determinism, and that verification bites."""

import hashlib

from kvtrace.cache import CacheConfig, ExternalTierConfig, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.engine import Engine
from kvtrace.engine.events import StaleHashFound
from tests.engine.workloads import external_continuation, hybrid_cache, mixed_sessions, preset


def hybrid_all_on(**kw) -> CacheConfig:
    base = dict(num_gpu_blocks=(48, 16), external=ExternalTierConfig(400))
    base.update(kw)
    return hybrid_cache(**base)


def test_hybrid_replay_with_all_behaviours_has_no_divergence_and_no_stale_hash():
    work = mixed_sessions()
    res = Engine(preset(hybrid_all_on(), batch=128, seqs=8), audit_interval=1).run(work)
    s = res.summary
    assert s["requests"] == len(work)
    # the run exercised what can go wrong ...
    # (its copies are the external tier's loads, which cow_copies no longer counts: the
    # external hits stand for them)
    assert s["prefix_cache_hits"] > 0 and s["external_prefix_cache_hits"] > 0
    assert s["evictions"] > 0 and s["preemptions"] > 0
    # ... and nothing did
    assert s["divergent_outputs"] == 0
    assert s["stale_hashes"] == 0
    assert s["table_disagreements"] == 0


def test_dense_retention_hybrid_and_attention_only_also_agree():
    work = mixed_sessions(seed=9)
    for cache in (
        hybrid_all_on(retention_interval=None),
        hybrid_all_on(retention_interval=32, num_prefill_checkpoint_blocks=0),
        CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=80, hash_block_size=16,
                    enable_partial_hits=True),
        CacheConfig(groups=(FullAttentionSpec(16), SlidingWindowSpec(16, 64), MambaSpec(16)),
                    num_gpu_blocks=(60, 60, 16), hash_block_size=16, retention_interval=0, enable_partial_hits=True),
    ):
        s = Engine(preset(cache, batch=96, seqs=8), audit_interval=3).run(work).summary
        assert s["prefix_cache_hits"] > 0
        assert (s["divergent_outputs"], s["stale_hashes"], s["table_disagreements"]) == (0, 0, 0)


def digest(batches) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update(repr(b.step).encode())
        for e in b.cache_events:
            h.update(repr(e).encode())
        for e in b.engine_events:
            h.update(repr(e).encode())
    return h.hexdigest()


def test_same_input_gives_identical_summary_records_and_event_stream():
    work = mixed_sessions(seed=5)
    runs = []
    for _ in range(2):
        batches = []
        res = Engine(preset(hybrid_all_on(), batch=128, seqs=8), audit_interval=4).run(work, [batches.append])
        runs.append((res.summary, res.requests, digest(batches), len(batches)))
    assert runs[0] == runs[1]
    assert runs[0][3] == runs[0][0]["steps"]  # one StepBatch per step


def test_the_auditor_and_the_sampler_see_corrupted_content():
    """Overwrite a cached state block behind the cache's back: both checks must fire."""
    work, cache = external_continuation()
    engine = Engine(preset(cache), audit_interval=1)
    corrupted = []

    import kvtrace.engine.storage as eng_mod  # the engine takes DeviceStorage from here when it runs

    real_storage = eng_mod.DeviceStorage

    class CorruptingStorage(real_storage):
        def copy_blocks(self, copies):  # the first CoW copy lands corrupted in its destination
            n = super().copy_blocks(copies)
            for c in copies:
                if not corrupted and self.is_state[c.group_id]:
                    self.data[c.group_id][c.dst] += 1
                    corrupted.append(c)
            return n

    eng_mod.DeviceStorage = CorruptingStorage
    try:
        batches = []
        res = engine.run(work, [batches.append])
    finally:
        eng_mod.DeviceStorage = real_storage
    assert corrupted
    assert res.summary["divergent_outputs"] > 0 or res.summary["stale_hashes"] > 0
    assert res.summary["stale_hashes"] > 0
    found = [e for b in batches for e in b.engine_events if isinstance(e, StaleHashFound)]
    assert found and found[0].expected_fingerprint != found[0].actual_fingerprint


def test_an_attention_block_written_after_it_was_verified_is_audited_again():
    """The audit re-reads an attention block only when the storage stamped a write or copy
    into it since it last matched: a later wrong write into a verified cached block (here
    one slot of the first published attention block, some audits after it was first
    verified) must still be found."""
    import kvtrace.engine.storage as eng_mod
    from kvtrace.cache.events import BlockPublished

    real_storage = eng_mod.DeviceStorage
    held: list = []

    class Held(real_storage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            held.append(self)

    target: list = []  # (group, block id, step published)
    done: list = []

    def corrupt(batch) -> None:
        storage = held[0]
        for ev in batch.cache_events:
            if not target and isinstance(ev, BlockPublished) and not storage.is_state[ev.group_id]:
                target.append((ev.group_id, ev.block_ids[0], batch.step.step))
        if target and not done and batch.step.step >= target[0][2] + 3:  # a few audits later
            g, blk, _ = target[0]
            xp = storage.arrays
            old = int(storage.read_kv(g, xp.ints([blk]))[0, 0])
            storage.write_kv(g, xp.ints([blk]), xp.ints([0]), xp.ints([(old + 1) % (2**31 - 1)]))
            done.append(batch.step.step)

    eng_mod.DeviceStorage = Held
    try:
        batches: list = []
        work = mixed_sessions()
        Engine(preset(hybrid_all_on(num_gpu_blocks=(400, 64)), batch=128, seqs=8),
               audit_interval=1).run(work, [corrupt, batches.append])
    finally:
        eng_mod.DeviceStorage = real_storage
    assert done
    found = [e for b in batches for e in b.engine_events if isinstance(e, StaleHashFound)]
    assert any(e.group_id == target[0][0] and e.block_id == target[0][1] for e in found), found[:3]
