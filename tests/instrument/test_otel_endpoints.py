"""``--otlp-endpoint`` URLs as a user types them: the traces path goes where a URL's path
goes, and an address nothing can be sent to is refused before anything is recorded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kvtrace.errors import ConfigError
from kvtrace.instrument.otlp.collector import OTLPCollector
from kvtrace.instrument.pipeline import traces_url
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import read

SPEC = RunSpec("gen:chat", limit=3, mode="cache-only", capacity_blocks=30)


def test_the_traces_path_goes_before_a_query_or_fragment():
    # it was appended after them, so it became part of the query (or was never sent)
    assert traces_url("http://c:4318?tenant=a") == "http://c:4318/v1/traces?tenant=a"
    assert traces_url("http://c:4318/?tenant=a") == "http://c:4318/v1/traces?tenant=a"
    assert traces_url("http://c:4318#top") == "http://c:4318/v1/traces#top"
    assert traces_url("http://[::1]:4318") == "http://[::1]:4318/v1/traces"
    assert traces_url("http://c:4318/otlp/v1/traces?x=1") == "http://c:4318/otlp/v1/traces?x=1"


def test_a_collector_url_with_a_query_is_delivered_to(tmp_path):
    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=None).start()
    try:
        result = run_replay(SPEC, otlp_endpoint=f"{collector.url.removesuffix('/v1/traces')}?tenant=a")
    finally:
        collector.stop()
    assert result.undelivered is None  # was: every span refused with a 404
    got = read.run(tmp_path / "collected.duckdb", result.otlp_run_id)
    assert got["status"] == "complete" and got["summary"]["requests"] == 3


@pytest.mark.parametrize("url", ["http://127.0.0.1:", "http://127.0.0.1:0", "http://[::1]:0", "https://c:0/v1/traces"])
def test_a_port_nothing_can_be_sent_to_is_refused_before_the_run(tmp_path, url):
    db = tmp_path / "local.duckdb"
    with pytest.raises(ConfigError, match=re.escape(f"--otlp-endpoint: {url}: expected a port from 1 to 65535")):
        run_replay(SPEC, db=str(db), otlp_endpoint=url)
    assert not db.exists() or read.runs(db).is_empty()  # (was: the whole replay, then exit 1)


def test_a_collector_that_keeps_answering_503_is_named_without_a_retry_to_come(tmp_path, monkeypatch):
    """The reason named the SDK's note of its next try ("..., retrying in 0.95s.") in the line
    that says the spans were not delivered, after the last try."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "3")  # (room for a first retry: its 1 s backoff +-20%)
    try:
        result = run_replay(SPEC, db=str(tmp_path / "local.duckdb"), otlp_endpoint=f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert result.undelivered is not None and "spans were not delivered" in result.undelivered
    assert "Service Unavailable" in result.undelivered and "retrying" not in result.undelivered
    assert read.run(tmp_path / "local.duckdb", result.run_id)["status"] == "complete"  # the store's copy is whole


@pytest.mark.parametrize("target", ["tracer:s3cret@collector:99999", "tracer:s3@cr3t@collector:x"])
def test_a_grpc_target_with_a_password_is_refused_without_showing_it(tmp_path, capsys, monkeypatch, target):
    """A gRPC target without a scheme escaped the error line's URL masking."""
    from tests.cli.support import run

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", target)
    code, _out, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db",
                           str(tmp_path / "local.duckdb")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "OTEL_EXPORTER_OTLP_ENDPOINT: tracer:***@collector:" in err and "s3" not in err and "cr3t" not in err
    assert not (tmp_path / "local.duckdb").exists()  # refused before the store was made


@pytest.mark.parametrize(("env", "value", "flag"), [
    (None, "tracer:s3cret@collector:4318", True),  # OTLP/HTTP, the flag
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "tracer:s3cret@collector:0", False),  # OTLP/HTTP, a variable
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "tracer:s3 cr3t@collector:99999", False),  # gRPC: a space in it
])
def test_an_endpoint_without_a_scheme_never_shows_its_password(tmp_path, capsys, monkeypatch, env, value, flag):
    """e149025 masked the gRPC form to the first space; OTLP/HTTP's refusal quoted it whole."""
    from tests.cli.support import run

    argv = ["replay", "gen:chat", "--limit", "2", "--mode", "cache-only"]
    if flag:
        argv += ["--otlp-endpoint", value]
    elif env == "OTEL_EXPORTER_OTLP_PROTOCOL":
        monkeypatch.setenv(env, "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", value)
    else:
        monkeypatch.setenv(env, value)
    code, _out, err = run(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "tracer:***@collector:" in err and "s3" not in err and "cr3t" not in err, err


def test_the_base_endpoint_variable_with_a_query_is_delivered_to(tmp_path, monkeypatch):
    # the SDK appended v1/traces after the query: every span a 404, after the whole replay
    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=None).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"{collector.url.removesuffix('/v1/traces')}?tenant=a")
        result = run_replay(SPEC)
    finally:
        collector.stop()
    assert result.undelivered is None
    assert read.run(tmp_path / "collected.duckdb", result.otlp_run_id)["summary"]["requests"] == 3


def test_the_traces_endpoint_variable_without_a_path_is_refused_before_the_run(tmp_path, monkeypatch):
    # the SDK posts to it as given (the spec's rule for the traces variable): a 404 for every span
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318")
    db = tmp_path / "local.duckdb"
    with pytest.raises(ConfigError, match=re.escape("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: http://127.0.0.1:4318: "
                                                    "the traces variable is the whole URL")):
        run_replay(SPEC, db=str(db))
    assert not db.exists() or read.runs(db).is_empty()


def test_the_flag_takes_a_grpc_host_port_target_as_the_variables_do(tmp_path, capsys, monkeypatch):
    """Under gRPC, --otlp-endpoint HOST:PORT was refused as no http(s) URL, though the
    endpoint variables took it; a TLS failure against the plaintext collector says what to do."""
    from tests.cli.support import run
    from tests.instrument.helpers import count_spans

    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=0).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    argv = ["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--otlp-endpoint", collector.grpc_target]
    try:
        # TLS (no INSECURE) against a plaintext collector, in a process of its own: gRPC's C
        # core logged each handshake on stderr (fd 2) beside the error line
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], capture_output=True, text=True,
                              env=env, check=False, timeout=120)
        err = proc.stderr.strip()
        assert proc.returncode == 1 and len(err.splitlines()) == 1, err
        assert "not delivered (TLS handshake failed: the collector speaks no TLS; over gRPC a HOST:PORT" in err, err
        assert "OTEL_EXPORTER_OTLP_INSECURE=true" in err and "SSL_ERROR" not in err
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        code, out, err = run([*argv, "--json"], capsys)
        assert code == 0, err
    finally:
        collector.stop()
    summary = json.loads(out)
    assert "otlp_spans_undelivered" not in summary, summary
    assert count_spans(tmp_path / "collected.duckdb", summary["otlp_run_id"]) > 0


@pytest.mark.parametrize("spec", [
    # an external load's copy has no source block (copy_src -1): refused by 9c29954's bounds
    RunSpec("gen:mixed", limit=40, capacity_blocks=40, external_capacity_blocks=4096),
    # the tier's own evictions carry block id -1 (a dense preset's tier fills and evicts: 40 requests
    # overflow a 400-block tier some 440 times)
    RunSpec("gen:chat", limit=40, preset="dense-attention", capacity_blocks=300, external_capacity_blocks=400),
    # vLLM says no block's last use (idle -1): refused since idle was bounded at 0
    RunSpec("gen:mixed", limit=20, capacity_blocks=60, backend="vllm"),
    RunSpec("gen:agent", limit=6, mode="cache-only", capacity_blocks=30),
])
def test_every_span_a_replay_makes_is_one_kvtraces_collector_takes(tmp_path, spec):
    if spec.backend == "vllm":
        pytest.importorskip("vllm", reason="the vllm backend needs vLLM (make vllm)")
    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=None).start()
    try:
        result = run_replay(spec, otlp_endpoint=collector.url)
    finally:
        collector.stop()
    assert result.undelivered is None, result.undelivered
    got = read.run(tmp_path / "collected.duckdb", result.otlp_run_id)
    assert got["status"] == "complete" and got["num_spans"] == result.summary["spans"] > 0


@pytest.mark.parametrize("target", ["dns:", "unix:", "dns:///", "ipv4: "])
def test_an_empty_grpc_target_is_refused_before_the_run(tmp_path, capsys, monkeypatch, target):
    """It passed the check: the whole replay ran, then every span was undelivered (exit 1)."""
    from tests.cli.support import run

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    code, _out, err = run(["replay", "gen:chat", "--limit", "2", "--otlp-endpoint", target], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "expected a target after" in err, err


@pytest.mark.parametrize("endpoint, secret", [
    ("http://u:s3cret@127.0.0.1:1", "s3cret"),
    ("http://u:p%40ss@nohost.invalid:4317", "p@ss"),  # (gRPC quotes the target URL-decoded)
    ("dns:///u:s3cret@nohost.invalid:4317", "s3cret"),  # (no scheme's //: the user part after the path)
])
def test_a_grpc_failure_that_quotes_the_target_never_shows_its_password(tmp_path, capsys, monkeypatch, endpoint,
                                                                         secret):
    """gRPC's reason quoted the target whole: "errors resolving u:secret@127.0.0.1:1"."""
    from tests.cli.support import run

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    code, _out, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--otlp-endpoint",
                           endpoint], capsys)
    assert code == 1 and "not delivered" in err and secret not in err and "***@" in err, err
    assert secret.replace("@", "%40") not in err
