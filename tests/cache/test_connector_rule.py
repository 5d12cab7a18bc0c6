"""vLLM 0.33's connector rule (its ``Scheduler.schedule``, waiting loop): the connector is asked
from the local hit cut down to a scheduler block, and a longer load replaces a local sub-block
tail (no copy-on-write of it races the load); a load no longer than the tail is not taken.
kvtrace's tier plays the connector: ``external.connector_hit`` is the rule,
``KVCacheManager.get_connector_hit`` applies it, and the engine and the conformance driver
admit with it."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.cache import CacheConfig, ExternalTierConfig, FullAttentionSpec, KVCacheManager, MambaSpec
from kvtrace.cache.events import PrefixLookup
from kvtrace.cache.external import connector_hit
from kvtrace.cache.request import Request
from kvtrace.engine import Engine, SchedulerConfig
from kvtrace.replay.conformance import ConformanceSpec
from kvtrace.workload import TraceRequest
from tests.engine.workloads import MS, preset
from tests.replay.test_conformance_random import _RecordingDriver, failures


@pytest.mark.parametrize(
    ("local", "block", "held_from", "expected"),
    [
        (8, 4, {8: 4}, (8, 4)),  # no tail: the load as asked, from the whole hit
        (9, 4, {8: 4}, (8, 4)),  # a 1-token tail, a 4-token load from 8: the load replaces the tail
        (9, 4, {8: 1}, (9, 0)),  # a load no longer than the tail: the tail stays, nothing loads
        (9, 4, {8: 0}, (9, 0)),
        (3, 4, {0: 4}, (0, 4)),  # the whole local hit was a tail
        (0, 4, {0: 4}, (0, 4)),
    ],
)
def test_connector_hit_asks_from_the_block_and_keeps_a_tail_only_against_a_shorter_load(
    local, block, held_from, expected
):
    asked = []

    def ask(start: int) -> int:
        asked.append(start)
        return held_from[start]

    assert connector_hit(local, block, ask) == expected
    assert asked == [local - local % block]  # asked once, from the block boundary


X, Y, Z, W, W2, Q, R = 11, 12, 13, 14, 15, 16, 17
# a: [X Y][Z W2] published (and written through to the tier); b: [X Y][Z W] and the partial key
# [X Y Z] on its second block (the prompt's last hash boundary); c evicts a's [Z W2] locally.
# q = [X Y][Z W2]...: locally [X Y] and the partial [Z] (3 tokens, a 1-token tail on 2-token
# blocks); the tier holds [Z W2] from 2.
PROMPTS = {"a": [X, Y, Z, W2, 1], "b": [X, Y, Z, W], "c": [21, 22, 23], "q": [X, Y, Z, W2, Q, R]}


def _config() -> CacheConfig:
    return CacheConfig(groups=(FullAttentionSpec(2),), num_gpu_blocks=5, hash_block_size=1,
                       enable_partial_hits=True, num_speculative_blocks=0, external=ExternalTierConfig(64))


def test_a_longer_load_replaces_the_local_sub_block_tail_in_blocks_lookup_and_stats():
    kv = KVCacheManager(_config())
    seen: list = []
    kv.subscribe(seen.extend)
    for rid, prompt in PROMPTS.items():
        request = Request(rid, np.array(prompt))
        blocks, local, _ = kv.get_computed_blocks(request)
        hit_tokens_before = kv.stats.hit_tokens
        if rid == "q":  # (what asking from the whole hit gives, as kvtrace did before the rule)
            assert (local, kv.get_num_external_hit_tokens(request, local)) == (3, 1)
        cut_blocks, cut, external = kv.get_connector_hit(request, blocks, local)
        if rid == "q":
            assert (cut, external) == (2, 2)
            assert [len(g) for g in cut_blocks.blocks] == [1] and [len(g) for g in blocks.blocks] == [2]
            assert cut_blocks.blocks[0][0] is blocks.blocks[0][0]  # sliced, the same blocks
            assert kv.stats.hit_tokens == hit_tokens_before - 1
        out = kv.allocate_slots(request, len(prompt) - cut - external, num_new_computed_tokens=cut,
                                new_computed_blocks=cut_blocks, num_external_computed_tokens=external)
        assert out is not None
        if rid == "q":
            assert kv.take_block_copies() == []  # the tail was dropped: nothing to copy on write
        request.num_computed_tokens = len(prompt)
        kv.free(request)
        kv.new_step_starts()
    (lookup,) = [e for e in seen if isinstance(e, PrefixLookup) and e.request_id == "q"]
    assert (lookup.num_hit_tokens, lookup.num_external_hit_tokens) == (2, 2)


def _trace(prompts: dict[str, list[int]]) -> list[TraceRequest]:
    return [TraceRequest(rid, i * 1000 * MS, len(p), 1, token_ids=np.array(p, dtype=np.int64))
            for i, (rid, p) in enumerate(prompts.items())]


def test_the_engine_admits_with_the_rule():
    records = {r.request_id: r for r in Engine(preset(_config(), seqs=1)).run(_trace(PROMPTS)).requests}
    q = records["q"]
    assert (q.num_local_hit_tokens, q.num_external_hit_tokens) == (2, 2)


class _CutRecordingDriver(_RecordingDriver):
    cuts: list

    def _connector(self, request, local, kv_hit, vllm_hit):
        out = super()._connector(request, local, kv_hit, vllm_hit)
        self.cuts.append((request.request_id, local, out[0], out[1]))
        return out


# vLLM 0.33 has fine-grained hits only beside a Mamba group: r2's local hit is 5 tokens (a
# 1-token tail on 2-token blocks), the tier holds 2 tokens from 4
MAMBA_PROMPTS = {"r0": [3, 4, 4, 4, 4, 1, 4, 1], "r1": [3, 4, 4, 4, 4, 1], "r2": [3, 4, 4, 4, 4, 1, 30, 39, 35, 21],
                 "r3": [3, 4, 3, 1, 2, 3, 4, 34, 37, 23, 37, 29], "r4": [3, 4, 22, 35, 21, 25]}


def test_vllms_manager_agrees_on_the_cut_blocks(vllm_api):
    cache = CacheConfig(groups=(FullAttentionSpec(2), MambaSpec(2)), num_gpu_blocks=12, hash_block_size=1,
                        enable_partial_hits=True, num_speculative_blocks=0, retention_interval=0,
                        num_prefill_checkpoint_blocks=1, external=ExternalTierConfig(64))
    driver = _CutRecordingDriver(cache, SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=1),
                                 ConformanceSpec("cut", concurrency=1, max_output_tokens=1 << 20), vllm_api)
    driver.cuts = []
    driver.drive(_trace(MAMBA_PROMPTS))
    assert failures(driver.run) == []
    assert ("r2", 5, 4, 2) in driver.cuts  # the rule cut r2's hit in both managers, and they agreed


def test_both_engine_backends_admit_with_the_rule(vllm_api):
    cache = CacheConfig(groups=(FullAttentionSpec(2), MambaSpec(2)), num_gpu_blocks=12, hash_block_size=1,
                        enable_partial_hits=True, num_speculative_blocks=0, retention_interval=0,
                        num_prefill_checkpoint_blocks=1, external=ExternalTierConfig(64))
    hits = {}
    for backend in ("kvtrace", "vllm"):
        result = Engine(preset(cache, seqs=1), backend=backend).run(_trace(MAMBA_PROMPTS))
        hits[backend] = {r.request_id: (r.num_local_hit_tokens, r.num_external_hit_tokens) for r in result.requests}
    assert hits["kvtrace"]["r2"] == (4, 2)  # 5 local cut to 4, the load from 4
    assert hits["vllm"] == hits["kvtrace"]
