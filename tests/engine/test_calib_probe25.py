"""Calibration, presets and TOML configs: the twenty-fifth session's probe (truth and bad input)."""

from __future__ import annotations

from kvtrace.replay.calibrate import calibrate, fit_report

_HEADER = "num_tokens,prefill_pairs,num_decode_seqs,decode_context_tokens,step_ms\n"
# five steps of the 8B's measurements (AIConfigurator's prefills, Dynamo-like decodes): as many
# measurements as the no-knee model fits terms
_FIVE = ("128,8256,0,0,6.0353\n1024,524800,0,0,21.1795\n2048,2098176,0,0,43.402\n"
         "1,0,1,512,5.5\n64,0,64,65536,8.1\n")


def test_a_fit_of_as_many_measurements_as_terms_marks_every_term_unchecked(tmp_path):
    """Five steps for five terms fitted attn_pair_ps at 9,431 (the 8B's is 807) and kv_read_ps
    at 0: the fit had no residual left to tell a term's error by, so the standard errors were
    set to 0 and the report marked no term, where it can check none. A sixth step marks four
    of them weakly determined."""
    path = tmp_path / "five.csv"
    path.write_text(_HEADER + _FIVE)
    fit = calibrate([path], name="x", knee=0)
    assert len(fit.observations) == len(fit.fitted) == 5
    assert set(fit.weakly_determined()) == set(fit.fitted)
    report = fit_report(fit)
    for term in fit.fitted:
        line = next(line for line in report if line.split()[0] == term)
        assert "unchecked: 5 measurements for 5 fitted terms" in line, line
    # one more step: a residual, and standard errors from it (finite ones, shown as numbers)
    path.write_text(_HEADER + _FIVE + "32,0,32,8000,6.3\n")
    six = calibrate([path], name="x", knee=0)
    assert six.weakly_determined() and all(se < float("inf") for se in six.weakly_determined().values())
    assert not any("unchecked" in line for line in fit_report(six))
