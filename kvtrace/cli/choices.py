"""The CLI's enumerations, each built from the one tuple that defines it (kvtrace.names),
so ``--help`` lists the choices and a typo is refused by the parser, naming the option."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, TypeAlias, cast

from kvtrace.names import BACKENDS, BEHAVIOURS, FORMATS, GENERATED_FORMATS, MODES, POLICIES, PRESETS, WORKLOADS


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
    GeneratedFormat = _choices("GeneratedFormat", GENERATED_FORMATS)
    Backend = _choices("Backend", BACKENDS)


def value(choice):
    """The plain string behind a choice (None and lists pass through)."""
    if choice is None:
        return None
    if isinstance(choice, (list, tuple)):
        return tuple(value(c) for c in choice)
    return choice.value if isinstance(choice, Enum) else choice
