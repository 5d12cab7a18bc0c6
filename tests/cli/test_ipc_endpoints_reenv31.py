"""``capture vllm``'s ipc:// endpoints ZMQ refuses only once the capture has made its store
and run (re-probe reenv31 of 03ff71b, which checked the path as given): an empty path
(``ipc://``) or abstract name (``ipc://@``), 'Invalid argument', and a DP rank's own path past
the 107 bytes a Unix socket's address holds (vLLM appends _dp{rank} to an ipc path holding
'inproc'), 'File name too long': each left a failed run behind. Refused first, one line,
nothing written."""

from __future__ import annotations

import pytest

from tests.cli.support import assert_one_line, run

INPROC_PATH = "ipc:///tmp/inproc" + "z" * 95  # (106 bytes: rank 0's fits, rank 1's _dp1 does not)


@pytest.mark.parametrize(("extra", "needles"), [
    (["--endpoint", "ipc://"], ["--endpoint: ipc://:", "got no path"]),
    (["--endpoint", "ipc://@"], ["--endpoint: ipc://@:", "got no path"]),
    (["--endpoint", "tcp://127.0.0.1:5557", "--replay-endpoint", "ipc://@"], ["--replay-endpoint", "got no path"]),
    (["--endpoint", INPROC_PATH, "--dp-size", "2"], [INPROC_PATH + "_dp1", "110 bytes, past the 107"]),
])
def test_refused_before_the_store_is_made(tmp_path, capsys, extra, needles):
    db = tmp_path / "cap.duckdb"
    code, out, err = run(["capture", "vllm", "--db", str(db), "--duration", "1", *extra], capsys)
    assert_one_line(code, err, *needles)
    assert not out and not db.exists()


def test_an_abstract_name_is_still_taken(tmp_path, capsys):
    db = tmp_path / "cap.duckdb"
    code, _, err = run(["capture", "vllm", "--db", str(db), "--duration", "0.2", "--endpoint", "ipc://@kvtrace-none"],
                       capsys)
    assert code in (0, 1) and "error" not in err, err
    assert db.exists()
