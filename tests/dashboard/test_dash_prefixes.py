"""The Evictions page's prefixes on a cache-only run, whose block keys are its trace's hash
ids (``0000000000000036``) rather than random 64-bit hashes."""

from __future__ import annotations

import polars as pl
import pytest
from apptest import render

from kvtrace.dashboard import ui


@pytest.fixture(scope="module")
def cache_only_run(tmp_path_factory) -> tuple[str, str]:
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path_factory.mktemp("cache_only") / "lru.duckdb")
    done = run_replay(RunSpec("gen:chat", limit=60, mode="cache-only", capacity_blocks=64, name="lru"), db=db)
    assert done.run_id is not None
    return db, done.run_id


def _attribution(db: str, run_id: str, monkeypatch) -> pl.DataFrame:
    at = render(db, monkeypatch, "evictions", run=run_id)
    return pl.from_pandas(at.dataframe[0].value)  # the first table: which publishes evicted which prefixes


def test_a_cache_only_runs_prefixes_are_told_apart_by_their_short_hash(cache_only_run, monkeypatch):
    top = _attribution(*cache_only_run, monkeypatch)
    shown = dict(zip(top["root_hash"], top["prefix"]))
    assert len(shown) >= 2, shown  # (several prefixes, or there is nothing to tell apart)
    assert all(h.startswith("00000000") for h in shown), shown  # the trace's hash ids, as stored
    short = {h: label.split(" · ")[0] for h, label in shown.items()}
    assert len(set(short.values())) == len(short), short  # every one read 00000000
    assert all(s in h for h, s in short.items()), short  # a reader finds it in the full root_hash


def test_short_hash_keeps_a_random_hashs_first_digits():
    assert ui.short_hash("d393a5d5680d4246") == "d393a5d5"
    assert ui.short_hash("0a3b4c5d6e7f8091") == "0a3b4c5d"
    assert ui.short_hash("0000000000000000") == "0"
    assert ui.short_hash(None) == "–"


def test_the_attribution_table_is_in_one_order_whatever_group_by_gave(cache_only_run, monkeypatch):
    top = _attribution(*cache_only_run, monkeypatch)
    keys = ["later_misses", "publish_request_id", "publish_kind", "root_hash"]
    ties = top.group_by("later_misses", "publish_request_id").len().filter(pl.col("len") > 1)
    assert ties.height, "no rows tied on misses and publishing request: nothing for the order to settle"
    ordered = top.sort(keys, descending=[True, False, False, False], nulls_last=True, maintain_order=True)
    assert top.select(keys).equals(ordered.select(keys))
