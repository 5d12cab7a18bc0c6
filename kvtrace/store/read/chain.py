"""Correctness: stale hashes and divergent outputs (over time and one by one), and the
stale-hash chain: the spans that explain how one hash came to name the wrong content."""

from __future__ import annotations

import polars as pl

from kvtrace.store.read._api import checked
from kvtrace.store.read._sql import DB, open_run, query, with_run
from kvtrace.store.schema import (
    FAMILIES,
    SPAN_COW,
    SPAN_DIVERGENT,
    SPAN_EVICT,
    SPAN_LOOKUP,
    SPAN_PUBLISH,
    SPAN_STALE_HASH,
    SPAN_STALE_LEFT,
    VIEW_SQL_TYPES,
    family_columns,
)


@checked
def stale_hashes_over_time(db: DB, run_id: str, window_ns: int | None = None) -> pl.DataFrame:
    """Per window: stale hashes found by the worker, stale entries left by the cache
    (behaviour off), and divergent outputs. Columns: window_start_ns, stale_found,
    stale_left, divergent_outputs."""
    return with_run(db, run_id, f"""
        SELECT start_ns // $w * $w AS window_start_ns,
               count(*) FILTER (WHERE name = '{SPAN_STALE_HASH}') AS stale_found,
               count(*) FILTER (WHERE name = '{SPAN_STALE_LEFT}') AS stale_left,
               count(*) FILTER (WHERE name = '{SPAN_DIVERGENT}') AS divergent_outputs
        FROM spans WHERE run_id = $run_id
          AND name IN ('{SPAN_STALE_HASH}', '{SPAN_STALE_LEFT}', '{SPAN_DIVERGENT}')
        GROUP BY ALL ORDER BY window_start_ns""", window_ns=window_ns)


@checked
def stale_hashes(db: DB, run_id: str) -> pl.DataFrame:
    """Every stale hash found, in order. Columns: seq, time_ns, step, request_id,
    group_id, block_id, block_hash, num_tokens, expected_fingerprint, actual_fingerprint."""
    return with_run(db, run_id, f"""
        SELECT seq, start_ns AS time_ns, step, request_id, group_id, block_ids[1] AS block_id,
               block_hashes[1] AS block_hash, num_tokens, expected_fingerprint, actual_fingerprint
        FROM verify_spans WHERE run_id = $run_id AND name = '{SPAN_STALE_HASH}' ORDER BY seq""")


@checked
def divergent_outputs(db: DB, run_id: str) -> pl.DataFrame:
    """Every divergent output token, in order. Columns: seq, time_ns, step, request_id,
    position (output index), expected_token, actual_token."""
    return with_run(db, run_id, f"""
        SELECT seq, start_ns AS time_ns, step, request_id, position, expected_token, actual_token
        FROM verify_spans WHERE run_id = $run_id AND name = '{SPAN_DIVERGENT}' ORDER BY seq""")


# --- the chain behind one stale hash ----------------------------------------------------
_CHAIN_COLUMNS = (
    "seq", "start_ns", "step", "name", "request_id", "group_id", "block_ids", "block_hashes", "publish_kind",
    "evict_reason", "copy_reason", "copy_src", "copy_dst", "num_tokens", "num_hit_tokens",
    "expected_fingerprint", "actual_fingerprint", "span_id",
)
_COW_COLUMNS = ("seq", "start_ns", "step", "name", "request_id", "group_id", "copy_reason", "copy_src",
                "copy_dst", "span_id")
_CHAIN_ROLES = {
    SPAN_PUBLISH: "publish", SPAN_STALE_LEFT: "overwrite", SPAN_COW: "cow", SPAN_EVICT: "evict",
    SPAN_STALE_HASH: "stale_hit", SPAN_LOOKUP: "lookup",
}


def _chain_select(view: str, where: str, only: tuple[str, ...] = _CHAIN_COLUMNS) -> str:
    """SELECT of the chain columns from one family view (NULL where the family lacks one,
    and for columns outside ``only``: list columns cost a scan even where filtered out;
    typed, so every backend unions them alike)."""
    table = next(t for t, (v, _, _) in FAMILIES.items() if v == view)
    have = set(family_columns(table)) & set(only)
    cols = ", ".join(c if c in have else f"CAST(NULL AS {VIEW_SQL_TYPES[c]}) AS {c}" for c in _CHAIN_COLUMNS)
    return f"SELECT {cols} FROM {view} WHERE run_id = $run_id AND {where}"


@checked
def stale_hash_chain(db: DB, run_id: str, block_hash: str, group_id: int | None = None) -> pl.DataFrame:
    """The spans that explain one stale hash, in time order: its publishes, the overwrite
    (stale_left, CoW into or out of its block), evictions, lookups naming it, and the stale
    hit; in group ``group_id`` only, or in every group.

    Columns: seq, time_ns, step, name, role (publish | overwrite | cow | evict | lookup |
    stale_hit | other), request_id, group_id, block_ids, publish_kind, evict_reason,
    copy_reason, copy_src, copy_dst, num_tokens, num_hit_tokens, expected_fingerprint,
    actual_fingerprint, span_id.
    """
    with open_run(db, run_id, derived=True) as (con, status):
        params: dict = {"run_id": run_id, "h": block_hash}
        # A finished run indexes the spans naming each stale hash (derived stale_chain):
        # filtering on those seqs lets DuckDB skip row groups instead of scanning every
        # block list; a running run has no index yet and searches the lists.
        by_hash = "list_contains(block_hashes, $h)"
        if status != "running":
            seqs = query(con, "SELECT seq FROM stale_chain WHERE run_id = $run_id AND block_hash = $h",
                         params)["seq"].to_list()
            if seqs:
                by_hash, params["seqs"] = "seq IN $seqs", seqs
        group = ""
        if group_id is not None:
            group, params["g"] = " AND group_id = $g", int(group_id)
        names = f"name IN ('{SPAN_PUBLISH}', '{SPAN_EVICT}', '{SPAN_STALE_LEFT}')"
        touched = query(con, " UNION ALL ".join([
            _chain_select("cache_spans", f"{names}{group} AND {by_hash}"),
            _chain_select("verify_spans", f"{by_hash}{group}"),
            _chain_select("lookup_spans", "(root_hash = $h OR first_miss_hash = $h)"),
        ]), params)
        touched = touched.filter(
            pl.col("block_hashes").is_null() | pl.col("block_hashes").list.contains(block_hash)
        )
        # (group, block id) of every block that held the hash: CoW copies into or out of
        # one of them within the chain's time range complete the story (time, not seq: a
        # batch's spans are numbered kind by kind, its copies after its lookups' and evictions').
        holders = (
            touched.filter(pl.col("block_ids").is_not_null())
            .select("group_id", pl.col("block_ids").list.get(pl.col("block_hashes").list.eval(
                pl.element() == block_hash).list.arg_max()).alias("block_id"))
            .unique().drop_nulls().rows()
        )
        if holders and touched.height:
            lo, hi = touched.select(pl.col("start_ns").min(), pl.col("start_ns").max().alias("hi")).row(0)
            cows = query(con, _chain_select(
                "cache_spans",
                f"name = '{SPAN_COW}' AND start_ns BETWEEN $lo AND $hi AND "
                "(list_contains($holders, [group_id, copy_dst]) OR list_contains($holders, [group_id, copy_src]))",
                _COW_COLUMNS,
            ), {"run_id": run_id, "lo": lo, "hi": hi, "holders": sorted([int(g), int(b)] for g, b in holders)})
            touched = pl.concat([touched, cows], how="vertical_relaxed")
    return (
        touched.sort(["start_ns", "seq"])  # time order; seq breaks the ties of one step's spans
        .with_columns(pl.col("name").replace_strict(_CHAIN_ROLES, default="other").alias("role"))
        .rename({"start_ns": "time_ns"})
        .select("seq", "time_ns", "step", "name", "role", "request_id", "group_id", "block_ids", "publish_kind",
                "evict_reason", "copy_reason", "copy_src", "copy_dst", "num_tokens", "num_hit_tokens",
                "expected_fingerprint", "actual_fingerprint", "span_id")
    )
