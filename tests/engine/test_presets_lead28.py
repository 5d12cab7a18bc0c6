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
