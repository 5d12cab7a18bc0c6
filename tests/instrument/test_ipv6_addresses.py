"""IPv6 addresses, served and reached: ``collect --host ::1`` (socketserver bound only IPv4,
so "::1" was refused with "Address family for hostname not supported"; the printed URL
and gRPC target bracket it as clients must write it), and ``capture vllm`` at tcp://[::1]."""

from __future__ import annotations

import re

import pytest

from kvtrace.instrument.otlp.collector import OTLPCollector
from kvtrace.process import bracketed, is_ipv6, unbracketed
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


def test_an_ipv6_endpoint_without_brackets_is_refused_with_the_spelling_that_works():
    """tcp://::1:5557 was taken, and ZMQ never reached it: the capture waited --duration out."""
    from kvtrace.errors import ConfigError
    from kvtrace.instrument.vllm.endpoints import capture_endpoints

    with pytest.raises(ConfigError, match=r"an IPv6 address goes in brackets: tcp://\[::1\]:5557"):
        capture_endpoints("tcp://::1:5557", None, 1.0, 1)
    assert capture_endpoints("tcp://[::1]:5557", "tcp://[::1]:6557", 1.0, 2)[1] == ("tcp://[::1]:5558", "tcp://[::1]:6558")


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback to serve on")
def test_a_busy_ipv6_port_is_named_as_a_url_names_it(tmp_path):
    import socket

    from kvtrace.errors import KVTraceError

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as busy:
        busy.bind(("::1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(KVTraceError, match=rf"cannot listen on \[::1\]:{port} \(OTLP/HTTP\)"):
            OTLPCollector(tmp_path / "c.duckdb", host="::1", port=port, grpc_port=None)


@pytest.mark.parametrize(("endpoint", "said"), [
    ("tcp://::1", "expected tcp://HOST:PORT (an IPv6 address in brackets"),  # (it suggested tcp://[:]:1)
    ("tcp://[]:5557", "[] is no IPv6 address"),  # (ran, and recorded that nothing came)
    ("tcp://[gg::1]:5557", "[gg::1] is no IPv6 address"),
])
def test_an_ipv6_endpoint_that_is_no_address_is_refused(endpoint, said):
    from kvtrace.errors import ConfigError
    from kvtrace.instrument.vllm.endpoints import capture_endpoints

    with pytest.raises(ConfigError, match=re.escape(said)):
        capture_endpoints(endpoint, None, 1.0, 1)


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback to serve on")
def test_dashboard_takes_a_bracketed_ipv6_host_as_collect_does():
    """dashboard --host '[::1]' said 'cannot listen on [::1]:0: Name or service not known'."""
    import socket

    from kvtrace.dashboard import check_address

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:  # (a port free a moment ago)
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    check_address("[::1]", port)
    check_address("::1", port)
