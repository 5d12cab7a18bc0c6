"""Each name a user can type (kvtrace.names) has exactly one implementation, and the CLI
offers exactly those names."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace import names
from kvtrace.cache.config import ALL_BEHAVIOURS
from kvtrace.cli import choices
from kvtrace.engine.presets import PRESETS
from kvtrace.names import markdown_code, markdown_literal, printable
from kvtrace.replay.generate import WORKLOADS
from kvtrace.replay.readers import READERS
from tests.support.markdown import shown


@pytest.mark.parametrize(("listed", "implemented"), [
    (names.PRESETS, PRESETS),
    (names.WORKLOADS, WORKLOADS),
    (names.FORMATS, READERS),
    (names.BEHAVIOURS, ALL_BEHAVIOURS),
], ids=["presets", "workloads", "formats", "behaviours"])
def test_every_name_has_one_implementation(listed, implemented):
    assert len(set(listed)) == len(listed)
    assert set(listed) == set(implemented)


def test_the_generated_formats_are_trace_formats():
    assert set(names.GENERATED_FORMATS) <= set(names.FORMATS)


@pytest.mark.parametrize(("enum", "listed"), [
    (choices.Mode, names.MODES), (choices.Policy, names.POLICIES), (choices.TraceFormat, names.FORMATS),
    (choices.Preset, names.PRESETS), (choices.Behaviour, names.BEHAVIOURS), (choices.Workload, names.WORKLOADS),
    (choices.GeneratedFormat, names.GENERATED_FORMATS), (choices.Backend, names.BACKENDS),
])
def test_the_cli_offers_exactly_the_names(enum, listed):
    assert tuple(m.value for m in enum) == listed


def test_the_cli_lists_its_choices_without_numpy_or_torch():
    """A typo is refused at parse time: importing the CLI must not pay for numpy or torch."""
    code = "import sys, kvtrace.cli; print(sorted(m for m in ('numpy', 'torch', 'msgspec') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_markdown_literal_and_code_show_any_text_as_it_is(text):
    """Rendered by a CommonMark parser (markdown-it), a name inside a sentence reads as
    ``printable`` shows it: no emphasis, link, image, HTML, entity or code made from it."""
    want = printable(text)
    assert shown(f"a {markdown_literal(text)} b") == f"a {want} b".strip()
    if want:
        assert shown(f"a {markdown_code(text)} b") == f"a {want} b".strip()


def test_cut_middle_keeps_both_ends_within_the_limit():
    """One middle cut for the CLI's error line and the OTLP receiver's refusals (each had its
    own, and the receiver's ran past its limit once it said how much it left out)."""
    text = "start:" + "k" * 5_000 + ": no such file"
    for limit in (120, 300, 1_000):
        cut = names.cut_middle(text, limit)
        assert len(cut) <= limit and cut.startswith("start:k") and cut.endswith(": no such file")
        left = int(cut.split("... (")[1].split(" characters")[0].replace(",", ""))
        assert len(cut) - len(f"... ({left:,} characters left out) ...") + left == len(text)
    assert names.cut_middle("short", 10) == "short"


def test_shown_value_quotes_a_value_whole_or_cut_in_its_middle():
    from kvtrace.names import shown_value

    assert shown_value(5) == "5" and shown_value("x") == "'x'"
    long = shown_value(list(range(1000)))
    assert len(long) <= 80 and long.startswith("[0, 1,") and long.endswith("998, 999]")
    assert "characters left out" in long
