"""IPv6 addresses, served and reached: ``collect --host ::1`` (socketserver bound only IPv4,
so "::1" was refused with "Address family for hostname not supported"; the printed URL
and gRPC target bracket it as clients must write it), and ``capture vllm`` at tcp://[::1]."""

from __future__ import annotations

import pytest

from kvtrace.instrument.otlp.collector import OTLPCollector
from kvtrace.instrument.otlp.limits import bracketed, is_ipv6, unbracketed
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import read

SPEC = RunSpec("gen:chat", limit=3, mode="cache-only", capacity_blocks=30)


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_ipv6_hosts_are_told_apart_from_names_and_ipv4():
    assert is_ipv6("::1") and is_ipv6("[::1]") and is_ipv6("fe80::1%eth0")
    assert not is_ipv6("127.0.0.1") and not is_ipv6("localhost") and not is_ipv6("")
    assert bracketed("::1") == "[::1]" and bracketed("[::1]") == "[::1]" and bracketed("10.0.0.1") == "10.0.0.1"
    assert unbracketed("[::1]") == "::1" and unbracketed("::1") == "::1"


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback to serve on")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_collector_on_an_ipv6_address_serves_both_transports(tmp_path, monkeypatch, host, protocol):
    db = tmp_path / "collected.duckdb"
    collector = OTLPCollector(db, host=host, port=0, grpc_port=0).start()
    assert collector.url.startswith("http://[::1]:") and collector.grpc_target.startswith("[::1]:")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    if protocol == "grpc":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        endpoint = collector.grpc_target
    else:
        endpoint = collector.url.removesuffix("/v1/traces")
    try:
        result = run_replay(SPEC, otlp_endpoint=endpoint)
    finally:
        collector.stop()
    assert result.undelivered is None, result.undelivered
    got = read.run(db, result.otlp_run_id)
    assert got["status"] == "complete" and got["summary"]["requests"] == 3


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback to serve on")
def test_capture_reaches_a_publisher_on_an_ipv6_address_and_its_replay_socket(tmp_path):
    """``capture vllm --endpoint tcp://[::1]:PORT``: ZMQ connects to an IPv6 address only
    with its IPV6 option set; without it the capture waited, deaf, for --duration."""
    from tests.instrument.test_vllm_capture import LEGACY, _capture_during
    from tests.instrument.vllm_publisher import VllmPublisher

    EventBatch, BlockStored, _, _ = LEGACY

    def body(pub):
        for k in range(1, 5):  # seq 2 dropped: a gap only the replay socket can fill
            batch = EventBatch(1_700_000_000.0 + k, [BlockStored([k + 1], k, [k] * 4, 4, None, "GPU", None)], 0)
            pub.publish(batch, send=k != 2)

    pub = VllmPublisher(host="[::1]")
    stats = _capture_during(tmp_path, pub, body, lambda cap: cap.stats.batches >= 5)
    assert pub.endpoint.startswith("tcp://[::1]:")
    assert stats.batches == 5 and stats.recovered == 1 and stats.lost == 0, stats
