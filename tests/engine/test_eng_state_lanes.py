"""Mamba groups of different ``num_lanes``: the content model advances one recurrent state a
request and writes it to every state group, so content mode cannot hold them. The worker
refused them with a ValueError: a traceback and exit 1 from ``kvtrace replay --config``,
after the run was recorded as failed."""

from __future__ import annotations

import pytest

from kvtrace.cache import FullAttentionSpec, MambaSpec
from kvtrace.engine import Engine, get_preset
from kvtrace.errors import ConfigError
from kvtrace.workload import TraceRequest
from tests.cli.support import assert_one_line, run

GROUPS = ('groups = [{type = "full_attention", block_size = 64}, {type = "mamba", block_size = 64}, '
          '{type = "mamba", block_size = 64, num_lanes = 8}]')


def test_the_engine_refuses_them_as_a_config_error():
    preset = get_preset("kimi-hybrid", groups=(FullAttentionSpec(64), MambaSpec(64), MambaSpec(64, num_lanes=2)))
    with pytest.raises(ConfigError, match="state lanes: expected one num_lanes for every Mamba group") as info:
        Engine(preset).run([TraceRequest("a", 0, 100, 2, hash_ids=(1, 2), hash_block_size=64)])
    assert info.value.what.endswith("got 2, 4")
    # one value for all of them is what the content model holds: that runs
    same = get_preset("kimi-hybrid", groups=(FullAttentionSpec(64), MambaSpec(64, num_lanes=8),
                                             MambaSpec(64, num_lanes=8)))
    result = Engine(same).run([TraceRequest("a", 0, 100, 2, hash_ids=(1, 2), hash_block_size=64)])
    assert result.summary["requests"] == 1 and result.summary["divergent_outputs"] == 0


def test_replay_names_the_file_key_before_anything_is_recorded(tmp_path, capsys):
    config = tmp_path / "lanes.toml"
    config.write_text(f"[cache]\n{GROUPS}\n")
    db = tmp_path / "runs.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--preset", "kimi-hybrid", "--config", str(config),
                        "--db", str(db)], capsys)
    assert_one_line(code, err, f"{config}: cache.groups: ", "expected one num_lanes for every Mamba group",
                    "got 4, 8")
    assert not db.exists()


def test_a_pool_the_file_sets_too_is_not_blamed(tmp_path, capsys):
    # the lanes are the groups' alone: it said `cache.groups / cache.num_gpu_blocks`
    config = tmp_path / "lanes.toml"
    config.write_text(f"[cache]\nnum_gpu_blocks = 300\n{GROUPS}\n")
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(config)], capsys)
    assert_one_line(code, err, f"{config}: cache.groups: KV storage of state lanes: ")
    assert "num_gpu_blocks" not in err


def test_storage_too_large_for_memory_names_what_makes_it():
    """Lanes no flag sets made the storage too large, and the error said to lower --block-size or
    the capacity; a pool of large blocks still names those."""
    from kvtrace.cache import CacheConfig
    from kvtrace.engine.memory import check_storage_fits

    lanes = CacheConfig(groups=(FullAttentionSpec(64), MambaSpec(64, num_lanes=2**62)), num_gpu_blocks=100,
                        hash_block_size=64)
    with pytest.raises(ConfigError, match=r"lower num_lanes of the Mamba groups in --config$"):
        check_storage_fits(lanes, "cpu")
    blocks = CacheConfig(groups=(FullAttentionSpec(2**34), MambaSpec(2**34)), num_gpu_blocks=100, hash_block_size=64)
    with pytest.raises(ConfigError, match="lower --block-size or --capacity-blocks") as info:
        check_storage_fits(blocks, "cpu")
    assert "num_lanes" not in str(info.value)
