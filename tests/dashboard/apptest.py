"""Driving the dashboard under Streamlit's AppTest: open a page on a store, read its charts."""

from __future__ import annotations

import json
from pathlib import Path

from streamlit.components.v2 import manifest_scanner
from streamlit.testing.v1 import AppTest

from kvtrace.dashboard import DB_ENV

APP = str(Path(__file__).resolve().parents[2] / "kvtrace" / "dashboard" / "app.py")


def _scanned_once():
    """Streamlit's scan of the installed packages for components, made once per test process.

    Each AppTest's first run reads the metadata of every installed distribution (about 250
    here, with vLLM's and Ray's): about 0.35 s an AppTest, half of the dashboard tests' time.
    What it finds depends on the installed packages only, which no test changes; a server
    (`kvtrace dashboard`) scans once when it starts."""
    scan = manifest_scanner.scan_component_manifests
    if getattr(scan, "kvtrace_once", False):  # (this module imported under two names)
        return
    found = scan()

    def once(max_workers=None):
        return list(found)

    once.kvtrace_once = True  # type: ignore[attr-defined]
    manifest_scanner.scan_component_manifests = once


_scanned_once()


def app_test(timeout: float = 120) -> AppTest:
    """The dashboard's app under AppTest (not yet run)."""
    return AppTest.from_file(APP, default_timeout=timeout)


def render(db: str, monkeypatch, page: str = "overview", **params: str) -> AppTest:
    """The app on ``db`` with ``params`` in the URL, switched to ``page`` (a views/ file
    stem); no exception raised."""
    monkeypatch.setenv(DB_ENV, db)
    at = app_test()
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

