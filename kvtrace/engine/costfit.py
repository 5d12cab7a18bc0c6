"""Fitting a cost model to observed step times (the arithmetic behind ``kvtrace calibrate``).

An observation is the work of one or more engine steps (their ``StepWork`` summed) and
the time they took. Every term of the cost model is linear in its coefficient, so the
fit is a non-negative least-squares problem on relative error (each observation
weighted by 1 / its time, so a 5 ms decode step counts as much as a 500 ms prefill):
Lawson-Hanson NNLS over columns scaled to unit norm. The knee of the piecewise token
term and the MoE routing (experts, experts per token) are not linear: the knee is
chosen from a few candidates by the smallest worst-case error, the routing is given.
Coefficients are rounded to the integers the cost model keeps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import numpy as np

from kvtrace.engine.clock import COEFFICIENTS, FITTED_TERMS, CostModel, StepWork, term_values
from kvtrace.errors import KVTraceError

KNEE_CANDIDATES = (0, 256, 512, 1024, 2048)
# Singular values of the scaled design below this fraction of the largest are taken as 0:
# exact collinearity leaves ~1e-16, the shipped measurements' smallest is ~2e-2.
_RANK_TOLERANCE = 1e-9


class Underdetermined(KVTraceError):
    """The observations cannot tell some fitted terms apart: many models fit them equally."""

    def __init__(self, terms: Sequence[str], rank: int, fitted: int, observations: int, knee: int):
        names = list(terms)
        listed = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
        at = f" with the token knee at {knee}" if knee else ""
        fix = f"{observations:,} observation fixes" if observations == 1 else f"{observations:,} observations fix"
        combinations = "1 combination" if rank == 1 else f"{rank} independent combinations"
        super().__init__(f"these measurements cannot tell {listed} apart{at} ({fix} {combinations} of the {fitted} "
                         "coefficients fitted; any split between those fits them as well); add measurements that "
                         "vary them independently (prefills of several lengths, decodes of several batch sizes and "
                         "contexts)")
        self.terms, self.rank, self.observations, self.knee = names, rank, observations, knee


@dataclass(slots=True)
class Observation:
    """The summed work of the steps one measurement covers, and how long they took."""

    work: list[StepWork]
    measured_ns: float
    group: str  # what kind of measurement: "prefill", "decode", ... (errors are reported per group)
    label: str = ""
    # how many steps each ``work`` entry stands for (None: one each): a request's thousands of
    # like steps are two entries, not an object each (a span's 2^31 decode steps filled memory)
    repeats: list[int] | None = None

    def steps(self) -> Iterator[tuple[StepWork, int]]:
        """(a step's work, how many such steps)."""
        return zip(self.work, self.repeats or repeat(1, len(self.work)))

    def predicted_ns(self, model: CostModel) -> int:
        """What ``model`` says the steps took, step by step as the engine's clock sums them."""
        return sum(k * model.step_ns_of(w) for w, k in self.steps())


@dataclass(slots=True)
class Fit:
    model: CostModel
    errors: list[float]  # relative error of each observation, (model - measured) / measured
    observations: list[Observation] = field(repr=False)
    fitted: tuple[str, ...] = ()  # the FITTED_TERMS the observations determined; the rest were given
    # each fitted term's standard error (its unit), from the residuals: where it is large
    # beside the value, the measurements hardly tell the term from the others (a fit can
    # then show a small median error and a term that is wrong by 100%)
    standard_errors: dict[str, float] = field(default_factory=dict)

    def weakly_determined(self) -> dict[str, float]:
        """The fitted terms whose value is within two standard errors of 0, or whose
        standard error is over a quarter of their value: term -> standard error (inf: no
        more observations than fitted terms, which any values fit exactly)."""
        return {t: se for t, se in self.standard_errors.items()
                if se > 0 and (2 * se >= abs(getattr(self.model, t)) or se > 0.25 * abs(getattr(self.model, t)))}

    def error_by_group(self) -> dict[str, tuple[int, float, float]]:
        """group -> (observations, median |error|, max |error|)."""
        out = {}
        for g in sorted({o.group for o in self.observations}):
            e = np.abs([err for err, o in zip(self.errors, self.observations) if o.group == g])
            out[g] = (len(e), float(np.median(e)), float(e.max()))
        return out

    @property
    def max_error(self) -> float:
        return float(np.max(np.abs(self.errors))) if self.errors else 0.0

    @property
    def median_error(self) -> float:
        return float(np.median(np.abs(self.errors))) if self.errors else 0.0


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 1000) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    passive: list[int] = []
    x = np.zeros(n)
    grad = a.T @ (b - a @ x)
    for _ in range(max_iter):
        active = [j for j in range(n) if j not in passive]
        if not active or grad[active].max() <= 1e-12 * max(1.0, np.abs(grad).max()):
            break
        passive.append(active[int(np.argmax(grad[active]))])
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                x = s
                break
            blocked = [j for j in passive if s[j] <= 0]
            alpha = min(x[j] / (x[j] - s[j]) for j in blocked)
            x = x + alpha * (s - x)
            passive = [j for j in passive if x[j] > 1e-15]
            x[[j for j in range(n) if j not in passive]] = 0.0
        grad = a.T @ (b - a @ x)
    return x


def _design(observations: Sequence[Observation], model: CostModel) -> np.ndarray:
    """(observations, FITTED_TERMS): each observation's summed term values."""
    rows = np.zeros((len(observations), len(FITTED_TERMS)))
    for i, o in enumerate(observations):
        for w, k in o.steps():
            rows[i] += np.multiply(k, term_values(model, w))
    return rows


_ABOVE_KNEE = FITTED_TERMS.index("token_above_knee_ns")


class _Designs:
    """``_design`` at each knee candidate, from one pass over the steps: only the column of
    tokens past the knee depends on it (a pass a candidate took most of a fit of a million
    observations). The same sums, in the same order, as ``_design``'s."""

    def __init__(self, observations: Sequence[Observation], model: CostModel):
        self.base = _design(observations, replace(model, token_knee=0))
        steps = [(i, k, w.num_tokens) for i, o in enumerate(observations) for w, k in o.steps()]
        self.index = np.fromiter((i for i, _, _ in steps), dtype=np.intp, count=len(steps))
        self.repeats = np.fromiter((float(k) for _, k, _ in steps), dtype=np.float64, count=len(steps))
        self.tokens = np.fromiter((float(t) for _, _, t in steps), dtype=np.float64, count=len(steps))

    def at(self, knee: int) -> np.ndarray:
        x = self.base.copy()
        if knee:
            x[:, _ABOVE_KNEE] = np.bincount(self.index, weights=self.repeats * np.maximum(self.tokens - knee, 0.0),
                                             minlength=len(x))
        return x


def _confounded(a: np.ndarray, terms: Sequence[str]) -> tuple[list[str], int]:
    """The terms that the columns of ``a`` (unit norm) cannot tell apart, and its rank:
    those with a share in a direction no observation sees (a null vector of ``a``).
    Only the right singular vectors are needed, all of them: from the thin SVD where the rows
    are at least the columns (its vt is square then), from the full one where they are fewer
    (the full SVD of 20,000 step rows built a 20,000 x 20,000 U: minutes, and 200,000 rows ran
    out of memory)."""
    _, s, vt = np.linalg.svd(a, full_matrices=a.shape[0] < a.shape[1])
    rank = int((s > _RANK_TOLERANCE * s.max()).sum()) if s.size and s.max() > 0 else 0
    null = vt[rank:]
    return [t for j, t in enumerate(terms) if null.size and np.abs(null[:, j]).max() > 1e-6], rank


def _standard_errors(a: np.ndarray, b: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """Each coefficient's standard error in the least-squares fit of ``a @ coef ~ b``: the
    residuals' variance times the diagonal of (a^T a)^-1 (0 where the fit is exact). Without
    residual degrees of freedom (no more observations than coefficients) it is unknown: inf.
    (It was 0: five steps for five terms fitted attn_pair_ps 12x the truth and kv_read_ps 0,
    and the report marked no term, the one fit that checks none of them.)"""
    n, k = a.shape
    if n <= k:
        return np.full(k, np.inf)
    resid = a @ coef - b
    variance = float(resid @ resid) / (n - k)
    return np.sqrt(np.clip(np.diag(np.linalg.pinv(a.T @ a)) * variance, 0.0, None))


def fit_cost_model(
    observations: Sequence[Observation],
    *,
    name: str,
    template: CostModel | None = None,
    knees: Sequence[int] | None = None,
    fixed: dict[str, int] | None = None,
    source: str = "",
) -> Fit:
    """The cost model (the ``FITTED_TERMS``) that best explains ``observations``.

    ``template`` holds what the data cannot tell (copy costs when no step copies, the
    MoE routing ``num_experts`` / ``experts_per_token``); ``knees``: candidates for the
    token knee (default ``KNEE_CANDIDATES``, 0 = no knee); ``fixed``: coefficients held at
    a value. A term the observations never exercise keeps the template's value.

    Raises ``Underdetermined`` when the observations cannot tell fitted terms apart (every
    step the same size, a single step): any split of the time between them fits as well, so
    a model would be printed with no error and mean nothing. A knee candidate that makes its
    term indistinguishable (every step past it) is passed over.
    """
    if not observations:
        raise ValueError("calibrate: no observations to fit")
    base = template or CostModel(name, 0, 0, 0, 0, 0)
    fixed = dict(fixed or {})
    y = np.asarray([o.measured_ns for o in observations], dtype=np.float64)
    if not (y > 0).all():
        raise ValueError("calibrate: every measured time must be positive")
    best: Fit | None = None
    undetermined: Underdetermined | None = None
    designs = _Designs(observations, base)
    for knee in (KNEE_CANDIDATES if knees is None else knees):
        model = replace(base, name=name, token_knee=knee, source=source)
        x = designs.at(knee)
        fit_terms = [j for j, t in enumerate(FITTED_TERMS)
                     if t not in fixed and x[:, j].any()
                     and not (t == "token_above_knee_ns" and knee == 0)]
        held = [j for j in range(len(FITTED_TERMS)) if j not in fit_terms]
        held_values = np.asarray([fixed.get(FITTED_TERMS[j], getattr(model, FITTED_TERMS[j])) for j in held], float)
        rest = y - x[:, held] @ held_values  # what the fitted terms must explain
        a = x[:, fit_terms] / y[:, None]
        scale = np.linalg.norm(a, axis=0)
        scale[scale == 0] = 1.0
        confounded, rank = _confounded(a / scale, [FITTED_TERMS[j] for j in fit_terms])
        if confounded:
            undetermined = undetermined or Underdetermined(confounded, rank, len(fit_terms), len(observations), knee)
            continue
        coef = nnls(a / scale, rest / y) / scale
        errors = _standard_errors(a / scale, rest / y, coef * scale) / scale
        # Any: replace() is checked per keyword; these keys are all int coefficients
        values: dict[str, Any] = {FITTED_TERMS[j]: int(v) for j, v in zip(held, held_values)}
        values |= {FITTED_TERMS[j]: round(float(c)) for j, c in zip(fit_terms, coef)}
        if knee == 0:
            values["token_above_knee_ns"] = 0
        fitted = replace(model, **values)
        pred = np.asarray([o.predicted_ns(fitted) for o in observations], dtype=np.float64)
        candidate = Fit(fitted, list((pred - y) / y), list(observations), tuple(FITTED_TERMS[j] for j in fit_terms),
                        {FITTED_TERMS[j]: float(e) for j, e in zip(fit_terms, errors)})
        if best is None or candidate.max_error < best.max_error - 1e-9:
            best = candidate
    if best is None:
        assert undetermined is not None
        raise undetermined
    return best


def coefficient_table(model: CostModel) -> list[tuple[str, int]]:
    """(name, value) of every cost-model coefficient, in ``COEFFICIENTS`` order."""
    return [(c, getattr(model, c)) for c in COEFFICIENTS]
