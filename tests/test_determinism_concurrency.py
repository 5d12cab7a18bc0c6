"""Determinism and concurrency promises checked end to end.

Determinism: equal inputs give equal digests whatever the process environment
(``PYTHONHASHSEED`` included) and whichever cache manager the engine drives.
"""

from __future__ import annotations

from kvtrace.replay.run import RunSpec, run_replay


def test_the_vllm_backends_digest_does_not_follow_pythonhashseed(vllm_api, monkeypatch):
    """vLLM 0.33 seeds its root block hash (NONE_HASH) with PYTHONHASHSEED when that is set,
    so every block hash, span and the digest of a ``--backend vllm`` replay changed with the
    shell's PYTHONHASHSEED (0, 1, 'random' each gave another digest)."""
    from vllm.v1.core import kv_cache_utils

    spec = RunSpec("gen:chat", limit=8, backend="vllm")
    digests, roots = {}, {}
    for seed in (None, "0", "1", "random"):
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        digests[seed] = run_replay(spec).summary["digest"]
        roots[seed] = kv_cache_utils.NONE_HASH
    assert len(set(digests.values())) == 1, digests
    assert len(set(roots.values())) == 1
