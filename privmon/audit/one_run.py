"""ε lower bounds from the canaries of one training run.

m canaries are each included in training with probability 1/2, independently; after training
every canary gets a score (higher = more likely included). The auditor guesses "included" on the
k₊ highest scores and "left out" on the k₋ lowest; many correct guesses refute (ε, δ)-DP
(Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run") or μ-GDP (Mahloujifar,
Melis, Chaudhuri, "Auditing f-Differential Privacy in One Run", Algorithm 3).
:func:`epsilon_from_guesses` bounds ε from counts fixed in advance; :func:`one_run_epsilon` also
chooses the guesses from the scores, in ways that keep the level. The count-level tests are in
:mod:`privmon.audit.one_run_math`; the bounds, the choice of guesses and its guarantee: docs,
Theory page, *One-run ε lower bounds*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from privmon._label_order import check_not_label_order
from privmon._validation import (
    as_scores,
    check_half_open_interval,
    check_int,
    check_open_unit,
    to_numpy,
)
from privmon.audit.one_run_math import fdp_mu, gdp_epsilon, split_p_value, steinke_epsilon

__all__ = [
    "BONFERRONI_GRID",
    "METHODS",
    "SPLIT_LEVEL",
    "OneRunAudit",
    "check_inclusion",
    "epsilon_from_guesses",
    "inclusion_bits",
    "one_run_epsilon",
]

METHODS = ("fdp", "steinke")
"""The bounds: Mahloujifar et al.'s f-DP test (μ-GDP, then ε at δ) and Steinke et al.'s."""

BONFERRONI_GRID = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
"""``selection="bonferroni"``: k₊ = k₋ = round(fraction · m) for each fraction (at least 1),
each pair tested at ``significance / 6`` (fewer when small m makes pairs coincide)."""

SPLIT_LEVEL = 1e-9
"""An in / out split whose two-sided p-value under independent fair coins is below this is
refused (:func:`one_run_epsilon`, and the canaries' own draws at construction): the bounds
assume each canary was included by such a coin."""

_SPLIT_RATIOS = (0.0, 0.5, 1.0)  # k₊ / r among the split's candidates: top only, both, bottom
_SPLIT_SIZES = 12  # guess counts per ratio, geometric from 1 to the selection part's size


@dataclass(frozen=True)
class OneRunAudit:
    """The result of :func:`one_run_epsilon`; ``float(audit)`` is ``audit.epsilon``.

    Attributes:
        epsilon: the ε lower bound at ``delta``, valid at level 1 - ``significance``.
        method: "fdp" or "steinke".
        delta: the δ the bound is stated at.
        significance: the level spent (1 - confidence).
        n_canaries: canaries the bound counts: the audited part, non-finite scores included.
        n_selection: canaries spent on choosing the guesses (the split's selection part; 0
            otherwise).
        n_dropped: non-finite scores among all canaries; each is an abstention unless the
            guesses outnumber the finite scores (see :func:`one_run_epsilon`).
        k_plus: guesses "included", on the highest audited scores.
        k_minus: guesses "left out", on the lowest audited scores.
        n_correct: correct guesses among the ``k_plus + k_minus``.
        selection: how the guesses were chosen: "split", "bonferroni" or "fixed".
        mu: the GDP parameter the f-DP test refutes (None for "steinke"): every μ' < mu is
            refuted, and ``epsilon`` is mu-GDP's ε at ``delta``.

    Examples:
        >>> import numpy as np
        >>> from privmon.audit import one_run_epsilon
        >>> rng = np.random.default_rng(0)
        >>> included = rng.random(1000) < 0.5
        >>> scores = rng.normal(size=1000) + 2.0 * included
        >>> audit = one_run_epsilon(scores[included], scores[~included], delta=1e-5)
        >>> audit.n_canaries + audit.n_selection, audit.n_guesses <= audit.n_canaries
        (1000, True)
        >>> round(float(audit), 2) == round(audit.epsilon, 2)
        True
    """

    epsilon: float
    method: str
    delta: float
    significance: float
    n_canaries: int
    n_selection: int
    n_dropped: int
    k_plus: int
    k_minus: int
    n_correct: int
    selection: str
    mu: float | None

    @property
    def n_guesses(self) -> int:
        """Guesses made: ``k_plus + k_minus``."""
        return self.k_plus + self.k_minus

    def __float__(self) -> float:
        return self.epsilon


def inclusion_bits(n: int, *, seed: int) -> tuple[np.ndarray, np.random.Generator]:
    """Which of ``n`` canaries are included: independent fair coins drawn from ``seed`` (the
    same bits for every kind of canary), refused by :func:`check_inclusion` when they cannot be
    audited; and the generator that drew them, for what the caller draws next.

    Examples:
        >>> from privmon.audit.one_run import inclusion_bits
        >>> bits, _ = inclusion_bits(1000, seed=0)
        >>> bits.shape, 400 < int(bits.sum()) < 600
        ((1000,), True)
    """
    rng = np.random.default_rng(seed)
    return check_inclusion(rng.random(n) < 0.5, seed=seed), rng


def check_inclusion(included: np.ndarray, *, seed: int) -> np.ndarray:
    """``included`` (the canaries' inclusion bits drawn from ``seed``) when the draw can be
    audited: both sides non-empty and a split fair coins make with p-value >= SPLIT_LEVEL.

    Refusing a draw conditions the audit on an acceptable one, which multiplies its level by at
    most 1 / (1 - 2^(1-m) - SPLIT_LEVEL) for m canaries (:func:`one_run_epsilon` refuses the
    same draws), a factor under 1 + 2e-6 from m = 20."""
    m, n_in = included.size, int(included.sum())
    side = "all" if n_in == m else "none" if n_in == 0 else None
    if side is not None:
        raise ValueError(
            f"the inclusion draw of seed={seed} includes {side} of the {m} canaries, so one "
            f"side of the audit would be empty (fair coins do this with probability "
            f"{2.0 ** (1 - m):.2g}): use more canaries (20 or more make it a one in 500,000 "
            "event) or another seed"
        )
    p = split_p_value(n_in, m - n_in)
    if p < SPLIT_LEVEL:
        raise ValueError(
            f"the inclusion draw of seed={seed} includes {n_in} of the {m} canaries, a split "
            f"fair coins make with probability {p:.2g}: use another seed"
        )
    return included


def _check_split(n_in: int, n_out: int) -> None:
    """Refuse scores whose in / out sizes independent fair coins cannot have made."""
    p = split_p_value(n_in, n_out)
    if p < SPLIT_LEVEL:
        raise ValueError(
            f"in_scores and out_scores: {n_in} in and {n_out} out is a split independent fair "
            f"coins make with probability {p:.2g} (two-sided; below SPLIT_LEVEL = "
            f"{SPLIT_LEVEL:g}): the bounds assume each canary was included in training by an "
            "independent fair coin (inclusion probability 1/2) drawn before training, so scores "
            "of other sets (members against a larger set of non-members, say) give no valid bound"
        )


def _check_bound_args(delta: Any, significance: Any, method: Any) -> tuple[float, float]:
    """delta in [0, 1) (> 0 for "fdp"), significance in (0, 1), a known method."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    delta = check_half_open_interval(delta, name="delta", low=0, high=1)
    if method == "fdp" and delta == 0.0:
        raise ValueError(
            "delta must be > 0 for method='fdp': a μ-GDP curve with μ > 0 has no finite ε "
            "at δ = 0 (use method='steinke' for a pure-DP bound)"
        )
    return delta, check_open_unit(significance, name="significance")


def _refuted(
    method: str, m: int, r: int, v: int, *, delta: float, level: float, floor: float
) -> float:
    """The test's refuted parameter for counts (m, r, v): ε for "steinke", μ for "fdp"."""
    if method == "steinke":
        return steinke_epsilon(m, r, v, delta, level, floor=floor)
    return fdp_mu(m, r, v, level, floor=floor)


def epsilon_from_guesses(
    *,
    n_canaries: int,
    n_guesses: int,
    n_correct: int,
    delta: float,
    significance: float = 0.05,
    method: Literal["fdp", "steinke"] = "fdp",
) -> float:
    """ε lower bound from counts fixed in advance: ``n_correct`` right among ``n_guesses``
    guesses on ``n_canaries`` canaries, each included with probability 1/2.

    ``method="fdp"``: the largest μ that Algorithm 3 of "Auditing f-Differential Privacy in One
    Run" refutes with the Gaussian trade-off curve, as ε at ``delta`` (> 0).
    ``method="steinke"``: the largest ε whose p-value β + α·δ·2m stays below ``significance``
    ("Privacy Auditing with One (1) Training Run"); at ``delta = 0`` the pure-DP bound. Both are
    valid at level 1 - ``significance`` when the number of guesses does not depend on the run;
    bounds are rounded down.

    Args:
        n_canaries: m, every canary of the audit (guessed or not), >= 1.
        n_guesses: r <= m.
        n_correct: v <= r.
        delta: δ in [0, 1); > 0 for "fdp".
        significance: in (0, 1).
        method: "fdp" or "steinke".

    Returns:
        The ε lower bound (0 when nothing is refuted).

    Examples:
        >>> from privmon.audit import epsilon_from_guesses
        >>> counts = dict(n_canaries=1000, n_guesses=100, n_correct=95, delta=1e-5)
        >>> round(epsilon_from_guesses(**counts), 2)
        3.32
        >>> round(epsilon_from_guesses(**counts, method="steinke"), 2)
        2.17
    """
    delta, significance = _check_bound_args(delta, significance, method)
    m = check_int(n_canaries, name="n_canaries", minimum=1)
    r = check_int(n_guesses, name="n_guesses")
    v = check_int(n_correct, name="n_correct")
    if r > m:
        raise ValueError(f"n_guesses must be <= n_canaries ({m}), got {r}")
    if v > r:
        raise ValueError(f"n_correct must be <= n_guesses ({r}), got {v}")
    bound = _refuted(method, m, r, v, delta=delta, level=significance, floor=0.0)
    return bound if method == "steinke" else gdp_epsilon(bound, delta)


def _scores(values: Any, *, name: str) -> np.ndarray:
    """One side's scores as a float64 vector, non-finite entries kept (as NaN)."""
    t, _ = as_scores(values, name=name, drop=False)
    if t.shape[1] != 1:
        raise ValueError(f"{name} must hold one score per canary, got shape {tuple(t.shape)}")
    y = to_numpy(t)[:, 0].copy()
    y[~np.isfinite(y)] = np.nan
    return y


def _counts(
    scores: np.ndarray, included: np.ndarray, tiebreak: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Correct guesses on the k highest / k lowest scores, for every k: (tp, tn), each of
    length n + 1. Ties are ordered by ``tiebreak`` (drawn independently of inclusion)."""
    order = np.lexsort((tiebreak, -scores))
    ranked = included[order]
    tp = np.concatenate(([0], np.cumsum(ranked)))
    tn = np.concatenate(([0], np.cumsum(~ranked[::-1])))
    return tp, tn


def _split_choice(
    tp: np.ndarray,
    tn: np.ndarray,
    n_select: int,
    n_audit: int,
    method: str,
    delta: float,
    level: float,
) -> tuple[int, int]:
    """(k₊, k₋) for the audit part: the candidate whose bound, predicted at the audit part's
    size from the selection part's counts, is largest.

    Candidates: 12 guess counts r, geometric from 1 to the selection part's size, each all on
    top, half and half, or all at the bottom, scaled to the audit part. Prediction: the
    selection part's precision p = (v + 1) / (r + 2) less one standard deviation
    sqrt(p(1 - p) / (r + 2)), times the audit part's guess count. The pessimism and the coarse
    grid are against the winner's curse (the largest of many noisy predictions is mostly luck
    at small r): on the idealised Gaussian mechanism (1e5 canaries, 20 seeds) they raise the
    mean f-DP bound from 3.13 to 3.20 at σ = 1 and from 1.33 to 1.40 at σ = 2, against 24
    counts with p alone.
    """
    scale = n_audit / n_select
    sizes = np.unique(np.round(np.geomspace(1, n_select, _SPLIT_SIZES)).astype(int))
    best, choice = -1.0, (0, 0)
    for r in sizes:
        for ratio in _SPLIT_RATIOS:
            k_plus = round(ratio * r)
            k_minus = int(r) - k_plus
            plus_a = min(round(k_plus * scale), n_audit)
            minus_a = min(round(k_minus * scale), n_audit - plus_a)
            precision = (tp[k_plus] + tn[k_minus] + 1) / (r + 2)
            precision -= math.sqrt(precision * (1.0 - precision) / (r + 2))
            guesses = plus_a + minus_a
            correct = round(precision * guesses)
            floor = max(best, 0.0)
            bound = _refuted(
                method, n_audit, guesses, correct, delta=delta, level=level, floor=floor
            )
            if bound > best:
                best, choice = bound, (plus_a, minus_a)
    return choice


def _check_selection(selection: Any) -> tuple[int, int] | None:
    """The fixed pair (k_plus, k_minus), or None for "split" / "bonferroni"."""
    if isinstance(selection, str) and selection in ("split", "bonferroni"):
        return None
    what = "'split', 'bonferroni' or a pair (k_plus, k_minus) of integers >= 0"
    if isinstance(selection, str) or not isinstance(selection, tuple | list) or len(selection) != 2:
        raise ValueError(f"selection must be {what}, got {selection!r}")
    return (
        check_int(selection[0], name="selection's k_plus"),
        check_int(selection[1], name="selection's k_minus"),
    )


def one_run_epsilon(
    in_scores: Any,
    out_scores: Any,
    *,
    delta: float,
    significance: float = 0.05,
    method: Literal["fdp", "steinke"] = "fdp",
    selection: Literal["split", "bonferroni"] | tuple[int, int] = "split",
    selection_fraction: float = 0.1,
    seed: int = 0,
) -> OneRunAudit:
    """ε lower bound from the scores of one run's canaries, at level 1 - ``significance``,
    the auditor's choice of guesses included.

    The auditor guesses "included" on the k₊ highest scores and "left out" on the k₋ lowest
    and counts the correct guesses; ``method`` turns the counts into a bound ("fdp":
    Mahloujifar et al.'s Algorithm 3 with the Gaussian trade-off curve, the refuted μ-GDP
    converted to ε at ``delta``; "steinke": Steinke et al.'s (ε, δ) p-value). Choosing (k₊, k₋)
    after seeing which guesses came out right would invalidate the level, so ``selection``
    offers three valid ways:

    * ``"split"`` (default): a seeded random ``selection_fraction`` of the canaries, drawn
      independently of inclusion, chooses the guesses (from 12 guess counts, each all on top,
      half and half or all at the bottom, with a pessimistic precision); the rest is audited.
    * ``"bonferroni"``: the pairs of :data:`BONFERRONI_GRID`, fixed before the run, each tested
      at ``significance / 6``; the largest bound is reported.
    * a pair ``(k_plus, k_minus)`` fixed before the run (e.g. by an earlier run): one test.

    Guarantee: P[bound > the mechanism's ε (μ for "fdp")] <= ``significance`` for any mechanism
    that is (ε, δ)-DP ("steinke") or μ-GDP ("fdp") in each canary, with "bonferroni" or a fixed
    pair; with "split", for "steinke" at ``delta = 0``, and otherwise when the selection part's
    scores do not depend on the audited canaries' bits (canaries that do not interact; not
    proven beyond, measured under the null by ``benchmarks/one_run_audit.py``). "fdp"
    refutes μ-GDP curves, so its ε is a lower bound for mechanisms whose trade-off curve is
    Gaussian (DP-SGD's, to a good approximation). The argument: docs, Theory page, *One-run ε
    lower bounds*.

    What the bound assumes: each canary was included in training by an independent fair coin
    (probability 1/2), drawn before training and independently of everything but its own
    inclusion. A split whose sizes such coins make with a two-sided probability below
    :data:`SPLIT_LEVEL` (10 in against 10,000 out) is refused; sizes cannot reveal every
    violation (members against as many non-members pass), so use canaries whose inclusion was
    randomised (:class:`~privmon.audit.GradientCanaries`, :class:`~privmon.audit.InputCanaries`,
    :class:`~privmon.audit.RecordCanaries`).

    Tied scores are ordered by seeded draws independent of inclusion. Non-finite scores are
    counted in ``n_dropped`` and ranked at the median of the finite scores: abstentions unless
    the guesses reach the middle of the ranking.

    Args:
        in_scores: scores of the canaries included in training, shape (n,) or (n, 1), numpy
            or torch (any device).
        out_scores: scores of the canaries left out, same form.
        delta: δ in [0, 1); > 0 for "fdp".
        significance: level in (0, 1) spent by the whole call.
        method: "fdp" or "steinke".
        selection: "split", "bonferroni" or a pair (k_plus, k_minus) of non-negative ints.
        selection_fraction: the split's selection part, in (0, 1).
        seed: seeds the split and the tie-breaking draws (an int >= 0).

    Returns:
        :class:`OneRunAudit`.

    Raises:
        ValueError: an argument out of its range, a side empty or without a finite score, or
            an in / out split fair coins cannot have made (below :data:`SPLIT_LEVEL`).

    Examples:
        >>> import numpy as np
        >>> from privmon.audit import one_run_epsilon
        >>> rng = np.random.default_rng(0)
        >>> included = rng.random(1000) < 0.5  # each canary trained on with probability 1/2
        >>> scores = rng.normal(size=1000) + 2.0 * included  # a mechanism that leaks
        >>> in_scores, out_scores = scores[included], scores[~included]
        >>> audit = one_run_epsilon(in_scores, out_scores, delta=1e-5)
        >>> round(audit.epsilon, 2), audit.k_plus, audit.k_minus, audit.n_correct
        (5.1, 171, 0, 168)
        >>> pair = one_run_epsilon(in_scores, out_scores, delta=1e-5, selection=(50, 50))
        >>> round(pair.epsilon, 2), pair.n_correct
        (5.55, 100)
    """
    delta, significance = _check_bound_args(delta, significance, method)
    fraction = check_open_unit(selection_fraction, name="selection_fraction")
    seed = check_int(seed, name="seed")
    fixed = _check_selection(selection)
    check_not_label_order(in_scores, out_scores, fn="audit.one_run_epsilon")
    y_in = _scores(in_scores, name="in_scores")
    y = np.concatenate((y_in, _scores(out_scores, name="out_scores")))
    _check_split(y_in.size, y.size - y_in.size)
    included = np.arange(y.size) < y_in.size
    missing = np.isnan(y)
    if missing.all():
        raise ValueError("in_scores and out_scores hold no finite score: all are NaN or ±inf")
    y[missing] = np.median(y[~missing])
    rng = np.random.default_rng(seed)
    tiebreak = rng.random(y.size)
    audit = np.arange(y.size)
    n_select, level = 0, significance
    if fixed is not None:
        if sum(fixed) > y.size:
            raise ValueError(
                f"selection asks for {sum(fixed)} guesses but there are {y.size} canaries"
            )
        pairs = [fixed]
    elif selection == "bonferroni":
        ks = {min(max(1, round(f * y.size)), y.size // 2) for f in BONFERRONI_GRID}
        pairs = sorted((k, k) for k in ks)
        level = significance / len(pairs)
    else:
        n_select = max(1, round(fraction * y.size))
        if n_select >= y.size:
            raise ValueError(
                f"selection='split' leaves no canary to audit: {y.size} canaries, "
                f"selection_fraction={fraction} (use a smaller fraction or a fixed pair)"
            )
        order = rng.permutation(y.size)
        select, audit = order[:n_select], order[n_select:]
        tp, tn = _counts(y[select], included[select], tiebreak[select])
        pairs = [_split_choice(tp, tn, n_select, audit.size, method, delta, significance)]
    tp, tn = _counts(y[audit], included[audit], tiebreak[audit])
    best, choice = -1.0, pairs[0]
    for k_plus, k_minus in pairs:
        correct = int(tp[k_plus] + tn[k_minus])
        floor = max(best, 0.0)
        bound = _refuted(
            method, audit.size, k_plus + k_minus, correct, delta=delta, level=level, floor=floor
        )
        if bound > best:
            best, choice = bound, (k_plus, k_minus)
    k_plus, k_minus = choice
    return OneRunAudit(
        epsilon=best if method == "steinke" else gdp_epsilon(best, delta),
        method=method,
        delta=delta,
        significance=significance,
        n_canaries=int(audit.size),
        n_selection=n_select,
        n_dropped=int(missing.sum()),
        k_plus=k_plus,
        k_minus=k_minus,
        n_correct=int(tp[k_plus] + tn[k_minus]),
        selection="fixed" if fixed is not None else str(selection),
        mu=None if method == "steinke" else best,
    )
