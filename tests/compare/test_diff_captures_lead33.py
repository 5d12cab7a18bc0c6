"""``kvtrace diff`` of two live captures of other servers: they come from different sources, they
replay no trace (live33's report: 'runs r1 and r2 replay different traces')."""

from __future__ import annotations

import warnings

from typer.testing import CliRunner

from kvtrace.cli import app
from tests.cli.support import assert_one_line, run

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # requests' charset warning on import
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher


def _capture(tmp_path, name: str, db) -> None:
    pub_ep = f"ipc://{tmp_path}/{name}"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=None, topic="")
    try:
        pub.publish(KVEventBatch(ts=1_700_000_000.0, events=[BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[1] * 16, block_size=16, lora_id=None,
            medium="GPU", lora_name=None)]))
        result = CliRunner().invoke(app, ["capture", "vllm", "--endpoint", pub_ep, "--db", str(db),
                                          "--duration", "1"])
    finally:
        pub.shutdown()
    assert result.exit_code == 0, result.output


def test_two_captures_of_other_servers_come_from_different_sources(tmp_path, capsys):
    db = tmp_path / "s.duckdb"
    _capture(tmp_path, "a", db)
    _capture(tmp_path, "b", db)
    capsys.readouterr()
    code, _, err = run(["diff", "r1", "r2", "--db", str(db)], capsys)
    line = assert_one_line(code, err, "runs r1 and r2 come from different sources (", "--force")
    assert "replay" not in line
    code, out, err = run(["diff", "r1", "r2", "--db", str(db), "--force"], capsys)
    assert code == 0 and "Times: none (a live capture" in out, err
