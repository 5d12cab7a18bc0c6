"""The bootstrap's resample counts: drawn a block of replicates at a time, in bounded memory,
as the one stream a single draw of them all would be."""

from __future__ import annotations

import tracemalloc

import numpy as np

from kvtrace.compare import bootstrap


def test_resample_counts_are_drawn_in_bounded_memory_as_one_stream(monkeypatch):
    """The draws and their counts for every replicate at once took 20 bytes a request a
    resample at their peak, five times the int32 counts returned (a 50,000-request diff at
    --resamples 10,000: 10 GB)."""
    n, resamples = 20_000, 200
    whole = np.random.Generator(np.random.PCG64(3)).integers(0, n, size=(resamples, n), dtype=np.int64)
    expected = np.stack([np.bincount(row, minlength=n) for row in whole]).astype(np.int32)
    del whole
    monkeypatch.setattr(bootstrap, "_DRAW_BLOCK", 1 << 16, raising=False)
    tracemalloc.start()
    try:
        counts = bootstrap.resample_counts(np.random.Generator(np.random.PCG64(3)), n, resamples)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counts.dtype == np.int32 and np.array_equal(counts, expected)
    assert peak < 1.5 * counts.nbytes, (peak, counts.nbytes)
