"""What a worker returns for one step, and the worker of ``--no-content`` mode (torch-free).

``StepResult`` carries the sampled tokens and the step's counts that the clock and the
request records need. ``tally`` is the one definition of those counts: a chunk that
does not consume all its request's known tokens, or more than one token, is prefill;
a single token that does is a decode. ``NoContentWorker`` does only that: no device
storage, no content model, no verification. Every token it samples is
``NO_CONTENT_TOKEN``, an id outside the vocabulary that no prompt holds (a recorded output
is still replayed by the scheduler), so a block holding sampled tokens is never a later
prompt's: hits, timings and every cache event are those of content mode wherever content
mode's sampled tokens do not reach a later prompt's keys (trace prompts are given, as ids
or tokens, so they do not), and divergences and stale hashes are not looked for. (Token 0
was sampled: a later prompt holding a block of 0s after an earlier request's prompt hit
that request's outputs, which content mode does not.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrace.cache import CacheConfig, MambaSpec
from kvtrace.engine.scheduler import DecodeRun
from kvtrace.workload.lines import VOCAB_SIZE

NO_CONTENT_TOKEN = VOCAB_SIZE  # prompts' ids lie in [0, VOCAB_SIZE)


@dataclass(slots=True)
class Divergence:
    request_id: str
    position: int  # output index
    expected: int
    actual: int


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, int]
    divergences: list[Divergence]
    num_kv_copies: int = 0
    num_state_copies: int = 0
    prefill_pairs: int = 0
    decode_context_tokens: int = 0
    num_decode_seqs: int = 0
    num_prefill_tokens: int = 0
    table_disagreements: int = 0  # Core's running-state block != the worker's table slot
    prefill_spans: list[tuple[str, int, int]] = field(default_factory=list)  # (request, start, num_tokens)


def tally(res: StepResult, request, start: int, n: int) -> bool:
    """Count the chunk [start, start + n) of ``request`` into ``res``; True when it samples
    (it consumes all the request's known tokens)."""
    num_tokens = request.num_prompt_tokens + len(request.output_token_ids)
    if n > 1 or start + n < num_tokens:
        res.prefill_pairs += n * start + n * (n + 1) // 2
        res.num_prefill_tokens += n
        res.prefill_spans.append((request.request_id, start, n))
    else:
        res.num_decode_seqs += 1
        res.decode_context_tokens += start + n
    return start + n == num_tokens


class NoContentWorker:
    """The engine's worker without content: step counts and ``NO_CONTENT_TOKEN`` for every sample."""

    verify = False

    def __init__(self, cache_config: CacheConfig):
        self.state_groups = {g for g, s in enumerate(cache_config.groups) if isinstance(s, MambaSpec)}
        self.requests: dict = {}  # the batch, from the outputs only (as the content worker's tables)

    def execute(self, out) -> StepResult:
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
        res = StepResult(sampled={}, divergences=[])
        for c in out.block_copies:
            if c.group_id in self.state_groups:
                res.num_state_copies += 1
            else:
                res.num_kv_copies += 1
        scheduled = out.num_scheduled_tokens
        for nr in out.scheduled_new_reqs:  # the batch's order: new requests, then running ones
            self.requests[nr.request_id] = nr.request
            if tally(res, nr.request, nr.num_computed_tokens, scheduled[nr.request_id]):
                res.sampled[nr.request_id] = NO_CONTENT_TOKEN
        for cr in out.scheduled_cached_reqs:
            if isinstance(cr, DecodeRun):
                for request, start in zip(cr.requests, cr.starts):
                    tally(res, request, start, 1)  # a decode: it samples
                    res.sampled[request.request_id] = NO_CONTENT_TOKEN
                continue
            request = self.requests[cr.request_id]
            if tally(res, request, cr.num_computed_tokens, scheduled[cr.request_id]):
                res.sampled[cr.request_id] = NO_CONTENT_TOKEN
        return res

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
