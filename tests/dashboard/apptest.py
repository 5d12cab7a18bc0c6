"""Driving the dashboard under Streamlit's AppTest: open a page on a store, read its charts."""

from __future__ import annotations

import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

from kvtrace.dashboard import DB_ENV

APP = str(Path(__file__).resolve().parents[2] / "kvtrace" / "dashboard" / "app.py")


def render(db: str, monkeypatch, page: str = "overview", **params: str) -> AppTest:
    """The app on ``db`` with ``params`` in the URL, switched to ``page`` (a views/ file
    stem); no exception raised."""
    monkeypatch.setenv(DB_ENV, db)
    at = AppTest.from_file(APP, default_timeout=120)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    if page != "overview":
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def traces(at: AppTest) -> list[dict]:
    """Every plotly trace on the page, as the browser would get it."""
    out = []
    for el in at.get("plotly_chart"):
        out += json.loads(el.proto.spec)["data"]
    return out

