"""Virtual time: a documented cost model turns each step's work into nanoseconds.

These are MODELLED times, not measurements. A step costs

    step_ns = step_overhead_ns
            + token_ns            * (all tokens scheduled in the step, prefill and decode)
            + attn_pair_ps / 1000 * (query-key pairs of prefill chunks: n * (start + (n + 1) / 2))
            + kv_read_ps / 1000   * (context tokens read by decode sequences)
            + decode_seq_ns       * (decode sequences)
            + kv_copy_ns          * (attention block copies)
            + state_copy_ns       * (recurrent-state block copies)

Every term is integer arithmetic (picoseconds where a nanosecond is too coarse), so the
same steps give the same times everywhere. Presets (the README copies this table):

| preset | step_overhead_ns | token_ns | attn_pair_ps | kv_read_ps | decode_seq_ns | kv_copy_ns | state_copy_ns |
|---|---|---|---|---|---|---|---|
| h200-kimi-hybrid | 6_000_000 | 14_000 | 340 | 2_400 | 40_000 | 2_000 | 20_000 |
| h200-dense-8b | 3_500_000 | 32_000 | 1_050 | 38_000 | 20_000 | 5_000 | 0 |

Where the numbers come from (H200: ~989 dense bf16 TFLOP/s, 4.8 TB/s HBM; assume ~50% MFU
and ~70% of bandwidth):
- h200-kimi-hybrid: a Kimi-Linear-like MoE, ~3B active parameters (6 GFLOP/token ->
  ~12-14 us/token), 7 MLA attention layers out of 27 (~172 kFLOP per query-key pair ->
  0.34 ns; ~8 KiB of latent KV per token -> 2.4 ns per context token read at decode),
  20 KDA layers whose ~40 MB state is read and written per decode sequence and per
  state copy (~20 us), and ~6 ms per step for expert-weight reads and launches.
- h200-dense-8b: a Llama-3-8B-like dense model (16 GFLOP/token -> 32 us/token,
  32 layers x 8 KV heads x 128 x 2 x 2 B = 128 KiB KV per token -> 38 ns per context
  token; a 16-token block is 2 MiB, ~1 us to copy plus a launch -> 5 us), ~3.5 ms per
  step for the 16 GB weight read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str
    step_overhead_ns: int
    token_ns: int
    attn_pair_ps: int
    kv_read_ps: int
    decode_seq_ns: int
    kv_copy_ns: int
    state_copy_ns: int

    def step_ns(
        self,
        num_tokens: int,
        prefill_pairs: int,
        decode_context_tokens: int,
        num_decode_seqs: int,
        num_kv_copies: int,
        num_state_copies: int,
    ) -> int:
        return (
            self.step_overhead_ns
            + self.token_ns * num_tokens
            + (self.attn_pair_ps * prefill_pairs + self.kv_read_ps * decode_context_tokens) // 1000
            + self.decode_seq_ns * num_decode_seqs
            + self.kv_copy_ns * num_kv_copies
            + self.state_copy_ns * num_state_copies
        )


COST_MODELS: dict[str, CostModel] = {
    m.name: m
    for m in (
        CostModel("h200-kimi-hybrid", 6_000_000, 14_000, 340, 2_400, 40_000, 2_000, 20_000),
        CostModel("h200-dense-8b", 3_500_000, 32_000, 1_050, 38_000, 20_000, 5_000, 0),
    )
}


def get_cost_model(name: str) -> CostModel:
    try:
        return COST_MODELS[name]
    except KeyError:
        raise ConfigError("cost model", name, f"unknown; known: {sorted(COST_MODELS)}") from None


def prefill_pairs(start: int, num_tokens: int) -> int:
    """Causal query-key pairs of a chunk of ``num_tokens`` queries after ``start`` context."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class Clock:
    """The engine's virtual time line (integer ns; it never reads a wall clock)."""

    __slots__ = ("cost", "now_ns")

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.now_ns = 0

    def advance_to(self, t_ns: int) -> None:
        if t_ns > self.now_ns:
            self.now_ns = t_ns

    def run_step(self, **work: int) -> tuple[int, int]:
        start = self.now_ns
        self.now_ns = start + self.cost.step_ns(**work)
        return start, self.now_ns
