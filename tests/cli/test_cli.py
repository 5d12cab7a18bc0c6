"""The ``kvtrace`` command end to end, as a user runs it (real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from tests.conftest import TRACES

KVTRACE = [sys.executable, "-m", "kvtrace.cli"]
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"


def kvtrace(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONHASHSEED="random", COLUMNS="200")
    return subprocess.run([*KVTRACE, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600,
                          check=False)


def test_replay_json_is_identical_across_processes():
    args = ("replay", "gen:mixed", "--limit", "25", "--json")
    a, b = kvtrace(*args), kvtrace(*args)
    assert a.returncode == 0, a.stderr
    sa = json.loads(a.stdout)
    assert a.stdout == b.stdout
    assert len(sa["digest"]) == 64
    for key in (
        "requests",
        "prompt_tokens",
        "prefix_cache_hits",
        "prefix_cache_hit_rate",
        "block_hit_rate",
        "p50_ttft_ms",
        "p99_ttft_ms",
        "p50_itl_ms",
        "p99_itl_ms",
        "publishes",
        "evictions",
        "cow_copies",
        "stale_hashes",
        "divergent_outputs",
        "preemptions",
        "digest",
    ):
        assert key in sa, key
    assert sa["requests"] == 25
    assert 0 < sa["prefix_cache_hit_rate"] < 1
    assert sa["stale_hashes"] == 0 and sa["divergent_outputs"] == 0


def test_behaviour_switch_changes_the_digest():
    on = json.loads(kvtrace("replay", "gen:mixed", "--limit", "25", "--json").stdout)
    off = json.loads(
        kvtrace("replay", "gen:mixed", "--limit", "25", "--json", "--without", "shared-prefix-pinning").stdout
    )
    assert on["digest"] != off["digest"]


def test_cache_only_on_mooncake_with_belady_bound():
    lru = kvtrace("replay", str(MOONCAKE), "--mode", "cache-only", "--capacity-blocks", "5859", "--limit", "400",
                  "--json")
    assert lru.returncode == 0, lru.stderr
    bel = kvtrace("replay", str(MOONCAKE), "--mode", "cache-only", "--policy", "belady", "--capacity-blocks", "5859",
                  "--limit", "400", "--json")
    s_lru, s_bel = json.loads(lru.stdout), json.loads(bel.stdout)
    assert s_lru["requests"] == s_bel["requests"] == 400
    assert 0 < s_lru["prefix_cache_hit_rate"] <= s_bel["prefix_cache_hit_rate"] < 1


def test_replay_records_run_into_duckdb(tmp_path):
    db = tmp_path / "runs.duckdb"
    res = kvtrace("replay", "gen:mixed", "--limit", "15", "--db", str(db), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    con = duckdb.connect(str(db), read_only=True)
    try:
        status, digest = con.execute("SELECT status, digest FROM runs").fetchone()
        n_spans = con.execute("SELECT count(*) FROM otel_traces").fetchone()[0]
    finally:
        con.close()
    assert status == "complete"
    assert digest == summary["digest"]
    assert n_spans == summary["spans"] > 0


def test_cache_only_run_stores_trace_ids_as_block_hashes(tmp_path):
    # cache-only keys blocks by trace id: the stored hashes must name the trace's own ids
    db = tmp_path / "co.duckdb"
    res = kvtrace("replay", str(MOONCAKE), "--mode", "cache-only", "--capacity-blocks", "5859", "--limit", "3",
                  "--db", str(db), "--json")
    assert res.returncode == 0, res.stderr
    first = json.loads(MOONCAKE.read_text().splitlines()[0])["hash_ids"]
    con = duckdb.connect(str(db), read_only=True)
    try:
        stored = con.execute("SELECT block_hashes FROM spans WHERE name = 'kvtrace.cache.publish' "
                             "ORDER BY start_ns, seq LIMIT 1").fetchone()[0]
    finally:
        con.close()
    assert stored == [f"{i:016x}" for i in first]


def test_bad_trace_line_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = MOONCAKE.read_text().splitlines()[:3]
    bad.write_text("\n".join(good + ['{"timestamp": 5, "input_length": "x"}']) + "\n")
    res = kvtrace("replay", str(bad), "--format", "mooncake", "--json")
    assert res.returncode != 0
    err = res.stderr.strip().splitlines()
    assert len(err) == 1, res.stderr
    assert "bad.jsonl:4" in err[0]
    assert "Traceback" not in res.stderr


def test_bad_config_key_names_file_and_key(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[cache]\nretention_intervall = 0\n")
    res = kvtrace("replay", "gen:mixed", "--limit", "2", "--config", str(cfg))
    assert res.returncode != 0
    assert "run.toml" in res.stderr and "cache.retention_intervall" in res.stderr
    assert "Traceback" not in res.stderr


def test_config_file_overrides_preset(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[cache]\nwithout = ["shared-prefix-pinning"]\n')
    via_file = json.loads(kvtrace("replay", "gen:mixed", "--limit", "25", "--json", "--config", str(cfg)).stdout)
    via_flag = json.loads(
        kvtrace("replay", "gen:mixed", "--limit", "25", "--json", "--without", "shared-prefix-pinning").stdout
    )
    assert via_file["digest"] == via_flag["digest"]


def test_unknown_behaviour_is_rejected():
    res = kvtrace("replay", "gen:mixed", "--limit", "2", "--without", "no-such-thing")
    assert res.returncode != 0
    assert "no-such-thing" in res.stderr and "Traceback" not in res.stderr


def test_missing_trace_file():
    res = kvtrace("replay", "/nonexistent/trace.jsonl")
    assert res.returncode != 0
    assert "/nonexistent/trace.jsonl" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("fmt", ["native", "mooncake"])
def test_generate_then_replay(tmp_path, fmt):
    out = tmp_path / f"w.{fmt}.jsonl"
    res = kvtrace("generate", "chat", "-o", str(out), "--format", fmt, "--requests", "12")
    assert res.returncode == 0, res.stderr
    rep = kvtrace("replay", str(out), "--json", "--preset", "dense-attention")
    assert rep.returncode == 0, rep.stderr
    assert json.loads(rep.stdout)["requests"] == 12


def test_diff_markdown_and_fail_if_gate(replayed_store):
    db, on, off = replayed_store.path, replayed_store.run_on, replayed_store.run_off
    md = kvtrace("diff", on, off, "--db", db, "--markdown")
    assert md.returncode == 0, md.stderr
    assert "| prefix_cache_hit_rate |" in md.stdout
    # B (pinning off) loses the system prompts' hits: a gate on the hit rate must fail the build.
    gated = kvtrace("diff", on, off, "--db", db, "--fail-if", "prefix_cache_hit_rate:-0.01")
    assert gated.returncode == 1
    assert "prefix_cache_hit_rate" in gated.stderr
    assert kvtrace("diff", off, on, "--db", db, "--fail-if", "prefix_cache_hit_rate:-0.01").returncode == 0


def test_diff_refuses_different_traces(tmp_path, replayed_store):
    import shutil

    db = tmp_path / "two.duckdb"
    shutil.copy(replayed_store.path, db)
    other = kvtrace("replay", "gen:chat", "--limit", "5", "--db", str(db), "--json")
    assert other.returncode == 0, other.stderr
    res = kvtrace("diff", replayed_store.run_on, "r3", "--db", str(db))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "trace" in res.stderr.lower()
    assert kvtrace("diff", replayed_store.run_on, "r3", "--db", str(db), "--force", "--json").returncode == 0


def test_export_parquet(tmp_path, replayed_store):
    import polars as pl

    out = tmp_path / "pq"
    res = kvtrace("export", "--db", replayed_store.path, "--run", replayed_store.run_on, "--parquet", str(out))
    assert res.returncode == 0, res.stderr
    files = sorted(out.rglob("*.parquet"))
    assert files
    spans = pl.concat([pl.read_parquet(f) for f in files if "span" in f.name], how="diagonal_relaxed")
    assert spans.height == replayed_store.summary_on["spans"]


def test_convert_to_native_keeps_requests(tmp_path):
    out = tmp_path / "native.jsonl"
    res = kvtrace("convert", str(MOONCAKE), "-o", str(out), "--limit", "30")
    assert res.returncode == 0, res.stderr
    a = json.loads(kvtrace("replay", str(MOONCAKE), "--limit", "30", "--mode", "cache-only",
                           "--capacity-blocks", "2000", "--json").stdout)
    b = json.loads(kvtrace("replay", str(out), "--mode", "cache-only", "--capacity-blocks", "2000", "--json").stdout)
    assert (a["requests"], a["prompt_tokens"], a["prefix_cache_hits"]) == (
        b["requests"],
        b["prompt_tokens"],
        b["prefix_cache_hits"],
    )
    # the header's source is the whole file's digest: it says these are its first 30 requests
    header = json.loads(out.read_text().splitlines()[0])
    assert header["source"].startswith("mooncake:sha256:") and header["source_limit"] == 30, header


def test_convert_with_a_limit_that_cuts_nothing_says_no_limit(tmp_path):
    lines = MOONCAKE.read_text().splitlines()
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(lines[:5]) + "\n")
    out = tmp_path / "native.jsonl"
    assert kvtrace("convert", str(short), "-o", str(out), "--limit", "5").returncode == 0
    assert "source_limit" not in json.loads(out.read_text().splitlines()[0])  # (the whole file: nothing cut)
    # a converted file converted again: its source_limit was of its own source, carried on
    cut, again = tmp_path / "cut.jsonl", tmp_path / "again.jsonl"
    assert kvtrace("convert", str(short), "-o", str(cut), "--limit", "2").returncode == 0
    assert kvtrace("convert", str(cut), "-o", str(again)).returncode == 0
    header = json.loads(again.read_text().splitlines()[0])
    assert "source_limit" not in header and header["converted_from"].startswith("mooncake:sha256:"), header
    assert header["converted_from_limit"] == 2  # (the provenance kept: the first 2 of that source)
    # converted a third and fourth time, one of them cut again: the first source stays, with
    # what is kept of it (a third conversion named the second file, and the trace was lost)
    third, fourth = tmp_path / "third.jsonl", tmp_path / "fourth.jsonl"
    assert kvtrace("convert", str(again), "-o", str(third), "--limit", "1").returncode == 0
    assert kvtrace("convert", str(third), "-o", str(fourth)).returncode == 0
    last = json.loads(fourth.read_text().splitlines()[0])
    assert last["converted_from"] == header["converted_from"] and last["converted_from_limit"] == 1, last
    assert last["source"] != json.loads(third.read_text().splitlines()[0])["source"]  # (each names its own input)


@pytest.mark.parametrize("given", ["null", '"abc"', "0", "true", "2.5"])
def test_convert_refuses_a_header_limit_that_is_no_count(tmp_path, given):
    """A native header's source_limit of null (free metadata, any JSON) was a TypeError traceback
    from the limits' min (2794f29)."""
    native = tmp_path / "h.jsonl"
    native.write_text(f'{{"kvtrace_trace":1,"block_size":16,"source_limit":{given},"converted_from_limit":5}}\n'
                      '{"arrival_ns":0,"input_length":3,"output_length":1,"hash_ids":[1]}\n')
    r = kvtrace("convert", str(native), "-o", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"kvtrace: error: {native}:1: header source_limit: expected a number of requests >= 1, "
        f"got {json.loads(given)!r}"], r.stderr


def test_dashboard_on_missing_db_is_one_line(tmp_path):
    res = kvtrace("dashboard", "--db", str(tmp_path / "nope.duckdb"))
    assert res.returncode != 0 and "nope.duckdb" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, what", [
    (("--endpoint", "tcp://vllm-host"), "--endpoint: tcp://vllm-host: expected tcp://HOST:PORT"),
    (("--endpoint", "tcp://h:5557", "--dp-size", "0"), "--dp-size: 0: expected >= 1"),
    (("--endpoint", "tcp://h:65535", "--dp-size", "2"), "--endpoint: tcp://h:65535: port 65535 + DP rank 1"),
])
def test_capture_vllm_bad_endpoint_is_one_line_before_any_run(tmp_path, args, what):
    db = tmp_path / "live.duckdb"
    r = kvtrace("capture", "vllm", *args, "--db", str(db), "--duration", "1")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtrace: error: {what}"), r.stderr
    assert not db.exists()


def test_conformance_exit_codes_and_report(vllm_api):
    """0 when both managers agree (in process: vLLM is imported once per session), 1 on a
    disagreement with the switch that explains it (a real process)."""
    from typer.testing import CliRunner

    from kvtrace.cli import app

    ok = CliRunner().invoke(app, ["conformance", "gen:mixed", "--limit", "12", "--capacity-blocks", "80",
                                  "--capacity-blocks", "2000", "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["agree"] and data["vllm_version"] == "0.33.0" and [r["num_gpu_blocks"] for r in data["runs"]] == [
        80, 2000]  # (vLLM's count, null block included: replay's capacity_blocks are the usable 79 and 1,999)
    assert all("capacity_blocks" not in r for r in data["runs"])
    assert all(r["disagreements"] == 0 and r["fields"]["allocation"]["agreed"] > 0 for r in data["runs"])
    off = kvtrace("conformance", "gen:study-shared-prefix-pinning", "--limit", "20", "--without",
                  "shared-prefix-pinning")
    assert off.returncode == 1, off.stderr
    assert "first disagreement: shared_prefix_boundary" in off.stdout
    assert "explained by switch shared-prefix-pinning" in off.stdout and off.stdout.rstrip().endswith("DISAGREE")


def test_conformance_without_vllm_is_one_line_and_exit_2():
    """The check happens before vLLM is imported: a missing install is named with the
    version expected and how to install it."""
    code = ("import importlib.metadata as m, sys\n"
            "real = m.version\n"
            "def version(name):\n"
            "    if name == 'vllm':\n"
            "        raise m.PackageNotFoundError(name)\n"
            "    return real(name)\n"
            "m.version = version\n"
            "sys.argv = ['kvtrace', 'conformance', 'gen:mixed', '--limit', '2']\n"
            "from kvtrace.cli import main\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM is not installed" in lines[0] and "0.33.0" in lines[0]
    assert "make vllm" in lines[0] and r.stdout == ""


def test_the_standard_endpoint_variable_alone_sends_the_spans(tmp_path):
    """OTEL_EXPORTER_OTLP_ENDPOINT without --otlp-endpoint or --db: the README says it sends
    the spans, but the replay recorded none and exited 0 (and a malformed one was ignored)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # (a 1 s bound on the export: the default 5 s is the dead-collector test's below)
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_TIMEOUT="1")
    r = subprocess.run([*KVTRACE, "replay", "gen:chat", "--limit", "3", "--json"], capture_output=True, text=True,
                       env=env, timeout=300, check=False)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"kvtrace: error: OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{port}: ")
    assert "spans were not delivered" in r.stderr
    r = subprocess.run([*KVTRACE, "replay", "gen:chat", "--limit", "3"], capture_output=True, text=True,
                       env=dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT="notaurl"), timeout=300, check=False)
    assert r.returncode == 2 and r.stderr.strip() == ("kvtrace: error: OTEL_EXPORTER_OTLP_ENDPOINT: notaurl: "
                                                      "expected an http(s)://HOST:PORT[/v1/traces] URL"), r.stderr


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_replay_to_a_dead_collector_says_how_many_spans_were_not_delivered(tmp_path, protocol):
    """Exit 1 and one error line with the count; no SDK retry lines; the DuckDB copy whole."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = tmp_path / "otlp.duckdb"
    # (the default bound: gRPC's error at a shorter one need not name the refused connection)
    env = dict(os.environ, OTEL_EXPORTER_OTLP_PROTOCOL=protocol, COLUMNS="200")
    r = subprocess.run([*KVTRACE, "replay", "gen:chat", "--limit", "5", "--db", str(db), "--json",
                        "--otlp-endpoint", f"http://127.0.0.1:{port}"], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert r.returncode == 1, r.stderr
    summary = json.loads(r.stdout)
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"kvtrace: run {summary['run_id']} recorded in {db}"
    sent = summary["spans"] + 2  # the run's records, a kvtrace.run span each: its opening one and its closing one
    assert len(lines) == 2 and lines[1].startswith(f"kvtrace: error: --otlp-endpoint http://127.0.0.1:{port}: "
                                                   f"{sent} of {sent} spans were not delivered ("), r.stderr
    assert lines[1].endswith(f"; of the run's {sent - 2} and its 2 kvtrace.run records)"), r.stderr
    assert "Connection refused" in lines[1]
    assert summary["otlp_spans_undelivered"] == sent > 1
    con = duckdb.connect(str(db), read_only=True)
    try:
        status = con.execute("SELECT status FROM runs WHERE run_id = ?", [summary["run_id"]]).fetchone()[0]
        stored = con.execute("SELECT count(*) FROM spans WHERE run_id = ?", [summary["run_id"]]).fetchone()[0]
    finally:
        con.close()
    assert (status, stored) == ("complete", summary["spans"])


def test_runs_lists_the_newest_hundred_in_its_table_and_says_how_many_it_left_out(tmp_path, capsys):
    """A store of 20,000 runs took a minute to lay out (rich, ~3 ms a row)."""
    import duckdb

    from kvtrace.cli.results import RUNS_SHOWN
    from tests.cli.support import run

    db = tmp_path / "s.duckdb"
    assert run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", str(db)], capsys)[0] == 0
    con = duckdb.connect(str(db))
    con.execute("INSERT INTO runs SELECT runs.* REPLACE ('m' || i AS run_id, 'n' || i AS name) "
                "FROM runs, range(150) t(i)")
    con.close()
    code, out, err = run(["runs", "--db", str(db)], capsys)
    assert code == 0 and out.count("│ m") + out.count("│ r1 ") == RUNS_SHOWN
    assert "51 older runs not listed (--limit 0 lists all 151)" in err
    code, out, err = run(["runs", "--db", str(db), "--json"], capsys)
    assert len(json.loads(out)["runs"]) == 151 and err == ""
    code, out, _ = run(["runs", "--db", str(db), "--json", "--limit", "3"], capsys)
    assert len(json.loads(out)["runs"]) == 3


def test_runs_shows_a_run_without_a_trace_as_a_dash_not_none(tmp_path, capsys):
    """A collected (OTLP) run names no trace: the table printed ``None`` in its trace column."""
    from kvtrace.store.writer import Store
    from tests.cli.support import run

    db = tmp_path / "s.duckdb"
    store = Store.open(db)
    run_id = store.create_run("collected", mode="otlp")
    store.finish_run(run_id, status="complete")
    store.close()
    code, out, err = run(["runs", "--db", str(db)], capsys)
    assert code == 0, err
    (line,) = [ln for ln in out.splitlines() if run_id in ln]
    assert "None" not in line and "│ - " in line


def test_runs_names_the_vllm_commit_of_a_vllm_backend_run(tmp_path, capsys):
    """README, Study your own vLLM patch: ``kvtrace runs`` lists two checkouts' runs "each with
    its commit"; it showed only ``vllm`` for both."""
    from kvtrace.store.writer import Store
    from tests.cli.support import run

    db = tmp_path / "s.duckdb"
    store = Store.open(db)
    ids = [store.create_run(name, config={"backend": "vllm", "vllm_version": "0.33.0", "vllm_commit": commit})
           for name, commit in (("A", "4ba787ec9"), ("B", "c0ffee123-dirty"))]
    ours = store.create_run("ours", config={})
    for run_id in (*ids, ours):
        store.finish_run(run_id, status="complete")
    store.close()
    code, out, err = run(["runs", "--db", str(db)], capsys)
    assert code == 0, err
    lines = {run_id: next(ln for ln in out.splitlines() if f"│ {run_id} " in ln) for run_id in (*ids, ours)}
    assert "vllm 0.33.0 @ 4ba787ec9" in lines[ids[0]] and "vllm 0.33.0 @ c0ffee123-dirty" in lines[ids[1]]
    assert "│ kvtrace " in lines[ours]
    code, out, err = run(["runs", "--db", str(db), "--json"], capsys)
    rows = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert (rows[ids[1]]["backend"], rows[ids[1]]["vllm_version"], rows[ids[1]]["vllm_commit"]) == (
        "vllm", "0.33.0", "c0ffee123-dirty")
    assert (rows[ours]["backend"], rows[ours]["vllm_commit"]) == ("kvtrace", None)


def test_runs_shows_the_medians_of_a_run_made_with_other_percentiles(tmp_path, capsys):
    """``runs`` read p50_ttft_ms, which a run made with --percentiles 25,75 does not carry: it
    showed '-' where ``diff`` showed the median (median_ttft_ms, in every summary)."""
    from tests.cli.support import run

    db = tmp_path / "s.duckdb"
    code, out, err = run(["replay", "gen:chat", "--limit", "4", "--percentiles", "25,75", "--db", str(db),
                          "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert "p50_ttft_ms" not in summary and summary["median_ttft_ms"] > 0
    code, out, err = run(["runs", "--db", str(db), "--json"], capsys)
    (row,) = json.loads(out)["runs"]
    assert (row["median_ttft_ms"], row["median_itl_ms"]) == (summary["median_ttft_ms"], summary["median_itl_ms"])


@pytest.mark.parametrize("argv, heading", [([], "Usage: kvtrace [OPTIONS] COMMAND"),
                                           (["capture"], "Usage: kvtrace capture [OPTIONS] COMMAND")])
def test_a_command_given_no_arguments_prints_its_help(capsys, argv, heading):
    """`kvtrace` alone, the first thing a new user types, printed its whole help squashed into
    one `kvtrace: error:` line, exit 2."""
    from tests.cli.support import run

    code, out, err = run(argv, capsys)
    assert code == 0 and err == ""
    assert out.startswith(heading) and ("vllm" if argv else "replay") in out and len(out.splitlines()) > 5


def test_a_status_lines_count_agrees_with_its_noun():
    """collect printed "1 requests rejected"."""
    from kvtrace.cli.output import count

    assert count(1, "request") == "1 request" and count(0, "request") == "0 requests"
    assert count(2048, "span") == "2,048 spans"


def test_conformances_help_speaks_of_no_mode_and_no_span_ids():
    """conformance took replay's help texts whole: --block-size spoke of cache-only mode and
    --seed of span ids, a command with no mode and no spans; replay keeps its own."""
    from typer.testing import CliRunner

    from kvtrace.cli import app

    own, replay = (" ".join(CliRunner().invoke(app, [command, "--help"]).output.split())
                   for command in ("conformance", "replay"))
    assert "cache-only" not in own and "span ids" not in own
    assert "Seed of a generated workload" in own and "Tokens per KV block, at least 1 (default: the preset's)." in own
    assert "span ids" in replay and "cache-only: the trace's" in replay
