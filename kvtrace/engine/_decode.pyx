# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The decode step's array work on the CPU, one C loop per group instead of a dozen numpy calls.

A decode batch is a few dozen requests, so numpy's per-call cost, not the data, is what
the step costs (kvtrace/engine/arrays.py). These loops do exactly what the numpy path of
``Worker._decode_write``, ``Worker._decode_sample`` and ``DeviceStorage.append_kv`` does,
value for value: every quantity is an int64 residue mod P reduced where the numpy path
reduces it (a floor-mod: C's ``%`` is made non-negative), and every read that the numpy
path makes before its writes is made before them here too. ``kvtrace.engine.worker``
chooses these or the numpy path; tests/engine/test_decode_kernels.py runs both.

``attention_prefill`` does the same for the prefill chunks' kv writes (``write_kv``): one
pass instead of the kv values, block ids, slots, scatter and block sums as arrays.
"""

cdef long long P = 2147483647
cdef long long KV_A = 1103515245
cdef long long KV_B = 12345679
cdef long long KV_C = 2654435761 % 2147483647


cdef inline long long at(const long long[:, ::1] table, long long row, long long col, Py_ssize_t size) except -1:
    """``table[row, col]``, checked as numpy would check it (and the block id against the
    storage's ``size``): the loops below index without bounds checks."""
    if row < 0 or row >= table.shape[0] or col < 0 or col >= table.shape[1]:
        raise IndexError(f"block table index ({row}, {col}) out of bounds for shape ({table.shape[0]}, {table.shape[1]})")
    cdef long long blk = table[row, col]
    if blk < 0 or blk >= size:
        raise IndexError(f"block id {blk} out of bounds for {size} blocks")
    return blk


cdef inline long long floor_mod(long long x) nogil:
    cdef long long r = x % P
    return r + P if r < 0 else r


def attention_append(long long[:, ::1] data, long long[::1] block_sum, long long[::1] stamp,
                     long long[::1] held_at, long long[::1] held_n, long long[::1] held_sum, long long now,
                     const long long[:, ::1] table, const long long[::1] rows, const long long[::1] pos,
                     const long long[::1] toks, long long[::1] total):
    """Write each request's kv at its position into the block its table names and add the
    block's sum over slots [0, slot] to ``total`` (``DeviceStorage.append_kv``; ``now`` is
    the write's stamp). Returns False, having changed nothing, when two requests name one
    block (a cache bug: the caller takes the general write)."""
    cdef Py_ssize_t b = rows.shape[0], bs = data.shape[1], i, j, k
    cdef long long blk, slot, v, old, part
    cdef bint kept
    cdef long long[::1] blocks = _scratch(b)
    for i in range(b):
        blocks[i] = at(table, rows[i], pos[i] // bs, data.shape[0])
        for j in range(i):
            if blocks[j] == blocks[i]:
                return False
    for i in range(b):
        blk = blocks[i]
        slot = pos[i] % bs
        v = (toks[i] * KV_A + pos[i] * KV_B + KV_C) % P
        kept = held_at[blk] == stamp[blk] and held_n[blk] == slot
        old = data[blk, slot]
        data[blk, slot] = v
        block_sum[blk] = floor_mod(block_sum[blk] + v - old)
        stamp[blk] = now
        if kept:
            part = held_sum[blk] + v
        else:  # the prefix sum is not remembered: read the slots back
            part = 0
            for k in range(slot + 1):
                part += data[blk, k]
        part = part % P
        held_sum[blk] = part
        held_n[blk] = slot + 1
        held_at[blk] = now
        total[i] += part
    return True


def attention_prefill(long long[:, ::1] data, long long[::1] block_sum, long long[::1] stamp, long long now,
                      const long long[:, ::1] table, const long long[::1] rows, const long long[::1] starts,
                      const long long[::1] lens, const long long[::1] toks):
    """Prefill chunks' kv (``Worker._compute_general``'s numpy write, ``DeviceStorage.write_kv``):
    chunk i's tokens ``toks[off_i : off_i + lens[i]]`` at positions ``starts[i]...`` into the
    blocks row ``rows[i]`` of ``table`` names, all chunks in order; then every block a chunk
    touched gets its sum over all its slots and the stamp ``now``."""
    cdef Py_ssize_t c = rows.shape[0], bs = data.shape[1], i, n = 0, m = 0, off = 0
    cdef long long a, e, b, p, lo, blk, acc, k
    if starts.shape[0] != c or lens.shape[0] != c:
        raise ValueError(f"attention_prefill: {c} rows, {starts.shape[0]} starts, {lens.shape[0]} lengths")
    for i in range(c):
        if lens[i] < 0 or starts[i] < 0:
            raise ValueError(f"attention_prefill: chunk {i} starts at {starts[i]} with {lens[i]} tokens")
        off += lens[i]
        if lens[i]:
            n += (starts[i] + lens[i] - 1) // bs - starts[i] // bs + 1
    if off != toks.shape[0]:
        raise ValueError(f"attention_prefill: {off} chunk tokens, {toks.shape[0]} given")
    # every block looked up before any write (as numpy checks an index first), in chunk order
    cdef long long[::1] touched = _scratch(n)
    for i in range(c):
        if lens[i]:
            for b in range(starts[i] // bs, (starts[i] + lens[i] - 1) // bs + 1):
                touched[m] = at(table, rows[i], b, data.shape[0])
                m += 1
    m = 0
    off = 0
    for i in range(c):
        a = starts[i]
        e = a + lens[i]
        if e > a:
            for b in range(a // bs, (e - 1) // bs + 1):
                blk = touched[m]
                m += 1
                lo = b * bs
                for p in range(a if a > lo else lo, e if e < lo + bs else lo + bs):
                    data[blk, p - lo] = floor_mod(toks[off + p - a] * KV_A + p * KV_B + KV_C)
        off += lens[i]
    for m in range(n):  # the sums after every write (a block two chunks name sees both)
        blk = touched[m]
        acc = 0
        for k in range(bs):
            acc += data[blk, k]
        block_sum[blk] = acc % P
        stamp[blk] = now


def full_block_sums(const long long[::1] block_sum, const long long[:, ::1] table, Py_ssize_t block_size,
                    const long long[::1] rows, const long long[::1] pos, long long[::1] total):
    """Add each request's full blocks' maintained sums (through its table) to ``total``."""
    cdef Py_ssize_t b = rows.shape[0], i, j, n
    cdef long long acc
    for i in range(b):
        n = pos[i] // block_size
        acc = 0
        for j in range(n):
            acc += block_sum[at(table, rows[i], j, block_sum.shape[0])]
        total[i] += acc


def state_step(long long[:, ::1] data, const long long[:, ::1] table, Py_ssize_t block_size,
               const long long[::1] multipliers, const long long[::1] rows, const long long[::1] pos,
               const long long[::1] toks, long long[::1] total):
    """Advance each request's state by its token, from the block holding the state before
    it to the block its position falls in, and add the new state's lanes to ``total``. All
    states are read before any is written, as the numpy path's gather does."""
    cdef Py_ssize_t b = rows.shape[0], d = data.shape[1], i, k
    cdef long long src, dst, s, acc
    cdef long long[::1] states = _scratch(b * d)
    for i in range(b):
        src = at(table, rows[i], (pos[i] + block_size - 1) // block_size - 1, data.shape[0])
        for k in range(d):
            states[i * d + k] = (data[src, k] * multipliers[k] + toks[i]) % P
    for i in range(b):
        acc = 0
        dst = at(table, rows[i], pos[i] // block_size, data.shape[0])
        for k in range(d):
            s = states[i * d + k]
            data[dst, k] = s
            acc += s
        total[i] += acc


def advance_tips(long long[:, ::1] tip_state, long long[::1] tip_tsum, long long[::1] tip_n,
                 const long long[::1] multipliers, long long num_state_groups, long long num_attention_groups,
                 long long vocab_size, const long long[::1] rows, const long long[::1] pos,
                 const long long[::1] toks, const long long[::1] total, long long[::1] sampled,
                 long long[::1] reference):
    """Sample ``total`` (mod P mod vocab) into ``sampled`` and, for each request whose tip
    stands at its position, advance the tip by its token and put the no-cache reference
    token in ``reference`` (``Worker._advance_tips``); -1 there for a request off its tip."""
    cdef Py_ssize_t b = rows.shape[0], d = tip_state.shape[1], i, k
    cdef long long r, e, s, lanes, ts, kv
    for i in range(b):
        sampled[i] = total[i] % P % vocab_size
        r = rows[i]
        if r < 0 or r >= tip_n.shape[0]:
            raise IndexError(f"tip row {r} out of bounds for {tip_n.shape[0]} rows")
        if tip_n[r] != pos[i]:
            reference[i] = -1
            continue
        e = pos[i] + 1
        lanes = 0
        for k in range(d):
            s = (tip_state[r, k] * multipliers[k] + toks[i]) % P
            tip_state[r, k] = s
            lanes += s
        ts = tip_tsum[r] + toks[i]
        tip_tsum[r] = ts
        tip_n[r] = e
        kv = (KV_A * (ts % P) + KV_B * ((e - 1) * e // 2 % P) + KV_C * e) % P
        reference[i] = (lanes % P * num_state_groups + kv * num_attention_groups) % P % vocab_size


cdef long long[::1] _scratch(Py_ssize_t n):
    import numpy
    return numpy.empty(n, dtype=numpy.int64)
