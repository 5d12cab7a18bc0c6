"""kvtrace study: each behaviour's generated workload, replayed with the behaviour on and off.

The three end-to-end tests assert the direction the reviews behind each behaviour describe (docs/cache_semantics.md).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from rich.console import Console

from kvtrace.compare import study as S
from kvtrace.compare.model import diff_summaries
from kvtrace.compare.render import to_markdown
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.numeric import percentile
from kvtrace.replay.run import RunSpec
from kvtrace.store import read
from tests.conftest import MOONCAKE

# --------------------------------------------------------------------- pure pieces


def test_study_trace_names_and_unknown_behaviour():
    assert S.study_trace("shared-prefix-pinning") == "gen:study-shared-prefix-pinning"
    with pytest.raises(KVTraceError, match="unknown behaviour 'pinning'"):
        S.run_study("pinning")


@pytest.mark.parametrize("sweep, expected", [
    ("capacity_blocks=64, 128,256", ("capacity_blocks", [64, 128, 256])),
    ({"retention": [0, 64]}, ("retention", ["0", "64"])),
    (None, None),
])
def test_parse_sweep(sweep, expected):
    assert S.parse_sweep(sweep) == expected


@pytest.mark.parametrize("sweep, match", [
    ("capacity_blocks", "NAME=V1,V2"),
    ("block_size=16", "unknown parameter 'block_size'; expected one of capacity_blocks, capacity_tokens, "
                      "external_capacity_blocks, retention$"),
    # (it named all nine of sweep's parameters, five of which a study does not sweep)
    ("capacity_blocks=200,,300", r"no empty value\) with NAME one of capacity_blocks, capacity_tokens, "
                                 "external_capacity_blocks, retention$"),
    ({"capacity_blocks": ["x"]}, "must be integers"),
    ({"capacity_blocks": [1], "retention": ["0"]}, "exactly one parameter"),
    ("capacity_blocks=96,96", "96 is given twice"),  # (the pair ran twice, all deltas 0)
    ("retention=none,None", r"--sweep: retention=none,None: None is given twice \(as none\)"),
])
def test_parse_sweep_errors(sweep, match):
    with pytest.raises(KVTraceError, match=match):
        S.parse_sweep(sweep)


def test_expectation_failures():
    on = {"prefix_cache_hit_rate": 0.8, "median_ttft_ms": 10.0, "p50_ttft_ms": 10.0, "prefix_cache_hits": 800,
          "stale_hashes": 0, "divergent_outputs": 0}
    off = {"prefix_cache_hit_rate": 0.5, "median_ttft_ms": 14.0, "p50_ttft_ms": 14.0, "prefix_cache_hits": 500,
           "stale_hashes": 3, "divergent_outputs": 0}
    for b in S.BEHAVIOURS:
        assert S.expectation_failures(b, on, off) == []
    # reversed: every expectation fails
    assert len(S.expectation_failures(S.TRANSIENT_CHECKPOINT_RETENTION, off, on)) == 2
    assert S.expectation_failures(S.EXTERNAL_HIT_RUNNING_COW, off, on) == [
        "behaviour on still has divergent outputs or stale hashes",
        "behaviour off shows neither divergent outputs nor stale hashes",
    ]
    # --no-content: neither is measured (null), which is no failure to find them and no TypeError
    unchecked = {**off, "stale_hashes": None, "divergent_outputs": None}
    assert S.expectation_failures(S.EXTERNAL_HIT_RUNNING_COW, {**on, **unchecked}, unchecked) == [
        "divergent outputs and stale hashes were not measured (a run without content checks)"]


def test_study_json_shape_without_and_with_sweep():
    on, off = {"prefix_cache_hit_rate": 0.8, "digest": "x"}, {"prefix_cache_hit_rate": 0.5, "digest": "y"}
    d = diff_summaries(off, on)
    res = S.StudyResult("shared-prefix-pinning", "gen:study-shared-prefix-pinning",
                        [S.StudyPoint(on=on, off=off, diff=d)])
    j = res.to_json()
    assert list(j) == ["behaviour", "trace", "on", "off", "diff", "expected_effect"]
    assert j["diff"]["metrics"]["prefix_cache_hit_rate"]["delta"] == pytest.approx(0.3)
    res.points.append(S.StudyPoint(on=on, off=off, diff=d, parameter="capacity_blocks", value=64))
    res.points[0].parameter, res.points[0].value = "capacity_blocks", 32
    j = res.to_json()
    assert j["sweep"]["parameter"] == "capacity_blocks"
    assert [p["value"] for p in j["sweep"]["points"]] == [32, 64]
    assert json.loads(json.dumps(j)) == j
    md = res.to_markdown()
    assert "| capacity_blocks | prefix_cache_hit_rate off | prefix_cache_hit_rate on |" in md
    assert "| 32 | 0.5000 | 0.8000 |" in md


def test_study_ends_with_its_verdict_in_every_format():
    """study printed the diff and never said whether the behaviour's expected effect showed
    (expectation_failures was read only by tests and the notebook)."""
    off = {"prefix_cache_hits": 10, "prefix_cache_hit_rate": 0.5}
    shown = {"prefix_cache_hits": 20, "prefix_cache_hit_rate": 0.8}
    not_shown = {"prefix_cache_hits": 10, "prefix_cache_hit_rate": 0.8}
    for on, ok in ((shown, True), (not_shown, False)):
        res = S.StudyResult(S.SHARED_PREFIX_PINNING, "t", [S.StudyPoint(on=on, off=off, diff=diff_summaries(off, on))])
        effect = res.to_json()["expected_effect"]
        assert effect["shown"] is ok and effect["unmet"] == S.expectation_failures(S.SHARED_PREFIX_PINNING, on, off)
        line = S.verdict_line(effect)
        assert line.startswith("Expected effect shown" if ok else "Expected effect NOT shown")
        assert ok or "prefix_cache_hits: expected off < on, got off=10 on=10" in line
        assert res.to_markdown().rstrip().endswith(f"**{line}**")
        console = Console(record=True, width=2000)
        res.print(console)
        assert console.export_text().rstrip().endswith(line)
    # --no-content runs measure no divergence or stale hash: no verdict, not a refutation
    unchecked = {"divergent_outputs": None, "stale_hashes": None}
    effect = S.expected_effect(S.EXTERNAL_HIT_RUNNING_COW, unchecked, unchecked)
    assert effect["shown"] is None and S.verdict_line(effect).startswith("Expected effect not measured")


# --------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    db = tmp_path_factory.mktemp("study") / "study.duckdb"
    return {b: S.run_study(b, db=db, seed=0) for b in S.BEHAVIOURS}, db


def test_transient_checkpoint_retention_off_lowers_hit_rate_raises_ttft(studies):
    res = studies[0][S.TRANSIENT_CHECKPOINT_RETENTION]
    assert res.expectation_failures() == []
    # a non-trivial effect (>5% relative)
    assert res.off["prefix_cache_hit_rate"] < 0.95 * res.on["prefix_cache_hit_rate"]
    assert res.off["p50_ttft_ms"] > res.on["p50_ttft_ms"]
    # Off, every mid-prompt checkpoint is published and takes an evicted block; on, those stay
    # request-local, and only prompt-end and junction checkpoints are published. (It read 0 on:
    # attribution compared seqs across span kinds, 6efd6bc.)
    by_kind = {s.key: s for s in res.diff.evictions_by_publish_kind}
    assert "checkpoint" in by_kind and by_kind["checkpoint"].a > by_kind["checkpoint"].b


def test_shared_prefix_pinning_off_re_prefills_the_system_prompt(studies):
    res = studies[0][S.SHARED_PREFIX_PINNING]
    assert res.expectation_failures() == []
    assert res.off["prefix_cache_hits"] < res.on["prefix_cache_hits"]
    assert res.diff.requests is not None and res.diff.requests.gained > res.diff.requests.lost


def test_external_hit_running_cow_off_diverges(studies):
    res = studies[0][S.EXTERNAL_HIT_RUNNING_COW]
    assert res.on["divergent_outputs"] == 0 and res.on["stale_hashes"] == 0
    assert res.off["divergent_outputs"] > 0 or res.off["stale_hashes"] > 0
    # The diff names the requests that diverged, read back from the verification spans.
    div = res.diff.divergent_requests
    assert div["b"] == []
    assert sum(n for _, n in div["a"]) == res.off["divergent_outputs"]
    if div["a"]:
        assert f"`{div['a'][0][0]}`" in to_markdown(res.diff)


def test_study_json_carries_full_summaries_and_store_diff(studies):
    res, db = studies
    r = res[S.SHARED_PREFIX_PINNING]
    j = json.loads(json.dumps(r.to_json()))
    assert j["behaviour"] == S.SHARED_PREFIX_PINNING and j["trace"] == "gen:study-shared-prefix-pinning"
    from kvtrace.store.schema import SUMMARY_FIELDS

    assert set(SUMMARY_FIELDS) <= set(j["on"]) and set(SUMMARY_FIELDS) <= set(j["off"])
    hits = j["diff"]["metrics"]["prefix_cache_hits"]
    assert hits["delta"] == j["on"]["prefix_cache_hits"] - j["off"]["prefix_cache_hits"]
    assert "latency" in j["diff"] and "requests" in j["diff"]  # read back through the store
    # The bootstrap's point estimates are kvtrace.numeric's percentiles of the stored
    # request spans (TTFT per request, every ITL gap), in ms.
    for side, run_id in (("a", r.first.run_off), ("b", r.first.run_on)):
        ttft = read.requests(db, run_id)["ttft_ns"].drop_nulls().to_numpy() / 1e6
        gaps = read.itl_gaps(db, run_id)["gap_ns"].drop_nulls().to_numpy() / 1e6
        assert j["diff"]["latency"]["p50_ttft_ms"][side] == pytest.approx(percentile(ttft, 50), rel=1e-12)
        assert j["diff"]["latency"]["p99_itl_ms"][side] == pytest.approx(percentile(gaps, 99), rel=1e-12)
    assert j["diff"]["run_b"]["behaviours"] is not None


def test_study_without_db_diffs_the_runs_kept_in_memory():
    """Summaries, per-request changes and latency CIs (``source.diff_results``); no evictions split."""
    res = S.run_study(S.SHARED_PREFIX_PINNING, seed=0, limit=30)
    assert res.diff.requests is not None and res.diff.requests.requests == 30 and res.diff.latency
    assert res.diff.evictions_by_reason == []
    assert res.diff.metric("prefix_cache_hits").delta == res.on["prefix_cache_hits"] - res.off["prefix_cache_hits"]


def test_study_is_deterministic():
    a = S.run_study(S.SHARED_PREFIX_PINNING, seed=1, limit=20).to_json()
    b = S.run_study(S.SHARED_PREFIX_PINNING, seed=1, limit=20).to_json()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_capacity_sweep_runs_one_pair_per_value():
    res = S.run_study(S.SHARED_PREFIX_PINNING, seed=0, limit=30, sweep="capacity_blocks=64,256")
    assert [(p.parameter, p.value) for p in res.points] == [("capacity_blocks", 64), ("capacity_blocks", 256)]
    assert res.points[0].on != res.points[1].on  # the capacity changes the run



def test_a_studys_store_diff_and_sweep_table_take_its_percentiles(tmp_path):
    """--percentiles 90,95: the store diff's latency rows were at 50,90,99 (what `kvtrace
    diff --percentiles 90,95` of the same runs does not show), and the swept table asked for
    p50_ttft_ms, in neither run: an error after every replay."""
    base = RunSpec(trace="", **S.study_defaults(S.SHARED_PREFIX_PINNING), percentiles=(90.0, 95.0))
    res = S.run_study(S.SHARED_PREFIX_PINNING, db=tmp_path / "p.duckdb", limit=20, base=base)
    assert sorted(s.name for s in res.diff.latency) == ["p90_itl_ms", "p90_ttft_ms", "p95_itl_ms", "p95_ttft_ms"]
    swept = S.run_study(S.SHARED_PREFIX_PINNING, limit=10, base=base, sweep="capacity_blocks=2000,4000")
    headers = [c.header for c in swept.sweep_table().columns]
    assert "Δ prefix_cache_hit_rate" in headers and "Δ p50_ttft_ms" not in headers
    assert "Δ median_ttft_ms" in headers  # TTFT by its median, which every run carries


def test_a_studys_verdict_does_not_hang_on_which_percentiles_were_asked_for():
    """TTFT's expected rise is read from the median, which every summary with a clock carries:
    a study run with --percentiles 90,99 has no p50_ttft_ms, and its verdict said the effect
    did not show ("got off=None on=None") while median_ttft_ms, the same statistic, showed it."""
    on = {"prefix_cache_hit_rate": 0.8, "median_ttft_ms": 10.0, "p90_ttft_ms": 12.0}
    off = {"prefix_cache_hit_rate": 0.5, "median_ttft_ms": 14.0, "p90_ttft_ms": 16.0}
    assert S.expectation_failures(S.TRANSIENT_CHECKPOINT_RETENTION, on, off) == []
    assert S.expectation_failures(S.TRANSIENT_CHECKPOINT_RETENTION, off, on) == [
        "prefix_cache_hit_rate: expected off < on, got off=0.8 on=0.5",
        "median_ttft_ms: expected off > on, got off=10.0 on=14.0",
    ]
    # the swept table's TTFT column is there whatever the percentiles
    assert "median_ttft_ms" in S.SWEEP_TABLE_METRICS and "p50_ttft_ms" not in S.SWEEP_TABLE_METRICS


def test_a_config_file_that_switches_the_behaviour_off_is_refused(tmp_path):
    """Its cache.without adds to both runs': B ran with the behaviour off too (equal digests)
    while the diff said it was on."""
    toml = tmp_path / "off.toml"
    toml.write_text('[cache]\nwithout = ["shared-prefix-pinning"]\n')
    base = RunSpec(trace="", config_file=str(toml))
    with pytest.raises(ConfigError, match=r"off\.toml: cache\.without: switches shared-prefix-pinning off"):
        S.run_study(S.SHARED_PREFIX_PINNING, limit=5, base=base)
    # another behaviour switched off by the file stays off in both runs, as --without does
    toml.write_text('[cache]\nwithout = ["external-hit-running-cow"]\n')
    assert S.run_study(S.SHARED_PREFIX_PINNING, limit=5, base=base).points


# --------------------------------------------------------------------- demo


def test_demo_records_four_runs_and_ends_with_the_dashboard_command(tmp_path):
    import io

    from rich.console import Console

    from kvtrace.compare.demo import run_demo

    # a long path with markup in it, on a narrow console: the closing lines keep it whole and literal
    folder = tmp_path / "[bold]runs" / ("x" * 60)
    folder.mkdir(parents=True)
    db = folder / "kvtrace-demo.duckdb"
    db.write_bytes(b"")  # an earlier demo file is replaced, not appended to
    buf = io.StringIO()
    res = run_demo(db, progress=False, console=Console(file=buf, width=60, color_system=None), limit=25)
    runs = read.runs(db)
    assert runs.height == 4 and set(runs["status"]) == {"complete"}
    assert len(set(runs["trace_digest"])) == 1  # one trace, four configurations
    assert sorted(res.diffs) == sorted(S.BEHAVIOURS)
    for behaviour, d in res.diffs.items():
        assert d.run_a["name"] == f"demo: without {behaviour}" and d.run_b["name"] == "demo: all on"
    text = buf.getvalue()
    assert "prefix_cache_hit_rate" in text and "shared-prefix-pinning" in text
    # the note saying why a CI shows as [–, –] is printed, as kvtrace diff prints it
    flat = " ".join(text.split())
    for d in res.diffs.values():
        assert any(n.startswith("no 95% CI for") for n in d.notes)  # (25 requests: p99 has none)
        assert all(" ".join(n.split()) in flat for n in d.notes)
    last = text.rstrip().splitlines()
    assert last[-1] == f"kvtrace dashboard --db '{db}'"  # (shell-quoted: the brackets are a glob)
    assert last[-2] == f"4 runs recorded in {db}. Open the dashboard:"


def test_a_study_sweep_is_checked_whole_before_any_pair_runs(tmp_path):
    db = tmp_path / "st.duckdb"
    with pytest.raises(ConfigError, match=r"^--sweep: capacity_blocks=0: "):
        S.run_study("external-hit-running-cow", sweep="capacity_blocks=20,0", db=db)
    assert not db.exists() or read.runs(db).height == 0  # (the 20 pair had been recorded)


def test_a_swept_study_without_content_shows_unmeasured_deltas_as_not_measured():
    """`study --sweep ... --no-content` printed the study, then failed (exit 2) on the sweep
    table's stale_hashes, which no-content runs do not measure."""
    from rich.console import Console

    base = RunSpec(trace="", **S.study_defaults("external-hit-running-cow"), content=False)
    res = S.run_study("external-hit-running-cow", base=base, sweep="external_capacity_blocks=64,4096", limit=6)
    console = Console(record=True, width=200)
    console.print(res.sweep_table(("prefix_cache_hit_rate", "stale_hashes")))
    rows = [line for line in console.export_text().splitlines() if line.strip().startswith(("│ 64", "│ 4096"))]
    assert len(rows) == 2 and all(row.rstrip(" │").endswith("–") for row in rows)


def test_a_backend_that_refuses_the_workloads_capacity_studies_a_sweep_of_its_own(capsys, vllm_api):
    """With vLLM's manager, a swept capacity_blocks was refused by blaming the workload's own
    --capacity-blocks 1024,16 (two groups' capacities, which vLLM's pool cannot take), which
    the sweep replaces."""
    from tests.cli.support import run

    code, out, err = run(["study", "transient-checkpoint-retention", "--backend", "vllm", "--limit", "4",
                          "--sweep", "capacity_blocks=200,400", "--json"], capsys)
    assert code == 0, err
    assert [p["value"] for p in json.loads(out)["sweep"]["points"]] == [200, 400]


def test_a_sweep_given_twice_is_refused(capsys):
    """A second --sweep replaced the first without a word (typer keeps the last option)."""
    from tests.cli.support import assert_one_line, run

    code, _, err = run(["study", "shared-prefix-pinning", "--limit", "3", "--sweep", "capacity_blocks=40",
                        "--sweep", "capacity_tokens=20480"], capsys)
    assert_one_line(code, err, "--sweep", "given more than once")


def test_a_capacity_tokens_sweep_replaces_the_studys_capacity_blocks():
    res = S.run_study("external-hit-running-cow", sweep="capacity_tokens=400000,800000", limit=4)
    assert [p.value for p in res.points] == [400_000, 800_000]


@pytest.mark.parametrize(("flags", "sweep", "needle"), [
    (["--capacity-blocks", "5000"], "capacity_blocks=300,600", "capacity_blocks = 5000"),
    (["--capacity-tokens", "9000"], "capacity_blocks=300,600", "capacity_tokens = 9000"),
    (["--retention", "0"], "retention=none,0", "retention = '0'"),
])
def test_a_setting_both_swept_and_given_for_the_study_is_refused(capsys, flags, sweep, needle):
    """As sweep refuses it: the study replayed the swept values and dropped the flag, exit 0."""
    from tests.cli.support import assert_one_line, run

    code, _, err = run(["study", "shared-prefix-pinning", *flags, "--sweep", sweep], capsys)
    assert_one_line(code, err, "--sweep", needle, "give it one way")


def test_the_markdown_heading_shows_the_trace_path_literally(tmp_path):
    name = tmp_path / "we\nird`|x\x1b[31m.jsonl"
    name.write_text("".join(MOONCAKE.read_text().splitlines(keepends=True)[:5]))
    md = S.run_study("shared-prefix-pinning", trace=str(name), limit=5).to_markdown()
    heading = md.splitlines()[0]
    assert heading.startswith("## kvtrace study `shared-prefix-pinning` on ``")
    assert "\x1b" not in md and "we\\nird" in heading  # (one line; the ESC and newline shown escaped)


def test_demo_refuses_to_overwrite_a_store_with_other_runs(tmp_path):
    from kvtrace.compare.demo import run_demo
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "mine.duckdb"
    run_replay(RunSpec(trace="gen:chat", limit=3, name="my precious run"), db=db)
    with pytest.raises(KVTraceError, match=r"not the demo's .*'my precious run'"):
        run_demo(db, progress=False, limit=3)
    (tmp_path / "junk.duckdb").write_bytes(b"not a database at all")
    with pytest.raises(KVTraceError, match="is not a kvtrace demo store"):
        run_demo(tmp_path / "junk.duckdb", progress=False, limit=3)


def test_a_refused_sweep_value_is_named_at_sweep():
    """`--sweep capacity_blocks=0,100` was refused as `--capacity-blocks: 0`, a flag the user
    never typed."""
    from kvtrace.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--sweep: capacity_blocks=0: expected an int >= 2"):
        S.run_study(S.SHARED_PREFIX_PINNING, limit=3, sweep="capacity_blocks=0,100")


def test_a_dense_preset_is_named_not_the_studys_own_retention(capsys):
    """The study workloads run at retention 0, which a preset without a sliding-window or
    Mamba group cannot take: the refusal named --retention, a flag the user never gave."""
    from tests.cli.support import run

    code, _, err = run(["study", "shared-prefix-pinning", "--preset", "dense-attention"], capsys)
    assert code == 2 and err.startswith("kvtrace: error: --preset: dense-attention: study shared-prefix-pinning "
                                        "replays its workload at --retention 0"), err
    assert "kimi-hybrid" in err and len(err.strip().splitlines()) == 1


def test_a_dense_preset_is_named_not_the_studys_own_capacities(capsys):
    """transient-checkpoint-retention's workload runs on two groups' pools (1024, 16): on a
    one-group preset the refusal named --capacity-blocks, a flag the user never gave."""
    from tests.cli.support import assert_one_line, run

    code, _, err = run(["study", "transient-checkpoint-retention", "--preset", "dense-attention"], capsys)
    line = assert_one_line(code, err, "kvtrace: error: --preset: dense-attention: study transient-checkpoint-retention "
                                      "replays its workload at --capacity-blocks 1024,16", "kimi-hybrid")
    assert "give --capacity-blocks" in line


def test_the_vllm_backend_is_named_not_the_studys_own_capacities(vllm_api, capsys):
    """vLLM keeps one pool for every group, so transient-checkpoint-retention's two-pool
    workload cannot run on --backend vllm: the refusal named --capacity-blocks (1024, 16),
    the study's own default, as if the user had given it."""
    from tests.cli.support import assert_one_line, run

    code, _, err = run(["study", "transient-checkpoint-retention", "--backend", "vllm"], capsys)
    line = assert_one_line(code, err, "kvtrace: error: --backend: vllm: study transient-checkpoint-retention "
                                      "replays its workload at --capacity-blocks 1024,16, which --backend vllm")
    assert "give --capacity-blocks a value it takes" in line


def test_a_study_of_no_requests_is_refused(capsys):
    """`study --limit 0` replayed two empty runs and printed a table of +0 deltas: "the
    behaviour changes nothing", a verdict on nothing."""
    from kvtrace.errors import ConfigError
    from tests.cli.support import assert_one_line, run

    with pytest.raises(ConfigError, match=r"^--limit: 0: a study of no requests compares nothing"):
        S.run_study(S.SHARED_PREFIX_PINNING, limit=0)
    code, out, err = run(["study", "shared-prefix-pinning", "--limit", "0", "--json"], capsys)
    assert_one_line(code, err, "--limit: 0: expected a number of requests >= 1")  # (the CLI's, for every command)
    assert out == ""


def test_a_swept_studys_tables_write_each_number_as_the_diff_does():
    """The delta table wrote a hits delta of 172,032 as +1.72e+05 (and -23.893 ms as -23.89),
    the Markdown sweep table 172032 and 40.79 where the diff beside them says 172,032 and
    40.786: one number, written two ways."""
    from kvtrace.compare.render import fmt

    off = {"prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, "median_ttft_ms": 64.679715, "divergent_outputs": 0}
    on = {"prefix_cache_hits": 172_032, "prefix_cache_hit_rate": 0.6233, "median_ttft_ms": 40.786285,
          "divergent_outputs": 0}
    diff = diff_summaries(off, on)
    point = S.StudyPoint(on=on, off=off, diff=diff, parameter="capacity_blocks", value=2048)
    res = S.StudyResult("shared-prefix-pinning", "gen:study-shared-prefix-pinning", points=[point])
    console = Console(record=True, width=200)
    console.print(res.sweep_table(("prefix_cache_hits", "median_ttft_ms", "prefix_cache_hit_rate")))
    (row,) = [line for line in console.export_text().splitlines() if line.strip().startswith("│ 2048")]
    cells = [c.strip() for c in row.strip(" │").split("│")]
    hits, ttft = diff.metric("prefix_cache_hits").delta, diff.metric("median_ttft_ms").delta
    assert cells == ["2048", fmt(hits, signed=True), fmt(ttft, signed=True), "+62.33 pp"] == \
        ["2048", "+172,032", "-23.893", "+62.33 pp"]
    markdown = res.sweep_markdown(("prefix_cache_hits", "median_ttft_ms"))
    assert markdown.splitlines()[-1] == "| 2048 | 0 | 172,032 | 64.680 | 40.786 |"


def test_a_swept_capacity_too_small_for_a_request_is_named_at_its_sweep_value():
    """The engine's 'cannot be scheduled' of a swept capacity named the pool's size and a
    --capacity-blocks the user never typed, not the --sweep value that made it."""
    base = RunSpec(trace="", **S.study_defaults("external-hit-running-cow"), content=False)
    with pytest.raises(KVTraceError, match=r"^--sweep capacity_blocks=2: engine: request \S+ .* cannot be scheduled"
                                           r".*; raise the capacity_blocks values of --sweep; the study stopped at "
                                           r"capacity_blocks=2, 0 of 1 values' pairs done$") as err:
        S.run_study("external-hit-running-cow", base=base, sweep="capacity_blocks=2", limit=2)
    assert "--capacity-blocks" not in str(err.value)  # (advice the study's own sweep replaces)


def test_a_studys_name_names_its_runs(tmp_path):
    """`study --name NAME` was dropped: its runs were called 'study BEHAVIOUR on/off' as any
    other study's (a sweep's runs take the name as their prefix)."""
    db = tmp_path / "s.duckdb"
    base = RunSpec(trace="", **S.study_defaults("external-hit-running-cow"), content=False, name="nightly")
    res = S.run_study("external-hit-running-cow", base=base, limit=2, db=db)
    names = dict(read.runs(db).select("run_id", "name").iter_rows())
    assert (names[res.first.run_off], names[res.first.run_on]) == ("nightly external-hit-running-cow off",
                                                                   "nightly external-hit-running-cow on")
    unnamed = S.run_study("external-hit-running-cow", base=replace(base, name=None), limit=2)
    assert unnamed.diff.run_b["name"] == "study external-hit-running-cow on"


def test_a_trace_of_no_requests_is_refused_before_any_replay(tmp_path, capsys):
    """A trace of a header alone replayed two empty runs, and the study said the behaviour's
    expected effect was NOT shown: a refutation from nothing, which --limit 0 is refused for."""
    from tests.cli.support import assert_one_line, run

    trace, db = tmp_path / "header.jsonl", tmp_path / "s.duckdb"
    trace.write_text('{"kvtrace_trace": 1}\n')
    with pytest.raises(KVTraceError, match=r": holds no request \(a header or blank lines only\?\)$"):
        S.run_study("external-hit-running-cow", trace=str(trace), db=db)
    assert not db.exists()
    code, out, err = run(["study", "external-hit-running-cow", "--trace", str(trace)], capsys)
    assert_one_line(code, err, f"{trace}: holds no request")
    assert out == ""
