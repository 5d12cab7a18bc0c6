"""Engine refuses a cache_config, scheduler_config or cost_model that is not one, the empty ones
too: ``{}``, ``0`` or ``""`` (falsy) was replaced by the preset's own and the run went on
silently with a config no one gave, where a non-empty dict is refused (586efcb)."""

from __future__ import annotations

import pytest

from kvtrace.engine.engine import Engine
from kvtrace.errors import KVTraceError


@pytest.mark.parametrize("name", ["cache_config", "scheduler_config", "cost_model"])
@pytest.mark.parametrize("given", [{}, 0, "", [], False], ids=repr)
def test_an_empty_config_that_is_not_one_is_refused(name, given):
    with pytest.raises(KVTraceError, match=rf"^engine: {name} "):
        Engine("kimi-hybrid", **{name: given})


def test_none_still_takes_the_presets():
    engine = Engine("kimi-hybrid", cache_config=None, scheduler_config=None, cost_model=None)
    preset = Engine("kimi-hybrid")
    assert (engine.cache_config, engine.scheduler_config, engine.cost_model) == (
        preset.cache_config, preset.scheduler_config, preset.cost_model)
