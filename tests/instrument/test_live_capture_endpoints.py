"""``capture vllm``'s endpoints: one address given for two of the server's sockets is refused
in one line before anything is recorded (a replay request sent to a PUB socket is never
answered: every gap waited out its timeout and was counted lost)."""

from __future__ import annotations

import re

import pytest

from kvtrace.errors import ConfigError
from kvtrace.instrument.vllm.endpoints import capture_endpoints
from tests.cli.support import assert_one_line, run


@pytest.mark.parametrize("endpoint, replay, dp_size, needle", [
    ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557", 1, "is --endpoint too"),
    ("ipc:///tmp/kv", "ipc:///tmp/kv", 1, "is --endpoint too"),
    # two names of the loopback interface, or of one host in two cases: one socket
    ("tcp://localhost:5557", "tcp://127.0.0.1:5557", 1, "is --endpoint too"),
    ("tcp://[::1]:5557", "tcp://LocalHost:5557", 1, "is --endpoint too"),
    ("tcp://vllm-host:5557", "tcp://VLLM-HOST:5558", 2, "where rank 1 publishes"),
    # a port with a leading zero, a name's trailing dot, an address in another spelling
    ("tcp://localhost:5557", "tcp://127.0.0.1:05557", 1, "is --endpoint too"),
    ("tcp://localhost:5557", "tcp://localhost.:5557", 1, "is --endpoint too"),
    ("tcp://localhost:5557", "tcp://[::ffff:127.0.0.1]:5557", 1, "is --endpoint too"),
    ("tcp://[::1]:5557", "tcp://[0:0:0:0:0:0:0:1]:5557", 1, "is --endpoint too"),
    # rank 1 publishes at 5558, where rank 0 answers replays
    ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 2, "DP rank 0 would answer replays at tcp://127.0.0.1:5558, "
                                                        "where rank 1 publishes"),
    ("tcp://127.0.0.1:5560", "tcp://127.0.0.1:5557", 4, "DP rank 3 would answer replays at tcp://127.0.0.1:5560, "
                                                        "where rank 0 publishes"),
])
def test_one_address_for_two_sockets_is_refused(endpoint, replay, dp_size, needle):
    with pytest.raises(ConfigError, match=re.escape(f"--replay-endpoint: {replay}: ") + ".*" + re.escape(needle)):
        capture_endpoints(endpoint, replay, None, dp_size)


def test_distinct_addresses_are_every_ranks_own():
    assert capture_endpoints("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600", None, 3) == [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600"), ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5601"),
        ("tcp://127.0.0.1:5559", "tcp://127.0.0.1:5602")]
    assert capture_endpoints("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559", None, 2)[1] == (
        "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5560")
    # another host at the same port is another socket
    assert capture_endpoints("tcp://127.0.0.1:5557", "tcp://10.0.0.2:5557", None, 1) == [
        ("tcp://127.0.0.1:5557", "tcp://10.0.0.2:5557")]


def test_the_command_says_so_in_one_line_and_records_nothing(tmp_path, capsys):
    code, _, err = run(["capture", "vllm", "--endpoint", "tcp://127.0.0.1:5557", "--replay-endpoint",
                        "tcp://127.0.0.1:5557", "--db", str(tmp_path / "c.duckdb"), "--duration", "1"], capsys)
    assert_one_line(code, err, "--replay-endpoint: tcp://127.0.0.1:5557: is --endpoint too")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("endpoint", ["tcp://localhost:\u00b2", "tcp://localhost:\u0665\u0665\u0665\u0667"])
def test_a_port_of_other_digits_is_one_line(tmp_path, capsys, endpoint):
    # a superscript two was a ValueError and a traceback; Arabic-Indic digits reached ZMQ
    code, _, err = run(["capture", "vllm", "--endpoint", endpoint, "--db", str(tmp_path / "c.duckdb"),
                        "--duration", "0.5"], capsys)
    assert_one_line(code, err, "--endpoint: ", "expected tcp://HOST:PORT")


def test_an_ipc_endpoint_with_more_than_one_dp_rank_is_refused(tmp_path, capsys):
    """vLLM 0.33's publisher offsets only tcp ports and inproc names by the DP rank: an ipc
    path on a rank above 0 raised ValueError there, while the capture waited at PATH_dp1 for
    a rank that could not start, and said only that it was never reached."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    with pytest.raises(ValueError, match="Invalid endpoint"):  # (vLLM's own rule, as this check reads it)
        ZmqEventPublisher.offset_endpoint_port(f"ipc://{tmp_path}/kv", 1)
    assert ZmqEventPublisher.offset_endpoint_port("tcp://127.0.0.1:5557", 1) == "tcp://127.0.0.1:5558"
    db = tmp_path / "s.duckdb"
    for args, option in ((["--endpoint", f"ipc://{tmp_path}/kv", "--dp-size", "2"], "--endpoint"),
                         (["--endpoint", "tcp://127.0.0.1:5557", "--replay-endpoint", f"ipc://{tmp_path}/r",
                           "--dp-size", "3"], "--replay-endpoint")):
        code, _, err = run(["capture", "vllm", "--db", str(db), *args, "--duration", "0"], capsys)
        line = assert_one_line(code, err, "vLLM publishes an ipc endpoint for DP rank 0 only")
        assert line.startswith(f"kvtrace: error: {option}: ipc://{tmp_path}/"), line
    assert not db.exists()
    assert capture_endpoints(f"ipc://{tmp_path}/kv", None, None, 1) == [(f"ipc://{tmp_path}/kv", None)]
    # (vLLM offsets any endpoint holding "inproc" as a name: an ipc path with it is every rank's)
    odd = f"ipc://{tmp_path}/inproc.sock"
    assert ZmqEventPublisher.offset_endpoint_port(odd, 1) == f"{odd}_dp1"
    assert capture_endpoints(odd, None, None, 2) == [(odd, None), (f"{odd}_dp1", None)]
