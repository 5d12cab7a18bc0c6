"""A chdb store's run row deleted by hand, its spans left: the next run took the id and the
spans with it (as on DuckDB, tests/store/test_damage_probe35.py)."""

from __future__ import annotations

import pytest

from tests.cli.support import run as kvtrace
from tests.clickhouse.test_ch_probe28 import _ch
from tests.conftest import MOONCAKE
from tests.store.test_damage_probe35 import assert_leftover_id_refused

pytest.importorskip("chdb")

REPLAY = ["replay", str(MOONCAKE), "--limit", "3", "--mode", "cache-only", "--capacity-blocks", "64"]


def test_a_run_id_whose_spans_remain_is_not_given_again(chdb_store, capsys):
    code, _, err = kvtrace([*REPLAY, "--db", chdb_store], capsys)
    assert code == 0, err
    spans = _ch(chdb_store, "SELECT count() FROM spans WHERE run_id = 'r1'")[0][0]
    _ch(chdb_store, "DELETE FROM runs WHERE run_id = 'r1'")
    code, _, err = kvtrace([*REPLAY, "--db", chdb_store], capsys)
    assert code == 0 and "run r2 recorded" in err, err
    assert _ch(chdb_store, "SELECT run_id, count() FROM spans GROUP BY run_id ORDER BY run_id") == [
        ("r1", spans), ("r2", spans)]
    assert_leftover_id_refused(chdb_store, "r1")
