"""The ground-floor helpers: cdiv and the one percentile definition (numpy linear)."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.numeric import cdiv, percentile, percentiles, sorted_percentile

values = st.lists(st.integers(-10**12, 10**12), min_size=1, max_size=200)
qs = st.floats(0, 100)


@given(values, qs)
def test_percentile_is_numpys_linear_interpolation(v, q):
    want = float(np.percentile(np.asarray(v, dtype=np.float64), q))
    assert percentile(v, q) == want
    assert sorted_percentile(sorted(v), q) == want
    assert percentiles(v, [q, 50.0]) == [want, float(np.percentile(np.asarray(v, dtype=np.float64), 50.0))]


def test_percentile_of_nothing_is_none_and_of_known_values_is_exact():
    assert percentile([], 50) is None and percentiles([], [50, 99]) == [None, None]
    assert percentile([1, 2, 3, 4], 50) == 2.5  # linear between the two middle values, as vllm bench serve
    assert percentile(list(range(1, 101)), 99) == 99.01


@given(st.integers(-10**9, 10**9), st.integers(1, 10**6))
def test_cdiv_is_the_ceiling(a, b):
    assert cdiv(a, b) == -((-a) // b) and cdiv(a, b) * b >= a > (cdiv(a, b) - 1) * b


def test_property_tests_carry_no_timing_rule():
    # (tests/conftest.py's profile: a deadline or the too-slow check failed tests on a loaded box)
    assert settings.default.deadline is None and HealthCheck.too_slow in settings.default.suppress_health_check
