"""The CLI's enumerations, each built from the one tuple that defines it, so ``--help``
lists the choices and a typo is refused by the parser, naming the option."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, TypeAlias, cast

from kvtrace.cache.config import BEHAVIOURS
from kvtrace.engine.backends import BACKENDS
from kvtrace.engine.presets import PRESETS
from kvtrace.replay.cache_only import POLICIES
from kvtrace.replay.generate import WORKLOADS
from kvtrace.replay.readers import FORMATS
from kvtrace.replay.run import MODES


def _choices(name: str, values) -> type[Enum]:
    # the functional API makes a class; type checkers only know that at module level
    return cast("type[Enum]", Enum(name, {v.replace("-", "_"): v for v in values}, type=str))


if TYPE_CHECKING:  # for a type checker each is the str it holds (one alias a line: a chain is no alias)
    Mode: TypeAlias = str
    Policy: TypeAlias = str
    TraceFormat: TypeAlias = str
    Preset: TypeAlias = str
    Behaviour: TypeAlias = str
    Workload: TypeAlias = str
    GeneratedFormat: TypeAlias = str
    Backend: TypeAlias = str
else:
    Mode = _choices("Mode", MODES)
    Policy = _choices("Policy", POLICIES)
    TraceFormat = _choices("TraceFormat", FORMATS)
    Preset = _choices("Preset", PRESETS)
    Behaviour = _choices("Behaviour", BEHAVIOURS)
    Workload = _choices("Workload", WORKLOADS)
    GeneratedFormat = _choices("GeneratedFormat", ("native", "mooncake"))
    Backend = _choices("Backend", BACKENDS)


def value(choice):
    """The plain string behind a choice (None and lists pass through)."""
    if choice is None:
        return None
    if isinstance(choice, (list, tuple)):
        return tuple(value(c) for c in choice)
    return choice.value if isinstance(choice, Enum) else choice
