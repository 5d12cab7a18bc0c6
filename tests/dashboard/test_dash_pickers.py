"""A picker's labels are plain text: a control character in a run's name is shown as its
escape there, as the page's header and `kvtrace runs` show it, never dropped."""

from __future__ import annotations

from apptest import render

from kvtrace.names import printable


def test_a_newline_in_a_runs_name_is_shown_in_the_run_picker_as_its_escape(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "names.duckdb")
    broken = run_replay(RunSpec("gen:chat", limit=2, name="two\nlines"), db=db).run_id
    # a name that reads like the first one's escape: the two labels must still differ
    typed = run_replay(RunSpec("gen:chat", limit=2, name="two\\nlines"), db=db).run_id
    assert broken is not None and typed is not None
    at = render(db, monkeypatch, run=broken)
    (picker,) = [s for s in at.selectbox if s.label == "Run"]
    assert all(o.isprintable() for o in picker.options), picker.options  # "two\nlines" read "twolines"
    assert len(set(picker.options)) == len(picker.options), picker.options
    assert picker.value == broken
    assert all(printable("two\nlines") in o for o in picker.options), picker.options
