"""The README's table of presets is what kvtrace.engine.presets builds, cell by cell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtrace.cache import FullAttentionSpec, MambaSpec
from kvtrace.engine.presets import PRESETS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
HEADER = "| preset | groups | hash block | retention | partial hits | checkpoints | block pool (shared by the groups) |"


def _rows() -> dict[str, list[str]]:
    table = README[README.index(HEADER):]
    table = table[:table.index("\n\n")]
    return {m.group(1): [c.strip() for c in m.group(2).split("|")]
            for m in re.finditer(r"^\| `([a-z0-9-]+)` \|(.+)\|$", table, flags=re.M)}


def _groups(groups) -> str:
    def one(g):
        if isinstance(g, MambaSpec):
            return f"Mamba/KDA({g.block_size}, align, {g.num_lanes} lanes)"
        assert isinstance(g, FullAttentionSpec), g
        return f"FullAttention({g.block_size})"
    return " + ".join(one(g) for g in groups)


def _number(cell: str) -> int:
    """The number a cell starts with (`10,240: ~8,192 for attention ...` is 10240)."""
    m = re.match(r"[\d,]+", cell)
    assert m is not None, cell
    return int(m.group(0).replace(",", ""))


def test_the_table_names_every_preset():
    assert set(_rows()) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_row_is_the_presets_settings(name):
    groups, hash_block, retention, partial, checkpoints, pool, batch, cost = _rows()[name]
    p = PRESETS[name]()
    c, s = p.cache_config, p.scheduler_config
    assert groups == _groups(c.groups)
    assert int(hash_block) == c.hash_block_size
    assert retention.split(" ")[0] == str(c.retention_interval)
    assert partial == ("on" if c.enable_partial_hits else "off")
    assert _number(checkpoints) == c.num_prefill_checkpoint_blocks
    if c.num_prefill_checkpoint_blocks:
        assert f"alignment {c.prefill_checkpoint_alignment}" in checkpoints
    assert _number(pool) == c.num_gpu_blocks
    attention_tokens = (c.num_gpu_blocks - p.state_blocks) * c.groups[0].block_size
    said = re.search(r"~([\d.]+)([kM]) tokens", pool)
    assert said is not None, pool
    assert float(said.group(1)) * {"k": 1e3, "M": 1e6}[said.group(2)] == pytest.approx(attention_tokens, rel=0.05)
    if p.state_blocks:
        assert f"~{p.state_blocks:,} for states" in pool
    assert batch == f"{s.max_num_batched_tokens} / {s.max_num_seqs}"
    assert cost == f"`{p.cost_model.name}`"
