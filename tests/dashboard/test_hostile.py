"""Hostile text on the pages: what Streamlit's own markdown rewrites."""

from __future__ import annotations

import html
import re

import pytest
from apptest import render
from markdown_it import MarkdownIt

from kvtrace.dashboard import ui
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
    from kvtrace.store.writer import Store

    db = str(tmp_path / "plugins.duckdb")
    with Store.open(db) as store:
        for suffix in ("", " B"):
            run = store.create_run(f"{PLUGINS}{suffix}", run_id=f"id {PLUGINS}{suffix}", mode="otlp",
                                   trace_source=f"t {PLUGINS}", config={"cost_model": {"name": f"cm {PLUGINS}"}},
                                   behaviours=[f"b {PLUGINS}", "x"])
            store.finish_run(run)
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
