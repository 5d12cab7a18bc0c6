"""A request's length against max_model_len, as vLLM 0.33 holds it: the prompt plus the
tokens generated, of which there is at least one (``max_tokens >= 1``: a trace's output of 0
gets one token). vLLM refuses a prompt of max_model_len tokens ("plus the number of
requested output tokens (at least 1) is longer than the maximum model length"); the engine
took it and generated a token past max_model_len."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvtrace.engine import Engine, get_preset
from kvtrace.errors import KVTraceError
from kvtrace.workload import TraceRequest


def _run(prompt: int, output: int, max_model_len: int, content: bool):
    preset = get_preset("dense-attention", scheduler={"max_model_len": max_model_len})
    work = [TraceRequest("a", 0, prompt, output, token_ids=np.arange(1000, 1000 + prompt, dtype=np.int64))]
    return Engine(preset, content=content).run(work)


@pytest.mark.parametrize("content", [True, False], ids=["content", "no-content"])
def test_a_prompt_of_max_model_len_has_no_room_for_its_one_token(content):
    with pytest.raises(KVTraceError, match=re.escape(
            "request a: 40 prompt + 0 output tokens (1 is generated) exceed max_model_len 40 (raise [scheduler] "
            "max_model_len in --config, or drop the request)")):
        _run(40, 0, 40, content)
    with pytest.raises(KVTraceError, match=re.escape("request a: 38 prompt + 3 output tokens exceed max_model_len 40")):
        _run(38, 3, 40, content)
    # at max_model_len exactly, with the one token of an output of 0 or with the output asked for
    for prompt, output in ((39, 0), (37, 3)):
        (r,) = _run(prompt, output, 40, content).requests
        assert r.num_prompt_tokens + r.num_output_tokens == 40
