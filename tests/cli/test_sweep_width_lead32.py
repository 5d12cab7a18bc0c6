"""``kvtrace sweep``'s table on a terminal: at 80 columns its 8 columns folded "(baseline)"
and every header mid-word. Now the parameters' columns always show, the metrics that fit
show whole (a cell folds at its spaces only), and a stderr line names those left out; a wide
terminal shows all of them, and piped output every column (found by the left32 probe)."""

from __future__ import annotations

import pytest

from tests.cli.test_runs_width_left32 import on_terminal, piped

ARGS = ["sweep", "gen:chat", "--limit", "20", "--param", "capacity_blocks=20,40", "--param", "retention=0,1024"]
METRICS = ("prefix_cache_hit_rate", "prefix_cache_hits", "evictions", "median_ttft_ms", "median_itl_ms",
           "divergent_outputs")


def _header(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith("┃"))
    return [h.strip() for h in line.strip("┃").split("┃")]


@pytest.mark.parametrize("columns", [80, 200])
def test_a_sweep_fits_the_terminal_and_names_what_it_leaves_out(columns):
    out, err = on_terminal(ARGS, columns)
    assert all(len(line) <= columns for line in out.splitlines()), out
    shown = _header(out)
    assert shown[:2] == ["capacity_blocks", "retention"]  # whole words: no header folded
    left_out = [m for m in METRICS if m not in shown]
    assert shown[2:] == [m for m in METRICS if m in shown]  # the metrics in their order, the first ones
    assert shown[2:] == list(METRICS[:len(shown) - 2])
    assert "(baseline)" in out and "(basel" not in out.replace("(baseline)", "")
    if left_out:
        assert f"columns left out to fit the terminal: {', '.join(left_out)}" in err
    else:
        assert "left out" not in err
    assert (columns == 80) == bool(left_out)


def test_a_piped_sweep_holds_every_column():
    assert all(m in piped(ARGS, 80) for m in METRICS)
