"""What a user can type gets one line naming the file, line, key or flag, and exit 2.

In-process (``kvtrace.cli.main`` with its own argv), so the many cases stay fast; the
real subprocess path is covered in test_cli.py. Every case asserts the exit code, that
stderr is exactly one ``kvtrace: error:`` line naming the place, and that no traceback
was printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.cli.support import assert_one_line, run

MOONCAKE_LINE = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}


def write_lines(path, rows: list, raw_tail: bytes = b"") -> str:
    with open(path, "wb") as f:
        for r in rows:
            f.write((json.dumps(r) if not isinstance(r, str) else r).encode() + b"\n")
        f.write(raw_tail)
    return str(path)


@pytest.mark.parametrize("timestamp", ["1e300", "10000000000000000000", "1e19", "-1"])
def test_impossible_timestamps_name_the_line(tmp_path, capsys, timestamp):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE, f'{{"timestamp": {timestamp}, "input_length": 10, '
                                                              '"output_length": 2, "hash_ids": [1]}'])
    code, _, err = run(["replay", trace, "--capacity-blocks", "40"], capsys)
    assert_one_line(code, err, "t.jsonl:2", "timestamp")


def test_a_non_utf8_byte_is_reported_on_its_line(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE, MOONCAKE_LINE], b'{"timestamp": 3, \xff}\n')
    code, _, err = run(["replay", trace], capsys)
    assert_one_line(code, err, "t.jsonl:3", "not UTF-8")
    csv = tmp_path / "azure.csv"
    csv.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,374,44\n"
                    b"2023-11-16 18:15:50.9,396,109\n2023-11-16 18:15:51\xff,879,0\n")
    code, _, err = run(["replay", str(csv)], capsys)
    assert_one_line(code, err, "azure.csv:4", "not UTF-8")


def test_huge_output_length_is_refused_before_it_hangs(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", [dict(MOONCAKE_LINE, output_length=10**12)])
    code, _, err = run(["replay", trace], capsys)
    assert_one_line(code, err, "t.jsonl:1", "output_length")
    ok = write_lines(tmp_path / "u.jsonl", [dict(MOONCAKE_LINE, output_length=2_000_000)])
    code, _, err = run(["replay", ok], capsys)
    assert_one_line(code, err, "request r0", "max_model_len")


@pytest.mark.parametrize("line, key", [
    ("num_gpu_blocks = -5", "cache.num_gpu_blocks"),
    ("num_gpu_blocks = 0", "cache.num_gpu_blocks"),
    ('num_gpu_blocks = [100, "a"]', "cache.num_gpu_blocks"),
    ("num_gpu_blocks = 1000000000000000", "cache.num_gpu_blocks"),
    ('hash_fn = "md5"', "cache.hash_fn"),
    ('without = ["nope"]', "cache.without"),
    ("num_prefill_checkpoint_blocks = -1", "cache.num_prefill_checkpoint_blocks"),
    ("external_capacity_blocks = -3", "cache.external_capacity_blocks"),
    # a group type that is no name (a list, a table) was a TypeError: unhashable
    ('groups = [{type=["full_attention"], block_size=64}]', "cache.groups[0].type"),
    ("groups = [{type={a=1}, block_size=64}]", "cache.groups[0].type"),
    # no request could be scheduled: the error blamed --capacity-blocks
    ("num_speculative_blocks = 1000000", "cache.num_speculative_blocks: 1,000,000 is not below the pool"),
    # storage no machine holds (160,000 GiB): named the flags alone, not the file's key
    ('groups = [{type="sliding_window", block_size=2147483648, sliding_window=1}]', "cache.groups: KV storage"),
])
def test_toml_cache_values_name_the_file_and_key(tmp_path, capsys, line, key):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"[cache]\n{line}\n")
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(cfg)], capsys)
    assert_one_line(code, err, "run.toml", key)


@pytest.mark.parametrize("text, key", [
    ("[scheduler]\nmax_num_seqs = 0\n", "scheduler.max_num_seqs"),
    ("[scheduler]\nmax_num_batched_tokens = -1\n", "scheduler.max_num_batched_tokens"),
    ('[scheduler]\nscheduler_reserve_full_isl = "no"\n', "scheduler.scheduler_reserve_full_isl: expected bool"),
    ('preset = "nope"\n', "preset"),
    ('preset = ""\n', "preset: expected a preset name, got ''"),  # (it meant the default preset)
    # what vLLM's SchedulerConfig refuses (1 token a step took 100 s for 20 requests)
    ("[scheduler]\nmax_num_batched_tokens = 1\n", "scheduler.max_num_batched_tokens: 1 is below max_num_seqs"),
    ("[scheduler]\nlong_prefill_token_threshold = 300000\nmax_model_len = 200000\n",
     "scheduler.long_prefill_token_threshold: 300000 exceeds max_model_len"),
    # an MoE term without its experts was a ZeroDivisionError, after a run was recorded
    ('[cost_model]\nname = "mine"\nstep_overhead_ns = 1000\ntoken_ns = 10\nattn_pair_ps = 1\nkv_read_ps = 1\n'
     "decode_seq_ns = 1\nmoe_expert_ns = 100\n", "cost_model.num_experts"),
    # tomllib's cost grows with the square of a key's depth: 80 KB of a.a.a... took 9 GB
    ("[cache]\n" + ".".join(["x"] * 40_000) + " = 1\n", "line 2: a key of more than 64 dotted parts"),
    ("[cache]\nx = {" + ".".join(["x"] * 40_000) + " = 1}\n", "line 2: a key of more than 64 dotted parts"),
    # a line separator inside a quoted part is no line end to TOML (it was to str.splitlines)
    ("[cost_model]\n" + ".".join('"\u2028"' if i % 50 == 49 else "a" for i in range(20_000)) + " = 1\n",
     "line 2: a key of more than 64 dotted parts"),
])
def test_toml_other_values_name_the_file_and_key(tmp_path, capsys, text, key):
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(cfg)], capsys)
    assert_one_line(code, err, "run.toml", key)


def test_unreadable_config_files(tmp_path, capsys):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "bin.toml").write_bytes(bytes(range(256)))
    (tmp_path / "latin1.toml").write_bytes(b'preset = "kimi-hybrid"\n# caf\xe9\n')
    for name, needle in (("dir.toml", "is a directory"), ("bin.toml", "not UTF-8"), ("latin1.toml", "line 2")):
        code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(tmp_path / name)], capsys)
        assert_one_line(code, err, name, needle)
    # about the file as a whole: its name, then what is wrong (no placeholder key between)
    (tmp_path / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    for name, what in (("dir.toml", "is a directory; expected a TOML file"),
                       ("missing.toml", "no such file; expected a TOML file"),
                       ("deep.toml", "invalid TOML: nested too deeply")):
        code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(tmp_path / name)], capsys)
        assert err.strip().endswith(f"{tmp_path / name}: {what}"), err


@pytest.mark.parametrize("argv, flag", [
    (["--capacity-blocks", "-5"], "--capacity-blocks: -5"),
    # said "or one int >= 2 per group (1 separate pools)" of a single int
    (["--preset", "dense-attention", "--capacity-blocks", "1"],
     "--capacity-blocks: 1: expected an int >= 2 (a pool holds vLLM's null block and at least one to use)"),
    (["--preset", "nope"], "--preset: 'nope' is not one of"),
    (["--without", "nope"], "--without: 'nope' is not one of"),
    (["--limit", "-1"], "--limit: -1"),
    (["--block-size", "549755813888"], "--block-size"),
    (["--preset", "dense-attention", "--retention", "0"], "--retention: 0"),
    # a capacity of no tokens was a pool of the preset's state blocks alone, -1 the same
    (["--capacity-tokens", "0"], "--capacity-tokens: 0: expected >= 1"),
    (["--capacity-tokens", "-1"], "--capacity-tokens: -1: expected >= 1"),
    # both capacities: engine mode took the tokens, cache-only mode the blocks, silently
    (["--capacity-blocks", "100", "--capacity-tokens", "50000"], "--capacity-tokens: 50000: give either it or"),
    (["--mode", "cache-only", "--block-size", "16", "--capacity-blocks", "100", "--capacity-tokens", "500"],
     "--capacity-tokens: 500: give either it or"),
    # cache-only's bounded pool: its flag, not CacheConfig's num_gpu_blocks
    (["--mode", "cache-only", "--capacity-blocks", "99999999999"], "--capacity-blocks: 99999999999: 99,999,999,999"),
    (["--mode", "cache-only", "--block-size", "4", "--capacity-tokens", "999999999999"],
     "--capacity-tokens: 999999999999: 250,000,000,000 blocks"),
    (["--mode", "cache-only", "--block-size", "4", "--capacity-tokens", "-5"], "--capacity-tokens: -5"),
    (["--mode", "cache-only", "--capacity-tokens", "64"], "--capacity-tokens: 64: cache-only mode needs --block-size"),
    # a pool is made up front: 2^25 blocks took 4.8 GB and 19 s before a 5-request trace
    (["--capacity-blocks", "33554432"], "--capacity-blocks: 33554432: 33,554,432 blocks is beyond what kvtrace"),
    (["--capacity-blocks", "1_000"], "--capacity-blocks: 1_000: expected a number of blocks"),
    (["--capacity-blocks", "\u0661\u0660\u0660"], "--capacity-blocks: \u0661\u0660\u0660: expected a number"),
    (["--retention", "-1"], "--retention: -1: expected none, 0 or a token count K"),
    # silently ignored before: a format for a generated workload, an empty endpoint
    (["--format", "mooncake"], "--format: mooncake: gen:chat is a generated workload"),
    (["--otlp-endpoint", ""], "--otlp-endpoint: '': expected a collector URL"),
])
def test_flags_name_themselves(capsys, argv, flag):
    limit = [] if argv[0] == "--limit" else ["--limit", "2"]
    code, _, err = run(["replay", "gen:chat", *limit, *argv], capsys)
    assert_one_line(code, err, flag)


@pytest.mark.parametrize("argv, needle", [
    (["study", "external-hit-running-cow", "--mode", "cache-only"], "--mode: cache-only: a study switches"),
    (["study", "shared-prefix-pinning", "--without", "shared-prefix-pinning"],
     "--without: shared-prefix-pinning: is the behaviour this study switches"),
    (["study", "shared-prefix-pinning", "--json", "--markdown"], "--markdown: given with --json"),
    (["diff", "r1", "r2", "--db", "{db}", "--json", "--markdown"], "--markdown: given with --json"),
    (["sweep", "gen:chat", "--limit", "2", "--param", "capacity_blocks=10,,20"], "--param: capacity_blocks=10,,20"),
    (["curve", "gen:chat", "--limit", "2", "--capacities", "9223372036854775808"],
     "--capacities: 9223372036854775808: at most 4,194,302"),
    (["curve", "gen:chat", "--limit", "2", "--capacities", "10,²"], "--capacities: 10,²: expected auto"),
    (["generate", "-o", "-"], "--out: -: not taken as stdout here; say /dev/stdout"),
    (["runs", "--db", ""], "--db: expected a store path, got an empty one"),
    # Path('') is the current directory: these read or wrote `.` before
    (["replay", "gen:chat", "--config", ""], "--config: expected a path, got an empty one"),
    (["convert", "", "-o", "x.jsonl"], "TRACE: expected a path, got an empty one"),
    (["generate", "gen:chat", "-o", ""], "--out: expected a path, got an empty one"),
    (["calibrate", "--from", ""], "--from: expected a path, got an empty one"),
    (["calibrate", "--from", "{calibration}", "--moe", "0:0"], "--moe: 0:0: expected E:K with 1 <= K < E"),
    (["calibrate", "--from", "{calibration}", "--knee", str(2**70)], "--knee: 1180591620717411303424"),
    (["calibrate", "--from", "{calibration}", "--name", ""], "--name: '': expected a name of printable text"),
    (["calibrate", "--from", "{calibration}", "--name", "a\nb"], "--name: 'a\\nb'"),
    (["calibrate", "--from", "{calibration}", "--name", "h200-dense-8b"], "is a built-in cost model's name"),
    (["calibrate", "--from", "{calibration}", "--moe", "8:²"], "--moe: 8:²: expected E:K"),
    (["calibrate", "--from", "{calibration}", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens: 0"),
    (["replay", "-", "--limit", "2"], "-: a trace is read more than once, so never from stdin"),
    (["convert", "-", "--format", "mooncake", "-o", "x.jsonl"], "-: a trace is read more than once"),
])
def test_settings_that_cannot_mean_what_they_say_are_refused(capsys, replayed_store, argv, needle):
    calibration = Path(__file__).resolve().parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"
    argv = [a.replace("{db}", replayed_store.path).replace("{calibration}", str(calibration)) for a in argv]
    code, _, err = run(argv, capsys)
    assert_one_line(code, err, needle)


def test_a_malformed_device_is_called_malformed(capsys, monkeypatch):
    monkeypatch.setenv("KVTRACE_DEVICE", "cuda:abc")
    code, _, err = run(["replay", "gen:chat", "--limit", "2"], capsys)
    assert_one_line(code, err, "KVTRACE_DEVICE: cuda:abc: expected cpu, cuda, cuda:N")


@pytest.mark.parametrize("argv, needle", [
    (["replay"], "Missing argument"),
    (["replay", "gen:chat", "--no-such-flag"], "No such option"),
    (["replay", "gen:chat", "--limit", "many"], "--limit: 'many' is not a valid int"),
    (["no-such-command"], "No such command"),
])
def test_usage_errors_are_one_line_too(capsys, argv, needle):
    code, _, err = run(argv, capsys)
    assert_one_line(code, err, needle)


def test_convert_into_a_missing_folder_or_onto_a_directory_leaves_nothing(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    (tmp_path / "adir").mkdir()
    for target, needle in ((tmp_path / "nope" / "out.jsonl", "does not exist"), (tmp_path / "adir", "is a directory")):
        code, _, err = run(["convert", trace, "-o", str(target)], capsys)
        assert_one_line(code, err, str(target), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "t.jsonl"]  # no *.tmp-PID left
    assert list((tmp_path / "adir").iterdir()) == []


def test_convert_removes_the_temporary_file_a_killed_write_left(tmp_path, capsys):
    """``kill -9`` mid-write left ``OUT.tmp-PID`` for good: nothing else cleans up after a kill,
    and each later write made its own. The next write of OUT removes a dead process's; a
    live writer's stays."""
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = tmp_path / f"out.jsonl.tmp-{int(gone.stdout)}"
    live = tmp_path / f"out.jsonl.tmp-{os.getppid()}"
    dead.write_text("half a trace")
    live.write_text("being written")
    code, _, err = run(["convert", trace, "-o", str(tmp_path / "out.jsonl")], capsys)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["t.jsonl", "out.jsonl", live.name])


def test_convert_writes_into_a_device_or_fifo_and_through_a_link_never_over_them(tmp_path, capsys):
    """``-o`` onto something that is not a regular file is written as a shell redirection
    would, never replaced by a file (as root, ``-o /dev/full`` once replaced the device);
    a symlink's file is replaced and the link kept; a full device is a one-line error.
    The devices are reached through links in tmp_path, so a regression replaces a link,
    never a device of the machine running the test."""
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    for device in ("/dev/null", "/dev/full"):
        link = tmp_path / os.path.basename(device)
        link.symlink_to(device)
        code, _, err = run(["convert", trace, "-o", str(link)], capsys)
        if device == "/dev/null":
            assert code == 0 and "wrote 1 request to" in err, err
        else:
            assert_one_line(code, err, str(link), "No space left")
        assert link.is_symlink() and os.readlink(link) == device
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    code, _, err = run(["convert", trace, "-o", str(fifo)], capsys)
    reader.join(10)
    assert code == 0, err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and got and got[0].count(b"\n") == 2  # header + 1 request
    (tmp_path / "link").symlink_to("real.jsonl")
    code, _, err = run(["convert", trace, "-o", str(tmp_path / "link")], capsys)
    assert code == 0, err
    assert os.readlink(tmp_path / "link") == "real.jsonl" and got[0] == (tmp_path / "real.jsonl").read_bytes()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("name", ["trace.jsonl", "table.csv"])
def test_a_data_file_given_as_the_store_is_refused_and_left_alone(tmp_path, capsys, name):
    """DuckDB opens an existing .jsonl or .csv as a new in-memory database, without error:
    a replay then stored nothing and failed with a traceback, and a reader named no file."""
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    data = tmp_path / name
    data.write_bytes(Path(trace).read_bytes())
    before = data.read_bytes()
    for argv in (["replay", trace, "--mode", "cache-only", "--db", str(data)], ["runs", "--db", str(data)],
                 ["diff", "r1", "r2", "--db", str(data)]):
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, name, "not a DuckDB database")
    assert data.read_bytes() == before


def test_a_sqlite_database_given_as_the_store_is_refused_and_left_alone(tmp_path, capsys):
    """DuckDB opens a SQLite file through its sqlite extension, which it tried to download
    (seconds, then an error about a URL)."""
    import sqlite3

    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    db = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("CREATE TABLE t (x)")
        con.commit()
    before = db.read_bytes()
    for argv in (["replay", trace, "--mode", "cache-only", "--db", str(db)], ["runs", "--db", str(db)]):
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, "app.db", "a SQLite database, not a DuckDB one")
    assert db.read_bytes() == before


def test_a_file_given_as_the_embedded_clickhouse_directory_is_refused_and_left_alone(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    before = Path(trace).read_bytes()
    for argv in (["replay", trace, "--mode", "cache-only", "--db", f"chdb:{trace}"], ["runs", "--db", f"chdb:{trace}"]):
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, "t.jsonl", "is a file, not a directory")
    assert Path(trace).read_bytes() == before


@pytest.mark.parametrize("db", ["", ":memory:"])
def test_an_in_memory_store_is_refused_before_anything_runs(tmp_path, capsys, db):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    code, _, err = run(["replay", trace, "--mode", "cache-only", "--db", db], capsys)
    assert_one_line(code, err, "expected a database file path")


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than the interpreter's stack: decoders raise RecursionError


@pytest.mark.parametrize("name, lines, fmt", [
    ("mooncake", [f'{{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1], "x": {DEEP}}}'],
     "mooncake"),
    ("native-header", [f'{{"kvtrace_trace": {DEEP}}}'], "native"),
    ("native-line", ['{"kvtrace_trace": 1, "block_size": 16}',
                     f'{{"arrival_ns": 0, "input_length": 3, "output_length": 1, "token_ids": {DEEP}}}'], "native"),
    ("bailian", [f'{{"chat_id": 1, "x": {DEEP}}}'], "bailian"),
    ("detected", [f'{{"x": {DEEP}}}'], None),
])
def test_json_nested_past_the_stack_is_one_line(tmp_path, capsys, name, lines, fmt):
    trace = write_lines(tmp_path / "t.jsonl", lines)
    code, _, err = run(["replay", trace, "--mode", "cache-only", *(["--format", fmt] if fmt else [])], capsys)
    assert_one_line(code, err, "t.jsonl")


def test_a_weka_file_nested_past_the_stack_is_one_line(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "c.json").write_text(f'{{"block_size": 16, "x": {DEEP}}}')
    code, _, err = run(["replay", str(tmp_path / "w"), "--mode", "cache-only"], capsys)
    assert_one_line(code, err, "c.json", "nested too deeply")


def test_a_toml_integer_longer_than_python_reads_is_one_line(tmp_path, capsys):
    """tomllib raises a plain ValueError (Python's 4,300-digit limit), not a TOMLDecodeError."""
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    (tmp_path / "c.toml").write_text("[cache]\nnum_gpu_blocks = " + "9" * 5000 + "\n")
    code, _, err = run(["replay", trace, "--config", str(tmp_path / "c.toml")], capsys)
    assert_one_line(code, err, "c.toml", "line 2", "a number too long to read")


def test_toml_nested_past_the_stack_is_one_line(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    (tmp_path / "c.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    code, _, err = run(["replay", trace, "--config", str(tmp_path / "c.toml")], capsys)
    assert_one_line(code, err, "c.toml", "nested too deeply")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:x"])
def test_a_cuda_device_this_torch_cannot_use_is_one_line(tmp_path, capsys, monkeypatch, device):
    import torch

    if torch.cuda.is_available():  # the error is for a machine without one; elsewhere check the index rule
        device = f"cuda:{torch.cuda.device_count()}"
    monkeypatch.setenv("KVTRACE_DEVICE", device)
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    code, _, err = run(["replay", trace, "--capacity-blocks", "40"], capsys)
    assert_one_line(code, err, "KVTRACE_DEVICE", device)


def test_an_unknown_device_names_the_choices_and_torch_cpu_gives_the_cpu_digest(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVTRACE_DEVICE", "tpu")
    code, _, err = run(["replay", "gen:chat", "--limit", "3"], capsys)
    assert_one_line(code, err, "KVTRACE_DEVICE", "cpu, cuda, cuda:N or torch:cpu")
    digests = []
    for device in ("cpu", "torch:cpu"):  # numpy, and the torch path a GPU takes
        monkeypatch.setenv("KVTRACE_DEVICE", device)
        code, out, err = run(["replay", "gen:chat", "--limit", "6", "--json"], capsys)
        assert code == 0, err
        digests.append(json.loads(out)["digest"])
    assert digests[0] == digests[1]


DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("source", ["mooncake_synthetic_trace.jsonl", "AzureLLMInferenceTrace_conv.csv",
                                    "weka_sample"])
def test_a_utf8_byte_order_mark_is_no_part_of_the_trace(tmp_path, capsys, source):
    """Windows tools start files with a UTF-8 BOM: the same replay with it as without."""
    src = DATA / source
    files = sorted(src.iterdir())[:2] if src.is_dir() else [src]
    plain, marked = tmp_path / "plain", tmp_path / "marked"
    for folder in (plain, marked):
        folder.mkdir()
        for f in files:
            lines = f.read_bytes().splitlines(keepends=True)
            body = b"".join(lines if src.is_dir() else lines[:40])
            (folder / f.name).write_bytes((b"\xef\xbb\xbf" if folder is marked else b"") + body)
    digests = []
    for folder in (plain, marked):
        target = folder if src.is_dir() else folder / src.name
        code, out, err = run(["replay", str(target), "--mode", "cache-only", "--json"], capsys)
        assert code == 0, err
        digests.append(json.loads(out)["digest"])
    assert digests[0] == digests[1]


def test_a_toml_config_with_a_byte_order_mark_reads_as_without(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    outs = []
    for bom in (b"", b"\xef\xbb\xbf"):
        (tmp_path / "c.toml").write_bytes(bom + b"[cache]\nnum_gpu_blocks = 77\n")
        code, out, err = run(["replay", trace, "--config", str(tmp_path / "c.toml"), "--json"], capsys)
        assert code == 0, err
        outs.append(json.loads(out)["digest"])
        (tmp_path / "c.toml").write_bytes(bom + b"[cache]\nnum_gpu_blocks = -5\n")  # read past the mark
        code, _, err = run(["replay", trace, "--config", str(tmp_path / "c.toml")], capsys)
        assert_one_line(code, err, "c.toml", "num_gpu_blocks")
    assert outs[0] == outs[1]


NATIVE_HEADER = '{"kvtrace_trace": 1, "block_size": 16}'


@pytest.mark.parametrize("line, needle", [
    ('{"arrival_ns": 18446744073709551616, "input_length": 3, "output_length": 1, "token_ids": [1, 2, 3]}',
     "arrival_ns"),
    ('{"arrival_ns": 0, "input_length": 3, "output_length": 1, "token_ids": [1, 18446744073709551616, 3]}',
     "token_ids"),
    ('{"arrival_ns": 0, "input_length": 3, "output_length": 1, "hash_ids": [18446744073709551616]}', "hash_ids"),
    ('{"arrival_ns": 0, "input_length": 3, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
])
def test_native_numbers_beyond_64_bits_name_the_line(tmp_path, capsys, line, needle):
    trace = write_lines(tmp_path / "n.jsonl", [NATIVE_HEADER, line])
    for mode in (["--mode", "cache-only", "--capacity-blocks", "4"], []):
        code, _, err = run(["replay", trace, *mode], capsys)
        assert_one_line(code, err, "n.jsonl:2", needle)


def test_a_non_chained_mooncake_trace_replays_cache_only(tmp_path, capsys):
    """hash_ids that repeat under different parents (a legal Mooncake trace that is not
    prefix-chained) are interned to int64 keys: the run records, nothing overflows."""
    rows = [dict(MOONCAKE_LINE, timestamp=t, input_length=1000, hash_ids=ids)
            for t, ids in enumerate(([1, 2], [3, 2], [1, 2], [4, 2]))]
    trace = write_lines(tmp_path / "nc.jsonl", rows)
    code, out, err = run(["replay", trace, "--mode", "cache-only", "--capacity-blocks", "2",
                          "--db", str(tmp_path / "s.duckdb"), "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["requests"] == 4 and summary["spans"] > 0


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> bytes:
    """The bytes of a store holding runs r1 and r2 (cache-only: quick), copied per test."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("store") / "s.duckdb"
    for _ in range(2):
        run_replay(RunSpec("gen:chat", mode="cache-only", capacity_blocks=64), db=db)
    return db.read_bytes()


def _store_with_runs(tmp_path, two_runs: bytes) -> str:
    db = tmp_path / "s.duckdb"
    db.write_bytes(two_runs)
    return str(db)


def test_a_store_whose_schema_version_is_not_an_integer(tmp_path, capsys, two_runs):
    import duckdb

    db = _store_with_runs(tmp_path, two_runs)
    con = duckdb.connect(db)
    con.execute("UPDATE kvtrace_meta SET value = 'two' WHERE key = 'schema_version'")
    con.close()
    for argv in (["replay", "gen:chat", "--limit", "2", "--db", db], ["diff", "r1", "r2", "--db", db]):
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, "s.duckdb", "schema_version", "'two'")
    with duckdb.connect(db) as con:  # a damaged value of 100,000 characters was quoted whole
        con.execute("UPDATE kvtrace_meta SET value = ? WHERE key = 'schema_version'", ["x" * 100_000])
    code, _, err = run(["diff", "r1", "r2", "--db", db], capsys)
    assert_one_line(code, err, "s.duckdb", "schema_version is 'xxx", "not a version number")
    assert len(err) < 400
    for raw in (" 3", "\uff13", "-1", "3.0"):  # (int() took the first two; -1 "predated" this kvtrace)
        with duckdb.connect(db) as con:
            con.execute("UPDATE kvtrace_meta SET value = ? WHERE key = 'schema_version'", [raw])
        code, _, err = run(["diff", "r1", "r2", "--db", db], capsys)
        assert_one_line(code, err, "s.duckdb", "damaged kvtrace store", "not a version number")


@pytest.mark.parametrize("gate, needle", [("x<1", "expected METRIC:THRESHOLD"), ("nope:1", "unknown metric")])
@pytest.mark.parametrize("fmt", [[], ["--json"], ["--markdown"]])
def test_a_bad_diff_gate_is_one_line_before_any_output(tmp_path, capsys, two_runs, gate, needle, fmt):
    db = _store_with_runs(tmp_path, two_runs)
    code, out, err = run(["diff", "r1", "r2", "--db", db, "--fail-if", gate, *fmt], capsys)
    assert_one_line(code, err, needle)
    assert out == ""


@pytest.mark.parametrize("damage", ["truncated", "corrupt-tail", "corrupt-head"])
def test_a_truncated_or_corrupt_store_is_one_line_for_replay_and_diff(tmp_path, capsys, two_runs, damage):
    """Whether DuckDB finds the damage when opening or only in a later query, the error
    names the file."""
    db = _store_with_runs(tmp_path, two_runs)
    data = bytearray(Path(db).read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 3]
    else:
        start = 4096 if damage == "corrupt-head" else int(len(data) * 0.3) // 4096 * 4096
        stop = 3 * 4096 if damage == "corrupt-head" else len(data)
        for i in range(start, stop):
            data[i] ^= 0x5A
    for argv in (["diff", "r1", "r2", "--db", db], ["replay", "gen:chat", "--limit", "2", "--db", db]):
        bad = tmp_path / "bad.duckdb"
        bad.write_bytes(bytes(data))
        argv = [str(bad) if a == db else a for a in argv]
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, "bad.duckdb", "DuckDB")


@pytest.mark.parametrize("argv, needle", [
    (["--resamples", "-1"], "--resamples: -1"),
    (["--resamples", "0"], "--resamples: 0"),
    (["--resamples", "2"], "--resamples: 2: expected"),  # (a "95% CI" of two replicates, marked significant)
    (["--resamples", "1000000000"], "--resamples: 1000000000"),
    (["--top", "-1"], "--top: -1"),
    (["--seed", "-1"], "--seed: -1"),
])
def test_diff_options_out_of_range(tmp_path, capsys, two_runs, argv, needle):
    db = _store_with_runs(tmp_path, two_runs)
    code, _, err = run(["diff", "r1", "r2", "--db", db, *argv], capsys)
    assert_one_line(code, err, needle)


@pytest.mark.parametrize("argv, needle", [
    (["study", "transient-checkpoint-retention", "--limit", "-1"], "--limit: -1"),
    (["generate", "chat", "-o", "{tmp}/g.jsonl", "--requests", str(2**63)], "--requests: 9223372036854775808"),
    (["replay", "{trace}", "--mode", "cache-only", "--capacity-blocks", "4", "--block-size", str(2**64)],
     "--block-size"),
    (["collect", "--db", "{tmp}/c.duckdb", "--port", "-1"], "--port: -1"),
    (["collect", "--db", "{tmp}/c.duckdb", "--port", "0", "--grpc-port", "70000"], "--grpc-port: 70000"),
    (["collect", "--db", "{tmp}/c.duckdb", "--port", "0", "--max-body-bytes", "0"], "--max-body-bytes: 0"),
    (["capture", "vllm", "--endpoint", "tcp://127.0.0.1:1", "--db", "{tmp}/v.duckdb", "--duration", "nan"],
     "--duration: nan"),
    (["capture", "vllm", "--endpoint", "tcp://127.0.0.1:1", "--db", "{tmp}/v.duckdb", "--duration", "-1"],
     "--duration: -1"),
    # a seed beyond 64 bits (or negative) overflowed in the span ids, after the store was made
    (["replay", "{trace}", "--mode", "cache-only", "--db", "{tmp}/c.duckdb", "--seed", str(2**64)],
     f"--seed: {2**64}"),
    (["replay", "{trace}", "--capacity-blocks", "40", "--db", "{tmp}/c.duckdb", "--seed", "-1"], "--seed: -1"),
    (["curve", "{trace}", "--seed", str(10**40)], f"--seed: {10**40}"),
    (["generate", "chat", "-o", "{tmp}/g.jsonl", "--seed", str(2**64)], "seed"),  # (its help gives the range)
    (["sweep", "{trace}", "--param", "capacity_blocks=40,80", "--seed", "-2"], "--seed: -2"),
])
def test_numeric_options_are_bounded(tmp_path, capsys, argv, needle):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    argv = [a.format(tmp=tmp_path, trace=trace) for a in argv]
    code, _, err = run(argv, capsys)
    assert_one_line(code, err, needle)
    assert not (tmp_path / "c.duckdb").exists() and not (tmp_path / "v.duckdb").exists()


def test_a_limit_beyond_the_file_is_no_limit(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE, dict(MOONCAKE_LINE, timestamp=1)])
    code, out, err = run(["convert", trace, "-o", str(tmp_path / "o.jsonl"), "--limit", str(2**63)], capsys)
    assert code == 0, err
    assert "wrote 2 requests" in err and out == ""


@pytest.mark.parametrize("text", ["50,,90", "50,90,", ",50"])
def test_an_empty_percentile_is_refused_not_skipped(tmp_path, capsys, text):
    db = str(tmp_path / "runs.duckdb")
    for cap in ("40", "80"):
        code, _, err = run(["replay", "gen:chat", "--limit", "3", "--mode", "cache-only", "--capacity-blocks", cap,
                            "--db", db], capsys)
        assert code == 0, err
    code, _, err = run(["diff", "r1", "r2", "--db", db, "--percentiles", text], capsys)
    assert_one_line(code, err, "--percentiles", "empty percentile")


@pytest.mark.parametrize("key", ["OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"])
@pytest.mark.parametrize("value", ["-5", "0", "abc", "nan", "inf"])
def test_a_bad_otlp_timeout_is_refused_before_anything_is_recorded(tmp_path, capsys, monkeypatch, key, value):
    monkeypatch.setenv(key, value)
    db = tmp_path / "runs.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", str(db),
                        "--otlp-endpoint", "http://127.0.0.1:9"], capsys)
    assert_one_line(code, err, key, repr(value), "positive number of seconds")
    assert not db.exists()


@pytest.mark.parametrize(("env", "needle"), [
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "OTEL_EXPORTER_OTLP_COMPRESSION: 'zstd': expected gzip or deflate"),
    ({"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "none", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION: 'none': expected gzip for OTLP over grpc"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "api-key=abc,a b"}, "OTEL_EXPORTER_OTLP_HEADERS: 'a b': expected comma-separated"),
    ({"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "novalue"}, "OTEL_EXPORTER_OTLP_TRACES_HEADERS: 'novalue'"),
])
def test_otlp_variables_the_sdk_would_log_and_drop_are_refused(tmp_path, capsys, monkeypatch, env, needle):
    # the SDK printed its own line ("Unsupported compression type", "Header format invalid")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    db = tmp_path / "runs.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", str(db),
                        "--otlp-endpoint", "http://127.0.0.1:9"], capsys)
    assert_one_line(code, err, needle)
    assert not db.exists()


def test_one_file_read_two_ways_is_named_as_such(tmp_path, capsys):
    """Two runs of one file with another --limit: the refusal showed the same path twice."""
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE, {**MOONCAKE_LINE, "timestamp": 1}])
    db = str(tmp_path / "s.duckdb")
    for limit in ("1", "2"):
        code, _, err = run(["replay", trace, "--mode", "cache-only", "--limit", limit, "--db", db], capsys)
        assert code == 0, err
    code, _, err = run(["diff", "r1", "r2", "--db", db], capsys)
    assert_one_line(code, err, "read differently (another --limit, --trace-block-size or --format)", "--force")


# --- a second CLI probe's findings --------------------------------------------------------------
def _native(path, rows: list[dict], header: object = 1) -> str:
    return write_lines(path, [{"kvtrace_trace": header, "block_size": 16}, *rows])


@pytest.mark.parametrize("token", [2**63 - 1, 10**30, -5])
def test_expected_output_ids_are_checked_like_the_prompts(tmp_path, capsys, token):
    """An id past int64 crashed the worker's array with an OverflowError; -5 was replayed."""
    trace = _native(tmp_path / "t.jsonl", [{"request_id": "a", "arrival_ns": 0, "input_length": 4, "output_length": 2,
                                            "token_ids": [1, 2, 3, 4], "expected_output": [token, 1]}])
    for mode in ("engine", "cache-only"):
        code, _, err = run(["replay", trace, "--mode", mode], capsys)
        assert_one_line(code, err, "t.jsonl:2", "expected_output", "[0, 163840)")


@pytest.mark.parametrize("header", [True, 1.0, "1"])
def test_a_native_version_must_be_the_integer_1(tmp_path, capsys, header):
    trace = _native(tmp_path / "t.jsonl", [], header=header)
    code, _, err = run(["replay", trace], capsys)
    assert_one_line(code, err, "t.jsonl:1", "kvtrace_trace: unsupported version")


@pytest.mark.parametrize("key, value", [("step_overhead_ns", 2**62), ("token_ns", 2**63 - 1),
                                        ("num_experts", 2**63 - 1)])
def test_cost_model_coefficients_are_bounded_at_their_key(tmp_path, capsys, key, value):
    """2^62 ns a step overflowed the digest's int64 times with a traceback, after the replay."""
    coefficients = {"step_overhead_ns": 1, "token_ns": 1, "attn_pair_ps": 1, "kv_read_ps": 1, "decode_seq_ns": 1,
                    "experts_per_token": 1, key: value}
    cfg = tmp_path / "cm.toml"
    cfg.write_text('[cost_model]\nname = "x"\n' + "".join(f"{k} = {v}\n" for k, v in coefficients.items()))
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(cfg)], capsys)
    assert_one_line(code, err, "cm.toml", f"cost_model.{key}", "expected an int from 0 to")


def test_a_virtual_clock_past_int64_is_refused_not_overflowed():
    from kvtrace.engine.clock import MAX_COEFFICIENT, Clock, CostModel
    from kvtrace.errors import KVTraceError

    big = MAX_COEFFICIENT
    clock = Clock(CostModel("slow", big, big, big, big, big))
    work = dict(num_tokens=8192, prefill_pairs=0, decode_context_tokens=0, num_decode_seqs=0, num_kv_copies=0,
                num_state_copies=0)
    with pytest.raises(KVTraceError, match="cost model slow: the virtual clock passed 2"):
        for _ in range(10_000):
            clock.run_step(**work)
    assert clock.now_ns > 2**63 - 1


@pytest.mark.parametrize("line, needle", [
    ('without = [["shared-prefix-pinning"]]', "cache.without: expected a list of str"),
    ('retention_interval = "none"\n[cost_model]\nname = "x"\nsource = 5', "cost_model.source"),
    ("hash_block_size = 0", "cache.hash_block_size: expected a positive token count"),
    ("hash_block_size = -64", "cache.hash_block_size: expected a positive token count"),
    ("hash_block_size = 100", "cache.hash_block_size: 100 does not divide the block size"),
    ('retention_interval = "6_4"', "cache.retention_interval"),
    ("num_gpu_blocks = [" + "1, " * 200_000 + "1]", "cache.num_gpu_blocks"),
])
def test_more_toml_cache_values_name_their_key(tmp_path, capsys, line, needle):
    """A nested list in `without` was a TypeError traceback; a hash_block_size of 0, -64 or
    100 was quietly shrunk to divide the block size, changing the results."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"[cache]\n{line}\n")
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(cfg)], capsys)
    shown = assert_one_line(code, err, "run.toml", needle)
    assert len(shown) < 1_200  # (a 200k-number list was echoed whole: a 600 kB line)


def test_an_explicit_hash_block_size_that_divides_is_kept(tmp_path):
    from kvtrace.replay.run import RunSpec, engine_preset

    cfg = tmp_path / "run.toml"
    cfg.write_text("[cache]\nhash_block_size = 64\n")
    assert engine_preset(RunSpec("gen:chat", config_file=str(cfg))).cache_config.hash_block_size == 64
    # without one, a --block-size shrinks the preset's own unit to divide it (documented)
    assert engine_preset(RunSpec("gen:chat", block_size=48)).cache_config.hash_block_size == 16


@pytest.mark.parametrize("argv, needle", [
    (["--no-content", "--block-size", str(2**70)], "--block-size"),
    (["--policy", "belady"], "--policy: belady: applies to cache-only mode only"),
])
def test_engine_mode_refuses_what_it_would_ignore_or_cannot_hold(capsys, argv, needle):
    code, _, err = run(["replay", "gen:chat", "--limit", "2", *argv], capsys)
    assert_one_line(code, err, needle)


def test_azure_numbers_are_ascii_decimal(tmp_path, capsys):
    for field, needle in (("3_74", "ContextTokens"), ("\u0663\u0667\u0664", "ContextTokens")):
        csv = tmp_path / "azure.csv"
        csv.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,{field},44\n")
        code, _, err = run(["replay", str(csv)], capsys)
        assert_one_line(code, err, "azure.csv:2", needle)
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n\u0662\u0660\u0662\u0663-11-16 18:15:46.6,374,44\n")
    code, _, err = run(["replay", str(csv)], capsys)
    assert_one_line(code, err, "azure.csv:2", "TIMESTAMP")


def test_a_weka_directory_with_an_unreadable_or_unnamed_file_is_one_line(tmp_path, capsys):
    import shutil

    sample = Path(__file__).resolve().parents[1] / "data" / "weka_sample" / "trace_0211.json"
    d = tmp_path / "wk"
    d.mkdir()
    shutil.copy(sample, d / "a.json")
    odd = os.path.join(os.fsencode(d), b"\xff\xfe.json")
    shutil.copy(sample, odd)
    for argv in (["replay", str(d), "--mode", "cache-only"], ["convert", str(d), "-o", str(tmp_path / "o.jsonl")]):
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, "file name is not UTF-8 text")
    os.unlink(odd)
    shutil.copy(sample, d / "b.json")
    with unreadable(d / "b.json"):
        code, _, err = run(["replay", str(d), "--mode", "cache-only"], capsys)
    # (met by the first requests' read, before the file's bytes are hashed)
    assert_one_line(code, err, "b.json: cannot open: Permission denied")


@contextlib.contextmanager
def unreadable(path: Path):
    """``path`` unreadable; as root, a FIFO-free stand-in: its open is made to fail."""
    import builtins

    real = builtins.open

    def refusing(file, *args, **kwargs):
        if os.fspath(file) == os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real(file, *args, **kwargs)

    builtins.open = refusing
    try:
        yield
    finally:
        builtins.open = real


@pytest.mark.parametrize("db", ["duckdb:y.duckdb", "md:foo", "motherduck:foo"])
def test_a_store_path_duckdb_would_read_as_a_url_is_refused(tmp_path, capsys, monkeypatch, db):
    """duckdb:y.duckdb wrote y.duckdb (DuckDB strips the prefix); md:foo fetched an extension."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", db], capsys)
    assert_one_line(code, err, db, "write ./")
    assert os.listdir(tmp_path) == []
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", f"./{db}"], capsys)
    assert code == 0, err


def _store_with_a_run(tmp_path, capsys) -> Path:
    db = tmp_path / "keep.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", str(db)], capsys)
    assert code == 0, err
    return db


def test_no_output_replaces_a_store_or_its_own_input(tmp_path, capsys):
    """calibrate -o onto its --from CSV replaced the measurements with TOML; convert and
    generate -o onto a store replaced every run."""
    db = _store_with_a_run(tmp_path, capsys)
    before = db.read_bytes()
    code, _, err = run(["generate", "chat", "-o", str(db), "--requests", "3"], capsys)
    assert_one_line(code, err, "keep.duckdb: is a DuckDB database")
    trace = tmp_path / "t.jsonl"
    assert run(["generate", "chat", "-o", str(trace), "--requests", "3"], capsys)[0] == 0
    code, _, err = run(["convert", str(trace), "-o", str(db)], capsys)
    assert_one_line(code, err, "keep.duckdb: is a DuckDB database")
    assert db.read_bytes() == before
    csv = Path(__file__).resolve().parents[1] / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"
    mine = tmp_path / "m.csv"
    mine.write_bytes(csv.read_bytes())
    code, out, err = run(["calibrate", "--from", str(mine), "-o", str(mine)], capsys)
    assert code == 2 and "m.csv: is also" in err and "Traceback" not in err
    assert out == ""  # refused before the fit, not after its report
    assert mine.read_bytes() == csv.read_bytes()
    code, _, err = run(["convert", str(trace), "-o", str(trace)], capsys)
    assert_one_line(code, err, "t.jsonl: is also")


def test_capture_refuses_a_trace_out_that_is_its_store_before_listening(tmp_path, capsys):
    db = _store_with_a_run(tmp_path, capsys)
    before = db.read_bytes()
    for out, store in ((db, db), (db, tmp_path / "other.duckdb"), (tmp_path / "new.duckdb", tmp_path / "new.duckdb")):
        code, _, err = run(["capture", "vllm", "--endpoint", "tcp://127.0.0.1:1", "--db", str(store),
                            "--trace-out", str(out), "--duration", "0.1"], capsys)
        assert_one_line(code, err, "is a DuckDB database" if store != out else "is also")
    assert db.read_bytes() == before
    assert not (tmp_path / "new.duckdb").exists() and not (tmp_path / "other.duckdb").exists()
    # its write-ahead log, which DuckDB makes only later (the trace was renamed over it, then
    # removed at the checkpoint): refused before listening, existing or not, store or not
    for store in (tmp_path / "fresh.duckdb", db):
        code, _, err = run(["capture", "vllm", "--endpoint", "tcp://127.0.0.1:1", "--db", str(store),
                            "--trace-out", f"{store}.wal", "--duration", "0.1"], capsys)
        assert_one_line(code, err, "is the write-ahead log of the DuckDB database")
    assert not (tmp_path / "fresh.duckdb").exists()


@pytest.mark.parametrize("argv", [["--block-size", "0"], ["--retention", "-1"], ["--limit", "-1"],
                                  ["--capacity-blocks", str(2**70)]])
def test_conformance_refuses_a_setting_before_it_loads_vllm(tmp_path, argv):
    """Each of these took 12-15 s to refuse: vLLM was loaded first."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvtrace import cli\nsys.argv = ['kvtrace', 'conformance', 'gen:chat', *sys.argv[1:]]\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    print(e.code, 'vllm' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["2", "False"], done
    assert_one_line(2, done.stderr, argv[0])


def test_a_second_interrupt_during_the_flush_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """Ctrl-C, then Ctrl-C again while the store was flushing: DuckDB's 'Query interrupted'
    escaped with a traceback (exit 1)."""
    from kvtrace.replay import run as replay_run
    from kvtrace.store.writer import Store

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def flush_interrupted(self):
        raise RuntimeError("Query interrupted")

    monkeypatch.setattr(replay_run, "_run_cache_only", interrupted)
    monkeypatch.setattr(Store, "flush", flush_interrupted)
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db",
                        str(tmp_path / "s.duckdb")], capsys)
    assert code == 130 and err.strip() == "kvtrace: error: interrupted; what was recorded is kept", err


def test_dashboard_refuses_a_run_the_store_lacks_before_serving(tmp_path, capsys, monkeypatch):
    import kvtrace.dashboard

    def serving(*args, **kwargs):
        raise AssertionError("the dashboard was started")

    monkeypatch.setattr(kvtrace.dashboard, "launch", serving)
    db = _store_with_a_run(tmp_path, capsys)
    code, _, err = run(["dashboard", "--db", str(db), "--run", "r99"], capsys)
    assert_one_line(code, err, "--run: r99: no such run in")
    code, _, err = run(["dashboard", "--db", str(db), "--run", "r1", "--compare", "r7"], capsys)
    assert_one_line(code, err, "--compare: r7: no such run in")


@pytest.mark.parametrize("as_json", [[], ["--json"]])
def test_a_sweep_baseline_no_combination_has_is_refused_before_the_sweep(capsys, monkeypatch, as_json):
    """With --json it was ignored (exit 0, no baseline); without, told after every replay ran."""
    from kvtrace.replay import sweep

    def ran(*args, **kwargs):
        raise AssertionError("the sweep ran")

    monkeypatch.setattr(sweep, "run_sweep", ran)
    code, _, err = run(["sweep", "gen:chat", "--limit", "2", "--mode", "cache-only", "--param",
                        "capacity_blocks=50,100", "--baseline", "capacity_blocks=70", *as_json], capsys)
    assert_one_line(code, err, "--baseline", "capacity_blocks=70 is not one of the swept values")


@pytest.mark.parametrize("argv", [["--top", "-1"], ["--resamples", "0"], ["--seed", "-1"], ["--percentiles", "-1"]])
def test_diff_refuses_its_options_before_the_comparison_loads(tmp_path, argv):
    """Each took 0.8-1.3 s to refuse: polars and the store were loaded first."""
    import subprocess
    import sys

    (tmp_path / "s.duckdb").write_bytes(b"")  # (a --db that exists: the options are what is wrong)
    code = ("import sys\nfrom kvtrace import cli\nsys.argv = ['kvtrace', 'diff', 'r1', 'r2', *sys.argv[1:]]\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    print(e.code, 'polars' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, "--db", str(tmp_path / "s.duckdb"), *argv], check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done
    assert_one_line(2, done.stderr, argv[0])


@pytest.mark.parametrize("text, needle", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,374,44,9\n",
     "azure.csv:2: expected 3 columns, got 4"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens,TIMESTAMP\n2023-11-16 18:15:46.6,374,44,x\n",
     "azure.csv:1: column TIMESTAMP appears 2 times"),
])
def test_an_azure_row_or_header_that_cannot_be_read_one_way_is_refused(tmp_path, capsys, text, needle):
    csv = tmp_path / "azure.csv"
    csv.write_text(text)
    code, _, err = run(["replay", str(csv)], capsys)
    assert_one_line(code, err, needle)


@pytest.mark.parametrize("key", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
@pytest.mark.parametrize("value", ["garbage::::", "host:99999", "host:"])
def test_a_malformed_grpc_endpoint_is_refused_before_anything_is_recorded(tmp_path, capsys, monkeypatch, key, value):
    """With OTLP/gRPC the endpoint went unchecked: the replay ran, then every span failed."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv(key, value)
    db = tmp_path / "runs.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", str(db)], capsys)
    assert_one_line(code, err, key, value, "expected HOST:PORT")
    assert not db.exists()


# --- a re-probe of the guards above --------------------------------------------------------------
def test_convert_never_replaces_a_file_of_its_directory_input(tmp_path, capsys):
    import shutil

    d = tmp_path / "wk"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "weka_sample", d)
    before = (d / "trace_0211.json").read_bytes()
    code, _, err = run(["convert", str(d), "-o", str(d / "trace_0211.json")], capsys)
    assert_one_line(code, err, "trace_0211.json: is also")
    assert (d / "trace_0211.json").read_bytes() == before


def test_a_duckdb_write_ahead_log_is_not_replaced(tmp_path, capsys):
    db = _store_with_a_run(tmp_path, capsys)
    wal = tmp_path / "keep.duckdb.wal"
    wal.write_bytes(b"uncheckpointed commits")
    trace = tmp_path / "t.jsonl"
    assert run(["generate", "chat", "-o", str(trace), "--requests", "3"], capsys)[0] == 0
    code, _, err = run(["convert", str(trace), "-o", str(wal)], capsys)
    assert_one_line(code, err, "is the write-ahead log of the DuckDB database")
    assert wal.read_bytes() == b"uncheckpointed commits" and db.exists()


def test_dev_stdout_is_written_where_the_redirection_points(tmp_path):
    """-o /dev/stdout with stdout appended to a file replaced the file (a rename over the
    link's target): what it held, and what the shell wrote after, was gone."""
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    subprocess.run([sys.executable, "-m", "kvtrace.cli", "generate", "chat", "-o", str(trace), "--requests", "3"],
                   check=True, capture_output=True)
    log = tmp_path / "log.txt"
    log.write_text("before\n")
    script = f"{sys.executable} -m kvtrace.cli convert {trace} -o /dev/stdout 2>/dev/null; echo after"
    subprocess.run(["sh", "-c", f"({script}) >> {log}"], check=True)
    lines = log.read_text().splitlines()
    assert lines[0] == "before" and lines[-1] == "after" and len(lines) == 2 + 1 + 3, lines


def test_a_weka_directory_named_like_a_glob_is_read_as_itself(tmp_path, capsys):
    import shutil

    sample = Path(__file__).resolve().parents[1] / "data" / "weka_sample"
    d = tmp_path / "wk[1]"
    shutil.copytree(sample, d)
    code, out, err = run(["convert", str(d), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert code == 0, err
    star = tmp_path / "g" / "d*"
    star.mkdir(parents=True)
    shutil.copy(sample / "trace_0211.json", star)
    shutil.copytree(sample, tmp_path / "g" / "dx")  # a sibling the glob would have matched
    code, _, err = run(["convert", str(star), "-o", str(tmp_path / "p.jsonl")], capsys)
    assert code == 0, err
    only = len((tmp_path / "p.jsonl").read_text().splitlines()) - 1
    code, _, err = run(["convert", str(sample / "trace_0211.json"), "-o", str(tmp_path / "q.jsonl")], capsys)
    assert code == 0 and only == len((tmp_path / "q.jsonl").read_text().splitlines()) - 1


@pytest.mark.parametrize("baseline", ["retention=None", "retention=00"])
def test_a_sweep_baseline_in_another_spelling_of_a_swept_value_is_taken(capsys, baseline):
    code, out, err = run(["sweep", "gen:chat", "--limit", "2", "--workers", "1", "--no-content", "--param",
                          "retention=none,0", "--baseline", baseline], capsys)
    assert code == 0, err


@pytest.mark.parametrize("db, ok", [("run-10:30.duckdb", True), ("a.b:x.duckdb", True), ("my_run:x.duckdb", False)])
def test_store_paths_follow_duckdbs_own_rule_for_prefixes(tmp_path, capsys, monkeypatch, db, ok):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", db], capsys)
    if ok:
        assert code == 0, err
    else:
        assert_one_line(code, err, db, "write ./")


@pytest.mark.parametrize(("argv", "shown"), [
    (["--otlp-endpoint", "http://user:s3cret@[::1"], "http://user:***@[::1"),
    (["--otlp-endpoint", "http://user:s3/cret@127.0.0.1:1/v1/traces"], "http://user:***@127.0.0.1:1"),  # (a /)
    (["--db", "clickhouse://user:s3/cret@h/db"], "clickhouse://user:***@h/db"),
    (["--db", " clickhouse://user:s3cret@h/db"], "clickhouse:/user:***@h"),  # (a path: normalised to one /)
])
def test_a_password_in_a_url_is_never_in_the_error_line(capsys, argv, shown):
    code, _, err = run(["replay", "gen:chat", "--limit", "2", *argv], capsys)
    assert_one_line(code, err, shown)
    assert "s3" not in err and "cret" not in err


def test_a_store_named_as_another_stores_write_ahead_log_is_refused(tmp_path, capsys):
    # DuckDB reads <file>.wal as <file>'s log: a store there was replayed into <file> and deleted
    trace = write_lines(tmp_path / "t.jsonl", [MOONCAKE_LINE])
    a = tmp_path / "a.duckdb"
    assert run(["replay", trace, "--mode", "cache-only", "--db", str(a)], capsys)[0] == 0
    code, _, err = run(["replay", trace, "--mode", "cache-only", "--db", f"{a}.wal"], capsys)
    assert_one_line(code, err, "a.duckdb.wal: is the write-ahead log's name of the store")
    b = tmp_path / "b.duckdb"
    assert run(["replay", trace, "--mode", "cache-only", "--db", f"{b}.wal"], capsys)[0] == 0  # (no b.duckdb yet)
    for argv in (["replay", trace, "--mode", "cache-only", "--db", str(b)], ["demo", "--db", str(b)]):
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, "b.duckdb.wal is a DuckDB database of its own")
    assert run(["runs", "--db", f"{b}.wal"], capsys)[0] == 0 and not b.exists()


def test_groups_without_mamba_drop_the_presets_prefill_checkpoint(tmp_path, capsys):
    # the default preset's checkpoint (a Mamba setting) was kept and then refused, blaming
    # the very key that turned it off
    cfg = tmp_path / "fa.toml"
    cfg.write_text('[cache]\ngroups = [{type="full_attention", block_size=512}]\nretention_interval = "none"\n'
                   "num_prefill_checkpoint_blocks = 0\n")
    code, out, err = run(["replay", "gen:chat", "--limit", "3", "--config", str(cfg), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["requests"] == 3


def test_the_default_run_name_names_the_preset_a_config_file_chose(tmp_path, capsys):
    cfg = tmp_path / "pd.toml"
    cfg.write_text('preset = "dense-attention"\n')
    db = tmp_path / "pn.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(cfg), "--db", str(db)], capsys)
    assert code == 0, err
    from kvtrace.store import read

    assert read.runs(db)["name"].to_list() == ["gen:chat engine dense-attention config=pd.toml"]


def test_dots_outside_keys_are_no_deep_key(tmp_path, capsys):
    # a comment, a string, a multi-line string and an array of floats were counted as key parts
    dots = "." * 80
    cfg = tmp_path / "ok.toml"
    cfg.write_text(f'# {dots}\n[scheduler]  # {dots}\nmax_num_seqs = 16\n[cache]\nwithout = []\n'
                   f'# """ {dots}\n[cost_model]\nname = "h200-kimi-hybrid"\n')
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(cfg)], capsys)
    assert code == 0, err
    from kvtrace.replay.config_file import _check_key_depth

    _check_key_depth(f'a = "{dots}"\nb = \'{dots}\'\nc = """\n{dots}\n"""\nd = [{", ".join(["1.5"] * 80)}]\n'
                     f'e = {{f = [{", ".join(["2.5"] * 80)}], g.h = 1}}\n', "x.toml")  # (refuses nothing)


def test_a_request_too_long_to_re_block_is_refused_before_its_tokens_are_made(tmp_path, capsys):
    """A 100-byte native trace (one request of 2^27 tokens in one 2^27-token block) replayed
    in cache-only mode at 16-token blocks took 62 s and 4.2 GB, then failed on the pool."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"kvtrace_trace":1}\n{"arrival_ns":0,"input_length":134217728,"output_length":1,'
                     '"hash_ids":[1],"block_size":134217728}\n')
    code, _, err = run(["replay", str(trace), "--mode", "cache-only", "--block-size", "16"], capsys)
    assert_one_line(code, err, "134,217,728 tokens) is 8,388,608 blocks of 16 tokens", "--block-size")


@pytest.mark.parametrize("command", [["generate", "chat", "--requests", "3"], ["convert", "TRACE"],
                                     ["calibrate", "--from", "CSV"]])
def test_an_output_path_ending_in_a_slash_is_no_file(tmp_path, capsys, command):
    """``-o newdir/`` wrote a file named newdir (a shell redirection says 'Is a directory')."""
    trace = tmp_path / "t.jsonl"
    assert run(["generate", "chat", "-o", str(trace), "--requests", "3"], capsys)[0] == 0
    csv = Path(__file__).resolve().parents[1] / "data" / "calibration"
    csv = next(p for p in sorted(csv.iterdir()) if p.suffix == ".csv")
    command = [str(trace) if c == "TRACE" else str(csv) if c == "CSV" else c for c in command]
    code, _, err = run([*command, "-o", f"{tmp_path}/newdir/"], capsys)
    assert_one_line(code, err, "newdir/: names a directory, which does not exist")
    assert not (tmp_path / "newdir").exists()


def test_a_pool_too_small_for_a_request_names_every_place_its_size_is_set(tmp_path, capsys):
    """The pool's size from a --config file was blamed on --capacity-blocks alone."""
    config = tmp_path / "small.toml"
    config.write_text("[cache]\nnum_gpu_blocks = 4\n")
    code, _, err = run(["replay", "gen:chat", "--limit", "3", "--config", str(config)], capsys)
    assert_one_line(code, err, "request chat0-t0 (895 prompt tokens) cannot be scheduled")
    assert "cache.num_gpu_blocks in --config" in err


def test_storage_sized_by_flags_names_the_flags_not_the_file_keys_they_replaced(tmp_path, capsys):
    """A file's num_gpu_blocks or groups replaced by --capacity-blocks and --block-size took
    the blame for storage the flags sized."""
    for line in ("num_gpu_blocks = 100", 'groups = [{type="full_attention", block_size=64}]'):
        cfg = tmp_path / "run.toml"
        cfg.write_text(f"[cache]\n{line}\n")
        code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(cfg), "--preset", "dense-attention",
                            "--capacity-blocks", "4000000", "--block-size", "4096"], capsys)
        text = assert_one_line(code, err, "KV storage", "--capacity-blocks")
        assert "run.toml" not in text and "cache." not in text, text


def test_a_clock_past_int64_names_the_config_file_whose_cost_model_made_it(tmp_path, capsys):
    """The clock's refusal named the model alone ("cost model mine: ..."), not the file that gave it."""
    cfg = tmp_path / "cm.toml"
    cfg.write_text('[cost_model]\nname = "mine"\nstep_overhead_ns = 1000000000000\ntoken_ns = 1000000000000\n'
                   "attn_pair_ps = 1\nkv_read_ps = 1\ndecode_seq_ns = 1\n")
    trace = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"
    code, _, err = run(["replay", str(trace), "--limit", "1000", "--no-content", "--config", str(cfg)], capsys)
    assert_one_line(code, err, f"{cfg}: cost_model: mine: the virtual clock passed 2^63 ns")


@pytest.mark.parametrize("argv, flag", [
    (["runs", "--db", "a.duckdb", "--db", "b.duckdb"], "--db"),
    (["replay", "gen:chat", "--limit", "2", "--seed", "1", "--seed=2"], "--seed"),
    (["export", "--db", "a.duckdb", "--run", "r1", "--run", "r2", "--parquet", "x"], "--run"),
])
def test_an_option_of_one_value_given_twice_is_refused(tmp_path, capsys, argv, flag):
    """click kept the last: `runs --db a.duckdb --db b.duckdb` read b alone without a word."""
    code, _, err = run(argv, capsys)
    assert_one_line(code, err, f"{flag}: given more than once")


def test_help_beside_an_option_given_twice_is_the_help(capsys):
    code, out, _err = run(["generate", "--help", "--seed", "1", "--seed", "2"], capsys)
    assert code == 0 and "Usage: kvtrace generate" in out
    # --help as a value (a run's name), or after --, is no help: the repeat is still refused
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--seed", "1", "--seed", "2", "--name", "--help"], capsys)
    assert_one_line(code, err, "--seed: given more than once")


def test_repeatable_options_and_flags_given_twice_still_run(capsys):
    code, out, err = run(["replay", "gen:chat", "--limit", "2", "--no-content", "--without",
                          "shared-prefix-pinning", "--without", "transient-checkpoint-retention", "--json", "--json"],
                         capsys)
    assert code == 0 and json.loads(out)["requests"] == 2, err


@pytest.mark.parametrize("argv", [["export", "--run", "r99", "--parquet", "{tmp}/out"], ["diff", "r1", "r99"],
                                  ["dashboard", "--run", "r99"]])
def test_a_store_path_with_a_newline_is_named_as_typed(tmp_path, capsys, argv):
    """The one-line error joined the path's newline into a space, naming another file (and
    suggesting a command for it)."""
    db = tmp_path / "n\nl.duckdb"
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--mode", "cache-only", "--db", str(db)], capsys)
    assert code == 0, err
    code, _, err = run([a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--db", str(db)], capsys)
    assert_one_line(code, err, "n\\nl.duckdb")
    assert "n l.duckdb" not in err


@pytest.mark.parametrize("command", [["runs"], ["export", "--run", "r1", "--parquet", "out"], ["dashboard"]])
def test_a_store_to_read_that_duckdb_reads_as_a_service_is_told_so_as_a_writer_is(tmp_path, capsys, monkeypatch,
                                                                                   command):
    """`runs --db md:foo` said 'no such database (run kvtrace replay TRACE --db md:foo)', a
    command that is refused: md: is MotherDuck to DuckDB, as the writer says."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run([command[0], "--db", "md:foo", *command[1:]], capsys)
    assert_one_line(code, err, "md:foo: expected a store file path, or chdb:DIR")
    assert "write ./md:foo for a file of that name" in err and "kvtrace replay" not in err
