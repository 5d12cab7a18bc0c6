"""The presets' scheduler limits are `vllm serve`'s own on the GPU their cost models price (an H200).

They ran 256 requests a step, vLLM's limit for smaller GPUs; on an H100 or H200 `vllm serve`
runs up to 1,024 (Dynamo's H200 data has 525 in one step), so a decode-heavy replay queued
requests that vLLM would have run.
"""

from __future__ import annotations

import pytest

from kvtrace.engine.presets import PRESETS, get_preset

GiB = 1 << 30


class _H200:
    """What vLLM's platform answers on an H200 (141 GB): the only input its defaults read."""

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return 141 * GiB

    def get_device_name(self, device_id: int = 0) -> str:
        return "NVIDIA H200"

    def is_device_capability(self, capability) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_schedules_as_vllm_serve_does_on_an_h200(name, vllm_api, monkeypatch):
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    monkeypatch.setattr(arg_utils, "current_platform", _H200())
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
    config = get_preset(name).scheduler_config
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (
        tokens[UsageContext.OPENAI_API_SERVER], seqs[UsageContext.OPENAI_API_SERVER])


def test_600_requests_arriving_together_all_start_in_the_first_step(tmp_path):
    """The limit binds: with 256 a step, 344 of these waited for the first ones to finish."""
    import json

    from kvtrace.replay.run import RunSpec, run_replay

    trace = tmp_path / "burst.jsonl"
    lines = [json.dumps({"kvtrace_trace": 1, "block_size": 16})]
    lines += [json.dumps({"request_id": f"r{i}", "arrival_ns": 0, "input_length": 8, "output_length": 4,
                          "token_ids": [1000 + 8 * i + k for k in range(8)]}) for i in range(600)]
    trace.write_text("\n".join(lines) + "\n")
    result = run_replay(RunSpec(str(trace), preset="dense-attention", content=False))
    ttfts = {r["ttft_ns"] for r in result.per_request}
    assert len(result.per_request) == 600 and len(ttfts) == 1


def test_the_memory_refusal_says_the_share_a_run_may_take(monkeypatch):
    """19.2 GiB was refused as 'more than cpu memory (23.5 GiB) can hold': the check stops at
    80% of it (the re-probe of the engine's fixes)."""
    from kvtrace.cache import CacheConfig, FullAttentionSpec
    from kvtrace.engine import memory
    from kvtrace.errors import ConfigError

    config = CacheConfig(groups=(FullAttentionSpec(16),), num_gpu_blocks=1_000, hash_block_size=16)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda dev: 10 * 2**30)
    monkeypatch.setattr(memory, "storage_bytes", lambda cfg, state_only=False: 9 * 2**30 if not state_only else 0)
    with pytest.raises(ConfigError) as caught:
        memory.check_storage_fits(config, "cpu")
    assert "9.0 GiB: more than the 80% of cpu memory a run may take (8.0 of 10.0 GiB)" in str(caught.value)


@pytest.mark.parametrize("given", [{"cache_config": {"num_gpu_blocks": 8}}, {"scheduler_config": {"max_num_seqs": 4}}])
def test_an_engine_config_that_is_not_one_is_refused_before_the_run(given):
    """Engine(scheduler_config={"max_num_seqs": 4}) was taken, and the run failed at its first step
    with an AttributeError (the re-probe of the engine's argument checks)."""
    from kvtrace.engine.engine import Engine
    from kvtrace.errors import KVTraceError

    (name,) = given
    with pytest.raises(KVTraceError, match=f"engine: {name} .*; expected a"):
        Engine(preset="dense-attention", content=False, **given)


def test_a_budget_below_the_presets_seats_says_where_they_come_from():
    """Since the presets run 1,024 seats, a config setting only max_num_batched_tokens = 512 is
    refused, as vLLM refuses it beside its own default; the refusal said 'below max_num_seqs
    1024' with no word of where 1,024 came from (the re-probe of the preset change)."""
    from kvtrace.errors import ConfigError

    with pytest.raises(ConfigError, match="max_num_seqs 1,024 is the preset's, vllm serve's on an H100 or H200: "
                                          "set max_num_seqs too"):
        get_preset("dense-attention", scheduler={"max_num_batched_tokens": 512})
    with pytest.raises(ConfigError) as given:  # (the user's own max_num_seqs: their numbers alone)
        get_preset("dense-attention", scheduler={"max_num_batched_tokens": 512, "max_num_seqs": 600})
    assert "preset's" not in str(given.value)
    assert get_preset("dense-attention", scheduler={"max_num_batched_tokens": 512, "max_num_seqs": 256})
