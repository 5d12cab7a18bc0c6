"""Hostile text on the pages: what Streamlit's own markdown rewrites, and links whose
values name nothing (empty, unknown, 100,000 characters, not a number)."""

from __future__ import annotations

import html
import re

import pytest
from apptest import render
from markdown_it import MarkdownIt

from kvtrace.dashboard import ui
from kvtrace.store import read
from tests.support.markdown import shown

# What Streamlit 1.67's markdown rewrites after parsing, in text outside code spans, however
# the text was escaped: its logo, an icon, an emoji (wherever the element's source holds a
# shortcode), an arrow or sign; and ':material/' anywhere in the source, code spans included.
_AFTER_PARSING = re.compile(r":streamlit:|:material_\w+:|:[\w+-]+:|(?:^|(?<=\s))(?:<->|->|<-|--|>=|<=|~=)(?=\s|$)")
_CODE = re.compile(r"<code>.*?</code>", re.S)


def streamlit_rewrites(markdown: str) -> list[str]:
    """What Streamlit would draw otherwise than a CommonMark parser shows ``markdown``."""
    found = [":material/"] if ":material/" in markdown else []
    text = html.unescape(re.sub(r"<[^>]+>", " ", _CODE.sub(" ", MarkdownIt().render(markdown))))
    return found + _AFTER_PARSING.findall(text)


PLUGINS = "n :streamlit: :material_home: :smile: a -> b -- c >= d <-> e :material/home: `t`"


def plugin_store(db: str) -> str:
    """Two runs whose name, id, trace, cost model and a behaviour hold PLUGINS."""
    from kvtrace.store.writer import Store

    with Store.open(db) as store:
        for suffix in ("", " B"):
            run = store.create_run(f"{PLUGINS}{suffix}", run_id=f"id {PLUGINS}{suffix}", mode="otlp",
                                   trace_source=f"t {PLUGINS}", config={"cost_model": {"name": f"cm {PLUGINS}"}},
                                   behaviours=[f"b {PLUGINS}", "x"])
            store.finish_run(run)
    return db


@pytest.mark.parametrize("text", [PLUGINS, ":+1:", "x:y:z", "--", "<->", " -> ", ":material/x:", "gen:mixed"])
def test_literal_and_code_leave_streamlit_nothing_to_rewrite(text):
    for markdown in (ui.literal(text), ui.code(text), f"a {ui.literal(text)} `:smile:` {ui.code(text)} b"):
        assert not streamlit_rewrites(markdown), markdown
    # what a reader sees (and copies, but for zero-width joiners) is the text as typed
    assert shown(ui.literal(text)).replace("\u2060", "") == text.strip()
    assert shown(ui.code(text)).replace("\u2060", "") == text.strip()


def test_names_ids_and_links_reach_streamlit_with_nothing_it_rewrites(tmp_path, monkeypatch):
    """A run's name, id, trace, backend, cost model and behaviours, and a link's run: no
    logo, icon, emoji or arrow made of them in the browser (Streamlit rewrites the parsed text)."""
    db = plugin_store(str(tmp_path / "plugins.duckdb"))
    pages = [render(db, monkeypatch, run=f"id {PLUGINS}"),
             render(db, monkeypatch, "latency", run=f"id {PLUGINS}"),
             render(db, monkeypatch, "compare", run=f"id {PLUGINS}", b=f"id {PLUGINS} B"),
             render(db, monkeypatch, run=f"gone {PLUGINS}")]
    whole = 0
    for at in pages:
        for el in [*at.markdown, *at.caption, *at.warning, *at.info, *at.error]:
            assert not streamlit_rewrites(el.value), el.value
            whole += shown(el.value).replace("\u2060", "").count(PLUGINS)
    assert whole >= 6  # the overview's name, id, trace, cost model, behaviours; the unknown run's warning


def test_a_link_value_is_quoted_whole_or_cut_and_an_empty_one_is_named(stale_db, monkeypatch):
    long = "x" * 100_000
    at = render(stale_db, monkeypatch, run=long)
    (warning,) = [shown(w.value) for w in at.warning]
    assert warning.startswith(f"Run {'x' * 120}… (100,000 characters) from the link is not in")
    at = render(stale_db, monkeypatch, run="")
    (warning,) = [shown(w.value) for w in at.warning]
    assert warning.startswith("Run (empty) from the link is not in")
    assert not at.metric  # no run shown in its place


def _warnings(at) -> list[str]:
    return [shown(w.value) for w in at.warning]


def test_a_linked_stale_hash_or_group_that_is_not_in_the_run_is_named(stale_db, monkeypatch):
    run = next(r for r in read.runs(stale_db)["run_id"] if read.stale_hashes(stale_db, r).height)
    at = render(stale_db, monkeypatch, "stale", run=run, stale="no-such-hash")
    assert "Stale hash no-such-hash from the link is not in this run: the first one a request wrote is shown " \
           "instead." in _warnings(at)
    at.run()  # the link now names the hash shown: said once
    assert not _warnings(at)
    at = render(stale_db, monkeypatch, "hit_rate", run=run, group="7")
    assert "KV group 7 from the link is not in this run: every group is shown instead." in _warnings(at)
    assert at.query_params["group"] in ("each", ["each"])


@pytest.mark.parametrize(("t0", "t1", "said"), [
    ("abc", None, "Time window t0=abc from the link is not a number of seconds: ignored."),
    ("1", "nan", "Time window t1=nan from the link is not a number of seconds: ignored."),
    ("1e400", "inf", "Time window t0=1e400, t1=inf from the link is not a number of seconds: ignored."),
    ("1e9", None, "The time window from the link holds nothing of this run"),
])
def test_a_linked_time_window_that_is_no_window_is_named(stale_db, monkeypatch, t0, t1, said):
    run = next(iter(read.runs(stale_db)["run_id"]))
    params = {"t0": t0} | ({"t1": t1} if t1 is not None else {})
    at = render(stale_db, monkeypatch, "hit_rate", run=run, **params)
    assert any(w.startswith(said) for w in _warnings(at)), _warnings(at)
    assert not at.error
