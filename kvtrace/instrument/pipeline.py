"""Tracer setup: one ``TracerProvider`` feeding the DuckDB store and/or an OTLP collector.

``--otlp-endpoint URL`` uses the SDK's OTLP/HTTP (protobuf) exporter. The standard
variables are honoured because the SDK reads them: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
/ ``OTEL_EXPORTER_OTLP_ENDPOINT`` (when no URL is given), ``..._HEADERS``,
``..._TIMEOUT``, ``..._COMPRESSION``, ``..._CERTIFICATE`` and friends, plus
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` for the resource.
"""

from __future__ import annotations

import os
from typing import Any, Mapping
from urllib.parse import urlparse

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from kvtrace.errors import ConfigError
from kvtrace.instrument.convert import RUN_ID_RESOURCE_KEY
from kvtrace.instrument.exporter import DuckDBSpanExporter
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.processor import BulkSpanProcessor

_ENV_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def otlp_requested(endpoint: str | None) -> bool:
    """True when a URL is given or the standard endpoint variables name one."""
    return bool(endpoint) or any(os.environ.get(k) for k in _ENV_ENDPOINTS)


def traces_url(endpoint: str) -> str:
    """A collector base URL gets the OTLP/HTTP traces path; a full URL is kept."""
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError("--otlp-endpoint", endpoint, "expected an http(s)://HOST:PORT[/v1/traces] URL")
    if parsed.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def otlp_span_exporter(endpoint: str | None = None) -> OTLPSpanExporter:
    """The SDK's OTLP/HTTP exporter; ``endpoint=None`` leaves it to the OTEL_* variables."""
    return OTLPSpanExporter(endpoint=traces_url(endpoint)) if endpoint else OTLPSpanExporter()


def make_resource(run_id: str | None, service_name: str = "kvtrace",
                  attributes: Mapping[str, Any] | None = None) -> Resource:
    attrs: dict[str, Any] = {"service.name": service_name}
    attrs.update(attributes or {})
    if run_id is not None:
        attrs[RUN_ID_RESOURCE_KEY] = run_id
    # Resource.create also reads OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME.
    return Resource.create(attrs)


def build_tracer_provider(
    *,
    store=None,
    run_id: str | None = None,
    otlp_endpoint: str | None = None,
    seed: int = 0,
    service_name: str = "kvtrace",
    resource_attributes: Mapping[str, Any] | None = None,
    background: bool = True,
    otlp_batch_size: int = 512,
) -> TracerProvider:
    """A provider with a never-dropping processor per destination.

    ``store`` + ``run_id``: spans go to the DuckDB store (columnar fast path).
    ``otlp_endpoint`` (or the OTEL_EXPORTER_OTLP_* variables): spans also go over OTLP/HTTP.
    ``background``: exports run on a worker thread each, behind a bounded blocking queue.
    Call ``provider.force_flush()`` before ``store.finish_run`` and ``shutdown()`` at the end.
    """
    resource = make_resource(run_id, service_name, resource_attributes)
    provider = TracerProvider(resource=resource, id_generator=SeededIdGenerator(seed))
    if store is not None:
        if run_id is None:
            raise ValueError("build_tracer_provider: a store needs a run_id")
        provider.add_span_processor(
            BulkSpanProcessor(DuckDBSpanExporter(store, run_id), background=background, run_id=run_id)
        )
    if otlp_requested(otlp_endpoint):
        provider.add_span_processor(
            BulkSpanProcessor(otlp_span_exporter(otlp_endpoint), background=background,
                              max_export_batch_size=otlp_batch_size, resource=resource, run_id=run_id)
        )
    return provider
