"""The read API's boundary: what a caller passes is checked against each function's
annotations before any SQL runs, so a notebook's ``hit_counters(db, 0)`` is one line
naming the parameter, not DuckDB's conversion error (or polars', or Python's) from deep
inside the query."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvtrace.errors import KVTraceError
from kvtrace.metrics import MAX_PERCENTILES
from kvtrace.names import shown_value

F = TypeVar("F", bound=Callable[..., Any])


class BadArgument(KVTraceError, ValueError):
    """An argument of a read function that it cannot take (a ValueError too, as Python's own)."""

    def __init__(self, function: str, parameter: str, what: str):
        super().__init__(f"{function}: {parameter}: {what}")


# What the read API's counts and percentile lists may hold, by parameter name: one rule
# each, for every function that takes one (a negative LIMIT reached DuckDB and was blamed on
# the store; 2^63 bins was an IndexError, 10^9 a MemoryError).
COUNT_RANGES: dict[str, tuple[int, int]] = {
    "limit": (0, 100_000_000), "top": (0, 1_000_000), "top_prefixes": (0, 10_000), "bins": (1, 100_000),
    "windows": (1, 100_000), "span_ns": (0, 2**63 - 1),
    "window_ns": (1, 2**63 - 1),  # (None: chosen; else named by the function asked, not "read")
}
PERCENTILE_LISTS = ("qs", "percentiles")  # each a list of distinct percentiles in 0..100
INT64 = (-(2**63), 2**63 - 1)  # what an int argument may be (the store's times, ids and counts)


def _check_range(function: str, parameter: str, value: Any) -> tuple[Any, ...] | None:
    """BadArgument for a count out of its range or a percentile list that is not one; a
    percentile list's items as a tuple (an iterator or generator is read once, by the check:
    the function then got an empty one, and said nothing of the percentiles asked)."""
    if parameter in COUNT_RANGES and isinstance(value, numbers.Integral):
        lo, hi = COUNT_RANGES[parameter]
        if not lo <= int(value) <= hi:
            raise BadArgument(function, parameter, f"expected {lo} to {hi:,}, got {shown_value(value)}")
    elif parameter in PERCENTILE_LISTS:
        try:
            if isinstance(value, (str, bytes)):  # ("50,90" was read character by character: "got '5'")
                raise TypeError
            qs = list(value)
        except Exception:  # (no iterable, or one whose __iter__ raises: a caller's object)
            raise BadArgument(function, parameter,
                              f"expected a list of percentiles, got {shown_value(value)}") from None
        if not 1 <= len(qs) <= MAX_PERCENTILES:
            raise BadArgument(function, parameter, f"expected 1 to {MAX_PERCENTILES:,} percentiles, got {len(qs):,}")
        for q in qs:
            # (NaN fails; an int past a float's range is compared as the int it is, float() overflows)
            if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 <= (
                    int(q) if isinstance(q, numbers.Integral) else float(q)) <= 100:
                raise BadArgument(function, parameter, f"expected percentiles from 0 to 100, got {shown_value(q, 40)}")
        if len(set(qs)) != len(qs):
            raise BadArgument(function, parameter, "expected distinct percentiles, got a repeated one")
        return tuple(qs)
    return None


def _accepts(hint: Any) -> tuple[type, ...] | None:
    """The plain types ``hint`` allows (None among them as NoneType), or None when it is not
    one this checks (a frame, a mapping: left to the function)."""
    if hint in (str, int, float, bool, Path):
        return (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [_accepts(a) if a is not type(None) else (type(None),) for a in typing.get_args(hint)]
        return None if any(p is None for p in parts) else tuple(t for p in parts for t in p)  # type: ignore[union-attr]
    if typing.get_origin(hint) is list and typing.get_args(hint) == (str,):
        return (list,)
    return None


def _check(function: str, parameter: str, value: Any, allowed: tuple[type, ...]) -> None:
    # (numpy's and polars' integers are ints to a caller: numbers.Integral, not bool)
    ok = isinstance(value, allowed) or (int in allowed and isinstance(value, numbers.Integral)) or (
        float in allowed and isinstance(value, numbers.Real))
    ok = ok and not (isinstance(value, bool) and bool not in allowed)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if ok and parameter not in COUNT_RANGES and not isinstance(value, bool) and isinstance(value, numbers.Integral) \
            and not INT64[0] <= int(value) <= INT64[1]:  # (DuckDB's "Python integer too large", from inside the query)
        raise BadArgument(function, parameter, f"expected a 64-bit integer, got {shown_value(value)}")
    if ok and isinstance(value, list):
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        want = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
        if allowed == (list,):
            want = "a list of str"
        raise BadArgument(function, parameter, f"expected {want}, got {shown_value(value)}")


def _plain(value: Any) -> Any:
    """A checked value as the builtin it stands for: a numpy or polars integer an int (DuckDB
    cannot bind numpy.int64), a real a float, a str subclass a str (its own __eq__ or
    __repr__ never runs inside the query or its error line)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def checked(func: F) -> F:
    """``func`` with its annotated arguments checked first (str, int, float, bool, paths,
    their optional forms and ``list[str]``; an int where a float is asked is fine), and its
    counts and percentile lists against ``COUNT_RANGES`` and ``PERCENTILE_LISTS``. A call
    with a missing or unknown argument is a BadArgument too."""
    signature = inspect.signature(func)
    hints = typing.get_type_hints(func)
    allowed: dict[str, tuple[type, ...]] = {}
    for name in signature.parameters:
        kinds = _accepts(hints.get(name))
        if kinds is not None:
            allowed[name] = kinds
    ranged = {name for name in signature.parameters if name in COUNT_RANGES or name in PERCENTILE_LISTS}

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as err:
            raise BadArgument(func.__name__, "arguments", str(err)) from None
        for name, value in bound.arguments.items():
            kinds = allowed.get(name)
            if kinds is not None:
                _check(func.__name__, name, value, kinds)
                bound.arguments[name] = _plain(value)
            if name in ranged:
                checked_value = _check_range(func.__name__, name, value)
                if checked_value is not None:  # (a generator's items, read once here: the function got none)
                    bound.arguments[name] = checked_value
        return func(*bound.args, **bound.kwargs)

    return typing.cast(F, wrapper)
