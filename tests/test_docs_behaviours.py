"""The README's Behaviours table: what switching a behaviour off shows, replayed as it says."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from kvtrace.replay.run import RunSpec, run_replay

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def _row(switch: str) -> str:
    rows = [line for line in README.splitlines() if line.startswith(f"| `{switch}` | vLLM review")]
    assert len(rows) == 1, switch
    return rows[0]


def test_transient_checkpoints_published_read_the_wrong_state_where_the_row_says(tmp_path):
    """The row said `gen:agent` at 60 blocks gives 44 divergent outputs: since vLLM's admission
    gate (on by default) it preempts less there and shows none; with the gate off it does."""
    said = re.search(r"\(`(gen:\w+)` at (\d+) blocks with vLLM's admission gate off, `\[scheduler\] "
                     r"(scheduler_reserve_full_isl = false)`: (\d+) divergent outputs; with the gate on, the default, "
                     r"it preempts less there and shows none\)", _row("transient-checkpoint-retention"))
    assert said is not None
    trace, blocks, setting, divergent = said.group(1), int(said.group(2)), said.group(3), int(said.group(4))
    config = tmp_path / "gate-off.toml"
    config.write_text(f"[scheduler]\n{setting}\n")
    spec = RunSpec(trace, capacity_blocks=blocks, without=("transient-checkpoint-retention",))
    gate_on = run_replay(spec).summary
    gate_off = run_replay(replace(spec, config_file=str(config))).summary
    assert gate_off["divergent_outputs"] == divergent > 0
    assert gate_on["divergent_outputs"] == 0 and gate_on["preemptions"] < gate_off["preemptions"]
