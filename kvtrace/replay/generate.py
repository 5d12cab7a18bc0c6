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
  that append the model's tool call and a tool output, so contexts grow to ~15k tokens
  with short gaps between steps.
- ``mixed``: chat and agent sessions interleaved (the demo workload; sized so an
  engine replay takes seconds).

Study workloads (one per behaviour in docs/cache_semantics.md). Their geometry is laid out
in the replaying preset's units: ``hash_block_size`` H and ``mamba_block_size`` M
(kimi-hybrid: 64 and 512). ``WORKLOADS[name].hints`` suggests replay settings
(retention, capacities, external tier) under which the effect shows.

- ``study-transient-checkpoint-retention``: prompts of one of four hot shared prefixes
  (whole Mamba blocks, 2-4k tokens, Zipf-like popularity) plus a 9-20k-token unique
  suffix (longer than one 8192-token prefill chunk) that does not end on a hash
  boundary. The prefill stops at the junction and at the tail hash boundary, so
  checkpoints fall inside the prompt: transient ones.
  Published (behaviour off), they compete in a small Mamba pool with the hot prefixes.
- ``study-shared-prefix-pinning``: many short requests over three system prompts whose
  length is a multiple of H but *not* of M: the junction (shared-prefix boundary) lies
  inside a Mamba block, where neither a block boundary nor a prompt end keeps a state
  at retention 0. User messages are longer than a Mamba block, so the state at a
  prompt's last full block never covers only the system prompt. Only pinning keeps the
  junction's state; without it every request re-prefills the system prompt.
- ``study-external-hit-running-cow``: families of a parent whose prompt ends at
  ``E = m*M + H`` (a hash boundary one hash block into a Mamba block), filler requests
  that push the parent out of GPU memory (it stays in the external tier), then children
  whose prompt is the parent's plus ``d = j*H + r`` tokens (1 <= j <= M/H - 2,
  0 < r < H): the external hit ends mid-block, the prefill runs to a partial tail in the
  same block and continues past it (review 003's 10 -> 14 -> 15 geometry, scaled).
  A retry of the first child (the same prompt again) then hits the keys that child left:
  wrong content there shows up as divergent output tokens, the "verbatim repeats".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtrace.errors import MAX_SEED, ConfigError
from kvtrace.replay.writers import BlockInterner, write_mooncake
from kvtrace.workload import TraceRequest
from kvtrace.workload.lines import VOCAB_SIZE
from kvtrace.workload.native import write_native

_NS_PER_S = 1_000_000_000
STUDY_PREFIX = "study-"
MAX_GENERATED = 1_000_000  # requests are built in memory: a larger workload is a typo, not a study
# Prompt tokens of one generated workload at most (int64s in memory, a GiB): an agent's
# sessions grow long contexts, so a million of its requests would have needed 80 GB.
MAX_GENERATED_TOKENS = 1 << 27
# Block ids of one generated workload at most (prompt="hash": each interned, a dict entry):
# block_size 1 under a 2^20-token Mamba block gave 3.3M ids a request, 2.5 GB for three. At
# the default 16-token blocks it is MAX_GENERATED_TOKENS's own bound.
MAX_GENERATED_IDS = MAX_GENERATED_TOKENS // 16


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

    def __init__(self, rng: np.random.Generator, asked: int = 0, max_tokens: int = MAX_GENERATED_TOKENS):
        self.rng = rng
        self.drafts: list[_Draft] = []
        self.asked = asked  # requests asked for (what a refusal names)
        self.num_tokens = 0
        self.max_tokens = max_tokens

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB_SIZE, size=int(n), dtype=np.int64)

    def add(self, arrival_s: float, rid: str, session: str | None, tokens: np.ndarray, output_length: int) -> None:
        self.num_tokens += int(tokens.shape[0])
        if self.num_tokens > self.max_tokens:
            raise ConfigError("--requests", str(self.asked),
                              f"this workload's prompts pass {self.max_tokens:,} tokens after "
                              f"{len(self.drafts):,} requests (a generated workload is built in memory); ask for fewer"
                              + ("" if self.max_tokens == MAX_GENERATED_TOKENS else
                                 f", or a larger block_size (at most {MAX_GENERATED_IDS:,} block ids)"))
        self.drafts.append(
            _Draft(round(arrival_s * _NS_PER_S), len(self.drafts), rid, session, tokens, int(output_length))
        )

    def sorted_drafts(self) -> list[_Draft]:
        return sorted(self.drafts, key=lambda d: (d.arrival_ns, d.order))


def _uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))


# -- general workloads -------------------------------------------------------------------

def _chat(w: _Workload, num_requests: int, tag: str = "chat", t0: float = 0.0,
          session_gap_s: float = 0.4) -> None:
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
            out = _uniform_int(rng, 16, 96)
            w.add(ts, f"{tag}{session}-t{turn}", f"{tag}{session}", context, out)
            # the answer becomes part of the next turn's prompt
            context = np.concatenate([context, w.tokens(out)])
            ts += float(rng.uniform(2.0, 8.0))  # reading and typing time
        made += turns
        session += 1


def _agent(w: _Workload, num_requests: int, tag: str = "agent", t0: float = 0.0,
           session_gap_s: float = 1.5) -> None:
    rng = w.rng
    preambles = [w.tokens(_uniform_int(rng, 2000, 3000)) for _ in range(2)]
    made, session, t = 0, 0, t0
    while made < num_requests:
        t += float(rng.exponential(session_gap_s))
        steps = min(_uniform_int(rng, 6, 14), num_requests - made)
        context = np.concatenate([preambles[int(rng.integers(2))], w.tokens(_uniform_int(rng, 200, 800))])
        ts = t
        for step in range(steps):
            out = _uniform_int(rng, 30, 120)
            w.add(ts, f"{tag}{session}-s{step}", f"{tag}{session}", context, out)
            tool_output = w.tokens(_uniform_int(rng, 100, 1500))
            context = np.concatenate([context, w.tokens(out), tool_output])
            ts += float(rng.uniform(0.5, 3.0))  # tool execution time
        made += steps
        session += 1


def _mixed(w: _Workload, num_requests: int) -> None:
    n_agent = num_requests // 3
    _chat(w, num_requests - n_agent)
    _agent(w, n_agent, session_gap_s=2.5)


# -- study workloads ---------------------------------------------------------------------

def _blocks_for(tokens: int, block: int) -> int:
    return max(1, round(tokens / block))


def _study_transient_checkpoint(w: _Workload, num_requests: int, g: _Geometry) -> None:
    rng = w.rng
    mbs = g.mamba_block_size
    # hot prefixes of ~2-4k tokens, whole Mamba blocks (the junction is block-aligned)
    lo, hi = _blocks_for(2048, mbs), _blocks_for(4096, mbs)
    hot = [w.tokens(mbs * _uniform_int(rng, lo, max(lo, hi))) for _ in range(4)]
    popularity = np.array([0.4, 0.3, 0.2, 0.1])
    t = 0.0
    for i in range(num_requests):
        t += float(rng.uniform(0.5, 1.0))
        k = int(rng.choice(4, p=popularity))
        # a long unique suffix, not ending on a hash boundary, longer than one prefill
        # chunk (8192 tokens): the chunks before the last one end inside the prompt, so
        # their checkpoints are transient (vLLM 0.33 reserves none there at retention 0;
        # the old behaviour publishes them)
        suffix = g.hash_block_size * _uniform_int(rng, 9000 // g.hash_block_size, 20000 // g.hash_block_size)
        suffix += _uniform_int(rng, 1, g.hash_block_size - 1)
        prompt = np.concatenate([hot[k], w.tokens(suffix)])
        w.add(t, f"ckpt{i}", f"hot{k}", prompt, _uniform_int(rng, 8, 32))


def _not_aligned_length(rng: np.random.Generator, g: _Geometry, lo_tokens: int, hi_tokens: int) -> int:
    """A multiple of the hash block size that is not a multiple of the Mamba block size."""
    mbs, hbs = g.mamba_block_size, g.hash_block_size
    per = mbs // hbs
    lo, hi = _blocks_for(lo_tokens, mbs), _blocks_for(hi_tokens, mbs)
    return mbs * _uniform_int(rng, lo, max(lo, hi)) + hbs * _uniform_int(rng, 1, per - 1)


def _study_shared_prefix(w: _Workload, num_requests: int, g: _Geometry) -> None:
    rng = w.rng
    system_prompts = [w.tokens(_not_aligned_length(rng, g, 1024, 2048)) for _ in range(3)]
    t = 0.0
    for i in range(num_requests):
        t += float(rng.uniform(0.2, 0.5))
        k = i % 3 if i < 3 else int(rng.integers(3))
        # The user message runs past the next Mamba block boundary, so the state at the
        # prompt's last full block (kept at retention 0) lies beyond the system prompt
        # and cannot stand in for the junction's state.
        user = _uniform_int(rng, g.mamba_block_size + 8, 2 * g.mamba_block_size)
        prompt = np.concatenate([system_prompts[k], w.tokens(user)])
        w.add(t, f"sys{k}-q{i}", f"sys{k}", prompt, _uniform_int(rng, 8, 32))


def _study_external_cow(w: _Workload, num_requests: int, g: _Geometry,
                        fillers_per_family: int = 3, children_per_family: int = 2) -> None:
    rng = w.rng
    mbs, hbs = g.mamba_block_size, g.hash_block_size
    per = mbs // hbs
    t, i, fam = 0.0, 0, 0
    while i < num_requests:
        # the parent's prompt tail, (num_prompt_tokens - 1) // hash * hash, lies one hash
        # block into a Mamba block (its last token is recomputed by a resend)
        parent = w.tokens(mbs * _uniform_int(rng, _blocks_for(512, mbs), _blocks_for(2048, mbs)) + hbs + 1)
        t += 1.0
        w.add(t, f"fam{fam}-parent", f"fam{fam}", parent, _uniform_int(rng, 8, 16))
        i += 1
        for f in range(min(fillers_per_family, num_requests - i)):
            t += 1.0
            filler = w.tokens(mbs * _uniform_int(rng, _blocks_for(2048, mbs), _blocks_for(3072, mbs)))
            w.add(t, f"fam{fam}-fill{f}", None, filler, 8)
            i += 1
        for c in range(min(children_per_family, num_requests - i)):
            # d > one hash block so a tail hash boundary lies past E, (E + d) % hash block
            # != 0 so the prompt continues past it, and E + d stays inside the same Mamba block
            d = hbs * _uniform_int(rng, 1, per - 2) + _uniform_int(rng, 1, hbs - 2)
            t += 1.0
            child = np.concatenate([parent, w.tokens(d)])
            w.add(t, f"fam{fam}-child{c}", f"fam{fam}", child, _uniform_int(rng, 8, 16))
            i += 1
            if c == 0 and i < num_requests:
                # the user retries the same message: a local hit on the keys the child left
                t += 1.0
                w.add(t, f"fam{fam}-retry{c}", f"fam{fam}", child, _uniform_int(rng, 8, 16))
                i += 1
        fam += 1


# -- registry ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Geometry:
    block_size: int  # tokens per trace hash id
    hash_block_size: int  # the cache's hash unit (kimi-hybrid: 64)
    mamba_block_size: int  # the Mamba/KDA group's block size (kimi-hybrid: 512)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    build: Callable
    default_requests: int
    description: str = ""
    # Suggested replay settings (RunSpec fields) under which the study shows its effect
    # with kimi-hybrid: capacities small enough that what the behaviour keeps or drops
    # matters. Empty for general workloads.
    hints: dict = field(default_factory=dict)


WORKLOADS: dict[str, WorkloadSpec] = {
    "chat": WorkloadSpec(lambda w, n, g: _chat(w, n), 160, "multi-turn chat, shared system prompts"),
    "agent": WorkloadSpec(lambda w, n, g: _agent(w, n), 80, "agent sessions, growing contexts"),
    "mixed": WorkloadSpec(lambda w, n, g: _mixed(w, n), 150, "chat + agent (demo default)"),
    "study-transient-checkpoint-retention": WorkloadSpec(
        _study_transient_checkpoint, 60, "long prompts over hot shared prefixes",
        # a pool per group (SGLang's layout) with a small state pool: the checkpoints crowd
        # the states alone; in one shared pool the attention blocks dilute them
        {"preset": "kimi-hybrid", "retention": "0", "capacity_blocks": (1024, 16)}),
    "study-shared-prefix-pinning": WorkloadSpec(
        _study_shared_prefix, 90, "short requests over system prompts ending mid Mamba block",
        {"preset": "kimi-hybrid", "retention": "0"}),
    "study-external-hit-running-cow": WorkloadSpec(
        _study_external_cow, 60, "external hits ending mid Mamba block, continued in it",
        # the former two 10-block pools, now one shared pool
        {"preset": "kimi-hybrid", "capacity_blocks": 20, "external_capacity_blocks": 4096}),
}
DEFAULT_WORKLOAD = "mixed"

# The largest block size of any unit (a Mamba block of 2^20 tokens: one study prompt's
# pieces stay megabytes, where a 2^40-token geometry asked numpy for 64 TiB at once).
MAX_GEOMETRY_TOKENS = 1 << 20
# The smallest sizes a study's layout has room in (else numpy's "low >= high"): the
# transient study's suffix ends 1 to H-1 tokens past a hash boundary, the CoW study's
# child 1 to H-2 tokens past one, and the pinning study's user message is M+8 to 2M tokens.
_LEAST_GEOMETRY: dict[str, dict[str, int]] = {
    "study-transient-checkpoint-retention": {"hash_block_size": 2},
    "study-external-hit-running-cow": {"hash_block_size": 3},
    "study-shared-prefix-pinning": {"mamba_block_size": 8},
}


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
    hash_block_size: int = 64,
    mamba_block_size: int = 512,
    prompt: str = "hash",
) -> list[TraceRequest]:
    """Build workload ``name`` with ``seed``.

    ``prompt`` is "hash" (hash_ids of ``block_size`` tokens) or "tokens" (token_ids).
    Study geometry is laid out in units of the replaying preset's ``hash_block_size``
    and ``mamba_block_size`` (defaults: kimi-hybrid's 64 and 512); ``block_size`` must
    divide the hash block size so that shared prefixes end exactly where designed.
    """
    spec = WORKLOADS.get(name)
    if spec is None:
        raise ConfigError("generate", "workload", f"unknown {name!r}; expected one of {', '.join(WORKLOADS)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ConfigError("--seed", str(seed), f"expected an int from 0 to {MAX_SEED:,}")
    n = spec.default_requests if num_requests is None else num_requests
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_GENERATED:
        raise ConfigError("--requests", str(n), f"expected an int from 1 to {MAX_GENERATED:,}")
    # each size checked on its own first: a 0 divided (ZeroDivisionError), a float or None
    # reached numpy, and a block_size of 0 was blamed on hash_block_size
    least = _LEAST_GEOMETRY.get(name, {})
    for key, size in (("block_size", block_size), ("hash_block_size", hash_block_size),
                      ("mamba_block_size", mamba_block_size)):
        lo = least.get(key, 1)
        if not isinstance(size, int) or isinstance(size, bool) or not lo <= size <= MAX_GEOMETRY_TOKENS:
            raise ConfigError("generate", key, f"expected an int from {lo} to {MAX_GEOMETRY_TOKENS:,} tokens"
                                               f"{' for ' + name if lo > 1 else ''}, got {size!r}")
    if hash_block_size % block_size:
        raise ConfigError("generate", "hash_block_size",
                          f"expected a multiple of block_size {block_size}, got {hash_block_size}")
    if mamba_block_size % hash_block_size or mamba_block_size < 3 * hash_block_size:
        raise ConfigError("generate", "mamba_block_size",
                          f"expected a multiple of hash_block_size {hash_block_size}, at least 3x, "
                          f"got {mamba_block_size}")
    if prompt not in ("hash", "tokens"):
        raise ConfigError("generate", "prompt", f"expected 'hash' or 'tokens', got {prompt!r}")
    # (as hash ids, at most MAX_GENERATED_IDS blocks of block_size tokens)
    most = MAX_GENERATED_TOKENS if prompt == "tokens" else min(MAX_GENERATED_TOKENS, MAX_GENERATED_IDS * block_size)
    w = _Workload(np.random.Generator(np.random.PCG64(seed)), n, most)
    spec.build(w, n, _Geometry(block_size, hash_block_size, mamba_block_size))
    interner = BlockInterner(block_size) if prompt == "hash" else None
    out: list[TraceRequest] = []
    for d in w.sorted_drafts()[:n]:
        req = TraceRequest(
            request_id=d.request_id,
            arrival_ns=d.arrival_ns,
            input_length=int(d.tokens.shape[0]),
            output_length=d.output_length,
            session_id=d.session,
            token_ids=d.tokens,
        )
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
    hash_block_size: int = 64,
    mamba_block_size: int = 512,
    prompt: str = "hash",
    mooncake_block_size: int = 512,
) -> int:
    """Generate and write a workload as ``native`` (lossless) or ``mooncake`` JSONL
    (re-blocked to ``mooncake_block_size``: sub-block study geometry is lost)."""
    reqs = generate(name, seed, num_requests, block_size=block_size, hash_block_size=hash_block_size,
                    mamba_block_size=mamba_block_size, prompt=prompt)
    if fmt == "native":
        header = {"generator": name, "seed": seed, "hash_block_size": hash_block_size,
                  "mamba_block_size": mamba_block_size}
        if prompt == "hash":
            header["block_size"] = block_size
        return write_native(reqs, out, header=header)
    if fmt == "mooncake":
        return write_mooncake(reqs, out, block_size=mooncake_block_size)
    raise ConfigError("generate", "format", f"expected 'native' or 'mooncake', got {fmt!r}")
