"""kvtrace.engine: the deterministic serving engine (scheduler, worker, clock) over kvtrace.cache.

One step of ``Engine.run`` (the call order with the cache manager):

1. admit arrivals (``arrival_ns <= now``) into the waiting queue;
2. ``Scheduler.schedule()``: running requests first, ``allocate_slots(req, n)`` each
   (``None`` -> preempt the last running request: ``free(victim)``, recompute later);
   then, unless someone was preempted, waiting requests in arrival order:
   ``get_computed_blocks`` -> ``get_num_external_hit_tokens`` -> split ->
   ``allocate_slots(req, n, num_new_computed_tokens, new_computed_blocks,
   num_external_computed_tokens)``; scheduled tokens count as computed at once (vLLM's
   ``_update_after_schedule``); ``take_block_copies()`` and ``take_state_writes()`` go into
   the ``SchedulerOutput``;
3. ``Worker.execute(output)``: tables from the output only, external loads, copies,
   content writes, sampling, the no-cache reference check;
4. ``Clock``: the step's modelled duration;
5. ``Scheduler.update_from_output``: append tokens, ``free`` finished requests;
6. ``new_step_starts()`` flushes the step's cache events (vLLM calls it at the top of the
   next ``schedule``: the same point); publishes are turned into audit expectations, the
   audit runs every ``audit_interval`` steps (and once at the end), and listeners get one
   ``StepBatch``.
"""

from typing import TYPE_CHECKING

from kvtrace.lazy import lazy_exports

# The public names and their modules. Loaded on first use, so that importing a torch-free
# module of the engine (clock, config, presets, events) does not import torch: the trace
# readers, cache-only replay and the CLI's error paths stay fast.
_EXPORTS = {
    "COST_MODELS": "clock", "Clock": "clock", "CostModel": "clock", "get_cost_model": "clock",
    "SchedulerConfig": "config", "Engine": "engine", "EngineResult": "engine",
    "PRESETS": "presets", "EnginePreset": "presets", "get_preset": "presets", "EngineRequest": "request",
    "CachedRequestData": "scheduler", "NewRequestData": "scheduler", "Scheduler": "scheduler",
    "SchedulerOutput": "scheduler", "Worker": "worker",
}
__all__ = [  # _EXPORTS' names, spelled out for the linters
    "COST_MODELS", "PRESETS", "CachedRequestData", "Clock", "CostModel", "Engine", "EnginePreset", "EngineRequest",
    "EngineResult", "NewRequestData", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Worker", "get_cost_model",
    "get_preset",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from kvtrace.engine.clock import COST_MODELS, Clock, CostModel, get_cost_model
    from kvtrace.engine.config import SchedulerConfig
    from kvtrace.engine.engine import Engine, EngineResult
    from kvtrace.engine.presets import PRESETS, EnginePreset, get_preset
    from kvtrace.engine.request import EngineRequest
    from kvtrace.engine.scheduler import CachedRequestData, NewRequestData, Scheduler, SchedulerOutput
    from kvtrace.engine.worker import Worker
