"""A ``--db`` URL's secrets in the store's own errors (what the dashboard shows of one, where no
CLI line masks it): one rule, ``names.without_secrets``, as every CLI line (reprobe33's report)."""

from __future__ import annotations

import pytest

from kvtrace.errors import ConfigError
from kvtrace.names import without_secrets
from kvtrace.store.backend import clickhouse_target


@pytest.mark.parametrize("url, secret", [
    ("clickhouse://h:8123/db?password=S3CRET", "S3CRET"),  # (a query's: the error quoted it whole)
    ("clickhouse://u:p@S3CRET@h:8123/db?bogus=1", "S3CRET"),  # (an @ not encoded: kept past the first @)
    ("clickhouse://u:S3CRET@h:8123/db?bogus=1", "S3CRET"),
    ("clickhouses://u:S3CRET@h:8443/a/b", "S3CRET"),
])
def test_a_url_refused_by_the_store_never_quotes_its_secret(url, secret):
    with pytest.raises(ConfigError) as err:
        clickhouse_target(url)
    assert secret not in str(err.value) and "***" in str(err.value), str(err.value)


def test_the_cli_and_the_store_mask_alike():
    line = "kvtrace: error: --db: clickhouse://u:p@w@h/db?token=T&x=1: unknown option"
    assert without_secrets(line) == "kvtrace: error: --db: clickhouse://u:***@h/db?token=***&x=1: unknown option"
