"""Seeded synthetic workloads (``kvtrace generate``; ``kvtrace demo`` replays ``mixed``).

Every workload is built at token level from ``numpy.random.Generator(PCG64(seed))`` and
then, by default, expressed as prefix-chained ``hash_ids`` of ``block_size`` tokens
(ids in order of first appearance, as a Mooncake trace would give them), or kept as
``token_ids`` with ``prompt="tokens"``. Same name, seed and sizes -> identical requests.

General workloads
- ``chat``: multi-turn conversations over a few shared system prompts. Turn k's prompt
  is the system prompt, all earlier user messages and assistant answers, and a new user
  message, so later turns extend the conversation (prefix reuse within a session).
- ``agent``: tool-using agent sessions: a long shared tool/system preamble, then steps
  that append the model's tool call and a tool output, so contexts grow to ~10k tokens
  with short gaps between steps.
- ``mixed``: chat and agent sessions interleaved (the demo workload; sized so an
  engine replay takes seconds).

Study workloads (one per behaviour in CACHE_SEMANTICS.md; ``mamba_block_size`` is the
Mamba/KDA group's block size of the preset the study runs, a multiple of ``block_size``)
- ``study-transient-checkpoint-retention``: long prompts (several prefill chunks) made
  of one of a few hot shared prefixes (a whole number of Mamba blocks) plus a long
  unique suffix. Published transient checkpoints compete with the hot prefixes.
- ``study-shared-prefix-pinning``: many short requests over three system prompts whose
  length is a multiple of ``block_size`` but *not* of ``mamba_block_size``: the junction
  (shared-prefix boundary) falls inside a Mamba block, where neither a block boundary
  nor a prompt end would keep a state at retention 0. Only pinning keeps it.
- ``study-external-hit-running-cow``: families of a parent whose prompt ends at
  ``E = m*mamba_block_size + block_size`` (a hash boundary inside a Mamba block), filler
  requests that push the parent out of GPU memory (to the external tier), then children
  whose prompt is the parent's plus ``d`` tokens, ending inside the *same* Mamba block
  and not on a hash boundary: the external hit ends mid-block and the prefill continues
  to a partial tail in that block (the 10 -> 14 -> 15 geometry of review 003, scaled).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtrace.cache.tokens import VOCAB_SIZE
from kvtrace.engine.workload import TraceRequest
from kvtrace.errors import ConfigError
from kvtrace.replay.writers import BlockInterner, write_mooncake, write_native

_NS_PER_S = 1_000_000_000
STUDY_PREFIX = "study-"


@dataclass(slots=True)
class _Draft:
    arrival_ns: int
    order: int
    request_id: str
    session: str | None
    tokens: np.ndarray
    output_length: int


class _Workload:
    """Collects draft requests; turns them into TraceRequests sorted by arrival."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.drafts: list[_Draft] = []

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB_SIZE, size=int(n), dtype=np.int64)

    def add(self, arrival_s: float, rid: str, session: str | None, tokens: np.ndarray, output_length: int) -> None:
        self.drafts.append(
            _Draft(round(arrival_s * _NS_PER_S), len(self.drafts), rid, session, tokens, int(output_length))
        )

    def sorted_drafts(self) -> list[_Draft]:
        return sorted(self.drafts, key=lambda d: (d.arrival_ns, d.order))


def _uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))


# -- general workloads -------------------------------------------------------------------

def _chat(w: _Workload, num_requests: int, tag: str = "chat", t0: float = 0.0,
          session_gap_s: float = 1.2) -> None:
    rng = w.rng
    system_prompts = [w.tokens(_uniform_int(rng, 300, 1200)) for _ in range(4)]
    popularity = np.array([0.4, 0.3, 0.2, 0.1])
    made, session, t = 0, 0, t0
    while made < num_requests:
        t += float(rng.exponential(session_gap_s))
        turns = min(1 + int(rng.geometric(0.35)), 8, num_requests - made)
        context = system_prompts[int(rng.choice(4, p=popularity))]
        ts = t
        for turn in range(turns):
            context = np.concatenate([context, w.tokens(_uniform_int(rng, 20, 300))])
            out = _uniform_int(rng, 16, 160)
            w.add(ts, f"{tag}{session}-t{turn}", f"{tag}{session}", context, out)
            # the answer becomes part of the next turn's prompt
            context = np.concatenate([context, w.tokens(out)])
            ts += float(rng.uniform(3.0, 20.0))
        made += turns
        session += 1


def _agent(w: _Workload, num_requests: int, tag: str = "agent", t0: float = 0.0,
           session_gap_s: float = 4.0) -> None:
    rng = w.rng
    preambles = [w.tokens(_uniform_int(rng, 2000, 3000)) for _ in range(2)]
    made, session, t = 0, 0, t0
    while made < num_requests:
        t += float(rng.exponential(session_gap_s))
        steps = min(_uniform_int(rng, 6, 14), num_requests - made)
        context = np.concatenate([preambles[int(rng.integers(2))], w.tokens(_uniform_int(rng, 200, 800))])
        ts = t
        for step in range(steps):
            out = _uniform_int(rng, 30, 200)
            w.add(ts, f"{tag}{session}-s{step}", f"{tag}{session}", context, out)
            tool_output = w.tokens(_uniform_int(rng, 100, 1500))
            context = np.concatenate([context, w.tokens(out), tool_output])
            ts += float(rng.uniform(0.5, 4.0))
        made += steps
        session += 1


def _mixed(w: _Workload, num_requests: int) -> None:
    n_agent = num_requests // 3
    _chat(w, num_requests - n_agent)
    _agent(w, n_agent, session_gap_s=6.0)


# -- study workloads ---------------------------------------------------------------------

def _study_transient_checkpoint(w: _Workload, num_requests: int, block_size: int, mamba_bs: int) -> None:
    rng = w.rng
    hot = [w.tokens(mamba_bs * _uniform_int(rng, 24, 40)) for _ in range(4)]
    popularity = np.array([0.4, 0.3, 0.2, 0.1])
    t = 0.0
    for i in range(num_requests):
        t += float(rng.uniform(0.5, 1.0))
        k = int(rng.choice(4, p=popularity))
        prompt = np.concatenate([hot[k], w.tokens(_uniform_int(rng, 3000, 6000))])
        w.add(t, f"ckpt{i}", f"hot{k}", prompt, _uniform_int(rng, 8, 32))


def _not_aligned_length(rng: np.random.Generator, block_size: int, mamba_bs: int, lo_blocks: int, hi_blocks: int) -> int:
    per = mamba_bs // block_size
    if per < 2:
        raise ConfigError("generate", "mamba_block_size", f"must be >= 2 x block_size ({block_size}), got {mamba_bs}")
    return mamba_bs * _uniform_int(rng, lo_blocks, hi_blocks) + block_size * _uniform_int(rng, 1, per - 1)


def _study_shared_prefix(w: _Workload, num_requests: int, block_size: int, mamba_bs: int) -> None:
    rng = w.rng
    system_prompts = [w.tokens(_not_aligned_length(rng, block_size, mamba_bs, 16, 32)) for _ in range(3)]
    t = 0.0
    for i in range(num_requests):
        t += float(rng.uniform(0.2, 0.5))
        k = i % 3 if i < 3 else int(rng.integers(3))
        prompt = np.concatenate([system_prompts[k], w.tokens(_uniform_int(rng, 40, 300))])
        w.add(t, f"sys{k}-q{i}", f"sys{k}", prompt, _uniform_int(rng, 8, 32))


def _study_external_cow(w: _Workload, num_requests: int, block_size: int, mamba_bs: int,
                        fillers_per_family: int = 3, children_per_family: int = 2) -> None:
    rng = w.rng
    per = mamba_bs // block_size
    if per < 3:
        raise ConfigError("generate", "mamba_block_size", f"must be >= 3 x block_size ({block_size}), got {mamba_bs}")
    t, i, fam = 0.0, 0, 0
    while i < num_requests:
        # the parent's prompt ends on a hash boundary one hash block into a Mamba block
        parent = w.tokens(mamba_bs * _uniform_int(rng, 4, 16) + block_size)
        t += 1.0
        w.add(t, f"fam{fam}-parent", f"fam{fam}", parent, _uniform_int(rng, 8, 16))
        i += 1
        for f in range(min(fillers_per_family, num_requests - i)):
            t += 1.0
            w.add(t, f"fam{fam}-fill{f}", None, w.tokens(mamba_bs * _uniform_int(rng, 8, 16)), 8)
            i += 1
        for c in range(min(children_per_family, num_requests - i)):
            # d > block_size so a tail hash boundary lies past E, d % block_size != 0 so the
            # prompt continues past it, and E + d stays inside the same Mamba block
            d = block_size * _uniform_int(rng, 1, per - 2) + _uniform_int(rng, 1, block_size - 1)
            t += 1.0
            w.add(t, f"fam{fam}-child{c}", f"fam{fam}", np.concatenate([parent, w.tokens(d)]),
                  _uniform_int(rng, 8, 16))
            i += 1
        fam += 1


# -- registry ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    build: Callable
    default_requests: int
    study: bool = False
    description: str = ""


WORKLOADS: dict[str, WorkloadSpec] = {
    "chat": WorkloadSpec(lambda w, n, bs, mbs: _chat(w, n), 160, description="multi-turn chat, shared system prompts"),
    "agent": WorkloadSpec(lambda w, n, bs, mbs: _agent(w, n), 80, description="agent sessions, growing contexts"),
    "mixed": WorkloadSpec(lambda w, n, bs, mbs: _mixed(w, n), 150, description="chat + agent (demo default)"),
    "study-transient-checkpoint-retention": WorkloadSpec(
        _study_transient_checkpoint, 60, True, "long prompts over hot shared prefixes"),
    "study-shared-prefix-pinning": WorkloadSpec(
        _study_shared_prefix, 90, True, "short requests over system prompts ending mid Mamba block"),
    "study-external-hit-running-cow": WorkloadSpec(
        _study_external_cow, 60, True, "external hits ending mid Mamba block, continued in it"),
}
DEFAULT_WORKLOAD = "mixed"


def study_workload(behaviour: str) -> str:
    """The generated workload built to expose ``behaviour`` (a CacheConfig behaviour name)."""
    name = STUDY_PREFIX + behaviour
    if name not in WORKLOADS:
        raise ConfigError("generate", "behaviour", f"no study workload for {behaviour!r}")
    return name


def generate(
    name: str = DEFAULT_WORKLOAD,
    seed: int = 0,
    num_requests: int | None = None,
    *,
    block_size: int = 16,
    mamba_block_size: int = 64,
    prompt: str = "hash",
) -> list[TraceRequest]:
    """Build workload ``name`` with ``seed``; ``prompt`` is "hash" (hash_ids of
    ``block_size`` tokens) or "tokens" (token_ids)."""
    spec = WORKLOADS.get(name)
    if spec is None:
        raise ConfigError("generate", "workload", f"unknown {name!r}; expected one of {', '.join(WORKLOADS)}")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError("generate", "seed", f"expected an int >= 0, got {seed!r}")
    n = spec.default_requests if num_requests is None else num_requests
    if not isinstance(n, int) or n < 1:
        raise ConfigError("generate", "num_requests", f"expected an int >= 1, got {n!r}")
    if block_size < 1 or mamba_block_size % block_size:
        raise ConfigError("generate", "mamba_block_size",
                          f"expected a multiple of block_size {block_size}, got {mamba_block_size}")
    if prompt not in ("hash", "tokens"):
        raise ConfigError("generate", "prompt", f"expected 'hash' or 'tokens', got {prompt!r}")
    w = _Workload(np.random.Generator(np.random.PCG64(seed)))
    spec.build(w, n, block_size, mamba_block_size)
    interner = BlockInterner(block_size) if prompt == "hash" else None
    out: list[TraceRequest] = []
    for d in w.sorted_drafts()[:n]:
        req = TraceRequest(
            request_id=d.request_id,
            arrival_ns=d.arrival_ns,
            input_length=int(d.tokens.shape[0]),
            output_length=d.output_length,
            session_id=d.session,
        )
        req.token_ids = d.tokens
        if interner is not None:
            req.hash_ids = tuple(interner.block_ids(req))
            req.hash_block_size = block_size
            req.token_ids = None
        out.append(req)
    return out


def write_generated(
    name: str,
    out: str | os.PathLike,
    *,
    fmt: str = "native",
    seed: int = 0,
    num_requests: int | None = None,
    block_size: int = 16,
    mamba_block_size: int = 64,
    prompt: str = "hash",
    mooncake_block_size: int = 512,
) -> int:
    """Generate and write a workload as ``native`` (lossless) or ``mooncake`` JSONL
    (re-blocked to ``mooncake_block_size``: a study's sub-block geometry is lost)."""
    reqs = generate(name, seed, num_requests, block_size=block_size, mamba_block_size=mamba_block_size,
                    prompt=prompt)
    if fmt == "native":
        header = {"generator": name, "seed": seed, "mamba_block_size": mamba_block_size}
        if prompt == "hash":
            header["block_size"] = block_size
        return write_native(reqs, out, header=header)
    if fmt == "mooncake":
        return write_mooncake(reqs, out, block_size=mooncake_block_size)
    raise ConfigError("generate", "format", f"expected 'native' or 'mooncake', got {fmt!r}")
