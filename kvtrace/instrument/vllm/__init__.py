"""Live capture of a vLLM server's KV events (ZMQ) into the kvtrace store.

- ``endpoints``: where each DP rank publishes, and the check of the capture's options
  (light: no ZMQ);
- ``wire``: vLLM's wire format (multipart PUB messages, msgpack event batches in both
  layouts, the replay socket) and its decoder;
- ``rows``: batches -> span rows: each batch a ``kvtrace.engine.step`` span parenting
  its events as ``kvtrace.cache.publish`` / ``kvtrace.cache.evict`` spans,
  ``source = 'vllm'``;
- ``capture``: ``VllmKVCapture`` follows one publisher (sequence tracking, gap recovery
  through the replay socket, lost batches counted); ``capture_vllm`` records every DP
  rank of a server into one run (``kvtrace capture vllm``);
- ``reconstruct``: a replayable native trace rebuilt from the ``BlockStored`` chains.
"""

from typing import TYPE_CHECKING

from kvtrace.lazy import lazy_exports

# Loaded on first use (see kvtrace.instrument).
_EXPORTS = {
    "CaptureStats": "capture",
    "VllmKVCapture": "capture",
    "capture_report": "capture",
    "capture_vllm": "capture",
    "run_captures": "capture",
    "ChainTracer": "reconstruct",
    "native_requests": "reconstruct",
    "write_native_trace": "reconstruct",
    "VllmSpanRows": "rows",
    "KVEvent": "wire",
    "KVEventBatch": "wire",
    "VllmWireError": "wire",
    "decode_kv_batch": "wire",
    "dp_endpoint": "endpoints",
}
__all__ = [  # _EXPORTS' names, spelled out for the linters
    "CaptureStats",
    "ChainTracer",
    "KVEvent",
    "KVEventBatch",
    "VllmKVCapture",
    "VllmSpanRows",
    "VllmWireError",
    "capture_report",
    "capture_vllm",
    "decode_kv_batch",
    "dp_endpoint",
    "native_requests",
    "run_captures",
    "write_native_trace",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from kvtrace.instrument.vllm.capture import CaptureStats, VllmKVCapture, capture_report, capture_vllm, run_captures
    from kvtrace.instrument.vllm.endpoints import dp_endpoint
    from kvtrace.instrument.vllm.reconstruct import ChainTracer, native_requests, write_native_trace
    from kvtrace.instrument.vllm.rows import VllmSpanRows
    from kvtrace.instrument.vllm.wire import KVEvent, KVEventBatch, VllmWireError, decode_kv_batch
