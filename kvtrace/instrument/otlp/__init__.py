"""OTLP in: kvtrace's collector for spans sent by any OpenTelemetry SDK (``kvtrace collect``).

- ``decode``: OTLP trace payloads (protobuf, JSON) -> span rows; ``PayloadError``;
- ``collector``: ``OTLPCollector`` (OTLP/HTTP on ``/v1/traces``, runs, the store) and
  ``serve_collector``;
- ``grpc``: the OTLP/gRPC ``TraceService/Export`` server, fed the collector's ``ingest``.
"""

from kvtrace.instrument.otlp.collector import DEFAULT_MAX_BODY_BYTES, TRACES_PATH, OTLPCollector, serve_collector
from kvtrace.instrument.otlp.decode import PayloadError, decode_json, decode_protobuf

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "TRACES_PATH",
    "OTLPCollector",
    "PayloadError",
    "decode_json",
    "decode_protobuf",
    "serve_collector",
]
