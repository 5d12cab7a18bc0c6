"""Typed JSON line decoding (msgspec) with errors that name the file and line."""

from __future__ import annotations

from typing import Iterator, TypeVar

import msgspec

from kvtrace.errors import TraceFormatError
from kvtrace.replay.readers._base import numbered_lines

T = TypeVar("T")


def decode_error(path: str, line: int | None, err: Exception) -> TraceFormatError:
    if isinstance(err, msgspec.ValidationError):
        return TraceFormatError(path, line, str(err))
    return TraceFormatError(path, line, f"invalid JSON: {err}")


def typed_lines(path: str, schema: type[T]) -> Iterator[tuple[int, T]]:
    decoder = msgspec.json.Decoder(schema)
    for lineno, text in numbered_lines(path):
        try:
            yield lineno, decoder.decode(text)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise decode_error(path, lineno, e) from None
