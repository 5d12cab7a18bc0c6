"""``kvtrace calibrate``: fit a cost model to a real engine's measurements.

A user with a GPU runs vLLM once; kvtrace then reproduces that server's latencies. The
measurements come in three forms, each read into observations (``engine.costfit``):

* **a CSV of step timings** (``.csv``): one row per engine step, columns ``num_tokens``
  (prefill tokens plus one per decode sequence), ``prefill_pairs``, ``num_decode_seqs``,
  ``decode_context_tokens``, optionally ``num_kv_copies``, ``num_state_copies``,
  ``num_kv_loads`` (tokens loaded from an external tier), ``num_state_loads``, and
  ``step_ms`` or ``step_ns`` (format: ``tests/data/calibration/README.md``). Each row is
  one exact equation; data made by a known cost model gives that model back. A row no
  engine step could be (more decoding sequences than tokens, fewer prefill pairs than
  prefill tokens, context without a decoding sequence: a column swapped) is refused at
  its line.
* **a ``vllm bench serve`` result** (``.json``, saved with ``--save-result
  --save-detailed``): per request ``input_lens``, ``output_lens``, ``ttfts`` and
  ``itls`` (seconds). A TTFT is the request's prefill, in chunks of
  ``max_num_batched_tokens``; an inter-token gap is a decode step (where a request has
  fewer gaps than output tokens after its first, the client read chunks of several tokens,
  and where it has more, some chunk held none: its gaps together are its decode steps); a
  request that failed
  (its TTFT 0.0, or an ``errors`` entry) is skipped. With its ``start_times`` (vllm
  bench serve saves them) each request's TTFT and gaps are a timeline, read as collected
  spans are (below): who else prefilled or decoded in each of its steps comes from the
  overlap, with its queueing counted as prefill. Without them, with ``max_concurrency`` C
  > 1 every step is assumed to carry C - 1 other decoding sequences at the run's mean
  context, so such runs fit well only at concurrency 1 (exact there).
* **vLLM's OTLP request spans** stored by ``kvtrace collect`` (a ``.duckdb`` store, and
  ``--run ID`` when it holds more than one collected run): per ``llm_request`` span,
  ``gen_ai.latency.time_in_model_prefill`` (its prefill chunks) and ``..._decode`` (its
  decode steps), with its prompt and completion tokens. The other requests in a step
  are read off the spans' overlap: those decoding at the request's first scheduling
  join each prefill chunk, the mean number decoding beside it joins each of its decode
  steps, and the others' prefills (each spread evenly over its [scheduled, first token))
  add their tokens and causal pairs, packed into chunks of the budget, to its steps.
  Requests served one at a time fit exactly.

Neither a bench result nor vLLM's spans say how many prompt tokens hit the prefix cache: each
TTFT is read as its whole prompt prefilled, so the server measured should run without prefix
caching (``vllm serve --no-enable-prefix-caching``), or, for a model of attention alone, be sent
distinct prompts (the report says so under such measurements). A hybrid model's server (Mamba,
linear attention) with prefix caching on also cuts each prompt's prefill at its Mamba blocks
(vLLM's ``mamba_cache_mode = "align"``, which prefix caching turns on, and kvtrace's
``kimi-hybrid`` preset): more steps than the chunks of the budget read here, distinct prompts or
not (a kvtrace kimi-hybrid replay, requests one at a time, fitted 32% off and decode_seq_ns 60x
the truth).

The fit and its error per kind of observation are printed (with the terms no measurement
exercised, which keep their given value); the model is written as a TOML ``[cost_model]``
table that ``kvtrace replay --config`` accepts. Measurements that cannot tell fitted terms
apart (``engine.costfit.Underdetermined``) are refused, naming the terms.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import msgspec
import numpy as np

from kvtrace.engine.clock import COEFFICIENTS, FITTED_TERMS, CostModel, StepWork, prefill_pairs
from kvtrace.engine.costfit import Fit, Observation, Underdetermined, fit_cost_model
from kvtrace.errors import ConfigError, KVTraceError, file_problem
from kvtrace.names import printable, shell_path
from kvtrace.workload.lines import (
    MAX_TOKENS,
    check_int,
    compressed_problem,
    csv_problem,
    decoded_lines,
    refuse_repeated_keys,
    row_nul_problem,
)

DEFAULT_MAX_BATCHED_TOKENS = 8192
_STEP_COLUMNS = ("num_tokens", "prefill_pairs", "num_decode_seqs", "decode_context_tokens")
# A step file's optional columns (0 where absent), in StepWork's order after the above: the
# terms only such a file can exercise (a measured load's num_kv_loads was read as none)
_OPTIONAL_STEP_COLUMNS = ("num_kv_copies", "num_state_copies", "num_kv_loads", "num_state_loads")


_KINDS = ("a step-timing .csv, a vllm bench serve .json or a kvtrace store (.duckdb, chdb:DIR or clickhouse://) of "
          "collected vLLM spans")


def _is_store(path: str | Path) -> bool:
    """A --from that names a store: a .duckdb file, or a ClickHouse one (``collect --db chdb:DIR``
    stores its spans there too; calibrate called it "no such file")."""
    from kvtrace.store.backend import is_clickhouse

    return _suffix(path) == ".duckdb" or is_clickhouse(str(path))


def observations_from_file(path: str | Path, *, max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
                           run_id: str | None = None) -> list[Observation]:
    """Observations of a step CSV, a ``vllm bench serve`` JSON or a store of vLLM spans
    (chosen by suffix)."""
    p = str(path)
    if _is_store(p) and _suffix(p) != ".duckdb":  # (a ClickHouse store: no file to check)
        try:
            return served_span_observations(p, run_id, max_num_batched_tokens)
        except ConfigError as err:  # (the address parser's, which names --db)
            if err.source != "--db":
                raise
            raise ConfigError("--from", err.key, err.what) from None
    problem = file_problem(p)
    if problem is not None:
        raise KVTraceError(f"{printable(p)}: {problem} (expected {_KINDS})")
    suffix = _suffix(p)
    if suffix == ".csv":
        return step_csv_observations(p)
    if suffix == ".json":
        return bench_serve_observations(p, max_num_batched_tokens)
    if suffix == ".duckdb":
        return served_span_observations(p, run_id, max_num_batched_tokens)
    raise KVTraceError(f"{printable(p)}: expected {_KINDS}")


def _suffix(path: str | Path) -> str:
    """What kind of --from a path is, by its suffix in any case (X.CSV was refused)."""
    return os.path.splitext(str(path))[1].lower()


# Bounds of a step's measurements: counts exact in float64 (their squares fit the fit's least
# squares), and a step of at most an hour: beyond them a value is a broken file, not a server.
_MAX_COUNT = 2**53
_MAX_STEP_NS = 3_600e9
_MIN_STEP_NS = 1_000.0  # a microsecond: no GPU step is shorter
_MAX_SECONDS = 3_600.0  # a bench result's TTFT or inter-token gap


# A number as a CSV writer puts it: ASCII digits, a point, an exponent (float() also took
# '1_000' and other scripts' digits, '١٢' as 12 ms, which no writer of step timings means)
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?")


def _number(path: str, line: int, key: str, text: str | None, integer: bool = True,
            maximum: float = _MAX_COUNT, lowest: float = 0.0) -> float:
    shown = printable(path)  # (a newline in a file's name shown as typed, not as a space)
    v = float(text) if text is not None and _NUMBER_TEXT.fullmatch(text.strip()) else math.nan
    if not math.isfinite(v) or v < lowest or v > maximum or (integer and v != int(v)):
        what = "an integer" if integer else "a number"
        raise KVTraceError(f"{shown}:{line}: {key}: expected {what} in [{lowest:g}, {maximum:,.0f}], got "
                           f"{text!r}"[:200])
    return v


def _seconds(where: str, key: str, value: object) -> float:
    """A finite number of seconds from a bench result: a microsecond (``_MIN_STEP_NS``, the
    step files' floor: 1e-200 s fitted an all-zero model, 5e-324 s failed the SVD) to an hour."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not _MIN_STEP_NS / 1e9 <= value <= _MAX_SECONDS):
        raise KVTraceError(f"{where}: {key}: expected seconds from {_MIN_STEP_NS / 1e9:g} (a microsecond) to "
                           f"{_MAX_SECONDS:,.0f}, got {value!r}"[:200])
    return float(value)


def step_csv_observations(path: str) -> list[Observation]:
    """One observation a row, read as a trace is (streamed, lines bounded, the byte-order
    mark dropped): the first bad row is named before the rest is read."""
    shown = printable(path)
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed by the with below)
    except OSError as e:
        raise KVTraceError(f"{shown}: cannot open: {e.strerror}") from None
    with f:
        # (UTF-16 was 'unreadable CSV header (... open the file in universal-newline mode?)', a file
        # padded with zeros '39: 1 fields; the header has 6': named as the trace readers name them)
        problem = compressed_problem(path, f.read(12), what="step timings")
        if problem is not None:
            raise KVTraceError(f"{shown}: {problem}")
        f.seek(0)
        reader = csv.reader(decoded_lines(path, f))
        try:
            header = [h.strip() for h in next(reader, None) or ()]
        except csv.Error as e:
            raise KVTraceError(f"{shown}:1: unreadable CSV header ({csv_problem(e)})") from None
        _refuse_nul(path, 1, header)
        if not header:
            raise KVTraceError(f"{shown}: no rows; expected a header and one row per step")
        twice = [c for c in header if header.count(c) > 1]
        if twice:  # (which one would hold the value?)
            raise KVTraceError(f"{shown}:1: column {twice[0]} appears {header.count(twice[0])} times")
        missing = [c for c in _STEP_COLUMNS if c not in header]
        if "step_ns" in header and "step_ms" in header:  # (step_ns was read, step_ms ignored without a word)
            raise KVTraceError(f"{shown}:1: columns step_ms and step_ns both given; expected one of them (the "
                               "step's duration in milliseconds or in nanoseconds)")
        time_col = "step_ns" if "step_ns" in header else "step_ms" if "step_ms" in header else None
        if missing or time_col is None:
            need = missing + ([] if time_col else ["step_ms or step_ns"])
            raise KVTraceError(f"{shown}:1: missing column(s) {need}; expected {list(_STEP_COLUMNS)} and step_ms")
        to_ns = 1e6 if time_col == "step_ms" else 1.0
        out = []
        while True:
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                raise KVTraceError(f"{shown}:{reader.line_num}: unreadable CSV row ({csv_problem(e)})") from None
            line = reader.line_num
            if not any(c.strip() for c in row):
                continue
            _refuse_nul(path, line, row)
            if len(row) != len(header):
                raise KVTraceError(f"{shown}:{line}: {len(row)} fields; the header has {len(header)}")
            r = dict(zip(header, row))
            vals = {c: int(_number(path, line, c, r.get(c))) for c in _STEP_COLUMNS}
            copies = {c: int(_number(path, line, c, r.get(c) or "0")) for c in _OPTIONAL_STEP_COLUMNS}
            # (a step of at least a microsecond: a subnormal duration once failed the fit's SVD; the
            # range said [0, ...] of a NaN, where 0 is refused)
            t = _number(path, line, time_col, r.get(time_col), integer=False, maximum=_MAX_STEP_NS / to_ns,
                        lowest=_MIN_STEP_NS / to_ns)
            work = StepWork(vals["num_tokens"], vals["prefill_pairs"], vals["decode_context_tokens"],
                            vals["num_decode_seqs"], *(copies[c] for c in _OPTIONAL_STEP_COLUMNS))
            problem = _impossible_step(work)
            if problem is not None:
                raise KVTraceError(f"{shown}:{line}: {problem}; are the columns as the header names them?")
            group = "prefill" if work.prefill_pairs else "decode"
            out.append(Observation([work], t * to_ns, group, r.get("label") or ""))
    if not out:
        raise KVTraceError(f"{shown}: no rows; expected a header and one row per step")
    return out


def _refuse_nul(path: str, line: int, row: list[str]) -> None:
    """A NUL byte in a row, named at its line and field (a file padded with zeros)."""
    shown = printable(path)
    problem = row_nul_problem(row)
    if problem is not None:
        raise KVTraceError(f"{shown}:{line}: {problem}")


def _impossible_step(w: StepWork) -> str | None:
    """Why a step file's row is no step an engine runs (as the engine counts one: each decoding
    sequence one token of the step and at least that token of context, each prefill token at
    least the pair with itself), or None. A column swapped or in another unit (the context in
    the sequences' column) was fitted as it stood."""
    prefill = w.num_tokens - w.num_decode_seqs
    if prefill < 0:
        return (f"num_decode_seqs: {w.num_decode_seqs:,} decoding sequences in a step of {w.num_tokens:,} tokens "
                "(num_tokens counts one token for each)")
    if prefill == 0 and w.prefill_pairs:
        return (f"prefill_pairs: {w.prefill_pairs:,} with no prefill token (the step's {w.num_tokens:,} tokens "
                "are its decoding sequences')")
    if w.prefill_pairs < prefill:
        return (f"prefill_pairs: {w.prefill_pairs:,} for {prefill:,} prefill tokens (each token attends at least "
                "to itself: at least one pair each)")
    if not w.num_decode_seqs and w.decode_context_tokens:
        return f"decode_context_tokens: {w.decode_context_tokens:,} with no decoding sequence (num_decode_seqs 0)"
    if w.decode_context_tokens < w.num_decode_seqs:
        return (f"decode_context_tokens: {w.decode_context_tokens:,} for {w.num_decode_seqs:,} decoding sequences "
                "(each reads at least its own token)")
    return None


def _like_steps(count: int, num_tokens: int, pairs: int, context: int, seqs: int
                ) -> tuple[list[StepWork], list[int]]:
    """``count`` steps of ``num_tokens`` tokens and ``seqs`` decoding sequences that have
    ``pairs`` prefill pairs and ``context`` decode context tokens in all, as (work, repeats):
    every term is linear in these, so two kinds of step (the totals split as integers
    allow) sum to what the steps one by one do (a request's 2^31 steps were an object each)."""
    if count == 1:
        return [StepWork(num_tokens, pairs, context, seqs)], [1]
    p, c = pairs // count, context // count
    work = [StepWork(num_tokens, p, c, seqs), StepWork(num_tokens, pairs - (count - 1) * p,
                                                      context - (count - 1) * c, seqs)]
    return work, [count - 1, 1]


def _prefill_steps(n: int, budget: int, others: int, other_ctx: float) -> tuple[list[StepWork], list[int]]:
    """The steps a prompt of ``n`` tokens takes, in chunks of ``budget`` tokens, each step
    also carrying ``others`` decoding sequences of mean context ``other_ctx``, as (work,
    repeats) for an ``Observation``: the full chunks together, then the last."""
    ctx = round(others * other_ctx)
    chunk = budget - others if budget > others else n  # (decodes filling the budget: one step)
    full, last = divmod(n, chunk)
    # the full chunks' pairs: chunk * start + chunk (chunk + 1) / 2 at start = 0, chunk, 2 chunk, ...
    pairs = chunk * chunk * full * (full - 1) // 2 + full * (chunk * (chunk + 1) // 2)
    work, repeats = _like_steps(full, chunk + others, pairs, full * ctx, others) if full else ([], [])
    if last:
        work.append(StepWork(last + others, prefill_pairs(full * chunk, last), ctx, others))
        repeats.append(1)
    return work, repeats


def _prompt_steps(n: int, budget: int, others: int, other_ctx: float) -> tuple[list[StepWork], list[int]]:
    """``_prefill_steps`` as the engine's clock prices them: a last chunk of one token (a
    1-token prompt, or one a token past a multiple of the chunk) is no prefill there but a
    decoding sequence reading the whole prompt (``kvtrace.engine.step.tally``: a chunk of one
    token that ends what is known, then samples). Read as a prefill's ``n`` pairs, data the
    engine made one request at a time fitted decode_seq_ns 53% off at a 0.1% error."""
    chunk = budget - others if budget > others else n
    if n - (-(-n // chunk) - 1) * chunk != 1:
        return _prefill_steps(n, budget, others, other_ctx)
    work, repeats = _prefill_steps(n - 1, budget, others, other_ctx) if n > 1 else ([], [])
    work.append(StepWork(1 + others, 0, round(others * other_ctx) + n, others + 1))
    repeats.append(1)
    return work, repeats


def _packed_steps(steps: int, seqs: int, context: int, tokens: int, pairs: int, budget: int
                  ) -> tuple[list[StepWork], list[int]]:
    """``steps`` steps of ``seqs`` decoding sequences (``context`` tokens read in all), among
    which ``tokens`` prefill tokens (``pairs`` pairs in all) are packed as the budget packs
    them: chunks of what the decodes leave of it, then the rest (all of them in the ``steps``,
    >= 1, shared evenly where the budget's chunks would need more). As (work, repeats); the
    sums are exact, so what is linear in them is too."""
    chunk = max(budget - seqs, 1)
    if tokens > steps * chunk:  # (more prefill than the steps hold at the budget: it shares them evenly)
        chunk = -(-tokens // steps)
    full, rest = divmod(tokens, chunk)
    busy = full + (rest > 0)
    # each kind of step (prefill tokens, how many): pairs in proportion to the tokens (the last
    # kind with tokens takes what rounding left), the context evenly (the last kind the rest)
    kinds = [(t, k) for t, k in ((chunk, full), (rest, 1 if rest else 0), (0, steps - busy)) if k]
    work, repeats = [], []
    tokens_left, pairs_left, context_left = tokens, pairs, context
    for index, (t, k) in enumerate(kinds):
        p = pairs_left if t * k == tokens_left else pairs * t * k // tokens
        c = context_left if index == len(kinds) - 1 else context * k // steps
        w, r = _like_steps(k, t + seqs, p, c, seqs)
        work += w
        repeats += r
        tokens_left, pairs_left, context_left = tokens_left - t * k, pairs_left - p, context_left - c
    return work, repeats


class _Rates:
    """Intervals [s, e), each with a rate: the sum over them of rate x the length of their part
    inside [lo, hi), in O(log n) (what other requests' prefills did during a request's)."""

    def __init__(self, intervals: list[tuple[int, int]], rates: list[float]):
        # times from the earliest start: the moments below are float sums, and a client's clock
        # (10^15 ns after a boot) would leave them a few tokens' rounding
        self.origin = min((s for s, _ in intervals), default=0)
        by_start = sorted(zip((s - self.origin for s, _ in intervals), rates))
        by_end = sorted(zip((e - self.origin for _, e in intervals), rates))
        self.starts = [s for s, _ in by_start]
        self.ends = [e for e, _ in by_end]
        self.start_rate = list(accumulate((w for _, w in by_start), initial=0.0))
        self.end_rate = list(accumulate((w for _, w in by_end), initial=0.0))
        self.start_moment = list(accumulate((w * s for s, w in by_start), initial=0.0))
        self.end_moment = list(accumulate((w * e for e, w in by_end), initial=0.0))

    def _left_of(self, x: int) -> float:
        a, b = bisect_left(self.starts, x), bisect_left(self.ends, x)
        return (x * self.start_rate[a] - self.start_moment[a]) - (x * self.end_rate[b] - self.end_moment[b])

    def covered(self, lo: int, hi: int) -> float:
        return self._left_of(hi - self.origin) - self._left_of(lo - self.origin)


# what a bench result's reading takes from it: each refused when given twice with two values
_BENCH_KEYS = frozenset(("input_lens", "output_lens", "ttfts", "itls", "errors", "start_times", "max_concurrency",
                         "duration"))


def bench_serve_observations(path: str, max_num_batched_tokens: int) -> list[Observation]:
    shown = printable(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        doc = json.loads(raw)
    except OSError as e:
        raise KVTraceError(f"{shown}: cannot read: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (too deep; an int of 5,000 digits)
        raise KVTraceError(f"{shown}: not a vllm bench serve result JSON ({type(e).__name__}: {e})"[:200]) from None
    try:  # (a key given twice: the last one was fitted without a word, where trace files take neither)
        refuse_repeated_keys(raw, _BENCH_KEYS)
    except msgspec.ValidationError as e:
        raise KVTraceError(f"{shown}: {e}") from None
    if not isinstance(doc, dict):
        raise KVTraceError(f"{shown}: expected a JSON object (a vllm bench serve result)")
    needed = ("input_lens", "output_lens", "ttfts", "itls")
    missing = [k for k in needed if not isinstance(doc.get(k), list)]
    if missing:
        raise KVTraceError(f"{shown}: {', '.join(missing)}: missing; save the bench with --save-result --save-detailed")
    ins, outs, ttfts, itls = (doc[k] for k in needed)
    if not len(ins) == len(outs) == len(ttfts) == len(itls):
        raise KVTraceError(f"{shown}: input_lens, output_lens, ttfts and itls differ in length")
    # every value checked before any is used
    ins = [check_int(path, None, f"input_lens[{i}]", n, 0) for i, n in enumerate(ins)]
    outs = [check_int(path, None, f"output_lens[{i}]", n, 0) for i, n in enumerate(outs)]
    errors = doc.get("errors")
    if errors is not None and (not isinstance(errors, list) or len(errors) != len(ins)):
        raise KVTraceError(f"{shown}: errors: expected a list with an entry per request (vllm bench serve's), got "
                           f"{errors!r}"[:200])
    for i, text in enumerate(errors or ()):
        if text is not None and not isinstance(text, str):
            raise KVTraceError(f"{shown}: errors[{i}]: expected the request's error text, got {text!r}"[:200])
    # A request that failed: vllm bench serve leaves its TTFT at 0.0 (no first token) and writes its
    # error, also when it failed after a first token; null is a TTFT no version measured.
    failed = {i for i, t in enumerate(ttfts)
              if t is None or (type(t) in (int, float) and t == 0) or (errors and errors[i])}
    done = [i for i in range(len(ttfts)) if i not in failed and ins[i] >= 1]
    for i in done:
        where = f"{shown}: request {i}"
        _seconds(where, "ttfts", ttfts[i])
        if not isinstance(itls[i], list):
            raise KVTraceError(f"{where}: itls: expected a list of seconds, got {itls[i]!r}"[:200])
        for j, gap in enumerate(itls[i]):
            _seconds(where, f"itls[{j}]", gap)
    starts = doc.get("start_times")
    if starts is not None:  # (vllm bench serve writes them since 0.11: each request's send time)
        if not isinstance(starts, list) or len(starts) != len(ins):
            raise KVTraceError(f"{shown}: start_times: expected a list with an entry per request (vllm bench "
                               f"serve's), got {starts!r}"[:200])
        for i in done:
            t = starts[i]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= _MAX_CLOCK_S:
                raise KVTraceError(f"{shown}: request {i}: start_times: expected seconds from 0 to "
                                   f"{_MAX_CLOCK_S:,.0f} (a monotonic clock's), got {t!r}"[:200])
        return _timeline_observations([_Timeline(
            f"request {i}", ins[i], outs[i], round(starts[i] * 1e9), round(starts[i] * 1e9) + round(ttfts[i] * 1e9),
            [round(g * 1e9) for g in itls[i]]) for i in done], max_num_batched_tokens, "bench") or _none_done(path)
    concurrency = doc.get("max_concurrency")
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):  # (null: vllm bench serve's unlimited)
        raise KVTraceError(f"{shown}: max_concurrency: expected null or an integer >= 1, got {concurrency!r}"[:200])
    duration = doc.get("duration")
    if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))
                                 or not math.isfinite(duration) or duration <= 0):
        raise KVTraceError(f"{shown}: duration: expected a positive number of seconds, got {duration!r}"[:200])
    if concurrency is None:
        # Little's law: mean requests in flight = their total latency / the run's length
        busy = sum(ttfts[i] + sum(itls[i]) for i in done)
        concurrency = 1
        if duration is not None:
            in_flight = busy / duration
            if not in_flight <= MAX_TOKENS:  # (a 1e-310 s run: infinitely many)
                raise KVTraceError(f"{shown}: duration: {duration!r} s for {busy:.6g} s of requests' latency is more "
                                   f"requests in flight than any server holds (at most {MAX_TOKENS:,})")
            concurrency = max(1, round(in_flight))
    if concurrency > MAX_TOKENS:
        raise KVTraceError(f"{shown}: max_concurrency: more than {MAX_TOKENS:,} requests in flight is beyond any "
                           "server")
    others = concurrency - 1
    mean_ctx = sum(ins[i] + outs[i] / 2 for i in done) / max(len(done), 1)  # (a failed request decoded nothing)
    obs: list[Observation] = []
    # the report names the assumption beside each group's error: a fit can look good under it
    # and still be wrong (a burst at concurrency 4 fitted 0 ns of step overhead, 3% median error)
    assumed = f", {others} others assumed (no start_times)" if others else ""
    prefill, decode = f"prefill (TTFT{assumed})", f"decode (ITL{assumed})"
    for i in done:
        n, ttft, gaps = ins[i], ttfts[i], itls[i]
        work, repeats = _prompt_steps(n, max_num_batched_tokens, others, mean_ctx)
        obs.append(Observation(work, ttft * 1e9, prefill, f"request {i}", repeats))
        decodes = outs[i] - 1
        if decodes < 1:  # (one output token: no decode step, whatever chunks followed it; as a timeline)
            continue
        if gaps and len(gaps) != decodes:
            # fewer gaps than tokens: some chunks the client read held several tokens (vLLM sends
            # what piled up since the last read), so a gap is no one step; together they are
            # the request's decode steps after its first token. More gaps than tokens: some
            # chunk held none (vllm bench serve times every chunk with choices, an empty one
            # too): a gap of a few microseconds read as a decode step threw the whole fit off
            # (median error 100%), where the timeline reading took them together
            ctx = decodes * (n + round(others * mean_ctx)) + decodes * (decodes + 1) // 2
            work, repeats = _like_steps(decodes, 1 + others, 0, ctx, 1 + others)
            obs.append(Observation(work, sum(gaps) * 1e9, decode,
                                   f"request {i}: {len(gaps)} gaps for {decodes} tokens", repeats))
            continue
        for j, gap in enumerate(gaps, start=1):
            ctx = n + j + round(others * mean_ctx)
            obs.append(Observation([StepWork(1 + others, 0, ctx, 1 + others)], gap * 1e9, decode,
                                   f"request {i} gap {j}"))
    if not obs:
        raise KVTraceError(f"{shown}: no completed request to fit")
    return obs


def _collected_run(db: str, run_id: str | None) -> str:
    """``run_id``, or the store's one collected (OTLP) run."""
    from kvtrace.store import read

    runs = read.runs(db)
    collected = runs.filter(runs["mode"] == "otlp")["run_id"].to_list()
    if run_id is not None:
        mode = runs.filter(runs["run_id"] == run_id)["mode"].to_list()
        if mode and mode[0] != "otlp":  # (said "no vLLM llm_request spans": the run was no collection at all)
            found = ", ".join(collected[:5]) + (", ..." if len(collected) > 5 else "") or "none"
            # (called as `runs` calls it: a live capture of KV events was "a replay (live mode)", and a
            # damaged mode's text was shown as it stood)
            from kvtrace.names import replay_mode, run_kind

            kind = run_kind(mode[0])
            what = f"a replay ({kind} mode)" if replay_mode(mode[0]) else f"a {kind}" if kind != "?" else \
                "a run of no mode kvtrace knows"
            raise KVTraceError(f"{db}: run {run_id}: no vLLM llm_request spans: it is {what}, "
                               f"not a collected run (the store's collected runs: {found})")
        return run_id
    if not collected:  # (a store of replays: "pass --run: it holds 0 collected runs" named no way out)
        raise KVTraceError(f"{db}: holds no collected run (vLLM's request spans, received by `kvtrace collect "
                           f"--db {shell_path(db)}` from a server started with --otlp-traces-endpoint)")
    if len(collected) != 1:
        found = ", ".join(collected) or "none"
        raise KVTraceError(f"{db}: pass --run: the store holds {len(collected)} collected runs ({found})")
    return str(collected[0])


class _Decoding:
    """The requests' decode intervals [f, e) (f <= e), queried in O(log n): how many hold a
    time and the sum of their weights; how much of all of them lies inside [a, b). Exact
    integers (a collected day is 10^5 requests: comparing every pair took hours)."""

    def __init__(self, intervals: list[tuple[int, int]], weights: list[int]):
        by_start = sorted(zip((f for f, _ in intervals), weights))
        by_end = sorted(zip((e for _, e in intervals), weights))
        self.starts = [f for f, _ in by_start]
        self.ends = [e for e, _ in by_end]
        self.start_sum = list(accumulate(self.starts, initial=0))
        self.end_sum = list(accumulate(self.ends, initial=0))
        self.start_weight = list(accumulate((w for _, w in by_start), initial=0))
        self.end_weight = list(accumulate((w for _, w in by_end), initial=0))

    def at(self, t: int) -> tuple[int, int]:
        """(intervals with f <= t < e, the sum of their weights)."""
        a, b = bisect_right(self.starts, t), bisect_right(self.ends, t)
        return a - b, self.start_weight[a] - self.end_weight[b]

    def _left_of(self, x: int) -> int:
        """The total length of the intervals' parts left of x."""
        a, b = bisect_left(self.starts, x), bisect_left(self.ends, x)
        return (a * x - self.start_sum[a]) - (b * x - self.end_sum[b])

    def covered(self, lo: int, hi: int) -> int:
        """The sum over the intervals of their length inside [lo, hi)."""
        return self._left_of(hi) - self._left_of(lo)


_SERVED_SECONDS = {"queue_s": 86_400.0, "prefill_s": _MAX_SECONDS, "decode_s": 86_400.0}


def _check_served(where: str, row: dict) -> None:
    """One llm_request span's latencies (gen_ai.latency.*, seconds) and token counts."""
    for key, limit in _SERVED_SECONDS.items():
        v = row[key]
        if not math.isfinite(v) or not 0 <= v <= limit:
            raise KVTraceError(f"{where}: {key}: expected seconds in [0, {limit:,.0f}], got {v!r}")
        if key in ("prefill_s", "decode_s") and 0 < v * 1e9 < _MIN_STEP_NS:  # (as the step files' floor)
            raise KVTraceError(f"{where}: {key}: expected 0 or at least {_MIN_STEP_NS / 1e9:g} s (a microsecond), "
                               f"got {v!r}")
    for key in ("prompt_tokens", "completion_tokens"):
        check_int(where, None, key, row[key], 0)


# A bench's start times are a client's monotonic clock (perf_counter): seconds since some
# point, a boot at most; a century bounds them (their nanoseconds stay far inside an int64).
_MAX_CLOCK_S = 100 * 365 * 86_400.0


@dataclass(slots=True)
class _Timeline:
    """One request as a server or a client saw it, in ns: prefill [scheduled, first token),
    then each inter-token gap (``gaps``, where the client read each token apart) or only
    its last token (``last``)."""

    label: str
    prompt: int
    outputs: int
    scheduled: int
    first: int
    gaps: list[int] | None
    last: int = 0

    def __post_init__(self) -> None:
        if self.gaps is not None:
            self.last = self.first + sum(self.gaps)


def _none_done(path: str) -> list[Observation]:
    raise KVTraceError(f"{path}: no completed request to fit")


def _timeline_observations(requests: list[_Timeline], budget: int, kind: str) -> list[Observation]:
    """A prefill observation per request, and its decode steps: one observation a gap where
    each gap is one token, else one for them all. The other requests in a step are read off
    the timelines' overlap: those decoding when it was scheduled join its prefill chunks,
    those decoding beside it its decode steps, and the others' prefills (each spread evenly
    over its [scheduled, first token)) add their tokens and causal pairs, packed into chunks
    of the budget, to its steps. Requests one at a time give every step exactly."""
    decoding = _Decoding([(r.first, r.last) for r in requests], [2 * r.prompt + r.outputs for r in requests])
    prefilled = [r for r in requests if r.first > r.scheduled]
    tokens_in = _Rates([(r.scheduled, r.first) for r in prefilled], [r.prompt / (r.first - r.scheduled)
                                                                      for r in prefilled])
    pairs_in = _Rates([(r.scheduled, r.first) for r in prefilled], [prefill_pairs(0, r.prompt) / (r.first - r.scheduled)
                                                                     for r in prefilled])
    mean_ctx = sum(r.prompt + r.outputs / 2 for r in requests) / max(len(requests), 1)
    obs: list[Observation] = []
    for r in requests:
        n, o = r.prompt, r.outputs
        if n < 1 or r.first <= r.scheduled:
            continue
        count, ctx2 = decoding.at(r.scheduled)
        # its prompt and the others' prefill tokens in its prefill, packed into steps of the budget
        own = prefill_pairs(0, n)
        tokens = n + max(0, round(tokens_in.covered(r.scheduled, r.first)) - n)
        pairs = own + max(0, round(pairs_in.covered(r.scheduled, r.first)) - own)
        chunk = max(budget - count, 1)
        steps, share = -(-tokens // chunk), round(ctx2 / 2)
        if tokens == n and n - (steps - 1) * chunk == 1:  # its prompt alone, ending in a lone token
            # (priced as the engine's clock prices it, a decoding sequence reading the prompt; as
            # a prefill's n pairs, a 1-token prompt fitted decode_seq_ns 53% off, requests one at a time)
            work, repeats = (_packed_steps(steps - 1, count, (steps - 1) * share, n - 1, own - n, budget)
                             if steps > 1 else ([], []))
            work.append(StepWork(1 + count, 0, share + n, count + 1))
            repeats.append(1)
        else:
            work, repeats = _packed_steps(steps, count, steps * share, tokens, pairs, budget)
        obs.append(Observation(work, r.first - r.scheduled, f"prefill ({kind})", r.label, repeats))
        if o < 2 or r.last <= r.first:
            continue
        if r.gaps is not None and len(r.gaps) == o - 1:  # a step a gap: who else was in each
            a = r.first
            for j, gap in enumerate(r.gaps, start=1):
                b = a + gap
                count, ctx2 = decoding.at(a)  # (itself among them)
                others_ctx = round((ctx2 - 2 * n - o) / 2) if count > 1 else 0
                work, repeats = _packed_steps(1, count, n + j + others_ctx, round(tokens_in.covered(a, b)),
                                              round(pairs_in.covered(a, b)), budget)
                obs.append(Observation(work, gap, f"decode ({kind})", f"{r.label} gap {j}", repeats))
                a = b
            continue
        # its o - 1 decode steps together (fewer gaps than tokens: some chunks the client read held
        # several), the j-th reading n + j tokens of its own and the others' context
        overlap = decoding.covered(r.first, r.last) - (r.last - r.first)  # the others' decode time in its own
        beside = round(overlap / (r.last - r.first))
        ctx = (o - 1) * (n + round(beside * mean_ctx)) + (o - 1) * o // 2
        work, repeats = _packed_steps(o - 1, 1 + beside, ctx, round(tokens_in.covered(r.first, r.last)),
                                      round(pairs_in.covered(r.first, r.last)), budget)
        label = r.label if r.gaps is None else f"{r.label}: {len(r.gaps)} gaps for {o - 1} tokens"
        obs.append(Observation(work, r.last - r.first, f"decode ({kind})", label, repeats))
    return obs


def served_span_observations(db: str, run_id: str | None, max_num_batched_tokens: int) -> list[Observation]:
    from kvtrace.store import read

    run_id = _collected_run(db, run_id)
    frame = read.served_requests(db, run_id).drop_nulls(["prompt_tokens", "completion_tokens", "queue_s",
                                                         "prefill_s", "decode_s"])
    if frame.height == 0:
        raise KVTraceError(f"{db}: run {run_id}: no vLLM llm_request spans with gen_ai.latency.* attributes "
                           "(start vLLM with --otlp-traces-endpoint pointing at `kvtrace collect`)")
    rows = frame.to_dicts()
    for r in rows:  # what a client sent: checked before any is used (NaN, inf, a 2^60-token prompt)
        _check_served(f"{db}: run {run_id}: span {r['span_id']}", r)
    timeline = []
    for r in rows:
        scheduled = r["arrival_ns"] + round(r["queue_s"] * 1e9)
        first = scheduled + round(r["prefill_s"] * 1e9)
        timeline.append(_Timeline(f"span {r['span_id']}", int(r["prompt_tokens"]), int(r["completion_tokens"]),
                                  scheduled, first, None, first + round(r["decode_s"] * 1e9)))
    obs = _timeline_observations(timeline, max_num_batched_tokens, "vLLM spans")
    if not obs:
        raise KVTraceError(f"{db}: run {run_id}: no completed request to fit")
    return obs


def calibrate(paths: Sequence[str | Path], *, name: str, template: CostModel | None = None,
              knee: int | None = None, max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
              run_id: str | None = None) -> Fit:
    """Fit one cost model to every observation of ``paths`` (``run_id``: the collected
    run of a store among them)."""
    seen: dict[str, str] = {}
    for p in paths:  # (one file twice counted its observations twice)
        real = os.path.realpath(p)
        if real in seen:
            raise KVTraceError(f"--from {p}: given twice (also as {seen[real]}); each file once")
        seen[real] = str(p)
    if run_id is not None and not any(_is_store(p) for p in paths):
        raise KVTraceError(f"--run {run_id}: names a run of a store (.duckdb, chdb:DIR or clickhouse://), and no "
                           "--from is one")
    obs: list[Observation] = []
    for p in paths:
        obs += observations_from_file(p, max_num_batched_tokens=max_num_batched_tokens, run_id=run_id)
    source = ", ".join(str(p) for p in paths)
    try:
        with np.errstate(all="ignore"):  # (extreme values: the fit's result is checked, not warned about)
            fit = fit_cost_model(obs, name=name, template=template, knees=None if knee is None else (knee,),
                                 source=source)
    except np.linalg.LinAlgError as e:
        raise KVTraceError(f"{source}: these measurements determine no cost model ({e})") from None
    except Underdetermined as e:
        raise KVTraceError(f"{source}: {e}") from None
    except KVTraceError as e:  # a coefficient out of its range: name the measurements
        raise KVTraceError(f"{source}: the fit gives {e}") from None
    if not any(getattr(fit.model, k) for k in FITTED_TERMS):  # (a model --config refuses: every latency 0)
        raise KVTraceError(f"{source}: the fit gives every coefficient 0 (each under half a unit: ns, or ps of a "
                           f"pair or context token): {len(obs):,} measurements of too much work for their times to "
                           "model any step's time")
    return fit


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quotes, backslashes and control characters escaped, the
    rest as it is (json.dumps wrote an emoji as a surrogate pair, which no TOML reader takes).
    A lone surrogate (an undecodable byte of a path) has no TOML form: written as its escape."""
    out = []
    for c in text:
        o = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\u{o:04x}")
        elif 0xD800 <= o <= 0xDFFF:
            out.append(f"\\\\u{o:04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def cost_model_toml(model: CostModel) -> str:
    """``model`` as the ``[cost_model]`` table of a ``--config`` file."""
    lines = ["[cost_model]", f"name = {_toml_string(model.name)}"]
    if model.source:
        lines.append(f"source = {_toml_string(model.source)}")
    lines += [f"{key} = {getattr(model, key)}" for key in COEFFICIENTS]
    return "\n".join(lines) + "\n"


def fit_report(fit: Fit) -> list[str]:
    """Lines describing the fitted model and its error per kind of observation."""
    m = fit.model
    out = [f"cost model {m.name}: {len(fit.observations)} observations, median error {fit.median_error:.1%}, "
           f"max {fit.max_error:.1%}"]
    for group, (n, med, mx) in fit.error_by_group().items():
        out.append(f"  {group}: {n} observations, median |error| {med:.1%}, max {mx:.1%}")
    if any(o.group.startswith("prefill (") for o in fit.observations):
        # (neither a bench result nor vLLM's span says how many prompt tokens hit the prefix cache:
        # a 512-token system prompt cached in two thirds of the requests fitted 0 ns of step
        # overhead, attn_pair_ps twice the truth and 4 ms a decoding sequence, at a median error of 0.0%)
        # (and a hybrid model's server with prefix caching cuts every prefill at its Mamba blocks, vLLM's
        # mamba_cache_mode "align": distinct prompts to it fitted decode_seq_ns 60x the truth, 32% off)
        out.append("  (each TTFT read as its whole prompt prefilled in chunks of the budget: prefix-cache hits, on "
                   "by default in vLLM, shorten it unseen, and on a hybrid model (Mamba, linear attention) prefix "
                   "caching also cuts each prefill at its Mamba blocks, more steps than read here; measure with "
                   "`vllm serve --no-enable-prefix-caching`, or distinct prompts to a model of attention alone)")
    weak = fit.weakly_determined()
    for key in COEFFICIENTS:
        # a term no measurement exercised is the template's (0 unless --moe), not a finding
        unused = (key == "token_above_knee_ns" and not m.token_knee) or (key == "moe_expert_ns" and not m.num_experts)
        given = key in FITTED_TERMS and key not in fit.fitted and not unused
        note = "  (not fitted: no measurement exercises it)" if given else ""
        if key in weak and math.isinf(weak[key]):  # (no residual left to estimate any term's error by)
            note = (f"  (unchecked: {len(fit.observations):,} measurements for {len(fit.fitted)} fitted terms leave "
                    "no residual to estimate its error by, so values far from the truth fit about as well; add "
                    "measurements)")
        elif key in weak:
            se = weak[key]
            shown = f"{se:,.0f}" if se >= 1 else f"{se:.2g}"  # (under 1 it read "token_ns = 0 (± 0: ...)")
            note = (f"  (± {shown}: weakly determined, these measurements hardly tell it from the other "
                    "terms; add steps that vary it alone)")
        out.append(f"  {key} = {getattr(m, key):,}{note}")
    return out
