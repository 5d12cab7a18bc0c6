"""Live capture of a vLLM server's KV events (ZMQ) into the kvtrace store.

- ``wire``: vLLM's wire format (multipart PUB messages, msgpack event batches in both
  layouts, the replay socket, the per-DP-rank endpoints) and its decoder;
- ``rows``: batches -> span rows: each batch a ``kvtrace.engine.step`` span parenting
  its events as ``kvtrace.cache.publish`` / ``kvtrace.cache.evict`` spans,
  ``source = 'vllm'``;
- ``capture``: ``VllmKVCapture`` follows one publisher (sequence tracking, gap recovery
  through the replay socket, lost batches counted); ``capture_vllm`` records every DP
  rank of a server into one run (``kvtrace capture vllm``);
- ``reconstruct``: a replayable native trace rebuilt from the ``BlockStored`` chains.
"""

from kvtrace.instrument.vllm.capture import CaptureStats, VllmKVCapture, capture_report, capture_vllm, run_captures
from kvtrace.instrument.vllm.reconstruct import ChainTracer, native_requests, write_native_trace
from kvtrace.instrument.vllm.rows import VllmSpanRows
from kvtrace.instrument.vllm.wire import KVEvent, KVEventBatch, VllmWireError, decode_kv_batch, dp_endpoint

__all__ = [
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
