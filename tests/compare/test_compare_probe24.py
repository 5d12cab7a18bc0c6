"""kvtrace diff's numbers against an independent reading of the store (raw SQL over its spans):
what the evictions table's publish-kind rows count, and the latency CIs recomputed from the
documented resampling (the request, PCG64 seeded with --seed, numpy's linear percentiles)."""

from __future__ import annotations

import collections
import json

import duckdb
import numpy as np
import pytest

from tests.cli.support import run


@pytest.fixture(scope="module")
def cache_only_pair(tmp_path_factory):
    """Two cache-only runs of one trace at two capacities: evictions, all of them of full blocks."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("probe24") / "c.duckdb"
    a = run_replay(RunSpec("gen:chat", limit=60, mode="cache-only", capacity_blocks=60), db=db)
    b = run_replay(RunSpec("gen:chat", limit=60, mode="cache-only", capacity_blocks=90), db=db)
    return str(db), a.run_id, b.run_id


def _next_publish_kinds(db: str, run_id: str) -> dict[str, int]:
    """Evicted blocks by the kind of the first publish that took the same block id (same group)
    after the eviction and before that block id's next eviction; 'none' where no publish did.
    From the evict and publish spans (one span may evict a block's two keys at one time)."""
    con = duckdb.connect(db, read_only=True)
    try:
        evicted = con.execute("SELECT start_ns, group_id, unnest(block_ids) FROM spans WHERE run_id = ? AND "
                              "name = 'kvtrace.cache.evict'", [run_id]).fetchall()
        published = con.execute("SELECT start_ns, group_id, unnest(block_ids), publish_kind FROM spans WHERE "
                                "run_id = ? AND name = 'kvtrace.cache.publish'", [run_id]).fetchall()
    finally:
        con.close()
    evictions, publishes = collections.defaultdict(list), collections.defaultdict(list)
    for t, group, block in evicted:
        evictions[(group, block)].append(t)
    for t, group, block, kind in published:
        publishes[(group, block)].append((t, kind))
    counts: collections.Counter[str] = collections.Counter()
    for block, times in evictions.items():
        for t in times:
            again = min((x for x in times if x > t), default=None)
            taken = min((p for p in publishes[block] if p[0] > t), default=None)
            counts[taken[1] if taken is not None and (again is None or taken[0] < again) else "none"] += 1
    return dict(counts)


def test_the_evictions_table_says_its_publish_kinds_are_of_the_publish_that_took_the_block(cache_only_pair, capsys):
    """The diff's evictions table listed 'publish kind | full | 731' and 'publish kind | none | 1'
    of a cache-only run, every one of whose publishes is full: the rows count evicted blocks by
    the publish that next took each block's place (the dashboard's "Evicted blocks by the
    publish that took their place"), which no view of the diff said; read as the evicted
    entries' own kinds, 'none' is no kind at all. Each view now says what the rows count."""
    db, a, b = cache_only_pair
    con = duckdb.connect(db, read_only=True)
    try:
        kinds = {k for (k,) in con.execute("SELECT DISTINCT publish_kind FROM spans WHERE run_id IN (?, ?) AND "
                                           "name = 'kvtrace.cache.publish'", [a, b]).fetchall()}
    finally:
        con.close()
    assert kinds == {"full"}  # (what a cache-only run publishes)
    code, out, err = run(["diff", a, b, "--db", db, "--json"], capsys)
    assert code == 0, err
    by_kind = json.loads(out)["evictions"]["by_publish_kind"]
    for side, run_id in (("a", a), ("b", b)):
        got = {k: v[side] for k, v in by_kind.items() if v[side]}
        assert got == _next_publish_kinds(db, run_id), (side, got)
    code, out, err = run(["diff", a, b, "--db", db, "--markdown"], capsys)
    assert code == 0, err
    head = next(line for line in out.splitlines() if line.startswith("**Evictions**"))
    assert "publish that next took the block's place" in head and "none: no publish did" in head, head
    code, out, err = run(["diff", a, b, "--db", db], capsys)
    assert code == 0, err
    text = " ".join(out.split())
    assert "│ publish kind " in out
    assert "by the kind of the publish that next took the block's place (none: no publish did)" in text, out


@pytest.fixture(scope="module")
def engine_pair(tmp_path_factory):
    """Two engine runs of one trace at two capacities (paired requests)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("probe24e") / "e.duckdb"
    a = run_replay(RunSpec("gen:chat", limit=60, capacity_blocks=30), db=db)
    b = run_replay(RunSpec("gen:chat", limit=60, capacity_blocks=60), db=db)
    return str(db), a.run_id, b.run_id


def test_the_latency_cis_are_the_documented_request_bootstrap_recomputed_from_the_spans(engine_pair, capsys):
    """Every latency figure `diff --json` prints, recomputed from the request spans alone as
    the bootstrap's docstring and the README define it: the request is the unit (a replicate
    draws n of the sorted request ids with replacement, PCG64(--seed), one draw for both runs
    when they hold the same requests), each replicate's percentile numpy's linear one of its
    expanded multiset, the 95% CI the 2.5% and 97.5% quantiles of the replicate deltas B - A."""
    db, a, b = engine_pair
    seed, resamples, qs = 11, 200, (25.0, 50.0, 90.0)
    code, out, err = run(["diff", a, b, "--db", db, "--json", "--seed", str(seed), "--resamples", str(resamples),
                          "--percentiles", ",".join(f"{q:g}" for q in qs)], capsys)
    assert code == 0, err
    got = json.loads(out)
    con = duckdb.connect(db, read_only=True)
    try:
        rows = {r: con.execute("SELECT request_id, ttft_ns, itl_ns FROM spans WHERE run_id = ? AND "
                               "name = 'kvtrace.request' ORDER BY request_id", [r]).fetchall() for r in (a, b)}
    finally:
        con.close()
    ids = [x[0] for x in rows[a]]
    assert ids == [x[0] for x in rows[b]] and got["bootstrap"]["paired"] is True
    draws = np.random.Generator(np.random.PCG64(seed)).integers(0, len(ids), size=(resamples, len(ids)))
    counts = np.stack([np.bincount(d, minlength=len(ids)) for d in draws])

    def observations(run_id: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
        pairs = [(i, t) for i, (_, t, _) in enumerate(rows[run_id])] if metric == "ttft" else \
            [(i, g) for i, (_, _, gaps) in enumerate(rows[run_id]) for g in gaps or []]
        return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs], dtype=np.float64)

    checked = 0
    for metric in ("ttft", "itl"):
        (own_a, val_a), (own_b, val_b) = observations(a, metric), observations(b, metric)
        for q in qs:
            shift = got["latency"][f"p{q:g}_{metric}_ms"]
            assert shift["a"] == pytest.approx(np.percentile(val_a, q) / 1e6, rel=1e-12)
            assert shift["b"] == pytest.approx(np.percentile(val_b, q) / 1e6, rel=1e-12)
            if shift["ci"][0] is None:
                continue
            deltas = [np.percentile(np.repeat(val_b, c[own_b]), q) / 1e6 - np.percentile(np.repeat(val_a, c[own_a]), q)
                      / 1e6 for c in counts]
            low, high = np.quantile(deltas, [0.025, 0.975])
            assert shift["ci"] == pytest.approx([low, high], rel=1e-9, abs=1e-12), (metric, q)
            checked += 1
    assert checked >= 4  # (the medians and the 25th percentiles of both metrics at least)


def test_a_trace_file_changed_between_two_runs_is_not_blamed_on_flags_never_given(tmp_path, capsys):
    """Two runs of one file with the same flags, the file edited between them: diff refused them
    as the file 'read differently (another --limit, --trace-block-size or --format)', flags
    neither run was given. The refusal names the change of the file too."""
    from tests.cli.support import assert_one_line

    line = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}
    trace, db = tmp_path / "t.jsonl", str(tmp_path / "s.duckdb")
    for last in (3, 4):  # (the same path, other content)
        trace.write_text("\n".join(json.dumps({**line, "timestamp": i, "hash_ids": [1, last + i]}) for i in range(3)))
        code, _, err = run(["replay", str(trace), "--mode", "cache-only", "--db", db], capsys)
        assert code == 0, err
    code, _, err = run(["diff", "r1", "r2", "--db", db], capsys)
    assert_one_line(code, err, "replay different traces", "changed between the runs", "--force")


def test_hits_moved_from_the_external_tier_to_the_gpu_are_not_called_worse():
    """The demo's shared-prefix-pinning pair: 9,216 prompt tokens the external tier served came
    from the GPU cache instead, the same prompts computed. diff called B worse on the tier's hits
    and on its transferred tokens (and its hit rate fell with its queries), and the notebook said
    B traded off against A, for a plain gain. The tier's figures have no direction: local_compute
    says whether prompts were lost to compute."""
    from kvtrace.compare.model import diff_summaries

    a = {"prefix_cache_queries": 462_513, "prefix_cache_hits": 32_384, "external_prefix_cache_queries": 430_129,
         "external_prefix_cache_hits": 350_976, "external_prefix_cache_hit_rate": 350_976 / 430_129,
         "prompt_tokens_by_source.local_cache_hit": 32_384,
         "prompt_tokens_by_source.external_kv_transfer": 350_976, "prompt_tokens_by_source.local_compute": 79_153}
    moved = 9_216
    b = {**a, "prefix_cache_hits": a["prefix_cache_hits"] + moved,
         "external_prefix_cache_queries": a["external_prefix_cache_queries"] - moved,
         "external_prefix_cache_hits": a["external_prefix_cache_hits"] - moved,
         "external_prefix_cache_hit_rate": (350_976 - moved) / (430_129 - moved),
         "prompt_tokens_by_source.local_cache_hit": 32_384 + moved,
         "prompt_tokens_by_source.external_kv_transfer": 350_976 - moved}
    verdicts = {m.name: m.verdict for m in diff_summaries(a, b).metrics}
    assert verdicts["prefix_cache_hits"] == verdicts["prompt_tokens_by_source.local_cache_hit"] == "better"
    assert verdicts["prompt_tokens_by_source.local_compute"] == "same"
    assert "worse" not in verdicts.values(), {k: v for k, v in verdicts.items() if v == "worse"}


def test_runs_that_record_no_trace_name_are_refused_by_their_digests_not_for_flags(tmp_path):
    """Two collected runs of other traces that kept their digests but not their traces' names
    were refused as "replay different traces (None, read differently (another --limit,
    --trace-block-size or --format) ...)": flags a collector never saw. A run kind is named as
    views name it."""
    from kvtrace.compare.source import diff_runs
    from kvtrace.errors import KVTraceError
    from kvtrace.names import run_kind
    from kvtrace.store.writer import Store

    db = tmp_path / "collected.duckdb"
    with Store.open(db) as store:
        for run_id, digest in (("c1", "a" * 64), ("c2", "b" * 64)):
            store.create_run(f"otlp {run_id}", run_id=run_id, mode="otlp", trace_digest=digest)
            store.finish_run(run_id, summary={"requests": 1, "prefix_cache_queries": 10, "prefix_cache_hits": 5})
    with pytest.raises(KVTraceError) as err:
        diff_runs(str(db), "c1", "c2")
    text = str(err.value)
    assert f"('trace digest {'a' * 16}' vs 'trace digest {'b' * 16}')" in text and "--limit" not in text
    assert text.endswith("pass --force to compare anyway")
    assert [run_kind(m) for m in ("otlp", "live", "cache-only/lru", "engine", "nope", None)] == [
        "collected", "live capture", "cache-only", "engine", "?", "?"]


def test_the_evictions_table_writes_its_counts_as_the_summary_table_does():
    """The evictions table wrote 302969 below a summary table's 302,969 (terminal and Markdown)."""
    from kvtrace.compare.model import CountShift, MetricDelta, RunDiff
    from kvtrace.compare.render import to_markdown, to_text

    diff = RunDiff({"run_id": "r1"}, {"run_id": "r2"}, [MetricDelta("evictions", 302_969, 301_000, -1_969, None)])
    diff.evictions_by_reason = [CountShift("lru", 302_969, 301_000)]
    text, markdown = " ".join(to_text(diff, width=200).split()), to_markdown(diff)
    assert "│ lru │ 302,969 │ 301,000 │ -1,969 │" in text
    assert "| reason | lru | 302,969 | 301,000 | -1,969 |" in markdown and "302969" not in markdown + text
