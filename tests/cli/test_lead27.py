"""Fixes the lead made from the twenty-seventh session's probes (each named in its test)."""

from __future__ import annotations

from tests.cli.support import run


def test_study_and_generate_name_their_arguments_as_a_user_types_them(capsys, monkeypatch):
    """The usage line read `{behaviour}:<transient-checkpoint-retention|...>`, and typing
    `behaviour:transient-checkpoint-retention` as it reads was refused (re-probe A)."""
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(["study", "--help"], capsys)
    assert code == 0 and "Usage: kvtrace study [OPTIONS] {BEHAVIOUR}" in out, out
    assert "behaviour:<" not in out and "shared-prefix-pinning" in out
    code, out, _ = run(["generate", "--help"], capsys)
    assert code == 0 and "Usage: kvtrace generate [OPTIONS] [WORKLOAD]" in out, out
    words = " ".join(out.split())  # (the help wraps anywhere)
    assert "workload]:<" not in out and "[WORKLOAD] The generated workload: chat, agent, mixed," in words
