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

from kvtrace.engine.clock import COST_MODELS, Clock, CostModel, get_cost_model
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.engine import Engine, EngineResult
from kvtrace.engine.presets import PRESETS, EnginePreset, get_preset
from kvtrace.engine.request import EngineRequest
from kvtrace.engine.scheduler import CachedRequestData, NewRequestData, Scheduler, SchedulerOutput
from kvtrace.engine.worker import Worker

__all__ = [
    "COST_MODELS", "Clock", "CostModel", "get_cost_model", "SchedulerConfig", "Engine", "EngineResult",
    "PRESETS", "EnginePreset", "get_preset", "EngineRequest", "CachedRequestData", "NewRequestData",
    "Scheduler", "SchedulerOutput", "Worker",
]
