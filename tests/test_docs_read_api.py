"""The README's Notebooks section on `kvtrace.store.read`: what each function returns."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

import kvtrace.store.read as read

README = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8").split())


def _functions() -> dict[str, Callable[..., object]]:
    return {name: f for name, f in vars(read).items()
            if callable(f) and not name.startswith("_") and getattr(f, "__module__", "").startswith(read.__name__)}


def test_every_function_is_in_the_docstring():
    assert "through `kvtrace.store.read` (every function is listed in its docstring;" in README
    assert [name for name in _functions() if f"{name}(" not in (read.__doc__ or "")] == []


def test_the_functions_that_return_no_frame_or_dict_are_the_ones_the_readme_names():
    """It said each returns a polars frame or a dict: latency_samples gives a numpy array,
    nice_window an int and finished_summary a bool."""
    said = re.search(r"each returns a polars frame or a dict, but ([^)]+)\)", README)
    assert said is not None
    named = set(re.findall(r"`(\w+)`", said.group(1)))
    others = {name for name, f in _functions().items()
              if not re.search(r"DataFrame|dict", str(inspect.signature(f).return_annotation))}
    assert others == named
