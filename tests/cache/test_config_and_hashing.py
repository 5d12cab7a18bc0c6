"""CacheConfig validation, behaviour switches, chained hashing and the trace memo."""

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.cache import (
    ALL_BEHAVIOURS,
    EXTERNAL_HIT_RUNNING_COW,
    SHARED_PREFIX_PINNING,
    TRANSIENT_CHECKPOINT_RETENTION,
    CacheConfig,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    Request,
)
from kvtrace.cache.hashing import BlockHasher, hash_block_tokens, none_hash, sha256_cbor
from kvtrace.errors import ConfigError


def test_behaviours_default_on_and_without_returns_a_copy():
    cfg = CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=8, hash_block_size=16)
    assert cfg.behaviours == ALL_BEHAVIOURS == {
        TRANSIENT_CHECKPOINT_RETENTION, SHARED_PREFIX_PINNING, EXTERNAL_HIT_RUNNING_COW
    }
    off = cfg.without(SHARED_PREFIX_PINNING)
    assert SHARED_PREFIX_PINNING not in off.behaviours and cfg.behaviours == ALL_BEHAVIOURS
    with pytest.raises(ConfigError, match="unknown"):
        cfg.without("no-such-behaviour")
    with pytest.raises(ConfigError, match="behaviours"):
        CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=8, hash_block_size=16, behaviours={"x"})


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(groups=(FullAttentionSpec(24),), hash_block_size=16), "block_size"),
        (dict(groups=(FullAttentionSpec(16), MambaSpec(32)), hash_block_size=16, retention_interval=48),
         "retention_interval"),
        (dict(groups=(FullAttentionSpec(16),), hash_block_size=16, hash_fn="md5"), "hash_fn"),
        (dict(groups=(FullAttentionSpec(16),), hash_block_size=16, num_gpu_blocks=(8, 8)), "num_gpu_blocks"),
        (dict(groups=(FullAttentionSpec(16),), hash_block_size=16, num_prefill_checkpoint_blocks=1),
         "num_prefill_checkpoint_blocks"),
        (dict(groups=(), hash_block_size=16), "groups"),
    ],
)
def test_invalid_configs_name_the_key(kwargs, key):
    kwargs.setdefault("num_gpu_blocks", 8)
    with pytest.raises(ConfigError) as e:
        CacheConfig(**kwargs)
    assert key in e.value.key and "CacheConfig" in str(e.value)


def test_chained_hash_matches_the_definition():
    hasher = BlockHasher("sha256_cbor", 4)
    r = Request("r", np.arange(10))
    r.bind_hasher(hasher)
    hashes = r.block_hashes
    assert len(hashes) == 2  # only full units
    nh = none_hash(sha256_cbor)
    h0 = hash_block_tokens(sha256_cbor, nh, (0, 1, 2, 3), None)
    assert hashes == [h0, hash_block_tokens(sha256_cbor, h0, (4, 5, 6, 7), None)]
    r.append_output_token_ids([10, 11])  # 12 tokens: a third unit appears
    assert len(r.block_hashes) == 3 and r.block_hashes[:2] == [h0, hashes[1]]


def test_salt_on_first_unit_and_lora_everywhere_change_the_chain():
    hasher = BlockHasher("xxhash", 4)

    def hashes(**kw):
        r = Request("r", np.arange(8), **kw)
        r.bind_hasher(hasher)
        return r.block_hashes

    plain, salted, lora = hashes(), hashes(cache_salt="s"), hashes(lora_name="a")
    assert len(plain[0]) == 8  # xxh3-64
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the chain carries the salt
    assert plain[0] != lora[0] and plain[1] != lora[1]
    assert hashes(cache_salt="s") == salted  # deterministic
    # vLLM 0.33 salts only with a non-empty salt (``if ... request.cache_salt``): an empty one
    # is none, and shares the cache (kvtrace kept it apart)
    assert hashes(cache_salt="") == plain


def test_an_empty_salt_is_no_salt_for_trace_block_ids_too():
    hasher = BlockHasher("sha256_cbor", 16)

    def hashes(**kw):
        r = Request("r", None, trace_block_ids=(1, 2), trace_block_size=16, num_prompt_tokens=32, **kw)
        r.bind_hasher(hasher)
        return r.block_hashes

    assert hashes(cache_salt="") == hashes() != hashes(cache_salt="s")


def test_trace_block_hashes_are_memoised_per_parent_and_id():
    hasher = BlockHasher("sha256_cbor", 16)

    def req(ids, n):
        r = Request("r", None, trace_block_ids=ids, trace_block_size=64, num_prompt_tokens=n)
        r.bind_hasher(hasher)
        return r

    a = req((1, 2, 3), 64 * 3 - 10)
    assert len(a.block_hashes) == (64 * 3 - 10) // 16
    misses = hasher.memo_misses
    b = req((1, 2, 3), 64 * 3)
    assert b.block_hashes[: len(a.block_hashes)] == a.block_hashes
    assert hasher.memo_misses == misses  # no new trace block hashed
    c = req((1, 9), 128)
    assert c.block_hashes[:4] == a.block_hashes[:4] and c.block_hashes[4] != a.block_hashes[4]
    assert hasher.memo_misses == misses + 1
    # tokens are synthesised lazily and agree with the trace token model
    assert c.prompt_token_ids.shape == (128,)


def test_manager_rejects_unknown_hash_fn_through_config():
    with pytest.raises(ConfigError):
        KVCacheManager(CacheConfig(groups=(FullAttentionSpec(4),), num_gpu_blocks=4, hash_block_size=4, hash_fn="x"))


_INTS = st.one_of(st.integers(-30, 300), st.integers(-(1 << 70), 1 << 70),
                  st.sampled_from([23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64, -2**64,
                                   -2**64 - 1, -24, -25, -257]))


@settings(max_examples=400, deadline=None)
@given(parent=st.one_of(st.binary(max_size=300), st.binary(min_size=32, max_size=32)), ns=_INTS, tid=_INTS, unit=_INTS)
def test_the_direct_trace_unit_encoding_is_cbor2s_canonical_one(parent, ns, tid, unit):
    from kvtrace.cache.hashing import trace_unit_cbor

    got = trace_unit_cbor(parent, ns, tid, unit)
    want = cbor2.dumps((parent, ("trace", ns, tid, unit), None), canonical=True)
    if all(-(1 << 64) <= v < (1 << 64) for v in (ns, tid, unit)):
        assert got == want
    else:
        assert got is None  # a bignum: left to cbor2


@settings(max_examples=300, deadline=None)
@given(parent=st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40)), ns=_INTS, tid=_INTS,
       count=st.integers(0, 30), hash_name=st.sampled_from(["sha256_cbor", "xxhash"]))
def test_a_trace_blocks_unit_hashes_at_once_are_each_units_hash(parent, ns, tid, count, hash_name):
    """``trace_block_unit_hashes`` (the memo's miss path) is the chain of per-unit hashes, or
    None where the common case does not hold."""
    from kvtrace.cache.hashing import HASH_FNS, RAW_HASH_FNS, trace_block_unit_hashes

    got = trace_block_unit_hashes(RAW_HASH_FNS[hash_name], parent, ns, tid, count)
    fast_case = ((len(parent) == 32 or count == 0) and 0 <= ns < 24 and 0 <= tid < 1 << 64 and count <= 24
                 and (hash_name == "sha256_cbor" or count <= 1))
    if not fast_case:
        assert got is None
        return
    want, p = [], parent
    for u in range(count):
        p = HASH_FNS[hash_name]((p, ("trace", ns, tid, u), None))
        want.append(p)
    assert got == tuple(want)


def test_a_trace_blocks_units_past_the_prompt_are_hashed_when_a_prompt_reaches_them():
    """A 2^26-token trace block had all its 4M units hashed for a prompt of a few hundred
    tokens (seconds a block, and the memo held them all)."""
    per_block = 1 << 22
    hasher = BlockHasher("sha256_cbor", 16)

    def req(ids, n, into=hasher):
        r = Request("r", None, trace_block_ids=ids, trace_block_size=16 * per_block, num_prompt_tokens=n)
        r.bind_hasher(into)
        return r.block_hashes

    short = req((7,), 600)
    memo = next(iter(hasher._trace_memo.values()))
    assert [len(units) for units in memo.values()] == [600 // 16]  # only what the prompt used
    longer = req((7,), 1000)  # extends the memoised units of the same block
    assert [len(units) for units in memo.values()] == [1000 // 16]
    assert longer[:len(short)] == short and longer == req((7,), 1000, BlockHasher("sha256_cbor", 16))
    assert req((7,), 600) == short  # a shorter prompt takes the first units of the longer entry
