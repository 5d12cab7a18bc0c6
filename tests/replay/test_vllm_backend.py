"""``--backend vllm``: kvtrace's engine around vLLM 0.33's own ``KVCacheManager``.

Real vLLM classes throughout (the session's ``vllm_api``), real DuckDB stores and
``kvtrace diff``. The patch study reverts one vLLM fix at run time, the way a user's
branch would differ: ``MambaManager.allocate_new_blocks`` back to its early return that
does not mark the request allocated (review 003; vLLM 0.33 has the fix).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import duckdb
import pytest

from kvtrace.cache.config import EXTERNAL_HIT_RUNNING_COW
from kvtrace.compare.source import diff_runs
from kvtrace.compare.study import study_defaults, study_trace
from kvtrace.replay.run import RunSpec, run_replay
from tests.conftest import MOONCAKE

TRACE = str(MOONCAKE)


# the size for both (dense-attention, 16-token blocks, is the slow one: both runs
# with content and spans about a minute on the shared 2-core box)
@pytest.mark.parametrize("preset, limit", [("dense-attention", 500), ("kimi-hybrid", 500)])
def test_both_backends_hit_the_same_tokens_per_request(vllm_api, tmp_path, preset, limit):
    """Every behaviour on, the synthetic trace's first requests: kvtrace diff between the
    kvtrace-backend run and the vllm-backend run shows no request with other hits."""
    db = tmp_path / "backends.duckdb"
    ours = run_replay(RunSpec(TRACE, preset=preset, limit=limit), db=db)
    theirs = run_replay(RunSpec(TRACE, preset=preset, limit=limit, backend="vllm"), db=db)
    d = diff_runs(db, ours.run_id, theirs.run_id)
    assert d.same_trace and d.requests is not None
    assert (d.requests.requests, d.requests.only_a, d.requests.only_b) == (limit, 0, 0)
    assert (d.requests.gained, d.requests.lost, d.requests.cached_tokens_delta) == (0, 0, 0)
    assert theirs.summary["prefix_cache_hits"] == ours.summary["prefix_cache_hits"] > 0
    for s in (ours.summary, theirs.summary):  # the worker verified every token of both
        assert s["divergent_outputs"] == s["stale_hashes"] == s["table_disagreements"] == 0
    # the same blocks published and evicted (kinds and reasons are partly inferred on vLLM's side)
    assert theirs.summary["publishes"] == ours.summary["publishes"]
    assert theirs.summary["evictions"] == ours.summary["evictions"]
    assert theirs.summary["backend"] == "vllm" and theirs.summary["vllm_version"] == "0.33.0"
    # every published and evicted key names its block, also one keyed and dropped within one
    # vLLM call (a Mamba boundary re-keyed as its checkpoint), and that drop is no LRU eviction
    with duckdb.connect(str(db), read_only=True) as con:
        unnamed = con.execute("SELECT run_id, name, count(*) FROM spans WHERE list_contains(block_ids, -1) "
                              "GROUP BY ALL").fetchall()
        young_lru = con.execute("SELECT count(*) FROM spans WHERE run_id = ? AND evict_reason = 'lru' "
                                "AND list_contains(ages, 0)", [theirs.run_id]).fetchone()[0]
    assert unnamed == []
    assert young_lru == 0


def _reverted_allocate_new_blocks(original):
    """vLLM's ``MambaManager.allocate_new_blocks`` before review 003's fix: the align-mode
    early return (no new block, no partial hit, no checkpoint) leaves the request out of
    ``_allocated_block_reqs``."""
    from vllm.utils.math_utils import cdiv

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        if self.mamba_cache_mode == "align":
            required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
            if (required <= len(self.req_to_blocks[request_id]) and request_id not in self._partial_hit_reqs
                    and request_id not in self._checkpoints):
                return []
        return original(self, request_id, num_tokens, num_tokens_main_model)

    return allocate_new_blocks


def test_a_vllm_patch_studied_end_to_end(vllm_api, tmp_path, monkeypatch):
    """A = vLLM 0.33, B = the same with the fix reverted; the external-hit study workload
    through both. kvtrace diff shows divergent outputs in B only, as many as kvtrace's own
    switch shows (--without external-hit-running-cow), and the Core/Worker disagreements."""
    from vllm.v1.core import single_type_kv_cache_manager as stkm

    db = tmp_path / "patch.duckdb"
    base = RunSpec(study_trace(EXTERNAL_HIT_RUNNING_COW), **study_defaults(EXTERNAL_HIT_RUNNING_COW))
    a = run_replay(replace(base, backend="vllm", name="A"), db=db)
    with monkeypatch.context() as m:
        m.setattr(stkm.MambaManager, "allocate_new_blocks",
                  _reverted_allocate_new_blocks(stkm.MambaManager.allocate_new_blocks))
        b = run_replay(replace(base, backend="vllm", name="B"), db=db)
    switch_on = run_replay(base, db=db)
    switch_off = run_replay(replace(base, without=(EXTERNAL_HIT_RUNNING_COW,)), db=db)

    patch = diff_runs(db, a.run_id, b.run_id)
    assert patch.metric("divergent_outputs").a == 0
    assert patch.metric("divergent_outputs").b > 0
    assert patch.divergent_requests["a"] == [] and patch.divergent_requests["b"]
    switch = diff_runs(db, switch_on.run_id, switch_off.run_id)
    assert switch.metric("divergent_outputs").b == patch.metric("divergent_outputs").b
    assert switch.divergent_requests["b"] == patch.divergent_requests["b"]  # the same requests, as often
    assert b.summary["table_disagreements"] == switch_off.summary["table_disagreements"] > 0
    assert a.summary["table_disagreements"] == 0
    # the hits themselves agree: the fix changes content, not what is found
    assert patch.requests is not None and (patch.requests.gained, patch.requests.lost) == (0, 0)
    assert a.summary["external_prefix_cache_hits"] == switch_on.summary["external_prefix_cache_hits"] > 0


def test_replay_backend_vllm_records_the_backend(vllm_api, tmp_path):
    """The CLI: the run's row in `kvtrace runs`, its config and summary, and every span's
    resource name the backend and the vLLM version and commit; the values the adapter
    inferred are marked per span (kvtrace.inferred), the others not."""
    from typer.testing import CliRunner

    from kvtrace.cli import app
    from kvtrace.engine.backends.vllm import vllm_commit

    db = tmp_path / "cli.duckdb"
    r = CliRunner().invoke(app, ["replay", TRACE, "--limit", "20", "--backend", "vllm", "--db", str(db), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["backend"] == "vllm" and summary["vllm_version"] == "0.33.0"
    runs = CliRunner().invoke(app, ["runs", "--db", str(db), "--json"])
    assert runs.exit_code == 0, runs.output
    (row,) = json.loads(runs.stdout)["runs"]
    assert row["backend"] == "vllm" and row["status"] == "complete"
    con = duckdb.connect(str(db), read_only=True)
    try:
        config = json.loads(con.execute("SELECT config FROM runs").fetchone()[0])
        resources = con.execute("SELECT DISTINCT resource_attributes FROM spans").fetchall()
        count = con.execute("SELECT count(*) FROM spans").fetchone()[0]
        marks = dict(con.execute("SELECT name, list(DISTINCT extra_attributes) FROM spans GROUP BY name").fetchall())
    finally:
        con.close()
    assert config["backend"] == "vllm" and config["vllm_version"] == "0.33.0"
    commit = vllm_commit()
    assert commit and config["vllm_commit"] == commit
    assert (row["vllm_version"], row["vllm_commit"]) == ("0.33.0", commit)
    assert count == summary["spans"] > 0
    assert resources == [({"kvtrace.backend": "vllm", "kvtrace.vllm.version": "0.33.0",
                           "kvtrace.vllm.commit": commit},)]
    assert marks["kvtrace.cache.publish"] == [{"kvtrace.inferred": '["kvtrace.publish.kind"]'}]
    assert marks["kvtrace.engine.step"] == [{"kvtrace.inferred": '["kvtrace.step.usage"]'}]  # kimi-hybrid: 2 groups
    assert marks["kvtrace.cache.free"] == marks["kvtrace.request"] == [None]


_FAKE_VERSION = ("import importlib.metadata as m, sys\n"
                 "real = m.version\n"
                 "def version(name):\n"
                 "    if name == 'vllm':\n"
                 "        {body}\n"
                 "    return real(name)\n"
                 "m.version = version\n"
                 "sys.argv = ['kvtrace', 'replay', 'gen:chat', '--limit', '2', '--backend', 'vllm', '--db', {db!r}]\n"
                 "from kvtrace.cli import main\n"
                 "main()\n")


@pytest.mark.parametrize("body, needle", [
    ("raise m.PackageNotFoundError(name)", "vLLM is not installed (kvtrace expects vLLM 0.33.0)"),
    ("return '0.31.2'", "vLLM 0.31.2 is installed; kvtrace expects vLLM 0.33.0"),
])
def test_replay_backend_vllm_without_a_usable_vllm(tmp_path, body, needle):
    """One line naming the version found and the one expected, exit 2, no run recorded
    (the store is not even created)."""
    db = tmp_path / "none.duckdb"
    code = _FAKE_VERSION.format(body=body, db=str(db))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and needle in lines[0], r.stderr
    assert r.stdout == "" and not db.exists()


def test_an_api_vllm_lacks_is_named(tmp_path, monkeypatch):
    """An installed 0.33.0 whose API was renamed (a user's branch): one line naming it."""
    from kvtrace.engine.backends.vllm import _load

    monkeypatch.setattr(_load, "_loaded", None)
    monkeypatch.setitem(_load._METHODS, "KVCacheManager", (*_load._METHODS["KVCacheManager"], "no_such_method"))
    from kvtrace.errors import KVTraceError

    with pytest.raises(KVTraceError, match=r"^vLLM 0\.33\.0: KVCacheManager\.no_such_method not found \(kvtrace "
                                           r"expects the API of vLLM 0\.33\.0\)$"):
        run_replay(RunSpec("gen:chat", limit=2, backend="vllm"), db=tmp_path / "x.duckdb")
    assert not (tmp_path / "x.duckdb").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--mode", "cache-only"], "--backend: vllm: applies to engine mode only"),
    (["--without", "shared-prefix-pinning"], "--without: shared-prefix-pinning: switches kvtrace's own behaviours"),
])
def test_settings_the_vllm_backend_refuses(tmp_path, capsys, argv, needle):
    from tests.cli.support import run

    db = tmp_path / "refused.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--backend", "vllm", "--db", str(db), *argv], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"kvtrace: error: {needle}"), err
    assert not db.exists()


def test_a_config_files_without_is_refused_as_the_flag_is(tmp_path, capsys):
    # the file's switch was ignored with the vLLM backend, and the run recorded as switched off
    from tests.cli.support import run

    cfg = tmp_path / "wo.toml"
    cfg.write_text('[cache]\nwithout = ["external-hit-running-cow"]\n')
    db = tmp_path / "refused.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--backend", "vllm", "--config", str(cfg),
                        "--db", str(db)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"kvtrace: error: {cfg}: cache.without: switches kvtrace's own behaviours"), err
    assert not db.exists()


def test_a_failure_inside_vllms_manager_is_one_line_and_a_failed_run(vllm_api, tmp_path, capsys):
    # vLLM 0.33's pool runs dry on an external hit here (kvtrace's manager completes): its
    # ValueError escaped as a traceback
    from kvtrace.store import read
    from tests.cli.support import run

    db = tmp_path / "v.duckdb"
    code, _, err = run(["replay", "gen:mixed", "--limit", "45", "--backend", "vllm", "--capacity-blocks", "40",
                        "--external-blocks", "5000", "--db", str(db)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "vLLM's KVCacheManager failed allocating for request" in lines[0] and "ValueError" in lines[0]
    assert "allocates an external (connector) load's Mamba blocks without counting them" in lines[0]
    assert read.runs(db)["status"].to_list() == ["failed"]


def test_the_demo_through_vllm_runs_on_a_pool_vllm_gets_through(vllm_api, tmp_path):
    """On the demo's 40-block pool vLLM 0.33 fails (the test above): `demo --backend vllm`
    replays all four runs on VLLM_DEMO_SETTINGS' pool instead, and says so in its title."""
    from io import StringIO

    from rich.console import Console

    from kvtrace.compare.demo import VLLM_DEMO_SETTINGS, run_demo
    from kvtrace.store import read

    out = StringIO()
    result = run_demo(tmp_path / "d.duckdb", progress=False, console=Console(file=out, width=250), backend="vllm")
    runs = read.runs(tmp_path / "d.duckdb")
    assert runs.height == 4 and set(runs["status"]) == {"complete"}
    assert [s.backend for s, _ in result.runs] == ["vllm", "kvtrace", "kvtrace", "kvtrace"]
    assert {s.capacity_blocks for s, _ in result.runs} == {VLLM_DEMO_SETTINGS["capacity_blocks"]}
    assert f"capacity_blocks={VLLM_DEMO_SETTINGS['capacity_blocks']}" in out.getvalue()
    assert result.runs[0][1].summary["divergent_outputs"] == 0


def test_vllms_manager_caches_its_environment_as_its_engine_core_does(vllm_api):
    """Both ways vLLM's manager is built here (conformance's reference, the engine
    backend) switch on vLLM's environment cache, as vLLM's EngineCore does once its
    scheduler is built: otherwise vLLM's KV-event code reads os.environ per event."""
    import vllm.envs

    from kvtrace.engine import get_preset
    from kvtrace.engine.backends.vllm import VllmKVCacheManager
    from kvtrace.engine.backends.vllm.engine_manager import VllmEngineManager

    config = get_preset("dense-attention").cache_config
    for build in (VllmKVCacheManager, VllmEngineManager):
        vllm.envs.disable_envs_cache()
        assert not vllm.envs._is_envs_cache_enabled()
        build(config, api=vllm_api)
        assert vllm.envs._is_envs_cache_enabled(), build.__name__


# A Mamba hit mid-block, then a final chunk that exports an internal checkpoint: vLLM 0.33's
# block-aligned split lets such a chunk run past the block end it starts in (its stop at the
# next block boundary is waived for internal checkpoints), so the slot holding the hit's
# copied state (after 20 tokens) is keyed at its block end (24) without that state ever
# being written. A later request resuming at 24 reads the wrong state.
MID_BLOCK_CONFIG = """[cache]
groups = [{ type = "full_attention", block_size = 8 }, { type = "mamba", block_size = 8 }]
num_gpu_blocks = 54
hash_block_size = 4
enable_partial_hits = true
num_prefill_checkpoint_blocks = 1
prefill_checkpoint_alignment = 4
"""


def _mid_block_trace(tmp_path) -> tuple[str, str]:
    shared = list(range(200, 220))  # 20 tokens: five 4-token hash blocks, two and a half Mamba blocks
    rows = [{"kvtrace_trace": 1},
            {"request_id": "a", "arrival_ns": 0, "input_length": 21, "output_length": 1,
             "token_ids": [*shared, 3000]},  # one chunk: its checkpoint after 20 tokens is published
            {"request_id": "b", "arrival_ns": 10**9, "input_length": 33, "output_length": 2,
             "token_ids": [*shared, *range(4000, 4013)]},  # hits 20; one chunk [20, 33) with a checkpoint at 32
            {"request_id": "c", "arrival_ns": 2 * 10**9, "input_length": 30, "output_length": 2,
             "token_ids": [*shared, *range(4000, 4004), *range(5000, 5006)]}]  # resumes at b's key at 24
    trace, config = tmp_path / "mid-block.jsonl", tmp_path / "mid-block.toml"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config.write_text(MID_BLOCK_CONFIG)
    return str(trace), str(config)


def test_a_stale_mamba_key_vllm_leaves_is_found_in_both_managers(vllm_api, tmp_path):
    """kvtrace's manager keys the same slot as vLLM's own, so both runs show it: the audit
    finds the stale key and the worker finds the resuming request's output divergent."""
    trace, config = _mid_block_trace(tmp_path)
    spec = RunSpec(trace, config_file=config, retention="none")
    ours = run_replay(spec)
    theirs = run_replay(replace(spec, backend="vllm"))
    for s in (ours.summary, theirs.summary):
        assert s["stale_hashes"] > 0 and s["divergent_outputs"] > 0, s
        assert s["table_disagreements"] == 0
    for key in ("stale_hashes", "divergent_outputs", "prefix_cache_hits", "publishes", "evictions"):
        assert ours.summary[key] == theirs.summary[key], key


def test_generated_agent_sessions_on_a_small_pool_show_it_on_both_backends(vllm_api, tmp_path):
    """The README's example of it with kimi-hybrid (Conformance): agent sessions, a 40-block
    pool in front of an external tier, a small step budget."""
    config = tmp_path / "small.toml"
    config.write_text("[scheduler]\nmax_num_batched_tokens = 1000\nmax_num_seqs = 4\n")
    spec = RunSpec("gen:agent", limit=10, seed=832, capacity_blocks=40, external_capacity_blocks=2000,
                   config_file=str(config))
    for backend in ("kvtrace", "vllm"):
        s = run_replay(replace(spec, backend=backend)).summary
        assert s["stale_hashes"] == 1 and s["table_disagreements"] == 0, (backend, s)


@pytest.mark.parametrize("argv, config, needle", [
    # vLLM's own check (after its import): the preset's partial hits, no longer expressible
    (["--block-size", "64"], None, "--block-size: 64: enable_partial_hits: vLLM 0.33 has fine-grained hits only"),
    ([], '[cache]\nhash_fn = "xxhash"\n', "{cfg}: cache.hash_fn: hash_fn 'xxhash'"),
    ([], "[cache]\nnum_gpu_blocks = [100, 100]\n", "{cfg}: cache.num_gpu_blocks: num_gpu_blocks per group"),
    ([], '[cache]\ngroups = [{ type = "sliding_window", block_size = 16, sliding_window = 32 }, '
         '{ type = "mamba", block_size = 16 }]\nhash_block_size = 16\n', "{cfg}: cache.groups: enable_partial_hits"),
])
def test_a_setting_vllm_cannot_express_is_named_where_it_was_set(vllm_api, tmp_path, capsys, argv, config, needle):
    # UnsupportedConfig named kvtrace's CacheConfig field only ("enable_partial_hits: ..."),
    # not the flag or file key the user set
    from tests.cli.support import assert_one_line, run

    cfg = tmp_path / "v.toml"
    if config is not None:
        cfg.write_text(config)
        argv = [*argv, "--config", str(cfg)]
    for command in ("replay", "conformance"):
        extra = ["--backend", "vllm"] if command == "replay" else []
        code, _, err = run([command, "gen:mixed", "--limit", "2", *extra, *argv], capsys)
        assert_one_line(code, err, "kvtrace: error: " + needle.format(cfg=cfg))


@pytest.mark.parametrize("capacity", [200, 60])
def test_an_eviction_by_another_groups_allocation_is_lru(vllm_api, capacity):
    """One pool for every group: a block a full-attention key left is reused for a Mamba
    state. The adapter looked for the block among the key's own group's new blocks only and
    inferred `replaced` (at 200 blocks 123 lru, 208 replaced where kvtrace's manager says 279
    and 52). At 60, a key on two blocks, one evicted and keyed alike again within the call,
    was taken for the other block's (6 evictions named the wrong block, then `replaced`)."""
    spec = RunSpec("gen:mixed", capacity_blocks=capacity, content=False)
    ours, theirs = run_replay(spec), run_replay(replace(spec, backend="vllm"))
    assert theirs.summary["evictions_by_reason"] == ours.summary["evictions_by_reason"]
    assert ours.summary["evictions_by_reason"]["lru"] > 0
