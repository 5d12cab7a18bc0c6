"""The README's examples work as written, from a fresh clone.

The notebooks' papermill commands name parameters the notebooks take, in combinations they
accept, into a folder the commands create; the Storage section names the schema versions a
store is refused for; `make bench` runs what the Benchmarks section says; the isolated A/B is
what `kvtrace study shared-prefix-pinning --markdown` prints.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}") + 1
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else len(README)]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _parameters(notebook: Path) -> set[str]:
    """The names the notebook's papermill parameters cell (its py:percent pair) assigns."""
    source = notebook.with_suffix(".py").read_text(encoding="utf-8")
    cell = source.split('# %% tags=["parameters"]\n', 1)[1].split("\n# %%", 1)[0]
    return set(re.findall(r"^(\w+) =", cell, flags=re.M))


def _papermill_commands() -> list[tuple[list[str], set[str]]]:
    """(argv, folders made by an earlier `mkdir -p`) of each papermill command of the Notebooks section."""
    out = []
    made: set[str] = set()
    for block in _bash_blocks(_section("Notebooks")):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:2] == ["mkdir", "-p"]:
                made.update(argv[2:])
            elif argv and argv[0].endswith("papermill"):
                out.append((argv, set(made)))
    return out


def test_each_papermill_command_runs_a_notebook_with_its_own_parameters_into_a_made_folder():
    commands = _papermill_commands()
    assert len(commands) >= 3  # two runs compared, a study, a trace
    for argv, made in commands:
        notebook, output = (ROOT / argv[3]), argv[4]
        assert notebook.exists(), argv
        assert str(Path(output).parent) in made, f"{output}: papermill does not create its folder"
        given = {argv[i + 1] for i, a in enumerate(argv) if a == "-p"}
        assert given <= _parameters(notebook), (argv, given - _parameters(notebook))


def test_the_regression_notebook_is_given_a_store_and_both_runs_or_none_of_them():
    """The notebook's rule (a study into a temporary store otherwise): `-p db_path` beside
    `-p behaviour` alone is refused, as the README's first version of this command was."""
    runs = {"db_path", "run_a", "run_b"}
    for argv, _made in _papermill_commands():
        if "regression_analysis" not in argv[3]:
            continue
        given = {argv[i + 1] for i, a in enumerate(argv) if a == "-p"}
        assert given & runs in (set(), runs), argv


def test_the_run_ids_the_notebook_example_names_are_the_demos():
    """`-p run_a r3 -p run_b r1`: the demo stores its runs in its specs' order, r1 the first."""
    from kvtrace.compare.demo import demo_specs

    names = [spec.name.removeprefix("demo: ") for spec in demo_specs()]
    for argv, _made in _papermill_commands():
        given = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-p"}
        if "run_a" not in given:
            continue
        comment = next(line for line in _section("Notebooks").splitlines() if "the demo's" in line)
        a, b = (int(given[k].removeprefix("r")) - 1 for k in ("run_a", "run_b"))
        assert f"the demo's r{a + 1} ({names[a]})" in comment and f"r{b + 1} ({names[b]})" in comment, comment


def test_the_storage_section_names_the_schema_versions_refused_for_appending():
    from kvtrace.store.schema import SCHEMA_VERSION

    section = " ".join(_section("Storage").split())  # (lines wrap anywhere)
    older = "1" if SCHEMA_VERSION == 2 else f"1 to {SCHEMA_VERSION - 1}"
    assert f"(schema version {older}; this kvtrace writes {SCHEMA_VERSION}:" in section
    assert "is refused for appending" in section


def test_make_bench_runs_what_the_benchmarks_section_says():
    """Each script in bench/ is run by `make bench` (bench/run_all.py) or named as run by hand."""
    import runpy

    order = runpy.run_path(str(ROOT / "bench" / "run_all.py"))["ORDER"]
    section = _section("Benchmarks")
    said = section[:section.index("| what (issue)")]
    clauses = [c for c in re.split(r"[;.]\s", said) if "by hand" in c]
    by_hand = {name for c in clauses for name in re.findall(r"`bench/(\w+)\.py`", c)}
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"run_all"}
    assert scripts - set(order) == by_hand, (sorted(scripts - set(order)), sorted(by_hand))
    assert not by_hand & set(order)


@pytest.mark.timeout(120)
def test_the_isolated_ab_is_what_study_prints(tmp_path):
    """The README's `kvtrace study shared-prefix-pinning --markdown` section, up to the folded metrics."""
    from typer.testing import CliRunner

    from kvtrace.cli import app

    title = "## An isolated A/B: `kvtrace study shared-prefix-pinning --markdown`\n"
    start = README.index(title) + len(title)
    shown = README[start:README.index("\n## Study your own vLLM patch", start)]  # (the output has ## headings)
    before_fold, after_fold = shown.split("\n(`--markdown` folds the other summary metrics", 1)
    count = re.match(r", (\d+) here", after_fold)
    assert count is not None, after_fold[:80]
    folded = int(count.group(1))

    result = CliRunner().invoke(app, ["study", "shared-prefix-pinning", "--markdown"])
    assert result.exit_code == 0, result.output
    printed = result.stdout
    head = printed[:printed.index("<details>")]
    assert head.strip() == before_fold.strip()
    assert f"<summary>{folded} more metrics</summary>" in printed
    verdict = printed.strip().splitlines()[-1]
    assert verdict in after_fold


def test_the_benchmark_tables_commands_take_the_flags_shown():
    """`bench/engine_replay.py --no-profile --no-content`: each script exists and declares each flag."""
    rows = [line for line in _section("Benchmarks").splitlines() if line.startswith("| ") and "`bench/" in line]
    seen = 0
    for row in rows:
        for script, flags in re.findall(r"`bench/([\w.]+)((?: --[a-z-]+(?: \d+)?)*)`", row):
            path = ROOT / "bench" / script
            assert path.exists(), script
            source = path.read_text(encoding="utf-8")
            for flag in re.findall(r"--[a-z-]+", flags):
                assert f'"{flag}"' in source, (script, flag)
                seen += 1
    assert seen >= 5


def test_the_engine_benchmark_row_names_the_pool_the_script_replays_at():
    """The row said the admission gate changes nothing 'at 16,384 blocks' (the Dynamo comparison's
    pool): bench/engine_replay.py replays at its preset's own pool, kimi-hybrid's 10,240."""
    from kvtrace.engine.presets import PRESETS

    row = next(line for line in _section("Benchmarks").splitlines() if "`bench/engine_replay.py --no-profile`" in line)
    said = re.search(r"changes nothing on this trace at the preset's ([\d,]+) blocks", row)
    assert said is not None, row
    source = (ROOT / "bench" / "engine_replay.py").read_text(encoding="utf-8")
    preset = re.search(r'"--preset", default="([a-z0-9-]+)"', source)
    assert preset is not None and f"`{preset.group(1)}`" in row
    assert int(said.group(1).replace(",", "")) == PRESETS[preset.group(1)]().cache_config.num_gpu_blocks
