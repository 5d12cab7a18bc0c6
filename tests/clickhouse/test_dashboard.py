"""Every dashboard page under Streamlit's AppTest on chdb stores: the replay written
directly, the replay read from the collector's otel_traces, and the story runs (stale
hashes, divergent outputs, attributed misses, one run still running)."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from kvtrace.dashboard import DB_ENV
from kvtrace.store import read
from tests.dashboard.apptest import app_test

PAGES = ["overview", "hit_rate", "evictions", "stale", "latency", "capacity", "compare"]


def render(db: str, monkeypatch, page: str, run_id: str) -> AppTest:
    monkeypatch.setenv(DB_ENV, db)
    at = app_test(60)
    at.query_params["run"] = run_id
    at.run()
    if page != "overview":
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert at.title[0].value  # the page ran to its title
    return at


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_chdb(ch_stores, story_stores, monkeypatch, page):
    (_, story), story_runs = story_stores
    for db, run_id in ((ch_stores.direct, ch_stores.run_on), (ch_stores.collected, ch_stores.run_collected),
                       (story, story_runs[1]), (story, story_runs[2])):
        at = render(db, monkeypatch, page, run_id)
        assert len(at.caption) >= len(at.get("plotly_chart"))  # every chart has its caption
        if page == "overview" and read.run(db, run_id)["status"] == "complete":  # headline numbers
            assert any(m.label == "Requests" for m in at.metric)
    assert read.runs(story).height == 3
