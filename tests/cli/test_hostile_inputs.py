"""Hostile values of the run settings and paths, re-probed after new options arrived: each is
one line naming the flag or argument as the user typed it, exit 2, and nothing written.

In-process (``kvtrace.cli.main`` with its own argv, tests/cli/support.py), as test_bad_input.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run

MOONCAKE_LINE = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}


@pytest.fixture
def trace(tmp_path: Path) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(MOONCAKE_LINE) + "\n")
    return str(path)


@pytest.mark.parametrize("argv", [
    ["replay", "{trace}", "--mode", "cache-only"],
    ["curve", "{trace}"],
    ["sweep", "{trace}", "--mode", "cache-only", "--param", "capacity_blocks=10,20"],
    ["convert", "{trace}", "-o", "{out}"],
])
@pytest.mark.parametrize("limit", ["-1", "0"])
def test_a_negative_or_zero_limit_is_named_by_its_flag(tmp_path: Path, capsys, trace, argv, limit):
    """A trace file's reader saw --limit -1 first and named its own parameter: "t.jsonl: limit:
    expected an int >= 0" (a generated workload's was "--limit: -1"). --limit 0 recorded an
    empty run (and converted an empty trace), where `runs --limit 0` lists all."""
    out = tmp_path / "out.jsonl"
    code, stdout, err = run([a.format(trace=trace, out=out) for a in argv] + ["--limit", limit], capsys)
    line = assert_one_line(code, err, f"--limit: {limit}: expected a number of requests >= 1 (without it: the "
                                      "whole trace)")
    assert "t.jsonl" not in line and stdout == ""
    assert not out.exists()


def test_a_negative_runs_limit_says_what_it_expects(tmp_path: Path, capsys):
    """`runs --limit -1` answered in click's words: "-1 is not in the range x>=0"."""
    from kvtrace.store.writer import Store

    Store.open(tmp_path / "s.duckdb").close()
    code, stdout, err = run(["runs", "--db", str(tmp_path / "s.duckdb"), "--limit", "-1"], capsys)
    assert_one_line(code, err, "--limit: -1: expected a number of runs >= 0 (0: all)")
    assert stdout == ""


@pytest.mark.parametrize("argv,named", [
    (["replay", ""], "TRACE"),
    (["curve", ""], "TRACE"),
    (["study", "shared-prefix-pinning", "--trace", ""], "--trace"),
    (["study", "shared-prefix-pinning", "--trace=", "--json"], "--trace"),
])
def test_an_empty_trace_is_refused_naming_it(capsys, argv, named):
    """`replay ''` said ": no such file or directory", naming nothing; `study --trace ''`
    replayed the behaviour's default workload as if no --trace was given."""
    code, stdout, err = run(argv, capsys)
    assert_one_line(code, err, f"{named}: expected a trace file, a directory of WEKA files or gen:NAME, got an "
                               "empty one")
    assert stdout == ""


@pytest.mark.parametrize("command", [["runs"], ["replay", "gen:chat", "--mode", "cache-only"]])
def test_a_store_path_is_shown_as_typed(tmp_path: Path, capsys, command):
    """A newline in --db was joined into a space ("a b.duckdb: no such database"), naming
    another path than the one typed, and an escape sequence reached the terminal."""
    db = str(tmp_path / "a\nb\x1b[31m.duckdb") if command == ["runs"] else "md:a\nb"
    code, _, err = run([*command, "--db", db], capsys)
    line = assert_one_line(code, err, "a\\nb")
    assert "\x1b" not in line


def test_more_percentiles_than_the_read_api_summarises_are_refused_at_the_flag(tmp_path: Path, capsys, trace):
    """2,001 were replayed: a run stopped before its summary is summarised from its spans at its
    own percentiles by the read API, which takes at most 1,001, so `runs` and `diff` of that
    store failed for good, naming "latency_summary: percentiles"."""
    many = ",".join(str(i / 20) for i in range(1002))
    db = tmp_path / "s.duckdb"
    code, stdout, err = run(["replay", trace, "--no-content", "--percentiles", many, "--db", str(db)], capsys)
    line = assert_one_line(code, err, "--percentiles: 0.0,0.05,", "expected at most 1,001 distinct percentiles, got "
                                                                  "1,002")
    assert "characters left out" in line and stdout == "" and not db.exists()
    code, _, err = run(["diff", "r1", "r2", "--db", trace, "--percentiles", many], capsys)  # (diff's own flag)
    assert_one_line(code, err, "--percentiles:", "got 1,002")
    top = ",".join(str(i / 10) for i in range(1001))  # (the read API's own bound: accepted)
    code, stdout, err = run(["replay", trace, "--no-content", "--percentiles", top, "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["p99.9_ttft_ms"] is not None


@pytest.mark.parametrize("db,needles", [
    ("s3://bucket/key", ["s3://bucket/key: expected a store file path", "write ./s3://bucket/key"]),
    ("", ["--db: expected a path, got an empty one"]),
])
def test_the_demos_store_is_taken_as_typed(tmp_path: Path, capsys, monkeypatch, db, needles):
    """--db was a Path, which reads '//' as '/': 's3:/bucket/key' was named, and 'write
    ./s3:/bucket/key' advised, a name other than the one typed."""
    monkeypatch.chdir(tmp_path)  # (nothing written here)
    code, _, err = run(["demo", "--db", db], capsys)
    assert_one_line(code, err, *needles)
    assert list(tmp_path.iterdir()) == []


def test_the_demo_takes_a_clickhouse_server_store(tmp_path: Path, capsys, monkeypatch):
    """The README's `demo --db clickhouse://...` was refused as 'clickhouse:/kv:***@...', a name
    DuckDB would read as a URL; it is a ClickHouse store, here one nothing answers at."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["demo", "--db", "clickhouse://kv:pw@127.0.0.1:1/otel"], capsys)
    # one line, before any progress bar (a "stopped 0/4" line came first), naming the reason
    # (not the driver's retry report with its random query id)
    assert_one_line(code, err, "kvtrace: error: clickhouse://kv@127.0.0.1:1/otel: cannot connect to ClickHouse at "
                               "127.0.0.1:1: [Errno 111] Connection refused")
    assert "pw" not in err and "query_id" not in err
    assert list(tmp_path.iterdir()) == []


def test_capture_refuses_a_trace_out_naming_a_missing_directory(tmp_path: Path, capsys):
    """--trace-out was a Path, which drops the / of NAME/: the capture wrote its trace to a file
    NAME where generate, convert and calibrate refuse it."""
    out, db = tmp_path / "newdir", tmp_path / "s.duckdb"
    code, _, err = run(["capture", "vllm", "--endpoint", "tcp://127.0.0.1:5557", "--db", str(db), "--duration", "0.1",
                        "--trace-out", f"{out}/"], capsys)
    assert_one_line(code, err, f"{out}/: names a directory, which does not exist")
    assert not out.exists() and not db.exists()


@pytest.mark.parametrize("grpc_port", ["5000", "-5", "4317"])
def test_collect_refuses_a_grpc_port_with_no_grpc(tmp_path: Path, capsys, grpc_port):
    """--no-grpc dropped --grpc-port without a word, whatever it was (-5 too), its default included."""
    db = tmp_path / "s.duckdb"
    code, _, err = run(["collect", "--db", str(db), "--port", "0", "--no-grpc", f"--grpc-port={grpc_port}"], capsys)
    assert_one_line(code, err, f"--grpc-port: {grpc_port}: given with --no-grpc")
    assert not db.exists()


def test_a_config_path_is_taken_as_typed(tmp_path: Path, capsys, trace):
    """--config was a Path, which drops a trailing /: `--config run.toml/` (no such directory) read
    run.toml, and errors named the path Path made (./a//b.toml as a/b.toml)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text("[scheduler]\nmax_num_seqs = 8\n")
    code, stdout, err = run(["replay", trace, "--no-content", "--config", f"{cfg}/"], capsys)
    assert_one_line(code, err, f"{cfg}/: cannot use this path (Not a directory)")
    assert stdout == ""
    typed = f"{tmp_path}//./missing.toml"
    code, _, err = run(["replay", trace, "--no-content", "--config", typed], capsys)
    assert_one_line(code, err, f"{typed}: no such file")


def test_convert_takes_its_trace_as_typed(tmp_path: Path, capsys, trace):
    """TRACE was a Path, which drops a trailing /: `convert t.jsonl/` converted t.jsonl."""
    out = tmp_path / "out.jsonl"
    code, _, err = run(["convert", f"{trace}/", "-o", str(out)], capsys)
    assert_one_line(code, err, f"{trace}/: cannot use this path (Not a directory)")
    assert not out.exists()
    code, _, err = run(["convert", "", "-o", str(out)], capsys)
    assert_one_line(code, err, "TRACE: expected a path, got an empty one")


@pytest.mark.parametrize("argv, named", [
    (["replay", "gen:chat", "--retention", "-1"], "--retention: -1:"),
    (["sweep", "gen:chat", "--param", "retention=-1,0"], "--param: retention=-1:"),
])
def test_a_bad_flag_beside_a_config_file_is_blamed_on_the_flag(tmp_path: Path, capsys, argv, named):
    """With any --config, a bad --retention was blamed on the file's one key: "s.toml:
    scheduler.max_num_seqs: conflicts with the preset's -1"."""
    cfg = tmp_path / "s.toml"
    cfg.write_text("[scheduler]\nmax_num_seqs = 8\n")
    code, _, err = run([*argv, "--limit", "2", "--config", str(cfg)], capsys)
    line = assert_one_line(code, err, named, "expected none, 0 or a token count K")
    assert "s.toml" not in line


@pytest.mark.parametrize("toml,flags,said", [
    # an unknown name in the file's cache.without was blamed on the --without beside it
    ('[cache]\nwithout = ["external-hit-running-cow", ""]\n', ["--without", "shared-prefix-pinning"],
     "c.toml: cache.without: unknown behaviours ['']"),
    # --block-size took the origin of the file's groups: the conflict went out as CacheConfig's
    ('[cache]\ngroups = [{ type = "full_attention", block_size = 32 }]\nhash_block_size = 32\n',
     ["--block-size", "64"], "c.toml: cache.groups: conflicts with the preset's retention_interval"),
    # the same without the flag: hash_block_size, which plays no part in it, was named beside groups
    ('[cache]\ngroups = [{ type = "full_attention", block_size = 64 }]\nhash_block_size = 16\n', [],
     "c.toml: cache.groups: conflicts with the preset's retention_interval"),
    # the file's hash unit was blamed on --block-size, which fits only the preset's unit
    ('[cache]\nhash_block_size = 7\n', ["--block-size", "64"],
     "c.toml: cache.hash_block_size: 7 does not divide the block size 64"),
])
def test_a_config_files_setting_is_named_in_the_file_beside_a_flag(tmp_path: Path, capsys, toml, flags, said):
    (tmp_path / "c.toml").write_text(toml)
    code, stdout, err = run(["replay", "gen:mixed", "--limit", "3", "--config", str(tmp_path / "c.toml"), *flags],
                            capsys)
    assert_one_line(code, err, said)
    assert stdout == ""


def test_a_retention_the_preset_sets_says_how_to_set_it_to_none_and_that_runs(tmp_path: Path, capsys):
    """Attention-only groups under kimi-hybrid (retention 0): "leave it unset (none)" of a setting
    the user never set; the two ways it names both run."""
    groups = '[cache]\nhash_block_size = 16\ngroups = [{ type = "full_attention", block_size = 16 }]\n'
    (tmp_path / "c.toml").write_text(groups)
    argv = ["replay", "gen:chat", "--limit", "2", "--mode", "engine", "--no-content"]
    code, _, err = run([*argv, "--config", str(tmp_path / "c.toml")], capsys)
    assert_one_line(code, err, 'set it to none (--retention none, or retention_interval = "none" in [cache]')
    assert run([*argv, "--config", str(tmp_path / "c.toml"), "--retention", "none"], capsys)[0] == 0
    (tmp_path / "c.toml").write_text(groups + 'retention_interval = "none"\n')
    assert run([*argv, "--config", str(tmp_path / "c.toml")], capsys)[0] == 0


def test_a_cache_only_trace_of_several_block_sizes_names_the_flag(tmp_path: Path, capsys):
    """It said "cache-only: block_size: trace mixes block sizes [16, 64]; pass one", naming
    neither the flag nor what to pass."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"kvtrace_trace":1}\n'
                     '{"request_id":"a","arrival_ns":0,"output_length":1,"hash_ids":[1,2],"block_size":16,'
                     '"input_length":32}\n'
                     '{"request_id":"b","arrival_ns":1,"output_length":1,"hash_ids":[3],"block_size":64,'
                     '"input_length":64}\n')
    code, stdout, err = run(["replay", str(trace), "--mode", "cache-only"], capsys)
    assert_one_line(code, err, "--block-size: not given, and the trace's hash ids are of several block sizes [16, 64]")
    assert stdout == ""
    code, stdout, err = run(["replay", str(trace), "--mode", "cache-only", "--block-size", "16", "--json"], capsys)
    assert code == 0 and '"requests": 2' in stdout
