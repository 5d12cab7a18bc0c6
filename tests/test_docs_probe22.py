"""What the docs probe (session 22) found: --help that did not say an option's range or
meant another command's, and a notebook error that named a CLI flag the notebook has not."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import typer.main

from kvtrace.cli.commands import app
from tests.notebooks.conftest import kernel_name, run_notebook  # noqa: F401  (the notebook fixtures)


def _option_help(command: str, flag: str) -> str:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    (param,) = [p for p in cmd.params if flag in getattr(p, "opts", ())]
    return " ".join((param.help or "").split())


@pytest.mark.parametrize("flag, least", [("--block-size", 1), ("--capacity-tokens", 1), ("--external-blocks", 1),
                                         ("--limit", 1), ("--capacity-blocks", 2)])
@pytest.mark.parametrize("command", ["replay", "sweep", "study"])
def test_a_run_settings_help_says_the_least_value_the_replay_takes(command, flag, least):
    """--block-size, --capacity-tokens, --external-blocks, --limit and --capacity-blocks said no
    range in --help, where the replay refuses anything below it ("expected >= 1")."""
    from kvtrace.cli.options import run_spec
    from kvtrace.errors import KVTraceError
    from kvtrace.replay.run import validate

    said = _option_help(command, flag)
    assert re.search(rf"(at least|>=) {least}\b", said), said
    key = {"--external-blocks": "external_blocks"}.get(flag, flag[2:].replace("-", "_"))
    value: object = str(least - 1) if flag == "--capacity-blocks" else least - 1
    with pytest.raises(KVTraceError, match=re.escape(flag)):  # the code refuses what the help rules out
        validate(run_spec("gen:chat", {key: value}))


def test_percentiles_help_says_their_range():
    for command in ("replay", "diff"):
        assert "each 0 to 100" in _option_help(command, "--percentiles")


def test_retention_help_says_which_values_and_that_it_is_engine_modes():
    said = _option_help("replay", "--retention")
    assert "engine mode" in said and "multiple of the block size" in said, said


def test_generates_seed_is_the_workloads_with_its_range():
    """generate's --seed said "Seed for generated workloads and span ids": generate makes no span."""
    said = _option_help("generate", "--seed")
    assert "span" not in said and "0 to 2^64-1" in said, said


def test_runs_of_different_traces_name_the_notebooks_force_parameter(run_notebook, tmp_path):  # noqa: F811
    """regression_analysis on two runs of different traces said "pass --force": a notebook has no
    flags, its switch is the parameter force."""
    from papermill.exceptions import PapermillExecutionError

    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "two.duckdb"
    for limit in (3, 4):  # one workload read to two lengths: two traces to a diff
        run_replay(RunSpec("gen:chat", mode="cache-only", limit=limit), db=db)
    with pytest.raises(PapermillExecutionError) as raised:
        run_notebook("regression_analysis", db_path=str(db), run_a="r1", run_b="r2")
    said = raised.value.evalue  # (the message: the traceback quotes the cell's code)
    assert "set force = True" in said and "--force" not in said, said
    result, _ = run_notebook("regression_analysis", db_path=str(db), run_a="r1", run_b="r2", force=True)
    assert result["db_path"] == str(db)


ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _readme_rows(command: str) -> str:
    (row,) = [line for line in README.splitlines() if line.startswith(f"| `kvtrace {command} ")]
    return row


@pytest.mark.parametrize("command", ["sweep", "curve"])
def test_the_reference_does_not_offer_workers_and_ray_as_alternatives(command):
    """The rows said `[--workers N | --ray ADDRESS]`, where --workers beside --ray bounds the
    replays in flight on the cluster, as both commands' --help says."""
    assert "--workers N \\| --ray" not in _readme_rows(command)
    assert "with --ray" in _option_help(command, "--workers")


def test_the_mooncake_hit_rates_come_with_the_commands_that_print_them(tmp_path):
    """The paragraph under the Benchmarks table gave LRU 31.5%, Belady 56.0% and the unbounded
    65.1% / 64.0% without a command; each cache-only command now shown prints its commented figure."""
    import subprocess
    import sys

    paragraph = README[README.index("\nHit rates on the Mooncake synthetic trace"):]
    (block,) = re.findall(r"```bash\n(.*?)```", paragraph, flags=re.S)[:1]
    trace = re.search(r"^T=(\S+)$", block, flags=re.M)
    assert trace is not None and (ROOT / trace.group(1)).exists()
    checked = 0
    for line in block.splitlines():
        argv = shlex.split(line, comments=True)
        if argv[:2] != ["kvtrace", "replay"] or "cache-only" not in argv:
            continue  # (the engine-mode line takes half a minute: the bench row's budget holds it)
        argv = [trace.group(1) if a == "$T" else a for a in argv[1:]]
        out = subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                             check=False)
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout)
        figures = [float(f) for f in re.findall(r"\b0\.\d{4}\b", line.split("#", 1)[1])]
        keys = ["prefix_cache_hit_rate", "block_hit_rate"][:len(figures)]
        assert [round(summary[k], 4) for k in keys] == figures, (line, {k: summary[k] for k in keys})
        checked += 1
    assert checked == 3


@pytest.mark.parametrize("given, said", [
    ({"generator": "nope"}, "trace_characterisation: generator: unknown 'nope'"),
    ({"num_requests": 2_000_000}, "trace_characterisation: num_requests: 2000000: expected an int from 1 to 1,000,000"),
    ({"trace_block_size": 64}, "trace_characterisation: trace_block_size: 64: a generated trace carries its own block"),
    ({"trace_path": "NATIVE", "trace_block_size": 64},
     "trace_characterisation: trace_block_size: 64: a native trace carries its own block size"),
])
def test_the_characterisation_names_its_parameters_not_cli_flags(run_notebook, tmp_path, given, said):  # noqa: F811
    """generator 'nope' was "generate: workload: unknown", num_requests 2,000,000 "--requests: ...",
    and trace_block_size beside a native or generated trace "(--trace-block-size)": flags the
    notebook has not."""
    from papermill.exceptions import PapermillExecutionError

    if given.get("trace_path") == "NATIVE":
        from kvtrace.replay.generate import write_generated

        write_generated("chat", tmp_path / "chat.jsonl", fmt="native", seed=0, num_requests=3)
        given = {**given, "trace_path": str(tmp_path / "chat.jsonl")}
    with pytest.raises(PapermillExecutionError) as raised:
        run_notebook("trace_characterisation", **given)
    assert said in raised.value.evalue and "--" not in raised.value.evalue, raised.value.evalue


def test_every_summary_key_is_said_in_the_metrics_section():
    """`replay --json` prints output_tok_per_s, virtual_duration_s, oversized_requests,
    stale_hashes_left, evictions_by_reason, steps, ... which the README's Metrics section (where
    replay's row sends a reader for "and more") did not name."""
    from kvtrace.replay.run import RunSpec, run_replay

    start = README.index("\n## Metrics")
    section = README[start:README.index("\n## ", start + 1)]
    said = set(re.findall(r"`([a-z_.]+)`", section))
    latency = re.compile(r"(mean|median|std|p\d+)_(ttft|tpot|itl|e2el|queue)_ms")  # (named by their pattern there)
    for spec in (RunSpec("gen:chat", limit=3), RunSpec("gen:chat", limit=3, mode="cache-only", capacity_blocks=5)):
        summary = run_replay(spec).summary
        unsaid = sorted(k for k in summary if k not in said and not latency.fullmatch(k))
        assert not unsaid, (spec.mode, unsaid)


def test_trace_format_says_azures_one_namespace_and_its_prompt_bound(tmp_path):
    """docs/trace-format.md gave Azure request i ids (i << 24) + j "in a namespace of its own"
    (every Azure request shares one namespace: the ids set them apart) and no bound on
    ContextTokens, which the reader refuses past 2^24."""
    from kvtrace.replay.readers import open_trace
    from kvtrace.replay.readers.azure import MAX_CONTEXT_TOKENS

    doc = " ".join((ROOT / "docs" / "trace-format.md").read_text(encoding="utf-8").split())
    assert "in the one namespace kept for Azure traces" in doc
    bound = re.search(r"`ContextTokens` is from 1 to 2\^24 \(([\d,]+)", doc)
    assert bound is not None and int(bound.group(1).replace(",", "")) == MAX_CONTEXT_TOKENS == 2**24
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,40,4\n"
                   "2023-11-16 18:15:47.0000000,40,4\n")
    first, second = list(open_trace(str(csv)))
    assert first.namespace == second.namespace
    assert (first.hash_ids[0], second.hash_ids[0]) == (0, 1 << 24)


def _subcommand_help(path: list[str], flag: str) -> str:
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    (param,) = [p for p in cmd.params if flag in getattr(p, "opts", ())]
    return " ".join((param.help or "").split())


@pytest.mark.parametrize("path, flag, said, argv", [
    (["generate"], "--requests", "1 to 1,000,000", ["generate", "chat", "-o", "{tmp}/g.jsonl", "--requests", "0"]),
    (["convert"], "--limit", "at least 1", ["convert", "{mooncake}", "-o", "{tmp}/c.jsonl", "--limit", "0"]),
    (["calibrate"], "--knee", "0 to 2^31", ["calibrate", "--from", "{mooncake}", "--knee", "-1"]),
    (["calibrate"], "--max-num-batched-tokens", "1 to 2^31",
     ["calibrate", "--from", "{mooncake}", "--max-num-batched-tokens", "0"]),
    (["collect"], "--max-body-bytes", "1 to 2,147,483,648",
     ["collect", "--db", "{tmp}/c.duckdb", "--max-body-bytes", "0"]),
    (["capture", "vllm"], "--duration", "0 to a year",
     ["capture", "vllm", "--endpoint", "tcp://127.0.0.1:5557", "--db", "{tmp}/v.duckdb", "--duration", "-1"]),
    (["capture", "vllm"], "--dp-size", "1 to 1,024",
     ["capture", "vllm", "--endpoint", "tcp://127.0.0.1:5557", "--db", "{tmp}/v.duckdb", "--dp-size", "0"]),
    (["sweep"], "--workers", "at least 1",
     ["sweep", "gen:chat", "--mode", "cache-only", "--param", "capacity_blocks=10,20", "--workers", "0"]),
    (["curve"], "--workers", "at least 1", ["curve", "gen:chat", "--mode", "engine", "--workers", "0"]),
])
def test_more_options_say_their_range_and_the_code_refuses_past_it(tmp_path, capsys, path, flag, said, argv):
    """These said no range in --help (the docs probe's list), though each is checked."""
    from tests.cli.support import run
    from tests.conftest import MOONCAKE

    assert said in _subcommand_help(path, flag)
    code, _, err = run([a.format(tmp=tmp_path, mooncake=MOONCAKE) for a in argv], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and flag in err, err
