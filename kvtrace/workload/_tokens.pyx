# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Trace-block token synthesis in one C pass: ``kvtrace.workload.tokens.blocks_tokens``.

The numpy path makes a dozen passes over the tokens (splitmix64's shifts, xors and
multiplies, then the modulo), and a replay synthesises every prompt token of a trace
(61M for the shared Mooncake trace). The same arithmetic, value for value: uint64 with
wrap-around, the remainder of an unsigned division.
"""

from libc.stdint cimport int64_t, uint64_t


def fill_blocks(const uint64_t[::1] seeds, int64_t[:, ::1] out, uint64_t vocab):
    """Row i of ``out``: token j = splitmix64(seeds[i] + j) mod ``vocab``."""
    cdef Py_ssize_t n = seeds.shape[0], width = out.shape[1], i, j
    cdef uint64_t x, seed
    if out.shape[0] != n:
        raise ValueError(f"fill_blocks: {n} seeds for {out.shape[0]} rows")
    if vocab == 0:
        raise ValueError("fill_blocks: vocab must be positive")
    with nogil:
        for i in range(n):
            seed = seeds[i]
            for j in range(width):
                x = seed + <uint64_t>j
                x ^= x >> 30
                x *= 0xBF58476D1CE4E5B9ULL
                x ^= x >> 27
                x *= 0x94D049BB133111EBULL
                x ^= x >> 31
                out[i, j] = <int64_t>(x % vocab)
