"""The README's Metrics section names every metric of kvtrace.metrics, in vLLM's words."""

from __future__ import annotations

from pathlib import Path

from kvtrace import metrics

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
SECTION = README[README.index("## Metrics"):README.index("\n## ", README.index("## Metrics") + 1)]


def test_every_counter_and_rate_is_in_the_readme_with_its_vllm_name_and_words():
    for c in metrics.COUNTERS:
        assert f"| `{c.key}` | `{c.vllm}` | {c.doc} |" in SECTION, c.key
    for r in metrics.RATES:
        assert f"| `{r.key}` |" in SECTION and r.doc in SECTION, r.key


def test_every_latency_is_in_the_readme_as_vllm_bench_serve_defines_it():
    for m in metrics.LATENCIES:
        assert f"| `{m.key}` | {m.label} | {m.doc} |" in SECTION, m.key
    assert "modelled" in SECTION and "null" in SECTION


def test_kvtraces_own_rates_and_the_default_percentiles_are_the_readmes():
    assert f"| `block_hit_rate` | (kvtrace) | {metrics.BLOCK_HIT_RATE_DOC} |" in SECTION
    assert metrics.GROUP_HIT_RATE_DOC in SECTION
    for kind in ("attention", "state"):
        assert f'"{metrics.group_hit_rate_label(kind)}"' in SECTION
    default = ",".join(metrics.percentile_word(p) for p in metrics.DEFAULT_PERCENTILES)
    assert f"(default `{default}`, vLLM's `--metric-percentiles`)" in SECTION
