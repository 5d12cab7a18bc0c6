"""OTLP in: kvtrace's collector for spans sent by any OpenTelemetry SDK (``kvtrace collect``).

- ``decode``: OTLP trace payloads (protobuf, JSON) -> span rows; ``PayloadError``;
- ``collector``: ``OTLPCollector`` (OTLP/HTTP on ``/v1/traces``, runs, the store) and
  ``serve_collector``;
- ``limits``: the receiver's limits and the check of its options (light: no pyarrow);
- ``grpc``: the OTLP/gRPC ``TraceService/Export`` server, fed the collector's ``ingest``.
"""

from typing import TYPE_CHECKING

from kvtrace.lazy import lazy_exports

# Loaded on first use (see kvtrace.instrument).
_EXPORTS = {
    "DEFAULT_MAX_BODY_BYTES": "limits",
    "OTLPCollector": "collector",
    "TRACES_PATH": "collector",
    "serve_collector": "collector",
    "PayloadError": "decode",
    "decode_json": "decode",
    "decode_protobuf": "decode",
}
__all__ = [  # _EXPORTS' names, spelled out for the linters
    "DEFAULT_MAX_BODY_BYTES",
    "TRACES_PATH",
    "OTLPCollector",
    "PayloadError",
    "decode_json",
    "decode_protobuf",
    "serve_collector",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from kvtrace.instrument.otlp.collector import TRACES_PATH, OTLPCollector, serve_collector
    from kvtrace.instrument.otlp.decode import PayloadError, decode_json, decode_protobuf
    from kvtrace.instrument.otlp.limits import DEFAULT_MAX_BODY_BYTES
