"""The trace source handle every reader is opened through: re-iterable and streaming.

Every reader is a generator of :class:`~kvtrace.workload.TraceRequest` in file order;
the line-level checks the readers share live in :mod:`kvtrace.workload.lines`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from kvtrace.errors import KVTraceError, TraceFormatError
from kvtrace.replay.readers.weka import conversation_paths
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import source_sha256

Reader = Callable[..., Iterator[TraceRequest]]
CHECKED_BEFORE_DIGEST = 1000  # requests read before a trace's bytes are hashed (a few ms)
CHECKED_EVERY = 1 << 14  # requests read between two looks at the files, while they are read
Stamp = tuple[Any, ...]  # each file's (device, inode, size, mtime ns) or None; a WEKA listing or None last


class TraceSource:
    """A re-iterable, streaming handle on a trace file (or a WEKA directory).

    Each ``iter()`` reopens the file, so a source can be replayed twice without holding
    its requests in memory. ``source_id`` is the sha256 of the bytes (WEKA: of the files'
    names and sha256s), for run records.
    """

    __slots__ = ("_files", "_reader", "_source_id", "_stamp", "format", "limit", "more", "options", "path")

    def __init__(self, path: str, fmt: str, reader: Reader, limit: int | None, options: dict,
                 files: list[str] | None = None):
        self.path, self.format, self.limit, self.options = path, fmt, limit, options
        self._reader, self._files = reader, files
        self._source_id: str | None = None
        self._stamp: Stamp | None = None  # the files as they were when hashed (source_id)
        self.more: bool | None = None  # a request past ``limit``: known once an iteration got there

    def __iter__(self) -> Iterator[TraceRequest]:
        stamp = self._stamp or self._stamps()
        it = self._reader(self.path, **self.options)
        return self._unchanged(it, stamp) if self.limit is None else self._limited(it, stamp)

    def _stamps(self) -> Stamp:
        """What says a file changed: its identity, size and modification time (None: not
        there, which the reader names); a WEKA directory's listing last (a conversation
        added while it was read was replayed under the digest of the files before)."""
        stamps: list[tuple[int, int, int, int] | None] = []
        for file in self.files:
            try:
                st = os.stat(file)
            except (OSError, ValueError):
                stamps.append(None)
                continue
            stamps.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        listing = None if self._files is None else tuple(conversation_paths(self.path))
        return (*stamps, listing)

    def _check_unchanged(self, stamp: Stamp) -> Stamp:
        """A refusal if the files read are not as they were when hashed (or when this read
        began): requests appended or a file replaced while a replay read it were replayed
        under the digest of the bytes before, the run of one trace named another. A file
        only touched, or rewritten with the same bytes, is hashed again and goes on (it was
        refused); without a digest to hold it to, a new time alone says nothing."""
        now = self._stamps()
        if now == stamp:
            return stamp
        same_files = now[-1] == stamp[-1] and all(
            a is not None and b is not None and a[:3] == b[:3] for a, b in zip(now[:-1], stamp[:-1]))
        if same_files:
            if self._source_id is None:
                return stamp
            files = [self.path] if self._files is None and self.format == "weka" else self._files
            if source_sha256(self.path, files) == self._source_id:
                self._stamp = now  # (hashed again: the next read need not)
                return now
        raise TraceFormatError(self.path, None, "changed while kvtrace read it (other bytes, another size or file "
                                                "than when it was hashed or opened); the requests read are not the "
                                                "trace its digest names: replay a copy nothing writes to")

    def _unchanged(self, it: Iterator[TraceRequest], stamp: Stamp) -> Iterator[TraceRequest]:
        """``it``, then ``_check_unchanged``; a trace of no request is refused (``_none_read``).
        The files are looked at every ``CHECKED_EVERY`` requests too: a trace a writer appended
        to faster than the read went on was read for ever, its refusal waiting for an end."""
        read = 0
        try:
            for request in it:
                read += 1
                yield request
                if read % CHECKED_EVERY == 0:
                    stamp = self._check_unchanged(stamp)
        except TraceFormatError:
            self._check_unchanged(stamp)  # (a file cut or rewritten mid-line reads as a bad line: say which)
            raise
        self._check_unchanged(stamp)
        if not read:
            self._none_read()

    def _none_read(self) -> None:
        """A trace that parsed but held no request (a CSV of its header alone) replayed
        nothing and exited 0 with a digest, where an empty file was an error."""
        raise TraceFormatError(self.path, None, "holds no request (a header or blank lines only?)")

    def _limited(self, it: Iterator[TraceRequest], stamp: Stamp) -> Iterator[TraceRequest]:
        """The first ``limit`` requests, then one more read, never yielded, for ``more``: a
        --limit equal to the trace's length cuts nothing. A bad request there is one more
        all the same (the requests asked for come before it, and were read). Then
        ``_check_unchanged``, as a whole read has it (a trace rewritten under a --limit
        read went unseen: the read never reached the end that checked it)."""
        assert self.limit is not None
        read = 0
        try:
            for request in islice(it, self.limit):
                read += 1
                yield request
                if read % CHECKED_EVERY == 0:  # (as a whole read looks: a --limit of millions)
                    stamp = self._check_unchanged(stamp)
        except TraceFormatError:
            self._check_unchanged(stamp)  # (as _unchanged's)
            raise
        try:
            self.more = next(it, None) is not None
        except KVTraceError:
            self.more = True
        self._check_unchanged(stamp)
        if not read:
            self._none_read()

    def holds_more(self) -> bool:
        """Whether the file holds a request past ``limit`` (False without a limit); read once
        for a source not iterated that far yet."""
        if self.limit is None:
            return False
        if self.more is None:
            for _ in self:
                pass
        return bool(self.more)

    @property
    def source_id(self) -> str:
        if self._source_id is None:
            # the first requests read first: a malformed start (a 20 GB line 2) is told at
            # once, not after every byte of the file was hashed
            for _ in islice(self, CHECKED_BEFORE_DIGEST):
                pass
            # a WEKA file's name is in its requests (ids, local namespace): a renamed copy is
            # another trace, told apart as a directory's files are, by (name, sha256)
            files = [self.path] if self._files is None and self.format == "weka" else self._files
            stamp = self._stamps()
            source_id = source_sha256(self.path, files)
            if self._stamps() != stamp:  # (written while it was hashed)
                raise TraceFormatError(self.path, None, "changed while kvtrace hashed it; replay a copy nothing "
                                                        "writes to")
            self._stamp, self._source_id = stamp, source_id
        return self._source_id

    @property
    def files(self) -> list[str]:
        """The files read: a WEKA directory's conversations, or the trace file itself."""
        return [self.path] if self._files is None else list(self._files)

    def __repr__(self) -> str:
        return f"TraceSource(path={self.path!r}, format={self.format!r}, limit={self.limit!r})"
