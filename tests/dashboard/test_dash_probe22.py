"""Probe 22 of the dashboard: what a sender may leave out of its spans, names with spaces
at their ends, and links naming a curve or a KV group the page has no figure for."""

from __future__ import annotations

import duckdb
from apptest import render


def _collected(db: str) -> str:
    import synthetic_run

    return synthetic_run.write_collected_run(db)


def test_a_request_whose_sender_left_out_its_ttft_and_prompt_length_is_no_zero_in_the_picker(tmp_path, monkeypatch):
    """A collected run's request span without a first token or prompt length: the picker
    said 'TTFT 0.0 ms' (the fastest of all, for no measurement) and 'cached 0/None'."""
    db = str(tmp_path / "collected.duckdb")
    run = _collected(db)
    with duckdb.connect(db) as con:
        con.execute("UPDATE spans_request SET ttft_ns = NULL, first_token_ns = NULL, num_prompt_tokens = NULL "
                    "WHERE run_id = ?", [run])
    at = render(db, monkeypatch, "latency", run=run)
    (picker,) = [s for s in at.selectbox if s.label.startswith("Request")]
    assert picker.options
    for label in picker.options:
        assert "TTFT –" in label and "/– tokens" in label, label
        assert "0.0 ms" not in label and "None" not in label, label


def test_a_name_with_a_space_at_an_end_is_shown_bold_not_with_its_asterisks(tmp_path, monkeypatch):
    """CommonMark opens ``**`` only before a character that is no space: the Overview showed
    a sender's run named ' x ' (or '  ') as '** x **', asterisks and all."""
    from markdown_it import MarkdownIt

    from kvtrace.store.writer import Store

    db = str(tmp_path / "names.duckdb")
    names = ("  ", " padded ", "end ")
    with Store.open(db) as store:
        for name in names:
            store.finish_run(store.create_run(name, mode="otlp"), summary={})
    for run, name in zip(("r1", "r2", "r3"), names):
        at = render(db, monkeypatch, run=run)
        html = MarkdownIt("commonmark").render(at.markdown[0].value)
        assert "**" not in html, html
        bold = html.split("<strong>", 1)[1].split("</strong>", 1)[0]
        assert bold.replace("\u2060", "") == name, (bold, name)


def test_a_linked_curve_on_a_store_without_curves_is_named_once_and_dropped(tmp_path, monkeypatch):
    """The Capacity page of a store without curves ignored ?curve= silently and kept it in
    the URL (every other page names a link's value it cannot show, once)."""
    db = str(tmp_path / "nocurve.duckdb")
    run = _collected(db)
    at = render(db, monkeypatch, "capacity", run=run, curve="c7")
    assert [w.value for w in at.warning] == ["Curve `c7` from the link is not in this store: it holds none."]
    assert "curve" not in at.query_params
    assert any("holds no capacity curve" in i.value for i in at.info)


def test_a_linked_kv_group_of_a_vllm_backend_run_is_not_said_to_be_missing(tmp_path, monkeypatch, vllm_api):
    """A --backend vllm run has KV groups 0 and 1 but no per-group hits: a link to its group
    0 said 'KV group 0 from the link is not in this run'."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "vllm.duckdb")
    run = run_replay(RunSpec("gen:chat", limit=4, backend="vllm", capacity_blocks=100), db=db).run_id
    at = render(db, monkeypatch, "hit_rate", run=run, group="0")
    said = [w.value for w in at.warning]
    assert said == ["KV group `0` from the link has no per-group hits in this run (below): every group is shown "
                    "instead."], said
    at = render(db, monkeypatch, "hit_rate", run=run, group="7")  # (not a group of the run's: said so)
    assert [w.value for w in at.warning] == ["KV group `7` from the link is not in this run: every group is shown "
                                             "instead."]
