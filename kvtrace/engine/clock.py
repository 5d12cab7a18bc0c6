"""Virtual time: a cost model turns each step's work into nanoseconds.

These are MODELLED times, not measurements. A step of work W costs

    step_ns = step_overhead_ns                                   fixed: weights read, launches, scheduling
            + token_ns            * T                            T = tokens in the step (prefill + decode)
            + token_above_knee_ns * max(0, T - token_knee)       GEMMs get dearer per token past a knee
            + attn_pair_ps / 1000 * prefill query-key pairs       n * (start + (n + 1) / 2) per prefill chunk
            + kv_read_ps / 1000   * decode context tokens         KV (or latent) bytes read by decode sequences
            + decode_seq_ns       * decode sequences              per-sequence work (recurrent state, sampling)
            + moe_expert_ns       * experts touched               E * (1 - (1 - k/E)^T): distinct experts of T tokens
            + kv_copy_ns * KV block copies + state_copy_ns * state copies
            + kv_load_ns * tokens loaded from the external tier + state_load_ns * states loaded

Every term is integer arithmetic (picoseconds where a nanosecond is too coarse; the MoE
term in 62-bit fixed point), so the same steps give the same times everywhere.
Prefill and decode in one step simply add: that is how a chunked prefill slows the
decodes that share its step (the interference is the prefill's terms, paid by all).

Presets, fitted with ``kvtrace calibrate`` to the step timings in ``tests/data/calibration``
(sources, models, GPUs and licences in its README; ``tests/engine/test_calibration.py``
holds every preset to its data):

| cost model | fitted to | median / max error |
|---|---|---|
| h200-dense-8b | Llama-3.1-8B, 1 H200, bf16, vLLM 0.24.0 kernels (NVIDIA AIConfigurator 0.12.0, 37 steps) | 1.4% / 5.5% |
| h200-dense-70b-tp4 | Llama-3.1-70B, 4 H200 (TP 4), same source | 1.3% / 5.7% |
| h200-dense-70b-tp8 | Llama-3.1-70B, 8 H200 (TP 8), same source | 1.3% / 6.4% |
| h200-kimi-hybrid | Kimi-Linear-48B-A3B shape (20 KDA + 7 MLA layers, MoE 256 top-8), 1 H200, same source in its HYBRID mode | 3.6% / 15.0% |

The 8B model is cross-checked against a measurement: NVIDIA Dynamo 1.6.1's H200 profile of
Llama-3.1-8B-Instruct-FP8 under vLLM (TTFT per input length, ITL per batch and context).
``h200-kimi-hybrid`` is derived, because no Kimi-Linear step timings are published: its
MoE and KDA kernels are partly AIConfigurator's estimates; the fully measured hybrid
nearest to it, Qwen3.5-35B-A3B (Gated DeltaNet 3:1, MoE 256 top-8), fits the same form
within 9.1%. Copy costs are not in the data: ``kv_copy_ns`` is one block's bytes at ~3.5
TB/s plus a launch; ``state_copy_ns`` is the recurrent state of all linear layers
(Kimi-Linear: 20 layers x 32 heads x 128 x 128 x 4 B = 40 MiB) at the same rate. Loads
from the external tier (a KV connector's CPU memory) are not in the data either: each is
its bytes over the host-to-device link at ~50 GB/s (PCIe 5.0 x16), a token's KV for
``kv_load_ns`` (per GPU under tensor parallelism: each GPU loads its shard over its own
link) and the whole recurrent state for ``state_load_ns``, added to the step that admits
the request (vLLM's synchronous load path; an asynchronous connector hides part of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvtrace.errors import ConfigError
from kvtrace.names import shown_value

_FP_BITS = 62  # fixed point of the MoE term: exact integers, the same on every machine
# A coefficient's bound: 1,000 s a unit in ns (1 s in ps), far past any machine, so that a
# step's time stays an int64 (the clock still refuses to run past 2^63 - 1 ns).
MAX_COEFFICIENT = 10**12
MAX_EXPERTS = 1 << 16
MAX_TIME_NS = (1 << 63) - 1  # the store's and the digest's times are int64


class StepWork(NamedTuple):
    """What one step did, as the cost model sees it."""

    num_tokens: int
    prefill_pairs: int = 0
    decode_context_tokens: int = 0
    num_decode_seqs: int = 0
    num_kv_copies: int = 0
    num_state_copies: int = 0
    num_kv_loads: int = 0  # tokens loaded from the external tier
    num_state_loads: int = 0  # recurrent states loaded from it (one a state group a loading request)


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str
    step_overhead_ns: int
    token_ns: int
    attn_pair_ps: int
    kv_read_ps: int
    decode_seq_ns: int
    kv_copy_ns: int = 0
    state_copy_ns: int = 0
    kv_load_ns: int = 0  # a token's KV loaded from the external tier
    state_load_ns: int = 0  # a recurrent state loaded from it
    token_knee: int = 0  # 0: no knee
    token_above_knee_ns: int = 0
    moe_expert_ns: int = 0
    num_experts: int = 0  # E of the MoE term (0: a dense model)
    experts_per_token: int = 0  # k
    source: str = ""  # what the coefficients were fitted to

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            v = getattr(self, name)
            hi = MAX_EXPERTS if name in ("num_experts", "experts_per_token") else MAX_COEFFICIENT
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
                raise ConfigError(f"cost model {self.name}", name, f"expected an int from 0 to {hi:,}, got {shown_value(v)}")
        if self.moe_expert_ns and not self.num_experts:  # (the term counts experts touched: E is needed)
            raise ConfigError(f"cost model {self.name}", "num_experts",
                              f"expected the number of experts (>= 1) with moe_expert_ns {self.moe_expert_ns}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigError(f"cost model {self.name}", "experts_per_token",
                              f"expected 1..num_experts ({self.num_experts}), got {self.experts_per_token}")

    def step_ns(
        self,
        num_tokens: int,
        prefill_pairs: int,
        decode_context_tokens: int,
        num_decode_seqs: int,
        num_kv_copies: int,
        num_state_copies: int,
        num_kv_loads: int = 0,
        num_state_loads: int = 0,
    ) -> int:
        ns = (
            self.step_overhead_ns
            + self.token_ns * num_tokens
            + (self.attn_pair_ps * prefill_pairs + self.kv_read_ps * decode_context_tokens) // 1000
            + self.decode_seq_ns * num_decode_seqs
            + self.kv_copy_ns * num_kv_copies
            + self.state_copy_ns * num_state_copies
            + self.kv_load_ns * num_kv_loads
            + self.state_load_ns * num_state_loads
        )
        if self.token_knee and num_tokens > self.token_knee:
            ns += self.token_above_knee_ns * (num_tokens - self.token_knee)
        if self.moe_expert_ns:
            ns += (self.moe_expert_ns * _experts_touched_fp(self.num_experts, self.experts_per_token, num_tokens)
                   ) >> _FP_BITS
        return ns

    def step_ns_of(self, work: StepWork) -> int:
        return self.step_ns(*work)


def free_step_problem(model: CostModel) -> str | None:
    """Why ``model`` cannot time a run, or None: some step would take 0 ns (its tokens cost
    nothing: a prefill-only step's TTFT read 0 ms). Every step costs something with a step
    overhead, a per-token or a MoE term; without them, a prefill needs attn_pair_ps >= 1000
    (a step's pairs are at least its tokens; the term is in ps, summed, then cut to ns) and a
    decode decode_seq_ns or kv_read_ps >= 1000. ``--config``, ``calibrate -o`` and ``Engine``
    refuse such a model."""
    if model.step_overhead_ns or model.token_ns or model.moe_expert_ns:
        return None
    if model.attn_pair_ps < 1000:
        free = "a prefill of a few tokens"
    elif not model.decode_seq_ns and model.kv_read_ps < 1000:
        free = "a decode of one sequence"
    else:
        return None
    return (f"{model.name}: step_overhead_ns and token_ns are both 0 (and no moe_expert_ns): {free} would take 0 ns "
            "(a TTFT or an inter-token gap of 0 ms)")


# The coefficients, in the order the fit and the TOML list them.
COEFFICIENTS = (
    "step_overhead_ns", "token_ns", "token_above_knee_ns", "attn_pair_ps", "kv_read_ps", "decode_seq_ns",
    "moe_expert_ns", "kv_copy_ns", "state_copy_ns", "kv_load_ns", "state_load_ns", "token_knee", "num_experts",
    "experts_per_token",
)
# The ones ``kvtrace calibrate`` fits (the knee and the MoE routing are chosen, copies derived).
FITTED_TERMS = (
    "step_overhead_ns", "token_ns", "token_above_knee_ns", "attn_pair_ps", "kv_read_ps", "decode_seq_ns",
    "moe_expert_ns", "kv_copy_ns", "state_copy_ns", "kv_load_ns", "state_load_ns",
)


def term_values(model: CostModel, work: StepWork) -> list[float]:
    """How much of each ``FITTED_TERMS`` coefficient's unit the step used: ``step_ns`` is
    (up to integer rounding) the dot product of these with the coefficients."""
    t = work.num_tokens
    above = max(0, t - model.token_knee) if model.token_knee else 0
    experts = (_experts_touched_fp(model.num_experts, model.experts_per_token, t) / (1 << _FP_BITS)
               if model.num_experts else 0.0)
    return [1.0, float(t), float(above), work.prefill_pairs / 1000, work.decode_context_tokens / 1000,
            float(work.num_decode_seqs), experts, float(work.num_kv_copies), float(work.num_state_copies),
            float(work.num_kv_loads), float(work.num_state_loads)]


_MOE_TABLES: dict[tuple[int, int], list[int]] = {}


def _experts_touched_fp(num_experts: int, k: int, num_tokens: int) -> int:
    """E * (1 - (1 - k/E)^T) in fixed point: the expected distinct experts T tokens route
    to, each picking k of E uniformly. (1 - k/E)^t is kept as floor(2^62 (E-k)^t / E^t),
    one integer step per token, memoised up to where it reaches 0 (a few million tokens at
    most): past that every expert is touched (a calibrate step of 2^40 tokens grew the
    table without end)."""
    q = _MOE_TABLES.get((num_experts, k))
    if q is None:
        q = _MOE_TABLES[(num_experts, k)] = [1 << _FP_BITS]
    if num_tokens >= len(q):
        while len(q) <= num_tokens and q[-1]:
            q.append(q[-1] * (num_experts - k) // num_experts)
        if num_tokens >= len(q):
            return num_experts << _FP_BITS
    return num_experts * ((1 << _FP_BITS) - q[num_tokens])


# Fitted by ``kvtrace calibrate --from tests/data/calibration/FILE`` (what the test holds).
COST_MODELS: dict[str, CostModel] = {
    m.name: m
    for m in (
        CostModel(
            "h200-dense-8b", step_overhead_ns=4_868_663, token_ns=11_675, attn_pair_ps=807, kv_read_ps=29_351,
            decode_seq_ns=872, kv_copy_ns=5_000, kv_load_ns=2_621, token_knee=512, token_above_knee_ns=9_019,
            source="Llama-3.1-8B bf16, 1 H200, vLLM 0.24.0 kernels (AIConfigurator 0.12.0): "
                   "tests/data/calibration/aic-h200-llama-3.1-8b-tp1.csv",
        ),
        CostModel(
            "h200-dense-70b-tp4", step_overhead_ns=12_235_275, token_ns=29_177, attn_pair_ps=1_020, kv_read_ps=18_553,
            decode_seq_ns=2_676, kv_copy_ns=5_000, kv_load_ns=1_638, token_knee=256, token_above_knee_ns=32_445,
            source="Llama-3.1-70B bf16, 4 H200 (TP 4), vLLM 0.24.0 kernels (AIConfigurator 0.12.0): "
                   "tests/data/calibration/aic-h200-llama-3.1-70b-tp4.csv",
        ),
        CostModel(
            "h200-dense-70b-tp8", step_overhead_ns=8_130_708, token_ns=26_131, attn_pair_ps=508, kv_read_ps=9_493,
            decode_seq_ns=0, kv_copy_ns=5_000, kv_load_ns=819, token_knee=256, token_above_knee_ns=11_698,
            source="Llama-3.1-70B bf16, 8 H200 (TP 8), vLLM 0.24.0 kernels (AIConfigurator 0.12.0): "
                   "tests/data/calibration/aic-h200-llama-3.1-70b-tp8.csv",
        ),
        CostModel(
            "h200-kimi-hybrid", step_overhead_ns=3_719_004, token_ns=5_979, attn_pair_ps=223, kv_read_ps=1_787,
            decode_seq_ns=14_703, kv_copy_ns=2_000, state_copy_ns=12_000, kv_load_ns=161,
            state_load_ns=838_861, token_knee=256, token_above_knee_ns=5_606,
            moe_expert_ns=101_848, num_experts=256, experts_per_token=8,
            source="Kimi-Linear-48B-A3B shape, 1 H200, vLLM 0.24.0 kernels, partly estimated (AIConfigurator 0.12.0 "
                   "HYBRID): tests/data/calibration/aic-h200-kimi-linear-48b-a3b-tp1.csv",
        ),
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
        if self.now_ns > MAX_TIME_NS:
            raise ConfigError(f"cost model {self.cost.name}", None, "the virtual clock passed 2^63 ns (292 years); "
                              "its coefficients are too large for this workload")
        return start, self.now_ns
