"""The names a user types, one tuple each: the CLI's choices and the config's values.

Stdlib only and on the ground floor, so that the CLI can list and check them without
importing what implements them (numpy, the readers, the engine): a typo is refused in a
fraction of a second. The implementing modules key their tables by these names, and
``tests/test_names.py`` holds that each name has exactly one implementation. At the end,
how a user's text is shown back: ``printable``, literal inside rich markup or Streamlit
markdown, and the stdout console every table uses (rich, imported when it is called).
"""

from __future__ import annotations

import html
import re
from typing import Any

# replay --mode (kvtrace.replay.run)
MODES = ("engine", "cache-only")


def replay_mode(stored: object) -> str | None:
    """The replay mode a run record's mode names (``cache-only/lru``: cache-only), or None
    for any other (live, otlp, damaged text): what a view says of it, never the stored text."""
    base = stored.partition("/")[0] if isinstance(stored, str) else None
    return base if base in MODES else None


# what a view calls a run that no replay made, by its stored mode
RUN_KINDS = {"otlp": "collected", "live": "live capture"}


def run_kind(stored: object) -> str:
    """What a view calls a run of this stored mode: its replay mode, ``collected``, ``live
    capture``, or ``?`` (damaged text: never the stored text itself)."""
    return replay_mode(stored) or RUN_KINDS.get(stored if isinstance(stored, str) else "", "?")


# cache-only --policy (kvtrace.replay.cache_only)
POLICIES = ("lru", "belady")
# trace formats (kvtrace.replay.readers); convert writes the last two
FORMATS = ("mooncake", "bailian", "weka", "azure", "native")
GENERATED_FORMATS = ("native", "mooncake")
# engine and cache presets (kvtrace.engine.presets)
PRESETS = ("dense-attention", "dense-70b-tp4", "dense-70b-tp8", "kimi-hybrid")
# generated workloads, gen:NAME (kvtrace.replay.generate)
WORKLOADS = ("chat", "agent", "mixed", "study-transient-checkpoint-retention", "study-shared-prefix-pinning",
             "study-external-hit-running-cow")
# The three switchable behaviours (kvtrace.cache.config): vLLM cache changes a study isolates.
TRANSIENT_CHECKPOINT_RETENTION = "transient-checkpoint-retention"
SHARED_PREFIX_PINNING = "shared-prefix-pinning"
EXTERNAL_HIT_RUNNING_COW = "external-hit-running-cow"
BEHAVIOURS = (TRANSIENT_CHECKPOINT_RETENTION, SHARED_PREFIX_PINNING, EXTERNAL_HIT_RUNNING_COW)
# cache backends the engine's scheduler drives (kvtrace.engine.backends); the first is the default
KVTRACE, VLLM = "kvtrace", "vllm"
BACKENDS = (KVTRACE, VLLM)
# The standard OpenTelemetry variables that name a collector (kvtrace.instrument.pipeline):
# either one, like --otlp-endpoint, makes a run send its spans there.
OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def otlp_requested(endpoint: str | None) -> bool:
    """Whether spans go to a collector: ``--otlp-endpoint`` given, or a standard variable set."""
    import os

    return bool(endpoint) or any(os.environ.get(k) for k in OTLP_ENDPOINT_VARIABLES)


# user:password@ after a scheme (one slash too: a path normalised), to the last @ of the word:
# a password may hold a / or an @ that was not encoded
_URL_PASSWORD = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*:/{1,2}[^/@\s:]*):\S*@")
# a secret a URL's query string gives (clickhouse://host/db?password=..., as ClickHouse's JDBC and
# other clients take it: refused as an unknown option, the error quoted it whole)
_QUERY_SECRET = re.compile(r"([?&;](?:password|passwd|pwd|pass|secret|token|access_token|api_key|apikey)=)"
                           r"[^&;#\s]*?(?=:\s|[&;#\s]|$)", re.IGNORECASE)


def without_secrets(line: str) -> str:
    """``line`` with every URL's password, in its userinfo or its query, as *** (every error and
    status line, and the store's own errors quoting a ``--db`` URL: one rule)."""
    return _QUERY_SECRET.sub(r"\1***", _URL_PASSWORD.sub(r"\1:***@", line))


def printable(text: object) -> str:
    """A user's text (a run's name, a trace's path) as one printable line: control
    characters (a newline, an escape sequence that would recolour the terminal) shown as
    their escapes, the rest as it is."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def shell_word(text: object) -> str:
    """``text`` as a command line shown for copying takes it: one shell word (a path with a
    space, a quote or a glob character quoted, as the demo's closing command quotes it). A
    word with a character no line shows as itself (a newline, an escape, a byte that is not
    UTF-8) is ANSI-C quoted, ``$'a\\nb'``, which bash, zsh and ksh read back as the same
    name: printable()'s escapes inside '...' pasted a backslash and an n, another file.
    Every hint that shows a command holding a user's value (the cli's, the store's, the
    compare pages', the dashboard's) quotes it here: one home, on the ground floor."""
    import shlex

    word = str(text)
    if word.isprintable():
        quoted = shlex.quote(word)
        # (shlex leaves a word of its safe characters bare, "=x.duckdb" too, which zsh, the
        # macOS shell, reads as the path of a command named x.duckdb: "not found")
        return f"'{word}'" if quoted == word and word.startswith("=") else quoted
    return "$'" + "".join(_ansi_c(c) for c in word) + "'"


def shell_path(path: object) -> str:
    """A file's path as one shell word (``shell_word``) that a command reads as that file,
    never as a flag or as stdin: a relative path that begins with ``-`` (``-x.duckdb``,
    ``-``) shown as ``./-x.duckdb``, the same file."""
    text = str(path)
    return shell_word(f"./{text}" if text.startswith("-") else text)


_ANSI_C = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _ansi_c(c: str) -> str:
    """``c`` inside ``$'...'``: a character no line shows as itself as its UTF-8 bytes, and a
    byte os.fsdecode kept as a surrogate (not UTF-8) as that byte, each ``\\xHH``: what the
    shell reads back is the name's bytes in any locale. (``\\xa0`` for U+00A0 pasted the byte
    a0, not its UTF-8 c2 a0, another file; ``\\u202e`` read under LC_ALL=C is the six
    characters ``\\u202E``.)"""
    if c in _ANSI_C:
        return _ANSI_C[c]
    if c.isprintable():
        return c
    return "".join(f"\\x{b:02x}" for b in c.encode("utf-8", "surrogateescape"))


_ERRNO = re.compile(r"\[Errno -?\d+\] [^'\")]+")


def errno_phrase(text: str) -> str | None:
    """The ``[Errno 111] Connection refused`` inside a network library's wrapped error text
    (urllib3's "HTTPConnectionPool(...): Max retries exceeded ... (Caused by ...)"), or None."""
    found = _ERRNO.search(text)
    return found.group(0).strip() if found else None


def shown_value(value: object, limit: int = 80) -> str:
    """An API caller's value as an error line quotes it: its repr, cut in the middle past
    ``limit`` characters (a list of a million items, an array's whole text), as one printable
    line (a repr's newline or terminal escape shown as its escape). A value that has no repr
    (its ``__repr__`` raises; an int past Python's 4,300 digits) is named by its type."""
    try:
        text = printable(str.__str__(repr(value)))  # (a plain str of a repr that is a str subclass)
    except Exception:  # (whatever a caller's __repr__ raises, the error line is still written)
        text = _without_repr(value)
    return cut_middle(text, limit)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun for a status line: "1 request", "2,048 requests" (``plural`` where
    an s is not it: "batches")."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {plural or noun + 's'}"


def shown_count(value: int) -> str:
    """An API caller's whole number as an error line quotes it: with thousands separators, as
    kvtrace prints every count, and one past Python's 4,300 printable digits by its size."""
    try:
        return cut_middle(f"{value:,}", 80)
    except ValueError:  # (int's str refuses it: sys.get_int_max_str_digits())
        return shown_value(value)


def _without_repr(value: object) -> str:
    kind = printable(type(value).__name__)
    if isinstance(value, int):  # (repr refuses an int past sys.get_int_max_str_digits())
        return f"<{kind} of about {int(value.bit_length() * 0.30103) + 1:,} digits>"
    return f"<{kind} whose repr raised>"


def cut_middle(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, cut in the middle where longer: its end (what is
    wrong, in an error quoting a huge path or key) and its start both kept, and how much
    was left out said between them."""
    if len(text) <= limit:
        return text
    keep = max(limit - len(f"... ({len(text):,} characters left out) ..."), 2)
    head, tail = keep * 3 // 5, keep - keep * 3 // 5
    return f"{text[:head]}... ({len(text) - head - tail:,} characters left out) ...{text[-tail:]}"


def markup_literal(text: object) -> str:
    """A user's text inside a rich markup string: ``printable``, and its brackets shown, not
    read as markup (``[/]`` would raise, ``[red]`` recolour)."""
    from rich.markup import escape

    return escape(printable(text))


# CommonMark's backslash-escapable ASCII punctuation (Streamlit's markdown: also its
# directives :red[...], math $...$ and entities &lt;)
_MARKDOWN_PUNCTUATION = re.compile(r"""([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~])""")


def markdown_literal(text: object) -> str:
    """A user's or a sender's text (a run's name, a collected run id) inside CommonMark
    (``diff --markdown``): ``printable``, every ASCII punctuation mark backslash-escaped (no
    emphasis, link, image, HTML, code, math or colour directive can start in it). Not enough
    for Streamlit, which rewrites shortcodes and arrows after parsing: the dashboard uses
    ``kvtrace.dashboard.ui.literal``, built on this."""
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", printable(text))


def plotly_literal(text: object) -> str:
    """A user's or a sender's text inside any string plotly draws (a trace's name, a label, a
    category, a title), shown as it is: plotly reads a subset of HTML there (``<a href>``,
    ``<br>``, ``<span style>``) and decodes entities, so ``&``, ``<`` and ``>`` become entities."""
    return html.escape(printable(text), quote=False)


def markdown_code(text: object) -> str:
    """The text as one inline code span, whatever backticks it holds (a fence longer than
    its longest run of them, padded where it starts or ends with one)."""
    text = printable(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    # a span's content loses one space each side when it has one on both (and is not all
    # spaces): pad it then, and where a backtick at an end would join the fence
    spaced = text[:1] == text[-1:] == " " and text.strip(" ")
    pad = " " if text[:1] == "`" or text[-1:] == "`" or spaced else ""
    return f"{fence}{pad}{text}{pad}{fence}" if text else "` `"


PIPED_WIDTH = 100_000  # columns rich lays out for a stdout that is not a terminal: no row is folded for grep
# The narrowest a table is laid out at: on a terminal narrower than that (5 columns) rich
# left every cell blank, exit 0; laid out at this width, its lines wrap on the terminal.
MIN_TERMINAL_WIDTH = 80


def stdout_console() -> Any:
    """rich's console for a command's stdout, the one every table goes through: a terminal's
    own width, at least ``MIN_TERMINAL_WIDTH``, else ``PIPED_WIDTH`` (rich's 80 would cut a
    metric's name and wrap a path)."""
    import sys

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
    if console.width < MIN_TERMINAL_WIDTH:
        console.width = MIN_TERMINAL_WIDTH
    return console
