"""Addresses a user types (``--db`` URLs, ``--otlp-endpoint``, ``--ray``): any text is
parsed or refused as one one-line KVTraceError naming the option, never another exception
(urlparse raises ValueError on an unclosed ``[`` or a bad port, which once escaped)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtrace.instrument.pipeline import traces_url
from kvtrace.replay.sweep import ray_host_port
from kvtrace.store.backend import clickhouse_target
from tests.fuzz.support import fuzz, one_line_error

# URL metacharacters, digits and a few odd ones (NUL, a non-ASCII letter, a newline)
URLISH = st.text(alphabet="[]:@/?#%&=.-_ab019 \x00\u00e9\n", max_size=40)


@fuzz(300)
@given(scheme=st.sampled_from(["clickhouse://", "clickhouses://", "chdb:"]), rest=URLISH)
def test_a_clickhouse_db_is_parsed_or_one_config_error(scheme, rest):
    try:
        target = clickhouse_target(scheme + rest)
    except Exception as err:  # (the invariant is on what escapes)
        one_line_error(err, "--db")
        assert "\n" not in str(err)
    else:
        assert target.path is not None or (target.host and 0 <= target.port < 65536)


@fuzz(300)
@given(text=st.one_of(URLISH, URLISH.map(lambda t: "http://" + t)))
def test_an_otlp_endpoint_is_parsed_or_one_config_error(text):
    try:
        url = traces_url(text)
    except Exception as err:
        one_line_error(err, "--otlp-endpoint")
    else:
        assert url.startswith(("http://", "https://"))


@fuzz(300)
@given(text=st.one_of(URLISH, URLISH.map(lambda t: "ray://" + t)))
def test_a_ray_address_is_parsed_or_one_error(text):
    try:
        host, port = ray_host_port(text)
    except Exception as err:
        one_line_error(err, "--ray")
    else:
        assert host and 0 <= port < 65536
