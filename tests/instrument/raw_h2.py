"""A gRPC request written as raw HTTP/2 frames (HPACK literals, no Huffman), for headers no
gRPC client would send: the receiver must cope with what any peer can put on the wire."""

from __future__ import annotations

import socket
import struct
import time

EXPORT_PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out = [limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes([*out, value])


def _literal(name: str, value: str) -> bytes:  # literal header field without indexing, new name
    n, v = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def export_with_headers(port: int, extra: list[tuple[str, str]], message: bytes = b"", compressed: bool = True,
                        wait_s: float = 0.5) -> bytes:
    """One Export call on stream 1 with ``extra`` headers; returns what the server sent
    within ``wait_s``."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", EXPORT_PATH), (":authority", "x"),
               ("content-type", "application/grpc"), ("te", "trailers"), *extra]
    block = b"".join(_literal(k, v) for k, v in headers)
    body = bytes([compressed]) + struct.pack(">I", len(message)) + message
    got = []
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"") + _frame(1, 4, 1, block)
                  + _frame(0, 1, 1, body))
        end = time.monotonic() + wait_s
        try:
            while time.monotonic() < end and (chunk := s.recv(65536)):
                got.append(chunk)
        except OSError:
            pass
    return b"".join(got)
