"""WEKA kv-cache-tester conversation traces (one JSON object per conversation file).

File keys used: ``block_size``, ``hash_id_scope`` ("local" or "global"; default local),
``id`` (optional), ``requests[{t, type, model, in, out, hash_ids}]`` with ``t`` in
seconds from the conversation start. Other keys are ignored.

- A ``type: "subagent"`` entry holds its own ``requests``, timed from the sub-agent's
  start (its ``t``), as the tester's ``flatten_requests`` reads them: each runs at the
  parent's base + the entry's ``t`` + its own ``t``, merged into the file's timeline by
  arrival. A sub-agent is a session of its own (``<id>:<agent_id>``, the tester replays it
  as another user); its ids share the file's namespace. Its requests are named
  ``<stem>/<i>/<j>``. (One level, as the tester writes them: one deeper is refused.)
- ``local`` ids are only meaningful inside their file, so each file gets its own
  namespace, derived from the file *name* (sha256, not Python's salted ``hash()``): the
  same conversation file always expands to the same tokens.
- kv-cache-tester hashes only full blocks (``len(hash_ids) == floor(in / block_size)``).
  kvtrace's convention is one id per block with the last one partial, so a leftover tail
  gets a synthetic id unique to that request (``TAIL_ID_BASE`` + its index in file order, in a local
  file's own namespace; in a ``global`` file, which shares namespace 0 with every other,
  + its index offset by a hash of the file's name, so two files' tails never meet): it
  can never hit, as in the tester. Lists already of length ``ceil`` are taken as they are.
- A directory of such files is one workload: requests of all files merged by arrival,
  ties broken by file name and then by position, so the order is deterministic.
"""

from __future__ import annotations

import glob
import hashlib
import heapq
import json
import os
import re
from collections.abc import Iterator

import msgspec

from kvtrace.errors import TraceFormatError, file_problem
from kvtrace.numeric import cdiv
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import (
    COMPRESSED_SUFFIXES,
    MAX_TIME_NS,
    MAX_TOKENS,
    ArrivalOrder,
    LineDecoder,
    S,
    check_int,
    compressed_problem,
    nul_problem,
    without_bom,
)

TAIL_ID_BASE = 1 << 62
# A conversation file is read whole (one JSON document): the kv-cache-tester's are a few MB.
# Past this a file is refused before it is read (a 10 GB one ended in a MemoryError).
MAX_FILE_BYTES = 256 << 20


class WekaRequest(msgspec.Struct):
    t: int | float
    in_: int | msgspec.UnsetType = msgspec.field(default=msgspec.UNSET, name="in")  # (absent: a sub-agent entry)
    out: int | msgspec.UnsetType = msgspec.UNSET  # (absent: a sub-agent entry; a request's 0 was a guess)
    hash_ids: list[int] = msgspec.field(default_factory=list)
    type: str | None = None
    model: str | None = None


class WekaEntry(WekaRequest):
    """A conversation's entry: a request, or a sub-agent holding its own (one level deep,
    as the tester writes them: the schema is not recursive)."""
    agent_id: str | None = None
    requests: list[WekaRequest] | None = None


SUBAGENT = "subagent"


class WekaFile(msgspec.Struct):
    block_size: int
    requests: list[WekaEntry]
    hash_id_scope: str = "local"
    id: str | None = None


def namespace_for(file_name: str) -> int:
    """A 63-bit namespace from a file's base name (stable across processes and machines)."""
    digest = hashlib.sha256(b"kvtrace/weka/" + os.fsencode(os.path.basename(file_name))).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def conversation_paths(folder: str) -> list[str]:
    """A WEKA folder's ``*.json`` files, sorted: the conversations it is read from (as listed
    now: ``TraceSource`` lists them again to tell one added while it read them)."""
    return sorted(glob.glob(os.path.join(glob.escape(folder), "*.json")))  # (a [ or * in the folder's name)


def _packed(name: str) -> bool:
    """A compressed conversation (``*.json.gz``...), which a folder's read refuses."""
    return name.endswith(tuple(".json" + s for s in COMPRESSED_SUFFIXES))


def _odd_case(name: str) -> bool:
    """A conversation named ``.JSON`` or the like, which a folder's read refuses."""
    return name.lower().endswith(".json") and not name.endswith(".json") and not name.startswith(".")


def read_in_folder(name: str) -> bool:
    """Whether a file of this name in a WEKA folder is read with it: a conversation (what
    ``conversation_paths``' glob lists: ``*.json``, not hidden), or a name the read refuses
    (compressed, another case). An output written there changes the folder's trace."""
    return (name.endswith(".json") and not name.startswith(".")) or _packed(name) or _odd_case(name)


def weka_files(path: str) -> list[str] | None:
    """The sorted .json files of a directory source, or None for a single file."""
    if not os.path.isdir(path):
        return None
    try:  # (glob finds nothing in a folder it cannot read: "holds no files" would be wrong)
        names = os.listdir(path)
    except OSError as e:
        raise TraceFormatError(path, None, f"cannot list the directory ({e.strerror or e})") from None
    files = conversation_paths(path)
    packed = sorted(n for n in names if _packed(n))
    if packed:  # (they were skipped without a word: 2 of 3 files replayed)
        raise TraceFormatError(os.path.join(path, packed[0]), None, f"compressed ({len(packed)} such in {path}); "
                               "kvtrace reads conversations as plain JSON: decompress them first")
    odd = sorted(n for n in names if _odd_case(n))
    if odd:  # (skipped without a word too, as on a file system whose names keep their case)
        raise TraceFormatError(os.path.join(path, odd[0]), None, f"named {odd[0][-5:]}, not .json ({len(odd)} such in "
                               f"{path}); kvtrace reads a directory's *.json conversations: rename them")
    if not files:
        raise TraceFormatError(path, None, "directory holds no *.json conversation files")
    for file in files:  # (a FIFO among them would block the read)
        problem = file_problem(file)
        if problem is not None:
            raise TraceFormatError(file, None, f"{problem}; expected a WEKA conversation file")
        if not os.path.basename(file).isascii():
            try:  # a file's name is its requests' id: text, which the store and the digest keep
                os.path.basename(file).encode("utf-8")
            except UnicodeEncodeError:
                raise TraceFormatError(file, None, "file name is not UTF-8 text (it names the conversation's "
                                                   "requests); rename the file") from None
    return files


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _top_level_value(text: str, key: str) -> int | None:
    """Where the value of the top-level ``key`` starts in the JSON object ``text`` (its last
    one, as the decoder reads a repeated key), or None (error path only; walks the JSON)."""
    dec = json.JSONDecoder()
    found = None
    try:
        i = _skip_ws(text, 0)
        if text[i] != "{":
            return None
        i += 1
        while True:
            i = _skip_ws(text, i)
            if text[i] == "}":
                return found
            name, i = dec.raw_decode(text, i)
            i = _skip_ws(text, i) + 1  # ':'
            i = _skip_ws(text, i)
            if name == key:
                found = i
            _, i = dec.raw_decode(text, i)
            i = _skip_ws(text, i)
            if text[i] == ",":
                i += 1
    except (ValueError, IndexError):
        return found


def key_line(text: str, key: str) -> int:
    """1-based line of the top-level ``key``'s value (a pretty-printed file's ``block_size``
    on line 14 was named at line 1); 1 where it is not found."""
    at = _top_level_value(text, key)
    return 1 if at is None else text.count("\n", 0, at) + 1


def request_line(text: str, index: int) -> int | None:
    """1-based line where ``requests[index]`` starts (error path only; walks the JSON)."""
    dec = json.JSONDecoder()
    i = _top_level_value(text, "requests")
    try:
        if i is None or text[i] != "[":
            return None
        i += 1
        k = 0
        while True:
            i = _skip_ws(text, i)
            if text[i] == "]":
                return None
            if k == index:
                return text.count("\n", 0, i) + 1
            _, i = dec.raw_decode(text, i)
            i = _skip_ws(text, i)
            if text[i] == ",":
                i += 1
            k += 1
    except (ValueError, IndexError):
        return None


def _load(path: str) -> tuple[str, WekaFile]:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                raise TraceFormatError(path, None, f"more than {MAX_FILE_BYTES:,} bytes: larger than a WEKA "
                                                   "conversation file is read (one JSON document, read whole)")
            raw = without_bom(raw)
    except OSError as e:
        raise TraceFormatError(path, None, f"cannot open: {e.strerror}") from None
    problem = compressed_problem(path, raw[:12])  # (a directory's file named .json: 'not UTF-8 text' it was)
    if problem is not None:
        raise TraceFormatError(path, None, problem)
    if not raw.strip(b" \t\r\n"):  # (a directory's empty file: msgspec said "Input data was truncated")
        raise TraceFormatError(path, None, "empty file; expected a WEKA conversation (one JSON object)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(path, raw.count(b"\n", 0, e.start) + 1, "not UTF-8 text") from None
    try:
        return text, LineDecoder(WekaFile).decode(text)
    except msgspec.ValidationError as e:
        m = re.search(r"\$\.requests\[(\d+)\]", str(e))
        top = re.search(r"`\$\.([A-Za-z_]+)`", str(e))  # (a top-level key's: block_size, id)
        line = request_line(text, int(m.group(1))) if m else key_line(text, top.group(1)) if top else 1
        raise TraceFormatError(path, line, str(e)) from None
    except RecursionError:
        raise TraceFormatError(path, None, "invalid JSON: nested too deeply") from None
    except msgspec.DecodeError as e:
        # msgspec names the byte at fault (json.loads would accept NaN and name no line);
        # a file cut short ends on its last line
        m = re.search(r"\(byte (\d+)\)", str(e))
        at = int(m.group(1)) if m else len(raw.rstrip())
        line = raw.count(b"\n", 0, at) + 1
        nul = None
        if raw[at:at + 1] == b"\x00":  # (a file padded with zeros was 'trailing characters (byte 56)')
            nul = nul_problem(raw[raw.rfind(b"\n", 0, at) + 1:at + 1].decode("utf-8"))
        raise TraceFormatError(path, line, nul or f"invalid JSON: {e}") from None


def read_weka_file(path: str, rank: int = 0) -> Iterator[tuple[int, int, int, TraceRequest]]:
    """(arrival_ns, rank, index, request) for each request of one conversation file, by
    arrival (a sub-agent's requests joined into the parent's timeline; ties in file order)."""
    text, conv = _load(path)
    bs = conv.block_size
    if not 0 < bs <= MAX_TOKENS:  # (bounded as every format's: 2^62 was refused by cache-only mode without
        line = key_line(text, "block_size")  # the file named)
        if bs <= 0:
            raise TraceFormatError(path, line, f"block_size: expected > 0, got {bs}")
        check_int(path, line, "block_size", bs, 1)
    tail_base = TAIL_ID_BASE
    if conv.hash_id_scope == "local":
        namespace = namespace_for(path)
    elif conv.hash_id_scope == "global":
        namespace = 0
        tail_base += namespace_for(path) >> 2  # (< 2^61: with any index the id stays below 2^63)
    else:
        raise TraceFormatError(path, key_line(text, "hash_id_scope"),
                               f"hash_id_scope: expected 'local' or 'global', got {conv.hash_id_scope!r}")
    stem = os.path.splitext(os.path.basename(path))[0]
    out: list[tuple[int, int, int, TraceRequest]] = []
    # Depth-first, in file order: a sub-agent's requests are numbered where its entry stands
    # (index: the request's place in the file, which breaks ties of arrival and numbers a
    # partial block's tail id; a file without sub-agents keeps the ids it always had). Each
    # timeline: its entries, its arrival check, start, session, request-id prefix, JSON key,
    # and the top-level entry it sits in, whose line an error names.
    stack: list[tuple[Iterator[tuple[int, WekaRequest]], ArrivalOrder, int, str, str, str, int]] = [
        (enumerate(conv.requests), ArrivalOrder(path, "t", S), 0, conv.id or stem, stem, "requests", -1)]
    while stack:
        entries, order, base_ns, session, name, where, top = stack[-1]
        for i, r in entries:
            key, at = f"{where}[{i}]", i if top < 0 else top

            def fail(what: str, at: int = at, key: str = key) -> TraceFormatError:
                return TraceFormatError(path, request_line(text, at), f"{key}.{what}")
            try:
                arrival = base_ns + order.check(r.t, None)
            except TraceFormatError as e:
                raise fail(e.what) from None
            if arrival >= MAX_TIME_NS:
                raise fail(f"t: the sub-agent's start plus {r.t!r} s is past {MAX_TIME_NS // S:,} s")
            if r.type == SUBAGENT:
                if not isinstance(r, WekaEntry):
                    raise fail("type: a sub-agent inside a sub-agent, which kvtrace does not read")
                agent = r.agent_id if r.agent_id is not None else str(i)
                stack.append((enumerate(r.requests or []), ArrivalOrder(path, "t", S), arrival, f"{session}:{agent}",
                              f"{name}/{i}", f"{key}.requests", at))
                break  # (its requests next, then this timeline's next entry)
            for key, given in (("in", r.in_), ("out", r.out)):
                if given is msgspec.UNSET:
                    raise fail(f"{key}: missing (every request has one; only a sub-agent entry has none)")
            try:
                n = check_int(path, None, "in", r.in_, 1)
                n_out = check_int(path, None, "out", r.out, 0)
            except TraceFormatError as e:
                raise fail(e.what) from None
            index = len(out)
            ids = r.hash_ids
            if ids and (min(ids) < 0 or max(ids) >= TAIL_ID_BASE):  # (a tail's id, read as a block, could hit)
                raise fail("hash_ids: ids must lie in [0, 2^62); kvtrace numbers partial tails from 2^62")
            full, want = n // bs, cdiv(n, bs)
            if len(ids) == full and full != want:
                ids = ids + [tail_base + index]
            elif len(ids) != want:
                raise fail(
                    f"hash_ids: expected floor or ceil of in {n} / block_size {bs} ({full} or {want}) ids, "
                    f"got {len(ids)}"
                )
            out.append((arrival, rank, index, TraceRequest(
                request_id=f"{name}/{i}",
                arrival_ns=arrival,
                input_length=n,
                output_length=n_out,
                hash_ids=tuple(ids),
                hash_block_size=bs,
                namespace=namespace,
                session_id=session,
            )))
        else:  # (this timeline is done)
            stack.pop()
    out.sort(key=lambda x: x[:3])
    yield from out


def read_weka(path: str) -> Iterator[TraceRequest]:
    files = weka_files(path)
    if files is None:
        for *_, req in read_weka_file(path):
            yield req
        return
    merged = heapq.merge(*(read_weka_file(f, rank) for rank, f in enumerate(files)), key=lambda x: x[:3])
    for *_, req in merged:
        yield req
