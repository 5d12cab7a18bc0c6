"""Scheduler configuration (vLLM's ``SchedulerConfig``, reduced to what kvtrace models)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # token budget per step
    max_num_seqs: int = 256  # running requests at most
    long_prefill_token_threshold: int = 0  # 0 = off; else a prefill chunk is at most this long
    max_model_len: int = 1 << 20
    enable_chunked_prefill: bool = True
    # vLLM 0.33's admission gate (its default): a waiting or preempted request is admitted only
    # if the free blocks hold its whole sequence, not just its first chunk
    scheduler_reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError("SchedulerConfig", name, f"expected a positive int, got {v!r}")
        for name in ("enable_chunked_prefill", "scheduler_reserve_full_isl"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ConfigError("SchedulerConfig", name, f"expected true or false, got {v!r}")
        thr = self.long_prefill_token_threshold
        # (a float or a string reached the scheduler's token arithmetic: a TypeError, or fractional chunks)
        if not isinstance(thr, int) or isinstance(thr, bool) or thr < 0:
            raise ConfigError("SchedulerConfig", "long_prefill_token_threshold", f"expected an int >= 0, got {thr!r}")

    def check_vllm_accepts(self) -> None:
        """ConfigError for what vLLM's own ``SchedulerConfig`` refuses (its
        ``verify_max_model_len``): a user's settings are held to it. (Tests may drive the
        scheduler with smaller budgets than vLLM allows.)"""
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("SchedulerConfig", "max_num_batched_tokens",
                              f"{self.max_num_batched_tokens} is below max_num_seqs {self.max_num_seqs}; vLLM "
                              "requires max_num_batched_tokens >= max_num_seqs")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ConfigError("SchedulerConfig", "long_prefill_token_threshold",
                              f"{self.long_prefill_token_threshold} exceeds max_model_len {self.max_model_len}; "
                              "vLLM requires it <= max_model_len")
