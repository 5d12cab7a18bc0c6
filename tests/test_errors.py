"""Every user error survives pickling as itself: a sweep's worker processes send theirs back
to the parent that way (an error that cannot be rebuilt broke the process pool)."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from kvtrace.cli.output import StdoutClosed
from kvtrace.compare.model import UnknownMetric
from kvtrace.engine.backends.vllm.config import UnsupportedConfig
from kvtrace.engine.costfit import Underdetermined
from kvtrace.errors import ConfigError, KVTraceError, OutputClosed, TraceFormatError
from kvtrace.instrument.convert import UnstorableValue
from kvtrace.instrument.otlp.collector import CollectorClosed, ExportAbandoned
from kvtrace.instrument.otlp.decode import PayloadError
from kvtrace.instrument.pipeline import SpansNotDelivered
from kvtrace.instrument.vllm.wire import VllmWireError
from kvtrace.store.errors import StoreBusyError, StoreError, UnknownRunError
from kvtrace.store.read._api import BadArgument
from kvtrace.workload.lines import LineTooLong

EXAMPLES = {
    KVTraceError: KVTraceError("a plain one"),
    TraceFormatError: TraceFormatError("t.jsonl", 4, "Expected `int`, got `str`"),
    LineTooLong: LineTooLong("t.jsonl", 2, "line longer than 64 MiB; expected one request a line"),
    ConfigError: ConfigError("run.toml", "cache.num_gpu_blocks", "expected >= 2"),
    StoreError: StoreError("s.duckdb", "not a kvtrace store"),
    StoreBusyError: StoreBusyError("s.duckdb", "busy"),
    UnknownRunError: UnknownRunError("s.duckdb", "r9"),
    SpansNotDelivered: SpansNotDelivered("http://127.0.0.1:1", 3, 5, "refused"),
    UnstorableValue: UnstorableValue("kvtrace.step: 2^64 is beyond BIGINT"),
    VllmWireError: VllmWireError("not a KV event batch"),
    UnsupportedConfig: UnsupportedConfig("no vLLM counterpart"),
    PayloadError: PayloadError("resourceSpans[0].scopeSpans: expected a list"),
    CollectorClosed: CollectorClosed("shutting down: not stored"),
    ExportAbandoned: ExportAbandoned("the client cancelled the export: not stored"),
    OutputClosed: OutputClosed("/dev/stdout: cannot write: Broken pipe"),
    StdoutClosed: StdoutClosed("cannot write to stdout: Broken pipe"),
    BadArgument: BadArgument("hit_counters", "run_id", "expected str, got 0"),
    UnknownMetric: UnknownMetric("runs r1 (mode otlp) and r2 (mode otlp): no metric 'x' to compare"),
    Underdetermined: Underdetermined(["prefill_token_ns", "step_ns"], 1, 2, 1, 0),
}


def _error_classes_in_source() -> set[str]:
    """The names of every class in kvtrace/ derived (through any chain) from KVTraceError."""
    bases: dict[str, set[str]] = {}
    for path in (Path(__file__).resolve().parents[1] / "kvtrace").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id for b in node.bases if isinstance(b, ast.Name)}
    found, grew = {"KVTraceError"}, True
    while grew:
        more = {name for name, b in bases.items() if b & found} - found
        found |= more
        grew = bool(more)
    return found


def test_every_error_class_has_an_example():
    assert _error_classes_in_source() == {cls.__name__ for cls in EXAMPLES}


@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_an_error_pickles_as_itself(cls):
    err = EXAMPLES[cls]
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err) and back.args == err.args
    assert back.__dict__ == err.__dict__


def test_a_path_with_a_control_character_is_shown_escaped_not_joined():
    """A newline in a trace's name showed as a space (the message's lines joined), where every
    other view shows it as \\n."""
    assert str(TraceFormatError("new\nline.jsonl", 3, "bad")) == "new\\nline.jsonl:3: bad"
    assert str(ConfigError("run\x1b.toml", "cache.num_gpu_blocks", "expected >= 2")) == \
        "run\\x1b.toml: cache.num_gpu_blocks: expected >= 2"
    # any message: its line breaks escaped, never joined into a space naming another file
    assert str(KVTraceError("no\ndir/x.toml: directory no\ndir does not exist")) == \
        "no\\ndir/x.toml: directory no\\ndir does not exist"
    assert str(KVTraceError("a library's\r\ntwo lines\u2028")) == "a library's\\r\\ntwo lines\\u2028"
