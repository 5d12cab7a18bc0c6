"""reprobe33: `kvtrace demo --db clickhouse://u:PASSWORD@...` printed the password twice: in the
closing dashboard command (the README's one exception, so that it works when pasted) and in the
line before it, 'N runs recorded in clickhouse://u:PASSWORD@...', which every other line names
without it (9621bb6)."""

from __future__ import annotations

import io

from rich.console import Console

from kvtrace.compare import demo

URL = "clickhouse://alice:S3CRET@db.example:8123/kv"


def test_the_demos_recorded_line_names_a_server_without_its_password(monkeypatch):
    monkeypatch.setattr(demo.Store, "open", lambda db: type("S", (), {"close": lambda self: None})())
    monkeypatch.setattr(demo, "_replay_all", lambda db, target, specs, seed, progress: demo.DemoResult(db))
    out = io.StringIO()
    demo.run_demo(URL, progress=False, console=Console(file=out, width=200))
    lines = out.getvalue().splitlines()
    recorded = next(line for line in lines if "runs recorded in" in line)
    assert recorded == "0 runs recorded in clickhouse://alice@db.example:8123/kv. Open the dashboard:"
    assert lines[-1] == f"kvtrace dashboard --db {URL}"  # (the README's exception: pasted, it works)
