"""The store's schema, as data: span columns, their Arrow types and OTel attribute keys.

One row of ``spans`` is one span. Typed columns hold the ``kvtrace.*`` attributes the
dashboard queries (fast, columnar); everything else a producer sends lands in
``extra_attributes``. The view ``otel_traces`` reassembles the ClickHouse-exporter shape
(``SpanAttributes`` map built from the typed columns plus ``extra_attributes``).

Producers (the instrument's exporters, the OTLP receiver, the vLLM capture) build Arrow
tables in ``SPAN_ARROW_SCHEMA`` (any subset of its columns, in any order; missing
columns are NULL) and hand them to ``Store.append_spans``. ``ATTRIBUTE_COLUMNS`` maps an
OTel attribute key to the typed column that stores it, so a span read back from OTLP
lands in the same columns as one produced in-process.
"""

from __future__ import annotations

import pyarrow as pa

# 2: ids stored as integers (trace_id_hi/lo, span_id, parent_span_id UBIGINT); views show hex.
# 3: request spans carry vLLM's external and preempted query counters (kvtrace.metrics).
SCHEMA_VERSION = 3

# --- span names -------------------------------------------------------------------------
SPAN_PUBLISH = "kvtrace.cache.publish"
SPAN_EVICT = "kvtrace.cache.evict"
SPAN_COW = "kvtrace.cache.cow"
# the copy_reason of an external-tier load into a local block, a copy span but no copy-on-write
# (the cache's COPY_EXTERNAL: a store imports no cache)
COPY_REASON_EXTERNAL = "external"
SPAN_LOOKUP = "kvtrace.cache.lookup"
SPAN_FREE = "kvtrace.cache.free"
SPAN_STALE_LEFT = "kvtrace.cache.stale_left"
SPAN_STEP = "kvtrace.engine.step"
SPAN_REQUEST = "kvtrace.request"
SPAN_STALE_HASH = "kvtrace.verify.stale_hash"
SPAN_DIVERGENT = "kvtrace.verify.divergent_output"
# Live vLLM KV events reuse the cache names with ``source = 'vllm'``:
#   BlockStored -> kvtrace.cache.publish (publish_kind 'vllm_stored')
#   BlockRemoved -> kvtrace.cache.evict (evict_reason 'vllm_removed')
#   AllBlocksCleared -> kvtrace.cache.evict (evict_reason 'reset', no block ids)
SPAN_NAMES = (
    SPAN_PUBLISH, SPAN_EVICT, SPAN_COW, SPAN_LOOKUP, SPAN_FREE, SPAN_STALE_LEFT,
    SPAN_STEP, SPAN_REQUEST, SPAN_STALE_HASH, SPAN_DIVERGENT,
)

SOURCE_REPLAY = "replay"  # produced in-process by kvtrace's engine
SOURCE_VLLM = "vllm"  # live vLLM KV events (ZMQ)
SOURCE_OTLP = "otlp"  # received over OTLP/HTTP
SOURCES = (SOURCE_REPLAY, SOURCE_VLLM, SOURCE_OTLP)

# --- columns ----------------------------------------------------------------------------
_I64 = pa.int64()
_I32 = pa.int32()
_STR = pa.string()
_F64 = pa.float64()
_U64 = pa.uint64()
_ATTR_MAP = pa.map_(pa.string(), pa.string())

EVENT_STRUCT = pa.struct([("time_ns", _I64), ("name", _STR), ("attributes", _ATTR_MAP)])
LINK_STRUCT = pa.struct(
    [("trace_id_hi", _U64), ("trace_id_lo", _U64), ("span_id", _U64), ("trace_state", _STR),
     ("attributes", _ATTR_MAP)]
)
CHUNK_STRUCT = pa.struct([("start_ns", _I64), ("end_ns", _I64), ("num_tokens", _I64)])
# The DuckDB types of the list-of-struct columns (events, links, prefill_chunks).
_EVENTS_SQL = "STRUCT(time_ns BIGINT, name VARCHAR, attributes MAP(VARCHAR, VARCHAR))[]"
_LINKS_SQL = ("STRUCT(trace_id_hi UBIGINT, trace_id_lo UBIGINT, span_id UBIGINT, trace_state VARCHAR, "
              "attributes MAP(VARCHAR, VARCHAR))[]")
_CHUNKS_SQL = "STRUCT(start_ns BIGINT, end_ns BIGINT, num_tokens BIGINT)[]"


class Col:
    """One span column: name, Arrow type, DuckDB type, the OTel attribute key it stores, and
    the least value a sender may put there (``min_value``: times, steps and durations are
    never negative, so the store's SQL can subtract any two of them in BIGINT without
    overflow; counts, ids and sizes are never negative either, so no sum of them in a view
    goes below zero; nor are a number column's gaps). A number column may say its greatest
    too (``max_value``: a pool's usage is a share, 0..1). `kvtrace collect` refuses a span
    with a value beyond them; the ClickHouse path keeps it as an extra attribute's text."""

    __slots__ = ("arrow", "attr", "doc", "max_value", "min_value", "name", "sql")

    def __init__(self, name: str, arrow: pa.DataType, sql: str, attr: str | None, doc: str,
                 min_value: int | None = None, max_value: float | None = None):
        self.name, self.arrow, self.sql, self.attr, self.doc = name, arrow, sql, attr, doc
        self.min_value, self.max_value = min_value, max_value


# (name, arrow type, duckdb type, OTel attribute key or None, meaning)
SPAN_COLUMN_DEFS: tuple[Col, ...] = (
    # identity and OTel envelope
    Col("run_id", _STR, "VARCHAR", None, "run this span belongs to (filled by Store.append_spans)"),
    Col("trace_id_hi", _U64, "UBIGINT", None, "trace id, high 64 bits (views: trace_id, 32 lowercase hex chars)"),
    Col("trace_id_lo", _U64, "UBIGINT", None, "trace id, low 64 bits"),
    Col("span_id", _U64, "UBIGINT", None, "span id (views: 16 lowercase hex chars)"),
    Col("parent_span_id", _U64, "UBIGINT", None, "parent span id (views: hex); NULL for a root span"),
    Col("trace_state", _STR, "VARCHAR", None, "W3C trace state"),
    Col("name", _STR, "VARCHAR", None, "span name, one of SPAN_NAMES for kvtrace spans"),
    Col("span_kind", _STR, "VARCHAR", None, "OTel kind as the ClickHouse exporter writes it; NULL = Internal"),
    Col("start_ns", _I64, "BIGINT", None, "start, virtual (replay) or unix (live) nanoseconds"),
    Col("end_ns", _I64, "BIGINT", None, "end nanoseconds; Duration = end_ns - start_ns"),
    Col("status_code", _STR, "VARCHAR", None, "Unset | Ok | Error; NULL = Unset"),
    Col("status_message", _STR, "VARCHAR", None, ""),
    Col("service_name", _STR, "VARCHAR", None, "NULL = 'kvtrace'"),
    Col("scope_name", _STR, "VARCHAR", None, "instrumentation scope"),
    Col("scope_version", _STR, "VARCHAR", None, ""),
    Col("resource_attributes", _ATTR_MAP, "MAP(VARCHAR, VARCHAR)", None, "OTel resource attributes"),
    Col("extra_attributes", _ATTR_MAP, "MAP(VARCHAR, VARCHAR)", None, "attributes without a typed column"),
    Col("events", pa.list_(EVENT_STRUCT), _EVENTS_SQL, None, "OTel span events"),
    Col("links", pa.list_(LINK_STRUCT), _LINKS_SQL, None, "OTel span links (views: trace_id, span_id as hex)"),
    Col("source", _STR, "VARCHAR", "kvtrace.source", "replay | vllm | otlp; NULL = replay"),
    # common kvtrace attributes
    Col("step", _I64, "BIGINT", "kvtrace.step", "scheduler step index", min_value=0),
    Col("group_id", _I32, "INTEGER", "kvtrace.group", "KV cache group (vLLM group_idx)"),
    Col("request_id", _STR, "VARCHAR", "kvtrace.request.id", "request id"),
    Col("block_ids", pa.list_(_I64), "BIGINT[]", "kvtrace.block.ids",
        "block ids this span covers (-1: the external tier's, which has no device block)", min_value=-1),
    Col("block_hashes", pa.list_(_STR), "VARCHAR[]", "kvtrace.block.hashes",
        "block hashes, lowercase hex, aligned with block_ids"),
    Col("num_tokens", _I64, "BIGINT", "kvtrace.num_tokens",
        "publish: prefix length the last key stands for; stale: prefix length the key claims", min_value=0),
    # publish / evict / cow
    Col("publish_kind", _STR, "VARCHAR", "kvtrace.publish.kind",
        "full | partial_tail | checkpoint | boundary | moved (| vllm_stored)"),
    Col("evict_reason", _STR, "VARCHAR", "kvtrace.evict.reason",
        "lru | stale_hash | replaced | moved | connector | reset (| vllm_removed)"),
    Col("ages", pa.list_(_I64), "BIGINT[]", "kvtrace.evict.ages", "evict: steps since each entry was published",
        min_value=0),
    Col("idle", pa.list_(_I64), "BIGINT[]", "kvtrace.evict.idle",
        "evict: steps since each entry was last used (-1: unknown, the vllm backend's)", min_value=-1),
    Col("copy_reason", _STR, "VARCHAR", "kvtrace.cow.why", "partial_hit | running_tail | external"),
    Col("copy_src", _I64, "BIGINT", "kvtrace.cow.src", "cow source block id (-1: the external tier)",
        min_value=-1),
    Col("copy_dst", _I64, "BIGINT", "kvtrace.cow.dst", "cow destination block id", min_value=0),
    # lookup (and request: hit counts at first schedule)
    Col("num_query_tokens", _I64, "BIGINT", "kvtrace.lookup.query_tokens", "lookup: tokens looked up", min_value=0),
    Col("num_hit_tokens", _I64, "BIGINT", "kvtrace.hit_tokens", "local prefix-cache hit tokens", min_value=0),
    Col("hit_tokens_per_group", pa.list_(_I64), "BIGINT[]", "kvtrace.lookup.hit_tokens_per_group",
        "lookup: hit tokens per KV group", min_value=0),
    Col("shared_prefix_boundary", _I64, "BIGINT", "kvtrace.shared_prefix_boundary",
        "lookup: shared prefix boundary (tokens)", min_value=0),
    Col("num_external_hit_tokens", _I64, "BIGINT", "kvtrace.external_hit_tokens",
        "hit tokens loaded from the external tier", min_value=0),
    Col("root_hash", _STR, "VARCHAR", "kvtrace.lookup.root_hash",
        "lookup: hash of the first full block (prefix family), hex"),
    Col("first_miss_hash", _STR, "VARCHAR", "kvtrace.lookup.first_miss_hash",
        "lookup: hash of the first full block that missed (group 0), hex"),
    Col("first_miss_index", _I64, "BIGINT", "kvtrace.lookup.first_miss_index",
        "lookup: its block index, -1 when all hit", min_value=-1),
    # engine step
    Col("num_prefill_tokens", _I64, "BIGINT", "kvtrace.step.prefill_tokens", "", min_value=0),
    Col("num_decode_seqs", _I64, "BIGINT", "kvtrace.step.decode_seqs", "", min_value=0),
    Col("num_running", _I64, "BIGINT", "kvtrace.step.running", "", min_value=0),
    Col("num_waiting", _I64, "BIGINT", "kvtrace.step.waiting", "", min_value=0),
    Col("num_copies", _I64, "BIGINT", "kvtrace.step.copies", "", min_value=0),
    Col("num_preempted", _I64, "BIGINT", "kvtrace.step.preempted", "", min_value=0),
    Col("usage", pa.list_(_F64), "DOUBLE[]", "kvtrace.step.usage", "block-pool usage per KV group, 0..1",
        min_value=0, max_value=1),
    # request
    Col("session_id", _STR, "VARCHAR", "kvtrace.request.session_id", ""),
    Col("arrival_ns", _I64, "BIGINT", "kvtrace.request.arrival_ns", "request arrival (span start is arrival too)",
        min_value=0),
    Col("first_scheduled_ns", _I64, "BIGINT", "kvtrace.request.first_scheduled_ns", "", min_value=0),
    Col("first_token_ns", _I64, "BIGINT", "kvtrace.request.first_token_ns", "", min_value=0),
    Col("num_prompt_tokens", _I64, "BIGINT", "gen_ai.usage.input_tokens", "", min_value=0),
    Col("num_output_tokens", _I64, "BIGINT", "gen_ai.usage.output_tokens", "", min_value=0),
    Col("num_computed_tokens", _I64, "BIGINT", "kvtrace.request.computed_prompt_tokens",
        "prompt tokens actually prefilled", min_value=0),
    Col("num_preemptions", _I64, "BIGINT", "kvtrace.request.preemptions", "", min_value=0),
    Col("num_divergent_tokens", _I64, "BIGINT", "kvtrace.request.divergent_tokens", "", min_value=0),
    Col("num_external_query_tokens", _I64, "BIGINT", "kvtrace.request.external_query_tokens",
        "tokens beyond the local hit asked of the external tier at first schedule (0 without one)", min_value=0),
    Col("num_preempted_query_tokens", _I64, "BIGINT", "kvtrace.request.preempted_query_tokens",
        "tokens looked up again at the re-admissions after preemptions", min_value=0),
    Col("num_preempted_hit_tokens", _I64, "BIGINT", "kvtrace.request.preempted_hit_tokens",
        "local hit tokens of those re-lookups", min_value=0),
    Col("ttft_ns", _I64, "BIGINT", "kvtrace.request.ttft_ns", "first_token_ns - arrival_ns", min_value=0),
    Col("itl_ns", pa.list_(_I64), "BIGINT[]", "kvtrace.request.itl_ns", "every inter-token gap", min_value=0),
    Col("itl_mean_ns", _F64, "DOUBLE", "kvtrace.request.itl_mean_ns", "", min_value=0),
    Col("itl_p50_ns", _F64, "DOUBLE", "kvtrace.request.itl_p50_ns", "", min_value=0),
    Col("itl_p99_ns", _F64, "DOUBLE", "kvtrace.request.itl_p99_ns", "", min_value=0),
    Col("itl_max_ns", _I64, "BIGINT", "kvtrace.request.itl_max_ns", "", min_value=0),
    Col("prefill_chunks", pa.list_(CHUNK_STRUCT), _CHUNKS_SQL, "kvtrace.request.prefill_chunks",
        "(start_ns, end_ns, num_tokens) per prefill chunk", min_value=0),
    # verification
    Col("expected_fingerprint", pa.uint64(), "UBIGINT", "kvtrace.verify.expected_fingerprint",
        "stale hash: content fingerprint the key implies"),
    Col("actual_fingerprint", pa.uint64(), "UBIGINT", "kvtrace.verify.actual_fingerprint",
        "stale hash: fingerprint actually found"),
    Col("position", _I64, "BIGINT", "kvtrace.verify.position", "divergent output: output index", min_value=0),
    Col("expected_token", _I64, "BIGINT", "kvtrace.verify.expected_token", ""),
    Col("actual_token", _I64, "BIGINT", "kvtrace.verify.actual_token", ""),
    # live vLLM extras
    Col("parent_block_hash", _STR, "VARCHAR", "kvtrace.vllm.parent_block_hash", "BlockStored parent hash, hex"),
    Col("token_ids", pa.list_(_I64), "BIGINT[]", "kvtrace.vllm.token_ids", "BlockStored token ids"),
    Col("block_size", _I32, "INTEGER", "kvtrace.vllm.block_size", ""),
    Col("lora_id", _I64, "BIGINT", "kvtrace.vllm.lora_id", ""),
    Col("medium", _STR, "VARCHAR", "kvtrace.vllm.medium", "GPU | CPU | ..."),
    Col("kv_cache_spec_kind", _STR, "VARCHAR", "kvtrace.vllm.kv_cache_spec_kind", ""),
)

# What a request span kvtrace writes always holds, as the readers read it (a sender's span
# otherwise gave every reader negative latencies or counters, or a rate above 1: a damaged run):
# - its times in this order, any absent (arrival: the span's start where no arrival is given);
# - ttft_ns = first_token_ns - arrival_ns where all three are given;
# - hit tokens within what was asked: (parts, whole), the whole given where a part is not 0 when
#   the readers take an absent whole for 0 (``REQUEST_WHOLE_NEEDED``).
REQUEST_TIME_ORDER: tuple[str, ...] = ("arrival_ns", "first_scheduled_ns", "first_token_ns", "end_ns")
REQUEST_TTFT: tuple[str, str, str] = ("ttft_ns", "first_token_ns", "arrival_ns")
REQUEST_WITHIN: tuple[tuple[tuple[str, ...], str], ...] = (
    (("num_hit_tokens", "num_external_hit_tokens"), "num_prompt_tokens"),
    (("num_external_hit_tokens",), "num_external_query_tokens"),
    (("num_preempted_hit_tokens",), "num_preempted_query_tokens"),
)
REQUEST_WHOLE_NEEDED: frozenset[str] = frozenset({"num_prompt_tokens"})

SPAN_COLUMNS: tuple[str, ...] = tuple(c.name for c in SPAN_COLUMN_DEFS)
SPAN_ARROW_SCHEMA: pa.Schema = pa.schema([pa.field(c.name, c.arrow) for c in SPAN_COLUMN_DEFS])
# OTel attribute key -> column name, for the OTLP receiver and the OTel exporter.
ATTRIBUTE_COLUMNS: dict[str, str] = {c.attr: c.name for c in SPAN_COLUMN_DEFS if c.attr}
# The most one span may count of anything a view sums over a run (tokens: a prompt, a lookup,
# a step's prefill, a chunk's; preemptions, sequences, copies): far above any real prompt or
# batch, and small enough that every such sum over 2^31 spans, and two sums added, fit the
# store's int64 (2^62 input tokens, or preemptions, in three spans were stored with a 200, then
# every reader called the run damaged: its sums overflowed). The receiver refuses more.
MAX_SPAN_COUNT = (1 << 31) - 1
SUMMED_COUNTS = frozenset({  # (prefill_chunks: each chunk's tokens)
    "num_tokens", "num_query_tokens", "num_hit_tokens", "hit_tokens_per_group", "num_external_hit_tokens",
    "num_prefill_tokens", "num_prompt_tokens", "num_output_tokens", "num_computed_tokens", "num_divergent_tokens",
    "num_external_query_tokens", "num_preempted_query_tokens", "num_preempted_hit_tokens", "prefill_chunks",
    "num_preemptions", "num_decode_seqs", "num_running", "num_waiting", "num_copies", "num_preempted",
})

# Derived GenAI attribute shown in otel_traces, not stored: local + external hit tokens.
GENAI_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
# A request span's GENAI_CACHE_READ is derived from these columns (their sum), not stored
# (README): a value equal to it is the alias kvtrace's export sends; any other (on another
# span, on one with neither column, another number) is the sender's, kept in
# extra_attributes, by `kvtrace collect` (``instrument.convert``) and ClickHouse's collector.
CACHE_READ_OF = ("num_hit_tokens", "num_external_hit_tokens")

RUN_STATUSES = ("running", "complete", "failed", "incomplete")


def named_run_name(run_id: str) -> str:
    """The name a collector gives a run its sender named (``kvtrace.run.id``) until the sender's
    record names it: a store's recovery tells such a run, numbered by its sender (``kvtrace.seq``,
    gaps and all), from a collector's own run, numbered by arrival."""
    return f"otlp {run_id}"


CONFIG_TEXT_KEYS = ("backend", "vllm_version", "vllm_commit")  # a run config's keys the views show as text
FINISHED_STATUSES = RUN_STATUSES[1:]  # what a finished run is (a collected run's record may name one)
# A kvtrace.run record that opens a run (a kvtrace export sends it with its first): what is known at
# the start, set where no record set it; it finishes nothing (store/clickhouse/run_rules.is_opening)
OPENING_STATUS = RUN_STATUSES[0]

# The headline fields of a run summary (``runs.summary``), in display order: what the
# replay prints first, what diff and the dashboard show before anything else. Every
# metric is defined once, in ``kvtrace.metrics`` (vLLM's names and words).
# A live capture's summary key: true when its run received nothing (the dashboard says so).
SUMMARY_NOTHING_RECEIVED = "nothing_received"

SUMMARY_FIELDS = (
    "requests", "prompt_tokens", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
    "external_prefix_cache_hit_rate", "block_hit_rate", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
    "p99_itl_ms", "publishes", "evictions", "cow_copies", "stale_hashes", "divergent_outputs", "preemptions",
    "digest",
)

# Filled by the writer (never needed from producers): per-run append order, the tie-break
# for spans that share a virtual timestamp (all cache events of one step do).
SEQ_COLUMN = "seq"
# Filled by the writer in the families that carry block lists: len(block_ids) (or of
# block_hashes when a vLLM span has no ids), so block counts scan a scalar column.
NUM_BLOCKS_COLUMN = "num_blocks"

# ClickHouse stores a run's span times shifted by its offset (runs.time_offset_ns), with
# the offset on every row too, so its views subtract it without a join; OTLP exports
# shift them the same way. OTel timestamps only: span start/end and event times.
TIME_OFFSET_COLUMN = "time_offset_ns"
SHIFTED_COLUMNS = ("start_ns", "end_ns")  # and events[].time_ns
# OTLP envelope of kvtrace's own exports: the resource says the offset, each span its seq
# (a collector reorders rows; ClickHouse's otel_traces sorts them), and one span named
# SPAN_RUN at the end carries the run record (``kvtrace.run.<column>`` attributes).
TIME_OFFSET_RESOURCE_KEY = "kvtrace.run.time_offset_ns"
# The resource attribute naming a sender's run (``run_id_problem`` says which can); the
# otel_traces view adds it from run_id.
RUN_ID_RESOURCE_KEY = "kvtrace.run.id"
# The resource attribute naming a replay's cache backend (absent: kvtrace's own).
BACKEND_RESOURCE_KEY = "kvtrace.backend"
# An extra attribute (``extra_attributes``) of a span whose backend inferred some of its
# values: the JSON array of their attribute keys (kvtrace.instrument.span_kinds).
INFERRED_ATTRIBUTE = "kvtrace.inferred"
SEQ_ATTRIBUTE = "kvtrace.seq"
# A sender's kvtrace.seq of a named run at most: the store numbers a span sent without one on past
# it, in int64 (both collector paths hold a named run's spans to 0..MAX_SENT_SEQ)
MAX_SENT_SEQ = (1 << 62) - 1
SPAN_RUN = "kvtrace.run"
RUN_RECORD_PREFIX = "kvtrace.run."

# --- DDL ----------------------------------------------------------------------------------
META_TABLE = "kvtrace_meta"
STORE_MAGIC = "kvtrace-store"


def meta_rows(rows, label: str) -> dict:
    """A store's ``kvtrace_meta`` rows (key, value) as a dict; StoreError for a key given
    twice with two values (a hand-edited table, or one ClickHouse keeps no key on): the
    last row read won, so a store of versions 3 and 4 was read as whichever came last.
    The same value twice (two writers that made one ClickHouse store at once) is one."""
    from kvtrace.names import cut_middle
    from kvtrace.store.errors import DAMAGED, StoreError

    meta: dict = {}
    for key, value in rows:
        if key in meta and meta[key] != value:
            shown = cut_middle(f"{meta[key]!r} and {value!r}", 160)
            raise StoreError(label, f"{DAMAGED} ({META_TABLE}.{cut_middle(str(key), 80)} is given twice: {shown})")
        meta[key] = value
    return meta


def meta_version(meta: dict, label: str) -> int:
    """The schema version a store's ``kvtrace_meta`` rows (key -> value) declare, on either
    backend; StoreError for a table that is another program's, damaged or too new."""
    from kvtrace.names import cut_middle
    from kvtrace.store.errors import DAMAGED, StoreError

    # (a value is quoted within 80 characters: a damaged one of 100,000 was quoted whole)
    if meta.get("magic") != STORE_MAGIC:
        magic = cut_middle(repr(meta.get("magic")), 80)
        raise StoreError(label, f"not a kvtrace store ({META_TABLE}.magic is {magic})")
    # every kvtrace (both backends, since the first) writes the version in the same insert as
    # the magic: a store without it is damaged, not an old one (it was read as "version 0",
    # which predates every kvtrace: refused for appending as old, its layout left unchecked)
    if "schema_version" not in meta:
        raise StoreError(label, f"{DAMAGED} ({META_TABLE} has no schema_version row: every kvtrace writes one beside "
                                "its magic)")
    raw = meta["schema_version"]
    # what kvtrace writes: its decimal digits alone (int() took ' 3' and a fullwidth '３', and
    # -1 was told as a version that "predates" this kvtrace)
    if not (isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise StoreError(label, f"{DAMAGED} ({META_TABLE}.schema_version is {cut_middle(repr(raw), 80)}, "
                                "not a version number)")
    version = int(raw)
    if version > SCHEMA_VERSION:  # (what to do, as the refusal of an older store says it)
        raise StoreError(label, f"store schema version {version} is newer than this kvtrace's ({SCHEMA_VERSION}); "
                                "read or append to it with the kvtrace that wrote it, or upgrade this one; "
                                "nothing in it was changed")
    return version


def created_now() -> str:
    """The ``created`` a run or curve is given when its caller gives none: the UTC time in whole
    seconds, ISO 8601 (metadata: no digest or result sees it). A replay takes it once, before its
    store's record, so the record its OTLP export sends at the end says the same time."""
    import datetime as dt

    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


# (column, DuckDB type, meaning) of ``runs``; run_id is the primary key.
RUN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("run_id", "VARCHAR", ""),
    ("name", "VARCHAR", ""),
    ("created", "VARCHAR", "caller-supplied (ISO 8601 recommended), else created_now()"),
    ("trace_source", "VARCHAR", "path/URL/generator spec of the input trace"),
    ("trace_digest", "VARCHAR", "digest of the input trace: runs are comparable when equal"),
    ("config", "JSON", ""),
    ("behaviours", "JSON", ""),
    ("mode", "VARCHAR", "engine | cache-only | live | otlp"),
    ("digest", "VARCHAR", "run determinism digest (set by finish_run)"),
    ("status", "VARCHAR", "running | complete | failed | incomplete"),
    ("summary", "JSON", "run summary (set by finish_run)"),
    ("writer_pid", "INTEGER", ""),
    ("writer_host", "VARCHAR", ""),
    ("writer_start", "VARCHAR", "writer process start token (pid reuse guard)"),
    ("time_offset_ns", "BIGINT", "ns added to the run's virtual span times where they are stored or sent as "
                                 "OTel timestamps (ClickHouse, OTLP: a TTL drops epoch times); views subtract "
                                 "it. Metadata: no digest or view depends on it. A DuckDB store keeps 0"),
)
RUNS_DDL = "CREATE TABLE IF NOT EXISTS runs (\n    " + ",\n    ".join(
    f"{name} {typ}{' PRIMARY KEY' if name == 'run_id' else ''}" for name, typ, _ in RUN_COLUMNS
) + "\n)"


# The collected runs a ``kvtrace.run`` record finished (`kvtrace collect`'s), one row a run, written
# with its finish: a restarted collector lets no second record finish one again. A record of its
# status alone left the run's row as a collector's close leaves it, and a second record, after a
# restart, finished the run again. (The OTel Collector's ClickHouse path reads its records from
# the exporter's table.) A store made before it gains it at its next writer's open.
RECORDED_RUNS_TABLE = "recorded_runs"
RECORDED_RUNS_COLUMNS: dict[str, str] = {"run_id": "VARCHAR"}
RECORDED_RUNS_DDL = f"CREATE TABLE IF NOT EXISTS {RECORDED_RUNS_TABLE} (run_id VARCHAR PRIMARY KEY)"


# A run id a sender names (the collector's ``kvtrace.run.id``): shown in every listing and
# typed back to diff and export, so short and printable.
MAX_RUN_ID_CHARS = 128


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a run (None: it can)."""
    if not run_id or len(run_id) > MAX_RUN_ID_CHARS:
        return f"expected 1 to {MAX_RUN_ID_CHARS} characters, got {len(run_id):,}"
    if not run_id.isprintable() or any(c.isspace() for c in run_id):
        return f"{run_id!r}: expected printable characters without spaces"
    return None


def next_run_id(numbered: str | None) -> str:
    """The id after ``numbered``, the largest ``r<digits>`` id of a store (None: ``r1``).

    Counted on digit strings, not a SQL integer: a sender's ``r9223372036854775807`` once
    overflowed BIGINT's ``+ 1`` and blocked every later run of the store. Leading zeros
    read as the number; the new id is in its shortest form, so it equals no existing id."""
    digits = (numbered or "r")[1:].lstrip("0")
    if not (digits.isascii() and digits.isdigit()):
        digits = "0"
    head = digits.rstrip("9")  # add one: the trailing 9s carry
    carried = len(digits) - len(head)
    return "r" + (head[:-1] + str(int(head[-1]) + 1) if head else "1") + "0" * carried


# The store's largest r<digits> id by number (length of its digits without leading zeros,
# then the digits): DuckDB's and ClickHouse's SQL alike.
LARGEST_NUMBERED_RUN_SQL = (
    "SELECT run_id FROM runs WHERE {matches} "
    "ORDER BY length(ltrim(substr(run_id, 2), '0')) DESC, ltrim(substr(run_id, 2), '0') DESC LIMIT 1")

# Capacity curves (``kvtrace curve``): one row per (curve, policy, capacity) point.
# capacity_blocks NULL is the unbounded cache; method says how the point was obtained:
# one-pass (Mattson's stack algorithm, exact), replay (a cache-only replay at that
# capacity) or run (an engine run, run_id). name -> DuckDB type.
CURVE_COLUMNS: dict[str, str] = {
    "curve_id": "VARCHAR", "created": "VARCHAR", "trace_source": "VARCHAR", "trace_digest": "VARCHAR",
    "mode": "VARCHAR", "block_size": "BIGINT", "policy": "VARCHAR", "capacity_blocks": "BIGINT",
    "hit_tokens": "BIGINT", "prompt_tokens": "BIGINT", "hit_blocks": "BIGINT", "total_blocks": "BIGINT",
    "method": "VARCHAR", "run_id": "VARCHAR",
}
CURVES_DDL = "CREATE TABLE IF NOT EXISTS curves (\n    " + ",\n    ".join(
    f"{name} {kind}" for name, kind in CURVE_COLUMNS.items()) + "\n)"

# --- physical layout ------------------------------------------------------------------
# Spans are stored in one table per span family, each holding the shared columns plus the
# family's own: DuckDB's append cost grows with the number of columns (NULL or not), so a
# family table takes a batch about twice as fast as one 76-column table, and each query
# scans only its family. ``spans`` is a VIEW with every column (SPAN_COLUMNS order + seq)
# over all family tables. Rows that carry a column their family lacks (say, an OTLP span
# with unusual attributes) go to ``spans_other``, which has every column, so nothing is
# dropped; each family VIEW (``lookup_spans`` ...) also reads its names from spans_other.
SHARED_COLUMNS = (
    "run_id", "trace_id_hi", "trace_id_lo", "span_id", "parent_span_id", "trace_state", "name", "span_kind",
    "start_ns", "end_ns", "status_code", "status_message", "service_name", "scope_name",
    "scope_version", "resource_attributes", "extra_attributes", "events", "links", "source",
    "step", "group_id", "request_id",
)
_BLOCKS = ("block_ids", "block_hashes", "num_tokens")
_VLLM = ("parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "kv_cache_spec_kind")
# family table -> (family view, span names, own columns)
FAMILIES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "spans_cache": ("cache_spans", (SPAN_PUBLISH, SPAN_EVICT, SPAN_COW, SPAN_FREE, SPAN_STALE_LEFT),
                    (*_BLOCKS, "publish_kind", "evict_reason", "ages", "idle", "copy_reason", "copy_src",
                     "copy_dst", *_VLLM)),
    "spans_lookup": ("lookup_spans", (SPAN_LOOKUP,),
                     ("num_query_tokens", "num_hit_tokens", "hit_tokens_per_group", "shared_prefix_boundary",
                      "num_external_hit_tokens", "root_hash", "first_miss_hash", "first_miss_index")),
    "spans_step": ("step_spans", (SPAN_STEP,),
                   ("num_prefill_tokens", "num_decode_seqs", "num_running", "num_waiting", "num_copies",
                    "num_preempted", "usage")),
    "spans_request": ("request_spans", (SPAN_REQUEST,),
                      ("num_hit_tokens", "num_external_hit_tokens", "session_id", "arrival_ns",
                       "first_scheduled_ns", "first_token_ns", "num_prompt_tokens", "num_output_tokens",
                       "num_computed_tokens", "num_preemptions", "num_divergent_tokens", "num_external_query_tokens",
                       "num_preempted_query_tokens", "num_preempted_hit_tokens", "ttft_ns", "itl_ns",
                       "itl_mean_ns", "itl_p50_ns", "itl_p99_ns", "itl_max_ns", "prefill_chunks")),
    "spans_verify": ("verify_spans", (SPAN_STALE_HASH, SPAN_DIVERGENT),
                     (*_BLOCKS, "expected_fingerprint", "actual_fingerprint", "position", "expected_token",
                      "actual_token")),
}
OTHER_TABLE = "spans_other"
FAMILY_OF_NAME: dict[str, str] = {n: t for t, (_, names, _) in FAMILIES.items() for n in names}
_SQL_TYPE = {c.name: c.sql for c in SPAN_COLUMN_DEFS} | {NUM_BLOCKS_COLUMN: "INTEGER"}


WRITER_COLUMNS = (SEQ_COLUMN, NUM_BLOCKS_COLUMN)


def has_block_lists(table: str) -> bool:
    return table == OTHER_TABLE or "block_ids" in FAMILIES[table][2]


def family_columns(table: str) -> tuple[str, ...]:
    """Stored columns of a family table (SPAN_COLUMNS order, then seq[, num_blocks])."""
    extra = (SEQ_COLUMN, NUM_BLOCKS_COLUMN) if has_block_lists(table) else (SEQ_COLUMN,)
    if table == OTHER_TABLE:
        return SPAN_COLUMNS + extra
    own = set(SHARED_COLUMNS) | set(FAMILIES[table][2])
    return tuple(c for c in SPAN_COLUMNS if c in own) + extra


def span_column_sql_type(column: str) -> str:
    """The DuckDB type of a stored span column (the writer's seq: BIGINT)."""
    return _SQL_TYPE.get(column, "BIGINT")


def _table_ddl(table: str) -> str:
    cols = ",\n    ".join(
        f"{c} {span_column_sql_type(c)}" for c in family_columns(table)
    )
    return f"CREATE TABLE IF NOT EXISTS {table} (\n    {cols}\n)"


# --- views: ids shown as hex -------------------------------------------------------------
# Tables store OTel ids as integers: about a sixth cheaper to append than hex strings
# (issue 4's exporter budget) and half the bytes. Every view (``spans``,
# the family views, ``otel_traces``) shows them as the lowercase hex strings OTel and the
# ClickHouse exporter use, so readers never see the integers.
_HEX_TRACE = "printf('%016x%016x', {0}trace_id_hi, {0}trace_id_lo)"
_HEX_SPAN = "printf('%016x', {0}{1})"
_VIEW_LINK = "STRUCT(trace_id VARCHAR, span_id VARCHAR, trace_state VARCHAR, attributes MAP(VARCHAR, VARCHAR))[]"
# view column -> (DuckDB type, SQL over the stored columns, the stored columns it needs)
_PRESENTED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "trace_id": ("VARCHAR", _HEX_TRACE.format(""), ("trace_id_hi", "trace_id_lo")),
    "span_id": ("VARCHAR", _HEX_SPAN.format("", "span_id"), ("span_id",)),
    "parent_span_id": ("VARCHAR", _HEX_SPAN.format("", "parent_span_id"), ("parent_span_id",)),
    "links": (_VIEW_LINK, "list_transform(links, lambda l: struct_pack(trace_id := "
              f"{_HEX_TRACE.format('l.')}, span_id := {_HEX_SPAN.format('l.', 'span_id')}, "
              "trace_state := l.trace_state, attributes := l.attributes))", ("links",)),
}


def view_columns(stored: tuple[str, ...]) -> tuple[str, ...]:
    """The view columns over these stored ones: trace_id_hi/lo become one trace_id."""
    return tuple("trace_id" if c == "trace_id_hi" else c for c in stored if c != "trace_id_lo")


# Columns of the ``spans`` view, in order (then seq, num_blocks).
SPAN_VIEW_COLUMNS: tuple[str, ...] = view_columns(SPAN_COLUMNS)
VIEW_SQL_TYPES: dict[str, str] = _SQL_TYPE | {c: t for c, (t, _, _) in _PRESENTED.items()}


def _select_as(table: str, columns: tuple[str, ...], where: str = "") -> str:
    """SELECT of view columns from one stored table (typed NULLs where it lacks one)."""
    have = set(family_columns(table))

    def item(c: str) -> str:
        sql_type, expr, needs = _PRESENTED.get(c, (VIEW_SQL_TYPES.get(c, "BIGINT"), c, (c,)))
        if all(n in have for n in needs):
            return expr if expr == c else f"{expr} AS {c}"
        return f"CAST({'0' if c == NUM_BLOCKS_COLUMN else 'NULL'} AS {sql_type}) AS {c}"

    return f"SELECT {', '.join(map(item, columns))} FROM {table}{where}"


def span_tables_ddl() -> list[str]:
    """CREATE statements: family tables, spans_other, the ``spans`` view, family views."""
    stmts = [_table_ddl(t) for t in FAMILIES] + [_table_ddl(OTHER_TABLE)]
    everything = SPAN_VIEW_COLUMNS + WRITER_COLUMNS
    union = "\nUNION ALL ".join(_select_as(t, everything) for t in (*FAMILIES, OTHER_TABLE))
    stmts.append(f"CREATE OR REPLACE VIEW spans AS\n{union}")
    for table, (view, names, _) in FAMILIES.items():
        cols = view_columns(family_columns(table))
        in_names = ", ".join(f"'{n}'" for n in names)
        stmts.append(
            f"CREATE OR REPLACE VIEW {view} AS\n{_select_as(table, cols)}\n"
            f"UNION ALL {_select_as(OTHER_TABLE, cols, f' WHERE name IN ({in_names})')}"
        )
    return stmts


SPAN_TABLES = (*FAMILIES, OTHER_TABLE)

# Whether spans of a run id remain where no ``runs`` row names it (the row deleted by hand):
# a new run given that id took them over, its summary saying 304 spans where 1,754 were its.
LEFTOVER_SPANS_SQL = " UNION ALL ".join(f"(SELECT 1 FROM {t} WHERE run_id = {{id}} LIMIT 1)" for t in SPAN_TABLES)
LEFTOVER_SPANS = "spans of a run of this id remain without its run row (deleted by hand?)"


def _attr_value_sql(c: Col) -> str:
    # ClickHouse's exporter stores every attribute as a string; arrays as JSON, like AsString().
    if c.sql.endswith("[]"):
        return f"CAST(to_json({c.name}) AS VARCHAR)"
    return f"CAST({c.name} AS VARCHAR)"


def otel_traces_view_ddl() -> str:
    """The ClickHouse exporter's ``otel_traces`` shape over ``spans`` (plus a trailing RunId)."""
    entries = ",\n            ".join(
        f"struct_pack(k := '{c.attr}', v := {_attr_value_sql(c)})"
        for c in SPAN_COLUMN_DEFS
        if c.attr
    )
    cache_read = (
        f"struct_pack(k := '{GENAI_CACHE_READ}', v := CASE WHEN name = '{SPAN_REQUEST}' THEN "
        "CAST(coalesce(num_hit_tokens, 0) + coalesce(num_external_hit_tokens, 0) AS VARCHAR) END)"
    )
    return f"""
CREATE OR REPLACE VIEW otel_traces AS
SELECT
    make_timestamp_ns(start_ns) AS "Timestamp",
    coalesce(trace_id, '') AS "TraceId",
    coalesce(span_id, '') AS "SpanId",
    coalesce(parent_span_id, '') AS "ParentSpanId",
    coalesce(trace_state, '') AS "TraceState",
    name AS "SpanName",
    coalesce(span_kind, 'Internal') AS "SpanKind",
    coalesce(service_name, 'kvtrace') AS "ServiceName",
    map_concat(coalesce(resource_attributes, MAP {{}}::MAP(VARCHAR, VARCHAR)),
               MAP {{'kvtrace.run.id': run_id}}) AS "ResourceAttributes",
    coalesce(scope_name, '') AS "ScopeName",
    coalesce(scope_version, '') AS "ScopeVersion",
    map_concat(
        map_from_entries(list_filter([
            {entries},
            {cache_read}
        ], lambda e: e.v IS NOT NULL)),
        coalesce(extra_attributes, MAP {{}}::MAP(VARCHAR, VARCHAR))
    )::MAP(VARCHAR, VARCHAR) AS "SpanAttributes",
    CAST(greatest(end_ns - start_ns, 0) AS UBIGINT) AS "Duration",
    coalesce(status_code, 'Unset') AS "StatusCode",
    coalesce(status_message, '') AS "StatusMessage",
    coalesce(list_transform(events, lambda e: make_timestamp_ns(e.time_ns)), [])::TIMESTAMP_NS[] AS "Events.Timestamp",
    coalesce(list_transform(events, lambda e: e.name), [])::VARCHAR[] AS "Events.Name",
    coalesce(list_transform(events, lambda e: e.attributes), [])::MAP(VARCHAR, VARCHAR)[] AS "Events.Attributes",
    coalesce(list_transform(links, lambda l: l.trace_id), [])::VARCHAR[] AS "Links.TraceId",
    coalesce(list_transform(links, lambda l: l.span_id), [])::VARCHAR[] AS "Links.SpanId",
    coalesce(list_transform(links, lambda l: l.trace_state), [])::VARCHAR[] AS "Links.TraceState",
    coalesce(list_transform(links, lambda l: l.attributes), [])::MAP(VARCHAR, VARCHAR)[] AS "Links.Attributes",
    run_id AS "RunId"
FROM spans
"""


# Column names and DuckDB types of the ClickHouse exporter's otel_traces (Nested columns
# flattened the way ClickHouse exposes them), for the compatibility test and docs.
OTEL_TRACES_COLUMNS: tuple[tuple[str, str], ...] = (
    ("Timestamp", "TIMESTAMP_NS"),
    ("TraceId", "VARCHAR"),
    ("SpanId", "VARCHAR"),
    ("ParentSpanId", "VARCHAR"),
    ("TraceState", "VARCHAR"),
    ("SpanName", "VARCHAR"),
    ("SpanKind", "VARCHAR"),
    ("ServiceName", "VARCHAR"),
    ("ResourceAttributes", "MAP(VARCHAR, VARCHAR)"),
    ("ScopeName", "VARCHAR"),
    ("ScopeVersion", "VARCHAR"),
    ("SpanAttributes", "MAP(VARCHAR, VARCHAR)"),
    ("Duration", "UBIGINT"),
    ("StatusCode", "VARCHAR"),
    ("StatusMessage", "VARCHAR"),
    ("Events.Timestamp", "TIMESTAMP_NS[]"),
    ("Events.Name", "VARCHAR[]"),
    ("Events.Attributes", "MAP(VARCHAR, VARCHAR)[]"),
    ("Links.TraceId", "VARCHAR[]"),
    ("Links.SpanId", "VARCHAR[]"),
    ("Links.TraceState", "VARCHAR[]"),
    ("Links.Attributes", "MAP(VARCHAR, VARCHAR)[]"),
)
