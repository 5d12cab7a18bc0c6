"""Reading trace files line by line, with errors that name the file and the line.

Shared by every reader (the native one here, the public formats in ``kvtrace.replay.readers``):
streamed numbered lines, typed JSON-line decoding (msgspec), field checks, arrival-order
checks, time units and the file digest that identifies a trace in run records.

Arrival times must not decrease within a file: a trace that goes back in time is refused
with the offending line, because silently re-sorting would change which request sees
whose cache and a streaming reader cannot sort without loading everything.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import math
import operator
import os
import re
import stat
import typing
from collections.abc import Iterable, Iterator
from decimal import Decimal
from typing import BinaryIO, TypeVar

import msgspec

from kvtrace.errors import (
    DUCKDB_MAGIC,
    READ_ONLY_MOUNT,
    STORE_SIDE_SUFFIXES,
    KVTraceError,
    OutputClosed,
    TraceFormatError,
    duckdb_magic,
    on_read_only_mount,
    read_only_problem,
    wal_owner,
)
from kvtrace.numeric import cdiv
from kvtrace.process import pid_after, remove_dead_leftovers

MAX_ID = (1 << 63) - 1  # hash ids must fit int64 (Arrow / DuckDB columns downstream)
VOCAB_SIZE = 163_840  # Kimi-class vocabulary; token ids lie in [0, VOCAB_SIZE)
MAX_TOKENS = 1 << 31  # prompt and output lengths: far above any context window, and int32-safe
MAX_TIME_NS = 1 << 62  # ~146 years of trace time: a later timestamp is a unit error, not a trace
MS, S = 1_000_000, 1_000_000_000  # ns per unit of a trace's timestamps
T = TypeVar("T")


_BOM = b"\xef\xbb\xbf"


def without_bom(raw: bytes) -> bytes:
    """A file's first bytes without the UTF-8 byte-order mark that Windows tools write
    (JSON allows a reader to ignore it; it is no part of any field)."""
    return raw[len(_BOM):] if raw.startswith(_BOM) else raw


# The magic numbers of the archives a trace is often kept in, and the command that opens each.
_COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
               (b"BZh", "bzip2", "bunzip2"), (b"\xfd7zXZ\x00", "xz", "unxz"), (b"PK\x03\x04", "zip", "unzip"))
COMPRESSED_SUFFIXES = (".gz", ".zst", ".bz2", ".xz", ".zip")


def compressed_problem(path: str, head: bytes | None = None, what: str = "traces") -> str | None:
    """What a compressed file is and how to open it (kvtrace reads traces as plain text:
    a gzip file was 'not UTF-8 text (byte 0x8b ...)'), or that it is a DuckDB store, a Parquet
    file or UTF-16/32 text, or None. ``head``: the file's first bytes when they are read
    already; ``what``: what the file was expected to hold, as the message names it."""
    if head is None:
        try:
            with open(path, "rb") as f:
                head = f.read(12)
        except OSError:
            return None  # (file_problem names it)
    for magic, kind, tool in _COMPRESSED:
        if head.startswith(magic):
            return f"{kind}-compressed; kvtrace reads {what} as plain text: decompress it first ({tool})"
    if head[8:12] == DUCKDB_MAGIC:  # (a store given as the trace was 'not UTF-8 text (byte 0xa6 ...)')
        if what != "traces":  # (calibrate's --from takes a store: "given as --db" was wrong there)
            return f"a DuckDB database (a kvtrace store?), not one of the {what} kvtrace reads here"
        return "a DuckDB database (a kvtrace store?), not a trace; a store is given as --db STORE"
    if head.startswith(b"PAR1"):  # (kvtrace export's output given back was 'not UTF-8 text (byte 0xb5 ...)')
        if what != "traces":
            return f"a Parquet file (a kvtrace export?), not one of the {what} kvtrace reads here"
        return "a Parquet file (a kvtrace export?), not a trace; kvtrace replays trace files, not recorded spans"
    for bom, encoding in _WIDE_BOMS:  # (a Windows tool's export was 'not UTF-8 text (byte 0xff at column 1)')
        if head.startswith(bom):
            return f"{encoding} text; kvtrace reads {what} as UTF-8: convert it first (iconv -f {encoding} -t UTF-8)"
    wide = _wide_without_bom(head)
    if wide is not None:  # (was 'invalid JSON: object keys must be strings (byte 1)', or an Azure
        # header's 'missing column(s)' of the three columns it names)
        return (f"{wide} text without a byte-order mark; kvtrace reads {what} as UTF-8: convert it first "
                f"(iconv -f {wide} -t UTF-8)")
    return None


def _wide_without_bom(head: bytes) -> str | None:
    """The encoding of UTF-16 or UTF-32 text that starts with no byte-order mark (``iconv -t
    UTF-16LE`` writes none), told by its first characters: ASCII, each padded with NUL bytes
    (no UTF-8 trace holds a NUL byte); None for anything else."""
    for width, encoding in ((4, "UTF-32LE"), (4, "UTF-32BE"), (2, "UTF-16LE"), (2, "UTF-16BE")):
        units = [head[i:i + width] for i in range(0, len(head) - width + 1, width)]
        if len(units) < 2:  # (too short to tell)
            continue
        if encoding.endswith("BE"):
            units = [unit[::-1] for unit in units]
        if all(0 < unit[0] < 0x80 and not any(unit[1:]) for unit in units):
            return encoding
    return None


# The byte-order marks of the wide Unicode encodings, UTF-32's first (its little-endian one starts as UTF-16's)
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
              (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


# The longest line a trace may have: a request of two million token ids written out fits
# with room to spare.
MAX_LINE_BYTES = 64 << 20


class LineTooLong(TraceFormatError):
    """A line past ``MAX_LINE_BYTES``: no line format's request, but a WEKA conversation
    (one JSON document, read whole) may be written on one line that long."""


def bounded_lines(path: str, f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) for each line of the open file ``f``; a line longer
    than ``MAX_LINE_BYTES`` (a file of NUL bytes, a lost newline) is a LineTooLong error,
    never read whole into memory."""
    for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
        if len(raw) > MAX_LINE_BYTES:
            raise LineTooLong(path, lineno, f"line longer than {MAX_LINE_BYTES >> 20} MiB; expected one request a line")
        yield lineno, raw


def decoded_lines(path: str, f: BinaryIO) -> Iterator[str]:
    """The open file's lines decoded one by one (a CSV reader's input): bounded as
    ``bounded_lines``, the first without a byte-order mark, and a byte that is not UTF-8
    reported on its own line."""
    for lineno, raw in bounded_lines(path, f):
        try:
            yield (without_bom(raw) if lineno == 1 else raw).decode("utf-8")
        except UnicodeDecodeError:
            raise TraceFormatError(path, lineno, "not UTF-8 text") from None


def csv_problem(err: Exception) -> str:
    """csv's reason, without its advice to a programmer ('do you need to open the file in
    universal-newline mode?' of a CR that ends no line, as an old Mac file's lines end)."""
    text = str(err)
    if text.startswith("new-line character seen in unquoted field"):
        return "a carriage return (\\r) in an unquoted field; expected lines that end in LF or CRLF"
    return text


def numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) for each non-blank line, streamed.

    Lines are read as bytes and decoded one by one, so a byte that is not UTF-8 is
    reported on its own line (a text-mode file decodes ahead, in blocks).
    """
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed by the with below; open errors named apart)
    except IsADirectoryError:
        raise TraceFormatError(path, None, "is a directory, not a trace file") from None
    except OSError as e:
        raise TraceFormatError(path, None, f"cannot open: {e.strerror}") from None
    with f:
        for lineno, raw in bounded_lines(path, f):
            if lineno == 1:
                raw = without_bom(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceFormatError(path, lineno, f"not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                                     f"{e.start + 1})") from None
            if text.strip():
                yield lineno, text


# What a JSON line's decoder can raise: malformed text, a wrong type, or nesting deeper
# than the interpreter's stack (msgspec then raises RecursionError)
JSON_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


# A high surrogate's escape in the last bytes of a line: msgspec looks six bytes past it for
# its pair and, finding the line's end, says "Input data was truncated" of a whole line.
_LONE_SURROGATE_AT_END = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?=[^\\]{0,5}$)")


def decode_error(path: str, line: int | None, err: Exception, text: str = "") -> TraceFormatError:
    """The one-line error of a JSON line ``text`` the decoder refused with ``err``."""
    nul = nul_problem(text)
    if nul is not None:  # (no JSON holds one: 'invalid character (byte 0)' of a file padded with zeros)
        return TraceFormatError(path, line, nul)
    if isinstance(err, msgspec.ValidationError):
        return TraceFormatError(path, line, str(err))
    if isinstance(err, RecursionError):
        return TraceFormatError(path, line, "invalid JSON: nested too deeply")
    lone = _LONE_SURROGATE_AT_END.search(text.rstrip()) if "truncated" in str(err) else None
    if lone:
        return TraceFormatError(path, line, f"invalid JSON: {lone.group()} is half a UTF-16 surrogate pair, "
                                            "which no text holds")
    trailing = _TRAILING_AT.search(str(err))
    if trailing and text.encode("utf-8", "surrogatepass")[:int(trailing.group(1)) - 1].rstrip(b" \t").endswith(b"\r"):
        # (lines that end in CR alone, as old Mac files' do, were read as one line of requests)
        return TraceFormatError(path, line, f"invalid JSON: {err}, after a carriage return (\\r): lines must end "
                                            "in LF or CRLF, not in CR alone")
    return TraceFormatError(path, line, f"invalid JSON: {err}")


_TRAILING_AT = re.compile(r"trailing characters \(byte (\d+)\)")


def row_nul_problem(row: list[str]) -> str | None:
    """``nul_problem`` of a CSV row, naming the field of its first NUL byte (1-based); None
    for a row without one (the Azure reader's and calibrate's rows)."""
    for field, cell in enumerate(row, start=1):
        if "\x00" in cell:
            return nul_problem(cell, f"in field {field}")
    return None


def nul_problem(text: str, where: str | None = None) -> str | None:
    """What a line holding a NUL byte is (no trace's text holds one: a file padded with zeros,
    as a crash or a preallocating writer leaves one, or UTF-16 text), naming the column of
    the first (or ``where`` it is); None for a line without one."""
    at = text.find("\x00")
    if at < 0:
        return None
    if where is None:  # (the column in bytes, as 'not UTF-8 text' counts it)
        where = f"at column {len(text[:at].encode('utf-8', 'surrogatepass')) + 1}"
    return f"a NUL byte (\\x00) {where}: not text (a file padded with zeros, as a crash can leave one, or UTF-16 text?)"


# Floats up to 2^53 are exact integers; past it a double may be an id or a length that was
# rounded on its way through a float (1.2345678901234567e18), which is refused, not guessed.
MAX_EXACT_FLOAT = 1 << 53


def integral_floats(value):
    """``value`` (generic JSON) with each float that is an exact integer made an int."""
    if type(value) is float:
        return int(value) if value.is_integer() and abs(value) <= MAX_EXACT_FLOAT else value
    if type(value) is list:
        return [integral_floats(v) for v in value]
    if type(value) is dict:
        return {k: integral_floats(v) for k, v in value.items()}
    return value


def _lenient_type(tp):
    """``tp`` with each int also taking a float, and each Struct its lenient twin."""
    if tp is int:
        return int | float
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _lenient_struct(tp)
    args = typing.get_args(tp)
    if not args:
        return tp
    if typing.get_origin(tp) is list:
        return list[_lenient_type(args[0])]
    return functools.reduce(operator.or_, (_lenient_type(a) for a in args))  # a union


@functools.cache
def _lenient_struct(schema: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """A twin of ``schema`` whose int fields also take floats, keyed and checked as it is
    (its unknown keys refused or skipped alike), so its errors name the same paths."""
    fields = [(f.name, _lenient_type(f.type),
               msgspec.field(default=f.default, name=f.encode_name) if f.default is not msgspec.NODEFAULT else
               msgspec.field(default_factory=f.default_factory, name=f.encode_name)
               if f.default_factory is not msgspec.NODEFAULT else msgspec.field(name=f.encode_name))
              for f in msgspec.structs.fields(schema)]
    return msgspec.defstruct("Lenient" + schema.__name__, fields,
                             forbid_unknown_fields=schema.__struct_config__.forbid_unknown_fields)


class LineDecoder:
    """A JSON decoder of ``schema`` (a msgspec Struct) whose integer fields also take
    integer-valued floats (1.0, 1e3: what pandas writes for an int column that once held a
    NaN). The strict decoder reads every line first; only a line it refuses for a float is
    decoded again, by a twin taking floats there, so traces of ints cost nothing more."""

    __slots__ = ("decoder", "keys", "lenient", "schema")

    def __init__(self, schema: type[T]):
        self.schema = schema
        self.decoder = msgspec.json.Decoder(schema)
        self.lenient: msgspec.json.Decoder = msgspec.json.Decoder(_lenient_struct(schema))  # type: ignore[arg-type]
        self.keys = _field_names(schema)

    def decode(self, text: str | bytes):
        try:
            value = self.decoder.decode(text)
        except msgspec.ValidationError as e:
            if "got `float`" not in str(e):
                raise
            # (by the twin: every other fault named at its path as the strict decoder names it;
            # a float that is no exact integer is then refused at its path by convert)
            twin = self.lenient.decode(text)
            value = msgspec.convert(integral_floats(msgspec.to_builtins(twin)), self.schema)
        refuse_repeated_keys(text, self.keys)
        return value


def _field_names(schema) -> frozenset[str]:
    """The JSON keys ``schema`` reads, its nested Structs' included."""
    names: set[str] = set()
    todo = [schema]
    while todo:
        tp = todo.pop()
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            for f in msgspec.structs.fields(tp):
                if f.encode_name not in names:
                    names.add(f.encode_name)
                    todo.append(f.type)
        else:
            todo.extend(typing.get_args(tp))
    return frozenset(names)


@functools.cache
def _quoted(keys: frozenset[str]) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
    return tuple(f'"{k}"' for k in keys), tuple(f'"{k}"'.encode() for k in keys)


class _Repeated(Exception):
    pass


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse_pairs(keys: frozenset[str]):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        seen: dict[str, object] = {}
        for name, value in pairs:
            if name in seen and name in keys and _differ(seen[name], value):
                raise _Repeated(name, seen[name], value)
            seen[name] = value
        return seen
    return hook


def _differ(a: object, b: object) -> bool:
    """Two JSON values that are not the same value (1 and 1.0 are; true and 1 are not)."""
    return (type(a) is not type(b) and not {type(a), type(b)} <= {int, float}) or a != b


def refuse_repeated_keys(text: str | bytes, keys: frozenset[str]) -> None:
    """A ValidationError when one JSON object of ``text`` (valid JSON, decoded already) gives
    a key of ``keys`` twice with two values: JSON leaves which one counts to the reader, and msgspec took the
    last unsaid (a trace's ``"timestamp": 0, "timestamp": 5``). Cheap where no key is written
    twice in the whole text (a line's usual case); parsed again otherwise."""
    quoted = _quoted(keys)
    # (a key may be written escaped, "timest\u0061mp", which the count cannot see)
    if isinstance(text, str):
        if not any(text.count(k) > 1 for k in quoted[0]) and "\\u" not in text:
            return
    elif not any(text.count(k) > 1 for k in quoted[1]) and b"\\u" not in text:
        return
    try:
        json.loads(text, object_pairs_hook=_refuse_pairs(keys))
    except _Repeated as e:
        name, first, then = e.args
        raise msgspec.ValidationError(f"key `{name}` given twice in one object, as {_shown(first)} and then "
                                      f"{_shown(then)}; JSON leaves which one counts undefined, so kvtrace takes "
                                      "neither") from None
    except (ValueError, RecursionError):  # (msgspec read it: nothing more to say here)
        return


def typed_lines(path: str, schema: type[T]) -> Iterator[tuple[int, T]]:
    """Each non-blank line decoded as ``schema`` (a msgspec Struct; see LineDecoder)."""
    decoder = LineDecoder(schema)
    for lineno, text in numbered_lines(path):
        try:
            yield lineno, decoder.decode(text)
        except JSON_ERRORS as e:
            raise decode_error(path, lineno, e, text) from None


_DECIMAL = re.compile(r"[+-]?[0-9]{1,40}")


def parse_decimal(text: str) -> int | None:
    """An integer written in text (a CSV field, a TOML string): ASCII digits with an optional
    sign, around spaces; None for anything else (Python's int() also takes '1_000' and other
    scripts' digits, which no trace writes)."""
    text = text.strip()
    return int(text) if _DECIMAL.fullmatch(text) else None


_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?")


def parse_integral(text: str) -> int | None:
    """An integer written in text as ``parse_decimal`` reads it, or as a decimal number
    that is exactly an integer ('374.0', '3.74e2': a CSV column written from floats);
    None for anything else."""
    value = parse_decimal(text)
    text = text.strip()
    if value is not None or len(text) > 80 or not _NUMBER.fullmatch(text):
        return value
    number = Decimal(text)  # (exact: no float rounds '374.0000000000000001' to an integer)
    if number.adjusted() > 40 or number != number.to_integral_value():
        return None  # (a fraction, or more digits than any field holds: parse_decimal's 40)
    return int(number)


def check_int(path: str, line: int | None, key: str, value, minimum: int, maximum: int = MAX_TOKENS) -> int:
    """``value`` as an int in [minimum, maximum]; a one-line TraceFormatError otherwise."""
    # bool is an int subclass in Python; a trace with `true` as a length is malformed.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceFormatError(path, line, f"{key}: expected an integer, got {value!r}"[:200])
    if value < minimum:
        raise TraceFormatError(path, line, f"{key}: expected >= {minimum}, got {value}")
    if value > maximum:
        raise TraceFormatError(path, line, f"{key}: {value} is beyond what kvtrace can replay (at most {maximum:,})")
    return value


# Said where the block size is not in the file (Mooncake, Bailian): the likeliest cause of a
# count that does not fit is ids of another size than the format's default
ANOTHER_BLOCK_SIZE = "; are the trace's ids of another block size? give it with --trace-block-size"


def check_hash_ids(
    path: str, line: int | None, hash_ids: list[int], input_length: int, block_size: int, key: str = "hash_ids",
    hint: str = "",
) -> tuple[int, ...]:
    want = cdiv(input_length, block_size)
    if len(hash_ids) != want:
        raise TraceFormatError(
            path, line,
            f"{key}: expected ceil(input_length {input_length} / block_size {block_size}) = {want} ids, "
            f"got {len(hash_ids)}{hint}",
        )
    if hash_ids and (min(hash_ids) < 0 or max(hash_ids) > MAX_ID):
        raise TraceFormatError(path, line, f"{key}: ids must lie in [0, 2^63)")
    return tuple(hash_ids)


class ArrivalOrder:
    """Arrival times of one file: converted to ns from the file's unit, checked to be
    finite, in range and not decreasing, naming the line otherwise."""

    __slots__ = ("last_ns", "path", "unit_ns", "what")

    def __init__(self, path: str, what: str, unit_ns: int = 1):
        self.path, self.what, self.unit_ns = path, what, unit_ns
        self.last_ns: int | None = None

    def check(self, value: int | float, line: int | None) -> int:
        """``value`` (in the file's unit) as integer ns."""
        arrival_ns = self._to_ns(value)
        if arrival_ns is None:
            raise TraceFormatError(
                self.path, line,
                f"{self.what}: {value!r} is not a time kvtrace can replay (expected a finite number below "
                # (exact: 4,611,686,018.4 s was taken where the bound read 4,611,686,018)
                f"{Decimal(MAX_TIME_NS) / Decimal(self.unit_ns):,f})"[:240],
            )
        last = self.last_ns
        if last is not None and arrival_ns < last:
            raise TraceFormatError(
                self.path, line,
                f"{self.what} goes back in time ({arrival_ns} ns < previous {last} ns); "
                "kvtrace needs the trace sorted by arrival",
            )
        if arrival_ns < 0:
            raise TraceFormatError(self.path, line, f"{self.what}: expected >= 0, got a negative time")
        self.last_ns = arrival_ns
        return arrival_ns

    def _to_ns(self, value: int | float) -> int | None:
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            ns = value * self.unit_ns
        elif isinstance(value, float) and math.isfinite(value) and abs(value) < MAX_TIME_NS / self.unit_ns:
            ns = round(value * self.unit_ns)  # bounded first: 1e300 s in ns is inf, which round() refuses
        else:
            return None
        return ns if ns < MAX_TIME_NS else None


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes: of a regular file, of the bytes it held when opened (one a
    writer extended faster than it was read, sparse gigabytes a second, was hashed for ever;
    a caller's stamps tell it changed), of anything else, all it gives."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            left = st.st_size if stat.S_ISREG(st.st_mode) else None
            while left is None or left > 0:
                chunk = f.read(1 << 20 if left is None else min(1 << 20, left))
                if not chunk:
                    break
                h.update(chunk)
                if left is not None:
                    left -= len(chunk)
    except OSError as e:  # (a file of a trace directory, which no check before opened)
        raise KVTraceError(f"{path}: cannot read: {e.strerror}") from None
    return h.hexdigest()


def source_sha256(path: str, files: list[str] | None) -> str:
    """sha256 of the file bytes; for a directory, of its sorted (name, sha256) list."""
    if files is None:
        return file_sha256(path)
    h = hashlib.sha256()
    for f in files:
        # (the name's own bytes: UTF-8 for any name that is text, and a name that is not still hashes)
        h.update(os.fsencode(os.path.basename(f)) + b"\0" + file_sha256(f).encode("ascii") + b"\n")
    return h.hexdigest()


_FD_PATH = re.compile(r"/(?:dev/fd|proc/self/fd)/([0-9]+)")
_STD_PATHS = {"/dev/stdout": 1, "/dev/stderr": 2}


def writes_in_place(path: str) -> bool:
    """Whether ``AtomicText`` writes ``path`` in place, not by a rename: a descriptor's name
    (/dev/stdout, /dev/fd/N, /proc/self/fd/N) or something that is no regular file (a device,
    a FIFO, a socket); False for a regular file, named through a link too, and for no file."""
    if _open_descriptor(path) is not None:
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


# How long an output FIFO may wait for its reader: a pipeline's starts at once; one that
# never comes held the command for good (a shell's `> FIFO` waits so too, but says nothing)
FIFO_READER_WAIT_S = 10.0


def _is_fifo(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _fifo_with_reader(name: str) -> int:
    """A blocking write descriptor of the FIFO ``name``, once a process opens it to read
    (polled: a blocking open would wait for good); KVTraceError after FIFO_READER_WAIT_S."""
    import fcntl
    import time

    deadline = time.monotonic() + FIFO_READER_WAIT_S
    while True:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.ENXIO:  # (ENXIO: no reader yet)
                raise KVTraceError(f"{name}: cannot write: {e.strerror}") from None
            if time.monotonic() >= deadline:
                raise KVTraceError(f"{name}: is a FIFO that no process opened to read within "
                                   f"{FIFO_READER_WAIT_S:g} s; start its reader first (nothing was written)") from None
            time.sleep(0.05)
            continue
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd


def _open_descriptor(path: str) -> int | None:
    """The descriptor ``path`` names (/dev/stdout, /dev/fd/N, /proc/self/fd/N), else None."""
    if path in _STD_PATHS:
        return _STD_PATHS[path]
    m = _FD_PATH.fullmatch(path)
    return int(m.group(1)) if m else None


class AtomicText:
    """Write-then-rename: the target appears only when writing succeeded, so a failed
    conversion never leaves half a trace behind.

    A symlink is followed (the file it names is replaced, the link kept). A target that
    exists and is not a regular file (``/dev/stdout``, ``/dev/null``, a FIFO) is written
    in place, as a shell redirection would, never replaced by a file. Every write error
    (a full disk, a closed pipe) is a one-line ``KVTraceError`` naming the target.
    """

    def __init__(self, path: str | os.PathLike, sources: Iterable[str | os.PathLike] = ()):
        """``sources``: the files the output is made from, which it must not replace."""
        self.name = os.fspath(path)  # as the user gave it: what messages name
        self.path = self.name  # what is opened, then what the temporary file replaces
        self.tmp: str | None = None  # None: written in place
        self.sources = [os.fspath(s) for s in sources]

    def check(self) -> bool:
        """KVTraceError unless the output may be written (a command checks before its work);
        returns whether it is written in place (not a regular file)."""
        if self.name.endswith(("/", os.sep)) and not os.path.isdir(self.name):  # (a file "NAME" was written)
            raise KVTraceError(f"{self.name}: names a directory, which does not exist; expected a file path to write")
        try:  # through links, also /dev/stdout's /proc/self/fd/1
            st = os.stat(self.name)
        except FileNotFoundError:
            real = os.path.realpath(self.name)
            for source in self.sources:  # (made by the command itself, before the output)
                if os.path.realpath(source) == real:
                    raise KVTraceError(f"{self.name}: is also {source}; write the output elsewhere") from None
            self._refuse_a_write_ahead_log()  # DuckDB makes it later, then the rename would replace it
            parent = os.path.dirname(real)
            if not os.path.isdir(parent):  # (said only when writing began: after calibrate's fit, say)
                raise KVTraceError(f"{self.name}: directory {parent} does not exist") from None
            self._refuse_a_folder_without_write(parent)
            return False
        except OSError as e:
            raise KVTraceError(f"{self.name}: cannot write: {e.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise KVTraceError(f"{self.name}: is a directory; expected a file path to write")
        if stat.S_ISREG(st.st_mode):  # (also one an open descriptor names: `-o /dev/stdout >> INPUT`
            # appended the output to the input it was reading, exit 0, and `>> STORE` to a database)
            self._refuse_to_replace(st)
        # /dev/stdout and the like stand for an open file: written in place, as a redirection
        # is (a rename would drop what the file held, and what the shell writes after)
        if not stat.S_ISREG(st.st_mode) or _open_descriptor(self.name) is not None:
            return True
        problem = read_only_problem(self.name)
        if problem is not None:  # (a rename would replace it all the same)
            raise KVTraceError(f"{self.name}: {problem}")
        self._refuse_a_folder_without_write(os.path.dirname(os.path.realpath(self.name)))
        return False

    def _refuse_a_folder_without_write(self, parent: str) -> None:
        """The temporary file is made in ``parent``: said before the command's work (a
        capture's whole session, calibrate's fit), not when the output is written."""
        if not os.access(parent, os.W_OK | os.X_OK):
            why = READ_ONLY_MOUNT if on_read_only_mount(parent) else "cannot write: Permission denied"
            raise KVTraceError(f"{self.name}: {why} (directory {parent})")

    def __enter__(self) -> _Sink:
        in_place = self.check()
        if not in_place:
            self.path = os.path.realpath(self.name)
            parent = os.path.dirname(self.path)  # (check() refused a missing one)
            suffix = f".tmp-{os.getpid()}"
            name = os.path.basename(self.path)
            if len(os.fsencode(name + suffix)) > 255:  # NAME_MAX: a valid 250-byte name was refused
                name = ".kvtrace-output"
            self.tmp = os.path.join(parent, name + suffix)
            prefix = name + ".tmp-"  # (the suffix's shape: the pid follows it)
            remove_dead_leftovers(parent, lambda entry: pid_after(prefix, entry))
        fd = _open_descriptor(self.name) if in_place else None
        fifo = _fifo_with_reader(self.name) if fd is None and in_place and _is_fifo(self.path) else None
        try:
            # an open descriptor's own file description (its offset, its append mode), so the
            # output lands where a redirection would put it; opening /dev/stdout anew truncates
            f = (os.fdopen(fifo, "wb") if fifo is not None else os.fdopen(os.dup(fd), "wb") if fd is not None
                 else open(self.tmp or self.path, "wb"))
            if self.tmp is not None:
                self._keep_mode(f.fileno())
            self.f = _Sink(f, self.name)
        except OSError as e:
            raise KVTraceError(f"{self.name}: cannot write: {e.strerror}") from None
        return self.f

    def _keep_mode(self, fd: int) -> None:
        """The file being replaced keeps its permissions (a 0600 output stays 0600; the
        temporary file was made with the umask's)."""
        with contextlib.suppress(FileNotFoundError):
            mode = stat.S_IMODE(os.stat(self.path).st_mode)
            os.fchmod(fd, mode)

    def _refuse_to_replace(self, st: os.stat_result) -> None:
        """An existing file this output must not replace: one it is read from (it would be
        gone before it was read), or a DuckDB database (a kvtrace store, say: every run)."""
        for source in self.sources:
            with contextlib.suppress(OSError):
                if os.path.samestat(st, os.stat(source)):
                    raise KVTraceError(f"{self.name}: is also {source}; write the output elsewhere")
        if duckdb_magic(self.name):
            raise KVTraceError(f"{self.name}: is a DuckDB database (a kvtrace store?), not replaced by this output; "
                               "write it elsewhere or remove that file first")
        self._refuse_a_write_ahead_log()  # (its commits not yet checkpointed)

    def _refuse_a_write_ahead_log(self) -> None:
        """``DB.wal`` of a DuckDB database, or of a store the command writes (``sources``), is
        DuckDB's own file, whether or not it exists yet; so are kvtrace's lock and markers
        beside it (``DB.write-lock``: a replay's writer removed what was written over its lock)."""
        suffix = next((s for s in STORE_SIDE_SUFFIXES if self.name.endswith(s)), None)
        if suffix is None:
            self._refuse_a_question_mark_log()
            return
        db = self.name[:-len(suffix)]
        real = os.path.realpath(db)
        if duckdb_magic(db) or any(os.path.realpath(s) == real for s in self.sources):
            what = "the write-ahead log" if suffix == ".wal" else "a lock or marker file"
            raise KVTraceError(f"{self.name}: is {what} of the DuckDB database {db}, not "
                               "replaced by this output; write it elsewhere")

    def _refuse_a_question_mark_log(self) -> None:
        """DuckDB names the log of a database with a '?' in its file name by putting '.wal'
        before that '?' (``a?b.duckdb``'s is ``a.wal?b.duckdb``): an output written there was
        taken for that database's log by its next writer, and deleted."""
        db = wal_owner(self.name)
        if db is None:
            return
        if duckdb_magic(db) or any(os.path.realpath(s) == db for s in self.sources):
            raise KVTraceError(f"{self.name}: is the write-ahead log of the DuckDB database {db} (DuckDB puts "
                               "'.wal' before a '?' in its name), not replaced by this output; write it elsewhere")

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is not None:  # the body's error is the one to report
                if self.tmp is None and issubclass(exc_type, KeyboardInterrupt):
                    self.f.discard()  # (a stop: a stalled reader's full pipe blocked the flush, and the stop)
                    return False
                with contextlib.suppress(KVTraceError):
                    self.f.close()
                return False
            self.f.close()
            if self.tmp is not None:
                try:
                    os.replace(self.tmp, self.path)
                except OSError as e:
                    raise KVTraceError(f"{self.name}: cannot write: {e.strerror}") from None
                self.tmp = None
        finally:
            if self.tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.tmp)
        return False


class _Sink:
    """The open output of an ``AtomicText``: an OSError of a write or of the close (where
    a buffered write meets a full disk) becomes one line naming the file."""

    __slots__ = ("_f", "name")

    def __init__(self, f, name: str):
        self._f, self.name = f, name

    def write(self, data: bytes) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            raise self._error(e) from None

    def close(self) -> None:
        try:
            self._f.close()
        except OSError as e:
            raise self._error(e) from None

    def discard(self) -> None:
        """Close after a stop (Ctrl-C, SIGTERM): what is still buffered is written where that
        needs no wait (a file, a pipe with room), else dropped. Into a pipe or FIFO whose
        reader stalled, the close's flush blocked on the full pipe, and the command with it,
        until a second signal (``timeout`` waited on it for ever). The flush is tried without
        blocking; where it would block, the descriptor is pointed at /dev/null (dup2: atomic,
        no descriptor number freed for another thread to take) before the close."""
        try:
            fd = self._f.fileno()
            blocking = os.get_blocking(fd)
            os.set_blocking(fd, False)  # (the open file's flag, shared with a shell's stdout: put back below)
            try:
                self._f.flush()
            finally:
                os.set_blocking(fd, blocking)
        except (OSError, ValueError):  # (BlockingIOError: a full pipe; a closed one: nothing to keep)
            with contextlib.suppress(OSError, ValueError):
                null = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(null, self._f.fileno())
                finally:
                    os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self._f.close()

    def _error(self, e: OSError) -> KVTraceError:
        error = OutputClosed if e.errno == errno.EPIPE else KVTraceError
        return error(f"{self.name}: cannot write: {e.strerror}")
