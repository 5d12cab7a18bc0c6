"""A package's public names, loaded on first use (PEP 562's module ``__getattr__``).

The engine, the cache and the store export their main classes from the package, but
importing the package must stay cheap: the CLI's error paths, the trace readers and the
dashboard must not pay for torch, DuckDB or Polars they never use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str | None]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``exports`` maps each public name to the module
    (relative to the package) that defines it, or to None for a subpackage of that name."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = exports[name]
        if module is None:
            return import_module(f"{package}.{name}")
        return getattr(import_module(f"{package}.{module}"), name)

    return __getattr__
