"""``kvtrace calibrate`` on measurements a known cost model made (with seeded noise), the
TOML it writes read back and replayed, and the measurements it must refuse in one line."""

from __future__ import annotations

from kvtrace.engine import clock


def test_the_moe_term_of_a_huge_step_keeps_no_table_past_saturation():
    """A calibrate step of 2^40 tokens with --moe grew the routing table one entry a token
    (a hang, then memory): past the point where every expert is touched it stays there."""
    def reference(e: int, k: int, t: int) -> int:
        q = 1 << 62
        for _ in range(t):
            q = q * (e - k) // e
        return e * ((1 << 62) - q)

    assert clock._experts_touched_fp(97, 3, 10**6) == 97 << 62
    assert len(clock._MOE_TABLES[(97, 3)]) < 10**4
    for t in (0, 1, 2, 50, 1000, 3000):
        assert clock._experts_touched_fp(97, 3, t) == reference(97, 3, t), t
