"""``SchedulerConfig`` refuses what is no token count as one ConfigError naming the field.
A config file's values are type-checked before they reach it, but ``get_preset(scheduler=...)``
and ``SchedulerConfig`` took ``long_prefill_token_threshold`` unchecked (1.5 cut prefills into
fractional chunks, "5" raised a TypeError in the scheduler) and ``True`` for a count."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvtrace.engine import Engine, SchedulerConfig, get_preset
from kvtrace.errors import ConfigError
from kvtrace.workload import TraceRequest


@pytest.mark.parametrize(("field", "value", "what"), [
    ("long_prefill_token_threshold", 1.5, "expected an int >= 0, got 1.5"),
    ("long_prefill_token_threshold", "5", "expected an int >= 0, got '5'"),
    ("long_prefill_token_threshold", True, "expected an int >= 0, got True"),
    ("long_prefill_token_threshold", -1, "expected an int >= 0, got -1"),
    ("max_num_seqs", True, "expected a positive int, got True"),
    ("max_num_batched_tokens", False, "expected a positive int, got False"),
    ("max_model_len", 2.0, "expected a positive int, got 2.0"),
])
def test_what_is_no_token_count_is_refused(field, value, what):
    with pytest.raises(ConfigError, match=re.escape(f"SchedulerConfig: {field}: {what}")):
        SchedulerConfig(**{field: value})
    with pytest.raises(ConfigError, match=re.escape(f"{field}: {what}")):
        get_preset("dense-attention", scheduler={field: value})


def test_a_threshold_that_is_a_count_still_cuts_prefills():
    preset = get_preset("dense-attention", scheduler={"long_prefill_token_threshold": 16})
    work = [TraceRequest(r, 0, 40, 1, token_ids=np.arange(k, k + 40)) for r, k in (("a", 0), ("b", 1000))]
    chunks = {r.request_id: [c[2] for c in r.prefill_chunks] for r in Engine(preset, content=False).run(work).requests}
    assert chunks == {"a": [16, 16, 8], "b": [16, 16, 8]}
