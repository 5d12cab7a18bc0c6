"""One definition of every run metric: vLLM's name, vLLM's words, one formula.

Ground floor (imports only ``kvtrace.numeric`` and numpy): the engine and cache-only
summaries, the span builder, the store's queries, ``kvtrace diff``, the dashboard and the
notebooks all read their hit counters and latency statistics from here, so a figure is the
same wherever it is shown for the same run and window.

Hit counters follow vLLM 0.33 (``vllm/v1/metrics/stats.py``: ``PrefixCacheStats``,
``PromptTokenStats``; recorded in ``Scheduler.schedule`` through
``KVCacheManager.record_prefix_cache_stats``). Each counter is a sum over requests of one
per-request quantity (``PER_REQUEST``), taken once per request **when it is first
scheduled**: a lookup that does not lead to admission counts nothing, and the re-lookups of a
preempted request go to the separate ``preempted_*`` counters, as in vLLM. Every counter is
in tokens. ``COUNTERS`` holds them as signed sums of per-request fields, so the Python sum
(``hit_counters``) and the store's SQL (``counter_sql``) are generated from the same table.

Latency follows ``vllm bench serve`` (``vllm/benchmarks/serve.py``): TTFT, TPOT, ITL and
E2EL with mean, median, population standard deviation and the requested percentiles
(numpy's linear interpolation, ``kvtrace.numeric``), named ``mean_ttft_ms``,
``p99_ttft_ms`` ...; kvtrace adds the queueing time. In kvtrace every time is *modelled* by
the engine's cost model (virtual time), never measured; cache-only runs have no time, so
their latency fields are None (JSON null), never 0. So is a statistic without samples where
vllm bench serve prints 0 (``np.mean(tpots or 0)``): TPOT and ITL of a run whose requests
all generated one token.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from kvtrace.names import shown_value
from kvtrace.numeric import percentiles as _percentiles

if TYPE_CHECKING:  # numpy is imported where a latency is summarised, not to parse a command line
    import numpy as np

# --- per-request quantities (the names of ``RequestFinished``'s fields) ------------------
PROMPT = "num_prompt_tokens"  # prompt tokens (at first schedule: the tokens looked up)
LOCAL_HIT = "num_local_hit_tokens"  # local prefix-cache hit at first schedule
EXTERNAL_QUERY = "num_external_query_tokens"  # tokens asked of the external tier (0 without one)
EXTERNAL_HIT = "num_external_hit_tokens"  # tokens the external tier supplied at first schedule
PREEMPTED_QUERY = "num_preempted_query_tokens"  # tokens looked up again at each re-admission
PREEMPTED_HIT = "num_preempted_hit_tokens"  # local hits of those re-lookups
PER_REQUEST: dict[str, str] = {
    PROMPT: "prompt tokens; a request first scheduled looks up all of them (vLLM: request.num_tokens)",
    LOCAL_HIT: "tokens found in the local prefix cache when the request was first scheduled",
    EXTERNAL_QUERY: "tokens beyond the local hit asked of the external tier at first schedule "
                    "(vLLM: request.num_tokens - num_new_local_computed_tokens; 0 without a tier)",
    EXTERNAL_HIT: "tokens loaded from the external tier at first schedule (num_external_computed_tokens)",
    PREEMPTED_QUERY: "tokens looked up at every re-admission after a preemption (summed)",
    PREEMPTED_HIT: "local hits of those re-admission lookups (summed)",
}


@dataclass(frozen=True, slots=True)
class Counter:
    """A run counter: the sum over requests of ``Σ sign · field``; ``vllm``: the vLLM
    metric it reproduces; ``doc``: its meaning, in vLLM's words where vLLM has them."""

    key: str
    label: str
    vllm: str
    terms: tuple[tuple[int, str], ...]
    doc: str


COUNTERS: tuple[Counter, ...] = (
    Counter("prefix_cache_queries", "Prefix cache queries", "vllm:prefix_cache_queries", ((1, PROMPT),),
            "Prefix cache queries, in terms of number of queried tokens (once per request, when first scheduled)."),
    Counter("prefix_cache_hits", "Prefix cache hits", "vllm:prefix_cache_hits", ((1, LOCAL_HIT),),
            "Prefix cache hits, in terms of number of cached tokens (local cache, once per request)."),
    Counter("preempted_prefix_cache_queries", "Preempted re-lookups (queried tokens)",
            "PrefixCacheStats.preempted_queries", ((1, PREEMPTED_QUERY),),
            "The queries of previously preempted requests, counted apart from the new requests' (as vLLM)."),
    Counter("preempted_prefix_cache_hits", "Preempted re-lookups (hit tokens)", "PrefixCacheStats.preempted_hits",
            ((1, PREEMPTED_HIT),), "The hits of previously preempted requests."),
    Counter("external_prefix_cache_queries", "External prefix cache queries", "vllm:external_prefix_cache_queries",
            ((1, EXTERNAL_QUERY),),
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens (the tokens beyond the local hit; kvtrace's external tier)."),
    Counter("external_prefix_cache_hits", "External prefix cache hits", "vllm:external_prefix_cache_hits",
            ((1, EXTERNAL_HIT),),
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens."),
    Counter("prompt_tokens_by_source.local_compute", "Prompt tokens computed at first schedule",
            'vllm:prompt_tokens_by_source{source="local_compute"}', ((1, PROMPT), (-1, LOCAL_HIT), (-1, EXTERNAL_HIT)),
            "Tokens prefilled locally (actual compute work), at the first schedule."),
    Counter("prompt_tokens_by_source.local_cache_hit", "Prompt tokens from the local cache",
            'vllm:prompt_tokens_by_source{source="local_cache_hit"}', ((1, LOCAL_HIT),),
            "Tokens from local prefix cache."),
    Counter("prompt_tokens_by_source.external_kv_transfer", "Prompt tokens from the external tier",
            'vllm:prompt_tokens_by_source{source="external_kv_transfer"}', ((1, EXTERNAL_HIT),),
            "Tokens from external KV transfer."),
)
COUNTER_KEYS: tuple[str, ...] = tuple(c.key for c in COUNTERS)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # PromptTokenStats.ALL_SOURCES
SOURCE_KEYS = tuple(f"prompt_tokens_by_source.{s}" for s in SOURCES)


@dataclass(frozen=True, slots=True)
class Rate:
    """``numerator / denominator`` of two counters (None when the denominator is 0)."""

    key: str
    label: str
    numerator: str
    denominator: str
    doc: str


RATES: tuple[Rate, ...] = (
    Rate("prefix_cache_hit_rate", "Prefix cache hit rate", "prefix_cache_hits", "prefix_cache_queries",
         "vLLM's vllm:prefix_cache_hits / vllm:prefix_cache_queries over the whole run (its log line's 'Prefix "
         "cache hit rate' is the last 1,000 requests'). The request hit rate."),
    Rate("external_prefix_cache_hit_rate", "External prefix cache hit rate", "external_prefix_cache_hits",
         "external_prefix_cache_queries",
         "vLLM's 'External prefix cache hit rate': external hits / external queries (None without a tier)."),
    Rate("preempted_prefix_cache_hit_rate", "Preempted re-lookup hit rate", "preempted_prefix_cache_hits",
         "preempted_prefix_cache_queries", "Hit rate of the re-lookups of preempted requests (None without any)."),
)
RATE_KEYS: tuple[str, ...] = tuple(r.key for r in RATES)
HEADLINE_RATE = "prefix_cache_hit_rate"

# The per-group rate is its own metric, never the request hit rate: the tokens one KV
# cache group alone would hit (its own lookup, capped by no other group's hit, before the
# groups agree), over the same prefix_cache_queries.
GROUP_HIT_RATE_DOC = ("Attention/state group hit rate: hit tokens KV group g alone found at each request's first "
                      "schedule (before the groups agree on one hit), over prefix_cache_queries. Not the request "
                      "hit rate: the request hits only what every group hits.")


def group_hit_rate_label(kind: str | None) -> str:
    """'attention group hit rate', 'state group hit rate', or 'group hit rate'."""
    return f"{kind} group hit rate" if kind else "group hit rate"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """The one division of every rate: None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def hit_counters(requests: Iterable[Mapping[str, int] | object]) -> dict[str, int]:
    """Every counter of ``COUNTERS`` over ``requests`` (mappings of, or objects with, the
    ``PER_REQUEST`` fields; a missing field counts 0)."""
    totals = dict.fromkeys(PER_REQUEST, 0)
    for r in requests:
        get = r.get if isinstance(r, Mapping) else (lambda f, _r=r: getattr(_r, f, 0))
        for f in totals:
            totals[f] += int(get(f) or 0)
    return {c.key: sum(sign * totals[f] for sign, f in c.terms) for c in COUNTERS}


def hit_rates(counters: Mapping[str, float | None]) -> dict[str, float | None]:
    """Every rate of ``RATES`` from counters."""
    return {r.key: ratio(counters.get(r.numerator), counters.get(r.denominator)) for r in RATES}


def hit_summary(requests: Iterable[Mapping[str, int] | object]) -> dict[str, float | int | None]:
    """Counters and rates, as a run summary carries them."""
    counters = hit_counters(requests)
    return {**counters, **hit_rates(counters)}


def counter_sql(column: Mapping[str, str]) -> dict[str, str]:
    """SQL aggregate for each counter, given the column (or SQL expression) holding each
    ``PER_REQUEST`` field: ``{key: "sum(coalesce(a, 0)) - sum(...)"}`` (BIGINT)."""
    out = {}
    for c in COUNTERS:
        parts = [f"{'-' if sign < 0 else '+'} coalesce(sum({column[f]}), 0)" for sign, f in c.terms]
        expr = " ".join(parts).lstrip("+ ")
        out[c.key] = f"CAST({expr} AS BIGINT)"
    return out


# --- block hit rate (kvtrace's own, not a vLLM metric) ------------------------------------
BLOCK_HIT_RATE_DOC = ("kvtrace's own: prompt blocks (of the first full-attention group's block size, the summary's "
                      "block_size; else the first group's) entirely served from cache, local or external, at first "
                      "schedule, over prompt blocks.")


def block_hits(hit_blocks: int, total_blocks: int) -> dict[str, int | float | None]:
    """The block hit rate with its two counts, as a run summary carries them (a capacity
    curve's engine points read the counts from there)."""
    return {"hit_blocks": hit_blocks, "total_blocks": total_blocks, "block_hit_rate": ratio(hit_blocks, total_blocks)}


# --- latency ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Latency:
    key: str  # as in vllm bench serve's result keys: mean_<key>_ms, p99_<key>_ms
    label: str
    doc: str


LATENCIES: tuple[Latency, ...] = (
    Latency("ttft", "TTFT", "Time to First Token: from the request's arrival to its first output token."),
    Latency("tpot", "TPOT", "Time per Output Token (excl. 1st token): (E2EL - TTFT) / (output tokens - 1), per "
                            "request with more than one output token."),
    Latency("itl", "ITL", "Inter-token Latency: every gap between consecutive output tokens, of every request."),
    Latency("e2el", "E2EL", "End-to-end Latency: from the request's arrival to its last output token."),
    Latency("queue", "Queue", "Queueing time: from arrival to the first step that schedules the request (vLLM's "
                              "vllm:request_queue_time_seconds, time spent in WAITING phase)."),
)
LATENCY_KEYS: tuple[str, ...] = tuple(m.key for m in LATENCIES)
LATENCY_LABEL = {m.key: m.label for m in LATENCIES}
# What every view calls a counter or a rate (``computed_prompt_tokens``, the prefill work
# with recompute after preemption, is another number than vLLM's local_compute: its label says when)
HIT_LABEL = {c.key: c.label for c in COUNTERS} | {r.key: r.label for r in RATES}
DEFAULT_PERCENTILES: tuple[float, ...] = (50, 90, 99)
# The run config key holding a run's --percentiles where they are not the default: a killed
# run keeps no summary, and its summary from spans is computed at these. A reporting choice,
# not a setting of the replay (pairing ignores it).
PERCENTILES_CONFIG_KEY = "percentiles"
MODELLED = "modelled"  # the word every latency view carries

# --- the definitions a run was recorded under ---------------------------------------------
# A run's numbers are what this module (and the spans it describes) said when it was recorded.
# Each change of a stored number's meaning bumps the version, with one line here; a replay
# records the version in its config (DEFINITIONS_CONFIG_KEY), and ``kvtrace diff`` and the
# dashboard's Compare say when two runs were recorded under different ones, since their
# numbers then differ for a reason no setting explains. Runs that record none predate version 1.
DEFINITIONS_CONFIG_KEY = "definitions"
DEFINITION_CHANGES: tuple[tuple[int, str, str], ...] = (  # (version, date, what changed)
    (1, "2026-12-06", "cow_copies counts copy-on-write copies only (no external-tier loads); hit_blocks and "
                      "total_blocks count the first full-attention group's blocks; the prefix reuse gap runs between "
                      "requests' first lookups and counts hits the external tier alone served; lookups record their "
                      "external hit tokens and no first miss past the last token they could hit"),
)
DEFINITIONS: int = DEFINITION_CHANGES[-1][0]


def recorded_definitions(mode: str | None, config: Mapping[str, Any] | None) -> int | None:
    """The definitions version a run was recorded under: its config's, 0 for a replay of
    kvtrace's that records none (it predates version 1), None where unknown (a live capture
    or a collected run that says nothing; a value that is no version)."""
    value = config.get(DEFINITIONS_CONFIG_KEY) if isinstance(config, Mapping) else None
    if value is None:
        mode = replayed_mode(mode, config)  # (a collected replay of a kvtrace that records none: 0 too)
        return 0 if mode == "engine" or str(mode or "").startswith("cache-only") else None
    return value if type(value) is int and value >= 0 else None


def definitions_note(a: int | None, b: int | None) -> str | None:
    """What a reader of a comparison must know when runs A and B were recorded under other
    definitions (``recorded_definitions``): which numbers changed meaning between them. None
    when they agree or either is unknown."""
    if a is None or b is None or a == b:
        return None
    low, high = min(a, b), max(a, b)
    older, newer = ("A", "B") if a < b else ("B", "A")
    changes = [f"version {version} ({date}): {text}" for version, date, text in DEFINITION_CHANGES
               if low < version <= high]
    if high > DEFINITIONS:  # (recorded by a newer kvtrace: what it changed, this one cannot say)
        first = max(low, DEFINITIONS) + 1
        unknown = f"version {first}" if high == first else f"versions {first} to {high}"
        changes.append(f"{unknown}: unknown to this kvtrace (version {DEFINITIONS})")
    # what puts them under one version: replayed here, a run is recorded under DEFINITIONS
    if high <= DEFINITIONS:
        again = f"Replay run {older} with this kvtrace"
    elif low == DEFINITIONS:
        again = f"Replay run {newer} with this kvtrace"
    else:
        again = "Replay both runs with this kvtrace (or compare them with the kvtrace that recorded the newer one)"
    return (f"runs A and B were recorded under different metric definitions (A {definitions_label(a)}; B "
            f"{definitions_label(b)}): their numbers may differ for no setting's sake. Changed since run {older}'s: "
            f"{' | '.join(changes)}. {again} to compare like with like")


def definitions_label(version: int | None) -> str:
    """How every view names a run's definitions version (``recorded_definitions``)."""
    if version is None:
        return "unknown"
    return f"version {version}" if version else "none recorded: before version 1"


def replayed_mode(mode: str | None, config: Mapping[str, Any] | None) -> str | None:
    """The mode a run's events were made in: its stored mode, but for a kvtrace replay a
    collector received (stored as ``otlp``, how it reached the store), the mode its sender
    replayed in, as its config says (a cache-only config names it; an engine config holds the
    engine's cache groups). Pairing, the times' words, the backend and the definitions read it."""
    if mode == "otlp" and isinstance(config, Mapping):
        if config.get("mode") == "cache-only":  # (stored as a direct cache-only run's is: with its policy)
            policy = config.get("policy")
            return f"cache-only/{policy}" if isinstance(policy, str) and policy.isidentifier() else "cache-only"
        cache = config.get("cache")
        if isinstance(cache, Mapping) and "groups" in cache:
            return "engine"
    return mode


def run_backend(mode: str | None, config: Mapping[str, Any] | None) -> str | None:
    """Whose cache produced a run's events, in every view: a replay's backend (kvtrace's
    manager unless its config names another), vLLM itself for a live capture, unknown (None)
    for spans a collector received whose record names no backend (its sender is not recorded;
    a cache-only replay's is kvtrace's own LRU)."""
    named = config.get("backend") if isinstance(config, Mapping) else None
    if mode == "live":
        return "vllm"
    if named:
        return str(named)
    # (a collected cache-only replay's record names none: its own LRU, as the direct run's)
    return None if replayed_mode(mode, config) == "otlp" else "kvtrace"


def backend_label(mode: str | None, config: Mapping[str, Any] | None) -> str | None:
    """``run_backend`` with the vLLM a ``--backend vllm`` run drove, as every view shows it:
    ``kvtrace``, ``vllm 0.33.0 @ COMMIT`` (12 hex digits: two checkouts, two labels), ``vllm``
    for a live capture; None for a collected run (its sender is unknown)."""
    config = config if isinstance(config, Mapping) else {}
    backend = run_backend(mode, config)
    if backend is None:
        return None
    if config.get("vllm_version"):
        backend += f" {config['vllm_version']}"
    if config.get("vllm_commit"):
        commit, dirty, _ = str(config["vllm_commit"]).partition("-dirty")  # (a checkout's uncommitted edits)
        backend += f" @ {commit[:12]}{dirty}"
    return backend


# Where a cache-only replay's spans are placed: one step (one request's lookup) a ms of
# virtual time; no clock, only an order the time axis shows (the instrumentor's default step).
CACHE_ONLY_STEP_NS = 1_000_000

NO_TIMES = "no times"  # the label of runs none of which has latencies (live captures, cache-only runs)


def times_word(*runs: tuple[str | None, str | None]) -> str:
    """How every view labels the latencies of ``runs`` ((mode, cost model) each): "recorded"
    where a run's came from a collector's sender (no cost model of kvtrace's made them),
    "no times" where no run has any (a live capture, a cache-only run: no clock; a live
    capture's tiles said "modelled" beside its "none" times), else "modelled"."""
    if any(mode == "otlp" and not model for mode, model in runs):
        return "recorded"
    return MODELLED if any(model for _, model in runs) else NO_TIMES


def times_source(mode: str | None, cost_model: str | None, code: Callable[[str], str] = str) -> str:
    """Where a run's times come from, in every view that shows them: the cost model that
    modelled them; the sender's own, for spans a collector received (a vLLM server's or
    another replay's, measured or modelled there); none for a cache-only run or a live
    capture (cache events carry no request times). ``code``: how a model's name is shown."""
    if cost_model:
        return f"{MODELLED} by cost model {code(cost_model)}"
    if mode == "otlp":
        return "as received over OTLP (the sender's own times, not modelled here)"
    if mode == "live":
        return "none (a live capture receives cache events, no request times)"
    return "none (no clock: cache-only)"


def percentile_word(p: float) -> str:
    """vllm bench serve's spelling of a percentile in a key: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if float(p).is_integer() else str(p)


def latency_keys(metric: str, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> list[str]:
    """The summary keys of one latency: mean_, median_, std_, p<P>_ <metric>_ms."""
    return [f"{s}_{metric}_ms" for s in ("mean", "median", "std")] + [
        f"p{percentile_word(p)}_{metric}_ms" for p in percentiles]


def summary_percentiles(summary: Mapping[str, object]) -> tuple[float, ...]:
    """The percentiles a run's summary holds (its ``p<P>_ttft_ms`` keys) in numeric order (a
    stored summary's keys come back in the store's text order, p100 before p99.9, not in the
    run's ``--percentiles``); DEFAULT_PERCENTILES for a summary with none."""
    found = []
    for key in summary:
        if key.startswith("p") and key.endswith("_ttft_ms"):
            try:
                found.append(float(key[1:-len("_ttft_ms")]))
            except ValueError:
                continue
    return tuple(sorted(set(found))) or DEFAULT_PERCENTILES


def is_latency_key(name: str) -> bool:
    """Whether a summary or diff metric name is a latency statistic (lower is better)."""
    if not name.endswith("_ms"):
        return False
    return name.rsplit("_", 2)[-2] in LATENCY_KEYS if name.count("_") >= 2 else False


MAX_PERCENTILES = 1_001  # 0, 0.1, ..., 100: the CDF's; what a run may record and the read API takes


def parse_percentiles(text: str | Sequence[float] | None) -> tuple[float, ...]:
    """``"50,90,99"`` (vllm bench serve's --metric-percentiles) -> (50.0, 90.0, 99.0);
    ValueError naming the bad item, or saying there are more than MAX_PERCENTILES distinct
    ones. None gives DEFAULT_PERCENTILES."""
    if text is None:
        return DEFAULT_PERCENTILES
    items = [s.strip() for s in text.split(",")] if isinstance(text, str) else list(text)
    out = []
    for item in items:
        if item == "":  # "50,,90" or a trailing comma: a typo, not a shorter list
            raise ValueError("an empty percentile in the list")
        try:  # (in ASCII digits, as every number a user types: float() read '５０' and '5_0' as 50)
            p = float(item)
            if isinstance(item, str) and not (item.isascii() and "_" not in item):
                raise ValueError
        except (TypeError, ValueError, OverflowError):  # (OverflowError: an int past a float's range)
            raise ValueError(f"percentile {shown_value(item)} is not a number in ASCII digits") from None
        if not 0 <= p <= 100 or math.isnan(p):
            raise ValueError(f"percentile {shown_value(item)} is outside 0..100")
        out.append(p)
    if not out:
        raise ValueError("no percentiles given")
    distinct = tuple(dict.fromkeys(out))
    if len(distinct) > MAX_PERCENTILES:
        raise ValueError(f"expected at most {MAX_PERCENTILES:,} distinct percentiles, got {len(distinct):,}")
    return distinct


# Summary keys counted in blocks (or a rate of them): two runs of other block sizes count them
# in other units, so a diff gives no delta for them (it said hit_blocks +4002.7%).
BLOCK_UNIT_KEYS = ("block_hit_rate", "hit_blocks", "total_blocks", "capacity_blocks", "publishes", "evictions")

NS_PER_MS = 1e6  # stored times are ns; every reported latency is ms, divided after the statistic


def latency_stats(values_ns: Sequence[float] | np.ndarray, metric: str,
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """``{mean_<metric>_ms, median_…, std_…, p<P>_…}`` of values in ns, in ms, as vllm bench
    serve computes them (np.mean, np.median, np.std with ddof 0, np.percentile linear); every
    value None when there are no samples. Sorted first, so any order of the same values
    gives the same bits."""
    import numpy as np

    keys = latency_keys(metric, percentiles)
    arr = np.sort(np.asarray(values_ns, dtype=np.float64))
    if arr.size == 0:
        return dict.fromkeys(keys, None)
    med, *ps = _percentiles(arr, [50.0, *percentiles])
    vals = [float(arr.mean()), med, float(arr.std()), *ps]
    return {k: None if v is None else v / NS_PER_MS for k, v in zip(keys, vals)}


def no_latency(percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, None]:
    """Every latency key as None: a run without time (cache-only)."""
    return {k: None for m in LATENCY_KEYS for k in latency_keys(m, percentiles)}


def tpot_ns(e2el_ns: float, ttft_ns: float, output_tokens: int) -> float | None:
    """One request's TPOT (ns) as vllm bench serve: None for one output token or fewer."""
    return (e2el_ns - ttft_ns) / (output_tokens - 1) if output_tokens > 1 else None


def request_latency_samples(requests: Iterable[object]) -> dict[str, list[float]]:
    """Per latency metric, the samples (ns) of finished requests (objects with arrival_ns,
    first_scheduled_ns, first_token_ns, finish_ns, num_output_tokens, itl_ns)."""
    out: dict[str, list[float]] = {k: [] for k in LATENCY_KEYS}
    for r in requests:
        arrival = r.arrival_ns  # type: ignore[attr-defined]
        ttft = r.first_token_ns - arrival  # type: ignore[attr-defined]
        e2el = r.finish_ns - arrival  # type: ignore[attr-defined]
        out["ttft"].append(ttft)
        out["e2el"].append(e2el)
        out["queue"].append(r.first_scheduled_ns - arrival)  # type: ignore[attr-defined]
        t = tpot_ns(e2el, ttft, r.num_output_tokens)  # type: ignore[attr-defined]
        if t is not None:
            out["tpot"].append(t)
        out["itl"].extend(r.itl_ns)  # type: ignore[attr-defined]
    return out


def latency_summary(samples: Mapping[str, Sequence[float] | np.ndarray],
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """Every latency statistic of every metric from per-metric samples (ns)."""
    out: dict[str, float | None] = {}
    for m in LATENCY_KEYS:
        out |= latency_stats(samples.get(m, ()), m, percentiles)
    return out


# --- a run summary's fields, as another program may send them -----------------------------
# The counts a summary carries (ints >= 0) and its rates (0..1): with the latency statistics
# (ms >= 0), the fields every view reads as numbers.
SUMMARY_COUNTS: tuple[str, ...] = (
    "requests", "prompt_tokens", *(c.key for c in COUNTERS), "hit_blocks", "total_blocks", "computed_prompt_tokens",
    "output_tokens", "publishes", "evictions", "cow_copies", "stale_hashes", "divergent_outputs", "preemptions",
    "steps", "table_disagreements", "stale_hashes_left", "oversized_requests",
    # (spans: diff showed a summary's -5 or "many" beside the 1,593 runs counted in the store)
    "spans", "otlp_spans_undelivered", "otlp_spans_missing",
)
def percent_text(rate: float, decimals: int = 2) -> str:
    """A rate as a percentage at ``decimals``; a nonzero one too small for them in 2 significant
    digits (1 hit in 30,002 queries read 0.00%, 16 hit tokens in 416,000 "0.00%" in a curve)."""
    percent = 100 * rate if abs(rate) >= 1e-9 else 0.0  # (below: float noise, as compare's fmt has it)
    if 0 < abs(percent) < 0.5 * 10 ** -decimals:
        return f"{percent:.2g}%"
    shown = f"{percent:.{decimals}f}"
    while 0 < rate < 1 and float(shown) >= 100 and decimals < 9:  # (one miss in 416,000 read 100.00%)
        decimals += 1
        shown = f"{percent:.{decimals}f}"
    return f"{shown}%"


def points_text(delta: float, decimals: int = 2) -> str:
    """A change of a rate in signed percentage points, as ``percent_text`` shows a rate."""
    points = 100 * delta if abs(delta) >= 1e-9 else 0.0  # (below: float noise, as compare's fmt has it)
    if 0 < abs(points) < 0.5 * 10 ** -decimals:
        return f"{points:+.2g} pp"
    return f"{points:+.{decimals}f} pp"


# A collected run's summary key: the spans its sender numbered that the collector has not
# received (the run is incomplete until they come; its sender's own summary is kept beside it)
SPANS_MISSING = "otlp_spans_missing"
SUMMARY_RATES: tuple[str, ...] = (*(r.key for r in RATES), "block_hit_rate")
SUMMARY_SIZES: tuple[str, ...] = ("capacity_blocks", "block_size")  # ints >= 1 (capacity: one a pool)
SUMMARY_AMOUNTS: tuple[str, ...] = ("output_tok_per_s", "virtual_duration_s")  # finite numbers >= 0
_MAX_COUNT = (1 << 63) - 1


def summary_problem(summary: Mapping[str, object]) -> str | None:
    """What is wrong with a run summary another program sent (``KEY: expected ...``), or
    None: each count an int from 0 to 2^63-1, each rate a number from 0 to 1, each latency
    statistic a number of ms from 0 to what int64 ns hold, each size an int >= 1, a
    throughput or duration a finite number >= 0, the evictions by reason counts (any of
    them may be null); other keys as they are."""
    for key, value in summary.items():
        if value is None:
            continue
        x = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if key in SUMMARY_COUNTS:
            ok = isinstance(x, int) and 0 <= x <= _MAX_COUNT
            want = "a count (an integer from 0 to 2^63-1)"
        elif key in SUMMARY_RATES:
            ok = x is not None and 0 <= x <= 1
            want = "a rate from 0 to 1"
        elif is_latency_key(key):  # (a store's times are int64 ns: 1e308 ms printed 300 digits in runs)
            ok = x is not None and math.isfinite(x) and 0 <= x <= _MAX_COUNT / NS_PER_MS
            want = f"a time in ms (from 0 to {_MAX_COUNT / NS_PER_MS:.4g}, what int64 ns hold)"
        elif key in SUMMARY_SIZES:
            sizes = value if isinstance(value, list) and key == "capacity_blocks" else [value]
            ok = bool(sizes) and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= _MAX_COUNT
                                     for v in sizes)
            want = "a size (an integer from 1 to 2^63-1)"
        elif key in SUMMARY_AMOUNTS:
            ok = x is not None and math.isfinite(x) and x >= 0
            want = "a finite number >= 0"
        elif key == "evictions_by_reason":
            ok = isinstance(value, dict) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_COUNT
                                                 for v in value.values())
            want = "an object of counts by reason"
        else:
            continue
        if not ok:
            return f"{key}: expected {want}, got {value!r}"[:200]
    return None


# (part, whole, rate): a summary's counters within another and the rate they give
_SUMMARY_RATIOS = (*((r.numerator, r.denominator, r.key) for r in RATES),
                   ("hit_blocks", "total_blocks", "block_hit_rate"))
_PERCENTILE_KEY = re.compile(r"p(\d+(?:\.\d+)?)_(.+)")


def summary_disagreement(summary: Mapping[str, Any]) -> str | None:
    """What in a run summary disagrees with itself (``KEY: ...``), or None: more hits than
    queries, a rate other than its counters' ratio (``ratio``), evictions other
    than their reasons' sum, a latency percentile below a lower one (``summary_problem`` has
    checked each value's range already). The collector refuses a received summary for it, and
    a store that took a record it could not refuse (the OTel Collector's ClickHouse exporter)
    keeps none that fails it."""
    def count(key: str) -> int | None:
        value = summary.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    for part_key, whole_key, rate_key in _SUMMARY_RATIOS:
        part, whole = count(part_key), count(whole_key)
        if part is not None and whole is not None and part > whole:
            return f"{part_key}: {part} exceeds {whole_key} {whole} (counted within it)"
        rate = summary.get(rate_key)
        if part is None or whole is None or (rate_key not in summary):
            continue
        want = ratio(part, whole)
        agree = rate is None if want is None else rate is not None and math.isclose(rate, want, rel_tol=1e-9,
                                                                                      abs_tol=1e-12)
        if not agree:
            return f"{rate_key}: {rate!r} is not {part_key} / {whole_key} = {part} / {whole} ({want!r})"[:200]
    by_reason, evictions = summary.get("evictions_by_reason"), count("evictions")
    if isinstance(by_reason, dict) and evictions is not None and sum(by_reason.values()) != evictions:
        return (f"evictions_by_reason: adds up to {sum(by_reason.values())}, not evictions {evictions}")[:200]
    by_stem: dict[str, list[tuple[float, str, float]]] = {}  # latency -> (percentile, key, value)
    for key, value in summary.items():
        found = _PERCENTILE_KEY.fullmatch(key)
        if found and is_latency_key(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
            by_stem.setdefault(found.group(2), []).append((float(found.group(1)), key, value))
    for points in by_stem.values():
        points.sort()
        for (_, low_key, low), (_, key, value) in pairwise(points):
            if value < low:
                return f"{key}: {value!r} is below {low_key} {low!r} (a higher percentile is never lower)"[:200]
    return None
