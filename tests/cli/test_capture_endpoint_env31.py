"""``capture vllm`` with an ipc:// endpoint whose path a Unix socket's address cannot hold
(probe env31): ZMQ's connect refused it ('File name too long') only once the capture had made
its store and run, which stayed behind as a failed run. Refused first, in one line, nothing
written."""

from __future__ import annotations

import pytest

from tests.cli.support import assert_one_line, run


@pytest.mark.parametrize("option", ["--endpoint", "--replay-endpoint"])
def test_an_ipc_path_past_a_sockets_address_is_refused_first(tmp_path, capsys, option):
    db = tmp_path / "cap.duckdb"
    long_path = "ipc:///tmp/" + "z" * 200
    endpoints = {"--endpoint": "tcp://127.0.0.1:5557", option: long_path}
    argv = ["capture", "vllm", "--db", str(db), "--duration", "1"]
    for name, value in endpoints.items():
        argv += [name, value]
    code, out, err = run(argv, capsys)
    assert_one_line(code, err, option, "the socket path is 205 bytes, past the 107")
    assert not out and not db.exists()


def test_a_multibyte_path_counts_its_bytes(tmp_path, capsys):
    db = tmp_path / "cap.duckdb"
    code, _, err = run(["capture", "vllm", "--db", str(db), "--duration", "1",
                        "--endpoint", "ipc:///tmp/" + "é" * 60], capsys)  # (65 characters, 125 bytes)
    assert_one_line(code, err, "125 bytes")
    assert not db.exists()
