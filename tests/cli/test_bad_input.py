"""What a user can type gets one line naming the file, line, key or flag, and exit 2.

In-process (``kvtrace.cli.main`` with its own argv), so the many cases stay fast; the
real subprocess path is covered in test_cli.py. Every case asserts the exit code, that
stderr is exactly one ``kvtrace: error:`` line naming the place, and that no traceback
was printed.
"""

from __future__ import annotations

import json
import sys

import pytest

from kvtrace import cli

MOONCAKE_LINE = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    old = sys.argv
    sys.argv = ["kvtrace", *argv]
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


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
])
def test_toml_cache_values_name_the_file_and_key(tmp_path, capsys, line, key):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"[cache]\n{line}\n")
    code, _, err = run(["replay", "gen:chat", "--limit", "2", "--config", str(cfg)], capsys)
    assert_one_line(code, err, "run.toml", key)


@pytest.mark.parametrize("text, key", [
    ("[scheduler]\nmax_num_seqs = 0\n", "scheduler.max_num_seqs"),
    ("[scheduler]\nmax_num_batched_tokens = -1\n", "scheduler.max_num_batched_tokens"),
    ('preset = "nope"\n', "preset"),
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


@pytest.mark.parametrize("argv, flag", [
    (["--capacity-blocks", "-5"], "--capacity-blocks: -5"),
    (["--preset", "nope"], "--preset: 'nope' is not one of"),
    (["--without", "nope"], "--without: 'nope' is not one of"),
    (["--limit", "-1"], "--limit: -1"),
    (["--block-size", "549755813888"], "--block-size"),
    (["--preset", "dense-attention", "--retention", "0"], "--retention: 0"),
])
def test_flags_name_themselves(capsys, argv, flag):
    limit = [] if argv[0] == "--limit" else ["--limit", "2"]
    code, _, err = run(["replay", "gen:chat", *limit, *argv], capsys)
    assert_one_line(code, err, flag)


@pytest.mark.parametrize("argv, needle", [
    (["replay"], "Missing argument"),
    (["replay", "gen:chat", "--no-such-flag"], "No such option"),
    (["replay", "gen:chat", "--limit", "many"], "--limit: Input should be a valid integer"),
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
