"""Fixes the lead made from the twenty-sixth session's re-probe of the engine's fixes (each
named in its test)."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from kvtrace.engine.clock import CostModel
from kvtrace.engine.engine import Engine
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.workload.request import TraceRequest

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "tests" / "data" / "calibration" / "aic-h200-llama-3.1-8b-tp1.csv"


def _one() -> list[TraceRequest]:
    return [TraceRequest("a", 0, 3, 2, token_ids=np.arange(1, 4, dtype=np.int64))]


def test_the_engine_refuses_a_cost_model_whose_steps_take_no_time():
    """--config refused a model of 0-ns steps; Engine(cost_model=...) ran it, its duration 0 s
    beside 2e9 output tokens/s (re-probe C)."""
    with pytest.raises(ConfigError, match=r"^engine: cost_model: z: step_overhead_ns and token_ns are both 0"):
        Engine("dense-attention", cost_model=CostModel("z", 0, 0, 0, 0, 0))
    with pytest.raises(KVTraceError, match=r"^engine: cost_model 'h200'; expected a CostModel"):
        Engine("dense-attention", cost_model="h200")  # type: ignore[arg-type]
    Engine("dense-attention", cost_model=CostModel("t", 0, 1, 0, 0, 0)).run(_one())  # (a token costs: taken)


@pytest.mark.parametrize("percentiles", [None, 50])
def test_the_engine_refuses_percentiles_it_cannot_take_in_one_line(percentiles):
    """None and 50 were tuple()'s TypeError (re-probe C)."""
    with pytest.raises(ConfigError, match=r"^engine: percentiles: "):
        Engine("dense-attention", percentiles=percentiles)


def test_a_fraction_percentile_is_the_number_it_is():
    """A Fraction passed the checks and was numpy's TypeError after the whole run (re-probe C)."""
    as_fraction = Engine("dense-attention", percentiles=(Fraction(1, 2),)).run(_one()).summary
    as_float = Engine("dense-attention", percentiles=(0.5,)).run(_one()).summary
    assert as_fraction == as_float


def test_token_ids_holding_a_bool_are_refused_as_a_reader_refuses_true():
    """numpy made [1, True, 3] ints: True ran as token 1 (re-probe C)."""
    with pytest.raises(KVTraceError, match=r"^workload: request 'a' has token_ids that are not token ids"):
        Engine("dense-attention").run([TraceRequest("a", 0, 3, 2, token_ids=[1, True, 3])])


def test_a_numpy_seed_is_told_it_is_no_python_int():
    """RunSpec(seed=np.int64(3)) said "3: expected a whole number" (re-probe C)."""
    from kvtrace.replay.run import RunSpec, run_replay

    with pytest.raises(ConfigError, match=r"^--seed: 3: expected a Python int, not numpy\.int64"):
        run_replay(RunSpec("gen:mixed", mode="cache-only", seed=np.int64(3), limit=5))


def test_calibrate_to_dev_stdout_appended_to_a_file_appends(tmp_path):
    """`calibrate -o /dev/stdout >> log` refused: "exists and is no cost-model TOML, which the
    model would replace whole", where it only appends through the descriptor (re-probe C)."""
    log = tmp_path / "log"
    log.write_text("x\n")
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, "-m", "kvtrace.cli", "calibrate", "--from", str(CALIBRATION), "-o",
                               "/dev/stdout"], stdout=out, stderr=subprocess.PIPE, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert text.startswith("x\n[cost_model]\n") and "token_ns = " in text


def test_calibrate_refuses_to_replace_a_run_config_under_dev(tmp_path, capsys):
    """`-o /dev/shm/x/run.toml` was taken for a stream by its name: the run config's preset and
    [cache] were replaced by the model, "not a file" (re-probe G). What the path is decides."""
    import shutil
    import uuid

    from tests.cli.support import run

    shm = Path("/dev/shm")
    assert shm.is_dir()  # (Linux: a tmpfs every machine here has)
    folder = shm / f"kvtrace-test-{uuid.uuid4().hex}"
    folder.mkdir()
    try:
        config = folder / "run.toml"
        config.write_text('preset = "kimi-hybrid"\n[cache]\nblock_size = 32\n')
        code, _, err = run(["calibrate", "--from", str(CALIBRATION), "-o", str(config)], capsys)
        assert code == 2 and "a --config file with settings besides [cost_model]" in err
        assert config.read_text().startswith('preset = "kimi-hybrid"')
    finally:
        shutil.rmtree(folder)


def _calibrate_redirected(tmp_path, out: str, stdin=None, stdout=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", "calibrate", "--from", str(CALIBRATION), "-o", out],
                          stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, text=True, check=False, cwd=tmp_path)


RUN_CONFIG = 'preset = "kimi-hybrid"\n[cache]\nblock_size = 32\n'


def test_calibrate_refuses_a_run_config_named_while_stdout_or_stdin_is_it(tmp_path):
    """`-o run.toml >> run.toml` and `-o /dev/stdin < run.toml` replaced the run config whole,
    exit 0 (re-probe H): a file is a file, whatever descriptor is open on it."""
    config = tmp_path / "run.toml"
    config.write_text(RUN_CONFIG)
    with open(config, "a") as out:
        done = _calibrate_redirected(tmp_path, str(config), stdout=out)
    assert done.returncode == 2 and "settings besides [cost_model]" in done.stderr
    assert config.read_text() == RUN_CONFIG
    with open(config) as into:
        done = _calibrate_redirected(tmp_path, "/dev/stdin", stdin=into)
    assert done.returncode == 2 and config.read_text() == RUN_CONFIG
