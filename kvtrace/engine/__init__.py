"""kvtrace.engine: the deterministic serving engine (scheduler, worker, clock) over kvtrace.cache."""

from kvtrace.engine.clock import COST_MODELS, Clock, CostModel, get_cost_model
from kvtrace.engine.config import SchedulerConfig
from kvtrace.engine.engine import Engine, EngineResult
from kvtrace.engine.presets import PRESETS, EnginePreset, get_preset
from kvtrace.engine.request import EngineRequest
from kvtrace.engine.scheduler import CachedRequestData, NewRequestData, Scheduler, SchedulerOutput
from kvtrace.engine.workload import TraceRequest
from kvtrace.engine.worker import Worker

__all__ = [
    "COST_MODELS", "Clock", "CostModel", "get_cost_model", "SchedulerConfig", "Engine", "EngineResult",
    "PRESETS", "EnginePreset", "get_preset", "EngineRequest", "CachedRequestData", "NewRequestData",
    "Scheduler", "SchedulerOutput", "TraceRequest", "Worker",
]
