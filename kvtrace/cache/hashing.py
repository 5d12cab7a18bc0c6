"""Chained block hashing, after vLLM's ``hash_block_tokens``.

hash(unit i) = H(parent or NONE_HASH, token ids of unit i, extra keys). Extra keys are
the LoRA name (every unit) and the cache salt (first unit only). ``sha256_cbor`` hashes
the canonical CBOR encoding and is stable across processes; ``xxhash`` (xxh3-64) hashes
the same encoding faster.

Trace requests given as prefix-chained block ids memoise the hashes of all units of a
trace block per (parent hash, namespace, id, extra keys): the cost grows with unique
blocks, not with tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import cbor2
import numpy as np
import xxhash

from kvtrace.numeric import cdiv

HashFn = Callable[[object], bytes]
# A block hash: bytes from the hash functions here; an int where the key is given (the
# trace ids of cache-only replay, vLLM's own int hashes), as vLLM's KV events carry.
BlockHash = bytes | int


class HashedRequest(Protocol):
    """What the hasher reads of a request (``kvtrace.cache.request.Request`` has it)."""

    _block_hashes: Sequence[BlockHash]  # a list, unless given keys the request never outgrows
    num_prompt_tokens: int
    trace_block_ids: tuple[int, ...] | None
    trace_block_size: int
    namespace: int
    lora_name: str | None
    cache_salt: str | None

    @property
    def num_tokens(self) -> int: ...

    def get_token_ids(self, start: int, end: int) -> np.ndarray: ...

_NONE_HASH_SEED = "kvtrace/NONE_HASH/v1"
# The trace-block memo is emptied past this many unit hashes (32-byte digests: about 75 MB with
# its keys), a day's replay kept every (parent, trace block) it met: 4-5 KB a request.
MAX_TRACE_MEMO_UNITS = 1 << 20


def sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_cbor(obj: object) -> bytes:
    return xxhash.xxh3_64_digest(cbor2.dumps(obj, canonical=True))


HASH_FNS: dict[str, HashFn] = {"sha256_cbor": sha256_cbor, "xxhash": xxhash_cbor}


def _sha256(encoded: bytes) -> bytes:
    return hashlib.sha256(encoded).digest()


# The same hashes of an already encoded object (trace_unit_cbor's bytes).
RAW_HASH_FNS: dict[str, Callable[[bytes], bytes]] = {"sha256_cbor": _sha256, "xxhash": xxhash.xxh3_64_digest}

_U64 = 1 << 64


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR head (RFC 8949 3.1) in its shortest form, as canonical encoding requires."""
    if n < 24:
        return bytes((major | n,))
    if n < 0x100:
        return bytes((major | 24, n))
    if n < 0x10000:
        return bytes((major | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((major | 26,)) + n.to_bytes(4, "big")
    return bytes((major | 27,)) + n.to_bytes(8, "big")


_TRACE_UNIT = b"\x84\x65trace"  # the 4-array ("trace", ...) and its text "trace"
# The common case's pieces: the 3-array head and a 32-byte parent's head; a unit index below
# 24, then the null extra keys.
_PARENT_32 = b"\x83\x58\x20"
_UNIT_TAILS = tuple(bytes((u, 0xF6)) for u in range(24))


def _trace_unit_middle(namespace: int, block_id: int) -> bytes:
    """("trace", namespace, block_id, ...: the part of a unit's encoding its block fixes
    (a namespace below 24, an id below 2^64)."""
    return b"".join((_TRACE_UNIT, bytes((namespace,)), _cbor_head(0x00, block_id)))


def trace_unit_cbor(parent: bytes, namespace: int, block_id: int, unit: int) -> bytes | None:
    """``cbor2.dumps((parent, ("trace", namespace, block_id, unit), None), canonical=True)``,
    built directly (cbor2's general encoder is most of a trace unit's hash), or None for an
    int beyond 64 bits (a bignum: left to cbor2). tests/cache/test_config_and_hashing.py
    holds both equal on random inputs."""
    if type(parent) is not bytes:
        return None
    if len(parent) == 32 and 0 <= namespace < 24 and 0 <= unit < 24 and 0 <= block_id < _U64:
        # the common case (a sha256 parent, a small namespace and unit) in one join: half the time
        return b"".join((_PARENT_32, parent, _trace_unit_middle(namespace, block_id), _UNIT_TAILS[unit]))
    ints = b""
    for v in (namespace, block_id, unit):
        if 0 <= v < _U64:
            ints += _cbor_head(0x00, v)
        elif -_U64 <= v < 0:
            ints += _cbor_head(0x20, -1 - v)
        else:
            return None
    return b"\x83" + _cbor_head(0x40, len(parent)) + parent + _TRACE_UNIT + ints + b"\xf6"


def trace_block_unit_hashes(hash_raw: Callable[[bytes], bytes], parent: bytes, namespace: int, block_id: int,
                            count: int) -> tuple[bytes, ...] | None:
    """The chained hashes of units ``0..count-1`` of one trace block without extra keys, each
    ``hash_raw(trace_unit_cbor(previous, namespace, block_id, unit))``: the encoding's middle
    (namespace and id) is built once per block, not once per unit. None where the common
    case does not hold (a parent or hash other than 32 bytes, a namespace, unit or id too
    large for it): then each unit goes the general way."""
    if not (0 <= namespace < 24 and 0 <= count <= 24 and 0 <= block_id < _U64):
        return None
    middle = _trace_unit_middle(namespace, block_id)
    out = []
    p = parent
    for u in range(count):
        if type(p) is not bytes or len(p) != 32:
            return None
        p = hash_raw(b"".join((_PARENT_32, p, middle, _UNIT_TAILS[u])))
        out.append(p)
    return tuple(out)


def none_hash(hash_fn: HashFn) -> bytes:
    """The parent of the first unit: H of a fixed seed (deterministic across runs)."""
    return hash_fn(_NONE_HASH_SEED)


def hash_block_tokens(
    hash_fn: HashFn, parent: bytes, token_ids: tuple[int, ...] | list[int], extra_keys: tuple | None
) -> bytes:
    return hash_fn((parent, tuple(token_ids), extra_keys))


class BlockHasher:
    """Fills ``Request.block_hashes`` incrementally, in ``hash_block_size`` units.

    Token units hash ``(parent, tokens, extra keys)``. Units inside a trace block
    (``Request.trace_block_ids``) hash ``(parent, ("trace", namespace, id, unit index),
    extra keys)`` instead: a trace block's tokens are a pure function of (namespace,
    id), so this names the same content without synthesising tokens, and the hashes
    of all units of one (parent, id) are memoised. Token-given and id-given requests
    therefore do not share keys (a trace is replayed in one mode).
    """

    __slots__ = ("_memo_units", "_trace_memo", "hash_block_size", "hash_fn", "hash_raw", "memo_hits", "memo_misses",
                 "none_hash")

    def __init__(self, hash_fn_name: str, hash_block_size: int):
        self.hash_fn = HASH_FNS[hash_fn_name]
        self.hash_raw = RAW_HASH_FNS[hash_fn_name]
        self.hash_block_size = hash_block_size
        self.none_hash = none_hash(self.hash_fn)
        # (namespace, lora, salt, trace block size) -> {(parent, id): unit hashes of that block}
        # (the hash itself, not a 1-tuple, when a trace block is one unit: _update_trace)
        self._trace_memo: dict[tuple, dict[tuple[bytes, int], bytes | tuple[bytes, ...]]] = {}
        self._memo_units = 0  # unit hashes the memo holds, held to MAX_TRACE_MEMO_UNITS
        self.memo_hits = 0
        self.memo_misses = 0

    @staticmethod
    def extra_keys(request: HashedRequest, first_unit: bool) -> tuple | None:
        keys: tuple = ()
        if request.lora_name is not None:
            keys += (request.lora_name,)
        if first_unit and request.cache_salt:  # (vLLM's test: an empty salt is none)
            keys += (request.cache_salt,)
        return keys or None

    def update(self, request: HashedRequest) -> None:
        """Hash every full unit of ``request``'s tokens not hashed yet."""
        hashes = cast(list, request._block_hashes)  # grown below only when short: then a list
        hbs = self.hash_block_size
        target = request.num_tokens // hbs
        n = len(hashes)
        if n >= target:
            return
        tids = request.trace_block_ids
        tbs = request.trace_block_size
        if tids is not None and tbs and tbs % hbs == 0:
            per_block = tbs // hbs
            prompt_units = min(request.num_prompt_tokens // hbs, target)
            if n < prompt_units and n % per_block == 0:
                n = self._update_trace(request, hashes, tids, tbs, per_block, n, prompt_units)
        if n >= target:
            return
        tokens = request.get_token_ids(n * hbs, target * hbs)
        fn = self.hash_fn
        parent = hashes[n - 1] if n else self.none_hash
        lora_only = self.extra_keys(request, False)
        for i in range(target - n):
            unit = tuple(tokens[i * hbs:(i + 1) * hbs].tolist())
            extra = self.extra_keys(request, True) if n + i == 0 else lora_only
            parent = fn((parent, unit, extra))
            hashes.append(parent)

    def _trace_block_units(self, request: HashedRequest, parent: bytes, tid: int, j: int,
                           have: tuple[bytes, ...] | None, count: int) -> tuple[bytes, ...]:
        """The first ``count`` unit hashes of trace block ``tid`` (the ``j``-th of the request)
        after ``parent``, extending ``have`` (its first units, memoised earlier)."""
        ns = request.namespace
        if not have and self.extra_keys(request, j == 0) is None:  # (the first unit's keys: the widest)
            fast = trace_block_unit_hashes(self.hash_raw, parent, ns, tid, count)
            if fast is not None:
                return fast
        out = list(have) if have else []
        p = out[-1] if out else parent
        for u in range(len(out), count):
            p = self._trace_unit_hash(p, ns, tid, u, self.extra_keys(request, j == 0 and u == 0))
            out.append(p)
        return tuple(out)

    def _trace_unit_hash(self, parent: bytes, namespace: int, block_id: int, unit: int, extra: tuple | None) -> bytes:
        """H((parent, ("trace", namespace, block_id, unit), extra)): the direct encoding when
        it applies (no extra keys, 64-bit ints), cbor2's otherwise; the same bytes either way."""
        encoded = trace_unit_cbor(parent, namespace, block_id, unit) if extra is None else None
        if encoded is not None:
            return self.hash_raw(encoded)
        return self.hash_fn((parent, ("trace", namespace, block_id, unit), extra))

    def _update_trace(self, request, hashes, tids, tbs, per_block, n, prompt_units) -> int:
        if self._memo_units > MAX_TRACE_MEMO_UNITS:  # (a cache of a pure function: no key changes)
            self._trace_memo.clear()
            self._memo_units = 0
        ctx = (request.namespace, request.lora_name, request.cache_salt, tbs)
        memo = self._trace_memo.get(ctx)
        if memo is None:
            memo = self._trace_memo[ctx] = {}
        ns = request.namespace
        parent = hashes[n - 1] if n else self.none_hash
        j = n // per_block
        last_j = min(len(tids), cdiv(prompt_units, per_block))
        misses = 0
        if per_block == 1:  # one unit per trace block: the memo holds the hash itself
            append = hashes.append
            lora_only = self.extra_keys(request, False)
            get = memo.get
            unit_hash = self._trace_unit_hash
            for tid in tids[j:last_j]:
                h = get((parent, tid))
                if h is None:
                    misses += 1
                    h = unit_hash(parent, ns, tid, 0, self.extra_keys(request, True) if not hashes else lora_only)
                    memo[(parent, tid)] = h
                append(h)
                parent = h
        else:
            while j < last_j:
                tid = tids[j]
                # the units the prompt uses: all but in its last block, whose other units are
                # hashed when a later prompt reaches them (a 2^26-token trace block was 4M
                # hashes, seconds, for a prompt of a few hundred tokens)
                take = min(per_block, prompt_units - len(hashes))
                units = cast("tuple[bytes, ...] | None", memo.get((parent, tid)))  # (tuples: per_block > 1)
                if units is None or len(units) < take:
                    misses += units is None  # (a block's further units, hashed later, extend its entry)
                    self._memo_units -= len(units) if units else 0
                    units = self._trace_block_units(request, parent, tid, j, units, take)
                    memo[(parent, tid)] = units
                    self._memo_units += len(units)
                hashes.extend(units if take == len(units) else units[:take])
                parent = units[-1]  # (the next block's parent: this block was whole unless it is the last)
                j += 1
        if per_block == 1:
            self._memo_units += misses
        self.memo_misses += misses
        self.memo_hits += (last_j - n // per_block) - misses
        return len(hashes)
