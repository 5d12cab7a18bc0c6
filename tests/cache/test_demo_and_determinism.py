"""The cache-only demo drive: behaviour directions on a generated stream, and determinism."""

from kvtrace.cache import EXTERNAL_HIT_RUNNING_COW, SHARED_PREFIX_PINNING, TRANSIENT_CHECKPOINT_RETENTION

from .drive import demo_config, generate_stream, run


def test_switching_a_behaviour_off_costs_hits_on_the_demo_stream():
    prompts = generate_stream()
    on = run(demo_config(), prompts)
    no_pin = run(demo_config().without(SHARED_PREFIX_PINNING), prompts)
    no_transient = run(demo_config().without(TRANSIENT_CHECKPOINT_RETENTION), prompts)
    assert on["token_hit_rate"] > no_pin["token_hit_rate"] + 0.02  # system prompts re-prefilled
    assert on["token_hit_rate"] > no_transient["token_hit_rate"] + 0.1  # hot prefixes evicted
    assert no_transient["evictions"]["lru"] > 2 * on["evictions"]["lru"]
    # no external tier in this stream: that behaviour has nothing to change
    assert run(demo_config().without(EXTERNAL_HIT_RUNNING_COW), prompts) == on


def test_same_stream_gives_identical_event_streams():
    from kvtrace.cache import KVCacheManager, Request

    prompts = generate_stream(seed=3, sessions=6, turns=2)

    def events_of():
        m = KVCacheManager(demo_config())
        out = []
        m.subscribe(out.extend)
        for i, p in enumerate(prompts):
            r = Request(f"r{i}", p)
            blocks, hit, boundary = m.get_computed_blocks(r)
            r.shared_prefix_boundary = boundary
            m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
            m.take_block_copies()
            r.num_computed_tokens = r.num_tokens
            m.free(r)
            m.new_step_starts()
        return out

    a, b = events_of(), events_of()
    assert len(a) > 50 and a == b
