"""Scheduler configuration (vLLM's ``SchedulerConfig``, reduced to what kvtrace models)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.errors import ConfigError
from kvtrace.names import shown_value


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
                raise ConfigError("SchedulerConfig", name, f"expected a positive int, got {shown_value(v)}")
        for name in ("enable_chunked_prefill", "scheduler_reserve_full_isl"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ConfigError("SchedulerConfig", name, f"expected true or false, got {shown_value(v)}")
        thr = self.long_prefill_token_threshold
        # (a float or a string reached the scheduler's token arithmetic: a TypeError, or fractional chunks)
        if not isinstance(thr, int) or isinstance(thr, bool) or thr < 0:
            raise ConfigError("SchedulerConfig", "long_prefill_token_threshold",
                              f"expected an int >= 0, got {shown_value(thr)}")

    def check_vllm_accepts(self) -> None:
        """ConfigError for what vLLM's own ``SchedulerConfig`` refuses (its
        ``verify_max_model_len``): a user's settings are held to it. (Tests may drive the
        scheduler with smaller budgets than vLLM allows.)"""
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("SchedulerConfig", "max_num_batched_tokens",
                              f"{self.max_num_batched_tokens} is below max_num_seqs {self.max_num_seqs}; vLLM "
                              "requires max_num_batched_tokens >= max_num_seqs")
        thr = self.long_prefill_token_threshold
        if not self.enable_chunked_prefill and thr and self.max_num_batched_tokens < self.max_model_len:
            # kvtrace lets a prompt wait for a budget that takes it whole where vLLM refuses a budget
            # under max_model_len; with a threshold too, vLLM's lone-request rule made a prompt over
            # the budget wait, idle, until another request arrived, then cut it at the threshold
            raise ConfigError("SchedulerConfig", "long_prefill_token_threshold",
                              f"{thr} with enable_chunked_prefill = false and max_num_batched_tokens "
                              f"{self.max_num_batched_tokens} below max_model_len {self.max_model_len}: a prompt "
                              "over the budget would be cut at the threshold while another request waits, and "
                              "never scheduled alone; vLLM requires max_num_batched_tokens >= max_model_len "
                              "without chunked prefill (set the threshold to 0, or raise the budget)")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ConfigError("SchedulerConfig", "long_prefill_token_threshold",
                              f"{self.long_prefill_token_threshold} exceeds max_model_len {self.max_model_len}; "
                              "vLLM requires it <= max_model_len")
