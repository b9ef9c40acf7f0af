"""Reference-model membership attacks: LiRA, RMIA and difficulty calibration.

Each attack compares a per-record statistic of the audited (target) model with the same statistic
under k reference (shadow) models trained on random subsets of the population, some with the
record and some without (``shadow_in[i, j]``: record j was in model i's training set):
:func:`lira` (Carlini et al., "Membership Inference Attacks From First Principles"), :func:`rmia`
(Zarifzadeh et al., "Low-Cost High-Power Membership Inference Attacks") and
:func:`calibrated_score` (Watson et al., "On the Importance of Difficulty Calibration in
Membership Inference Attacks"). :func:`leave_one_out` makes each model in turn the target of the
others. :class:`privmon.queries.ReferenceModelQuery` uses the same pieces.

Inputs are numpy arrays or torch tensors on any device, worked in float64 on the target scores'
device and vectorized over records and models; results are float64 numpy arrays aligned with the
records. A non-finite shadow score is left out of its record's fit; a record that cannot be
scored gets NaN, which privmon's estimators drop and count. The formulas and the Gaussian fits:
docs, Theory page, *Reference-model attacks*.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from privmon._shown import positions
from privmon._validation import (
    as_array,
    as_mask,
    as_tensor,
    check_flag,
    check_positive,
    check_unit,
    to_numpy,
)

__all__ = [
    "FIXED_VARIANCE_BELOW",
    "LOMO_ATTACKS",
    "calibrated_score",
    "leave_one_out",
    "lira",
    "rmia",
]

# LiRA §VI: with fewer shadow models than this, a global variance beats per-record variances.
FIXED_VARIANCE_BELOW = 64
_MIN_VAR = 1e-60
_LOG_2PI = math.log(2 * math.pi)


# --- inputs ---------------------------------------------------------------------------------------


def reference_inputs(
    target: Any, shadow: Any, shadow_in: Any, *, kind: str, mask_required: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checked ``(target (n,), shadow (k, n), shadow_in (k, n) bool or None)`` on the target's
    device; ``kind`` is "scores" or "probs" (probabilities must lie in [0, 1])."""
    t = as_array(target, name=f"target_{kind}", ndim=1)
    s = as_array(shadow, name=f"shadow_{kind}", ndim=2, device=t.device)
    n = t.shape[0]
    if s.shape[1] != n:
        raise ValueError(
            f"shadow_{kind} must have shape (k, n) = (k, {n}), one row per shadow model and one "
            f"column per record of target_{kind}, got shape {tuple(s.shape)}"
        )
    if kind == "probs":
        for name, v in ((f"target_{kind}", t), (f"shadow_{kind}", s)):
            outside = (v < 0.0) | (v > 1.0)  # NaN and inf: dropped later, not refused here
            outside &= torch.isfinite(v)
            if bool(outside.any()):
                raise ValueError(
                    f"{name} must be probabilities of the true label in [0, 1]; "
                    f"{positions(outside)} are not"
                )
    if shadow_in is None:
        if mask_required:
            raise ValueError(f"shadow_in is required: a boolean array of shape {tuple(s.shape)}")
        return t, s, None
    return t, s, as_mask(shadow_in, name="shadow_in", shape=tuple(s.shape), device=t.device)


# --- the pieces (shared with privmon.queries.ReferenceModelQuery) ------------------------------


def gaussian_fit(
    scores: torch.Tensor, use: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per column of ``scores`` (k, n): the maximum-likelihood mean and variance of its finite
    entries where ``use`` (None: all rows), and their number. NaN where there is none."""
    ok = torch.isfinite(scores) if use is None else use & torch.isfinite(scores)
    count = ok.sum(dim=0)
    c = count.to(scores.dtype)
    mean = torch.where(ok, scores, 0.0).sum(dim=0) / c
    var = torch.where(ok, scores - mean, 0.0).square().sum(dim=0) / c
    # equal scores (a capped confidence): their value and variance 0 exactly, where the sum
    # divided by the count would leave a rounding error that the floored variance magnifies
    high = torch.where(ok, scores, -math.inf).amax(dim=0)
    equal = high == torch.where(ok, scores, math.inf).amin(dim=0)
    return torch.where(equal, high, mean), torch.where(equal, 0.0, var), count


def pooled_variance(var: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """LiRA's fixed variance: the mean of the per-record variances ``var`` over the records with
    at least two scores (``count``), a 0-d tensor; NaN when there is none."""
    ok = count >= 2
    return var[ok].mean() if bool(ok.any()) else var.new_tensor(math.nan)


def fit_variance(
    var: torch.Tensor, count: torch.Tensor, *, fixed: bool, pooled: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-record variances (NaN below two scores) or the fixed variance broadcast to every
    record with at least one score (``pooled``, by default :func:`pooled_variance` of these
    records); floored at 1e-60."""
    if fixed:
        pooled = pooled_variance(var, count) if pooled is None else pooled
        var = torch.where(count >= 1, pooled, math.nan)
    else:
        var = torch.where(count >= 2, var, math.nan)
    return var.clamp_min(_MIN_VAR)


def log_normal(t: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """log N(t; mean, var), elementwise."""
    return -0.5 * (_LOG_2PI + torch.log(var) + (t - mean).square() / var)


def lira_offline_score(t: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """log Φ((t − μ_out) / σ_out), NaN where t is not finite."""
    score = torch.special.log_ndtr((t - mean) / var.sqrt())
    return torch.where(torch.isfinite(t), score, math.nan)


def rmia_marginal(
    probs: torch.Tensor, shadow_in: torch.Tensor | None, *, online: bool, a: float
) -> torch.Tensor:
    """RMIA's Pr(x) from the reference models' probabilities (k, n): online, their mean over
    all models; offline, ½((1 + a)·Pr_out(x) + (1 − a)) with Pr_out the mean over the models
    trained without x (all of them when ``shadow_in`` is None)."""
    if online:
        return gaussian_fit(probs, None)[0]
    pr_out = gaussian_fit(probs, None if shadow_in is None else ~shadow_in)[0]
    return 0.5 * ((1.0 + a) * pr_out + (1.0 - a))


def rmia_score(ratio: torch.Tensor, population_ratio: torch.Tensor, gamma: float) -> torch.Tensor:
    """Fraction of population ratios r(z) with r(x) / r(z) ≥ γ, counted as r(z) ≤ r(x) / γ by
    binary search in the sorted r(z) (one division per record instead of one per pair; the two
    tests agree up to rounding when r(x) / r(z) lies within an ulp of γ). NaN where r(x) is
    NaN; ``population_ratio`` must be free of NaN."""
    rz = torch.sort(population_ratio).values
    count = torch.searchsorted(rz, (ratio / gamma).contiguous(), right=True)
    score = count.to(torch.float64) / rz.shape[0]
    return torch.where(torch.isnan(ratio), math.nan, score)


def _target_finite(t: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), score, math.nan)


def _check_fixed_variance(fixed_variance: Any) -> bool | None:
    if fixed_variance is None:
        return None
    return check_flag(fixed_variance, name="fixed_variance")


def lira_tensor(
    t: torch.Tensor,
    s: torch.Tensor,
    m: torch.Tensor,
    *,
    online: bool,
    fixed_variance: bool | None,
) -> torch.Tensor:
    """:func:`lira` on checked tensors: target (n,), shadow (k, n), mask (k, n)."""
    fixed = s.shape[0] < FIXED_VARIANCE_BELOW if fixed_variance is None else fixed_variance
    mu_out, var_out, n_out = gaussian_fit(s, ~m)
    var_out = fit_variance(var_out, n_out, fixed=fixed)
    if not online:
        return lira_offline_score(t, mu_out, var_out)
    mu_in, var_in, n_in = gaussian_fit(s, m)
    var_in = fit_variance(var_in, n_in, fixed=fixed)
    return _target_finite(t, log_normal(t, mu_in, var_in) - log_normal(t, mu_out, var_out))


def rmia_tensor(
    t: torch.Tensor,
    s: torch.Tensor,
    m: torch.Tensor | None,
    population: torch.Tensor,
    *,
    online: bool,
    a: float,
    gamma: float,
) -> torch.Tensor:
    """:func:`rmia` on checked tensors; ``population`` a bool mask (n,)."""
    ratio = _target_finite(t, t / rmia_marginal(s, m, online=online, a=a))
    rz = ratio[population]
    rz = rz[~torch.isnan(rz)]
    if rz.numel() == 0:
        raise ValueError("population has no record with a finite probability ratio to compare with")
    return rmia_score(ratio, rz, gamma)


def calibrated_tensor(t: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """:func:`calibrated_score` on checked tensors."""
    return _target_finite(t, t - gaussian_fit(s, None if m is None else ~m)[0])


# --- public API -----------------------------------------------------------------------------------


def lira(
    target_scores: Any,
    shadow_scores: Any,
    shadow_in: Any,
    *,
    online: bool = True,
    fixed_variance: bool | None = None,
) -> np.ndarray:
    """LiRA membership scores (Carlini et al., "Membership Inference Attacks From First
    Principles"), shape (n,), higher = member.

    Args:
        target_scores: (n,) the target model's statistic per record, e.g. the logit-scaled
            confidence φ (higher = more member-like).
        shadow_scores: (k, n) the same statistic under k shadow models.
        shadow_in: (k, n) bool, ``shadow_in[i, j]``: record j was in shadow model i's training
            set.
        online: True (default): the log likelihood ratio log N(t; μ_in, σ²_in) − log N(t; μ_out,
            σ²_out) of Gaussians fitted per record to the models with and without it (eq. 4,
            Algorithm 1). False: the offline one-sided test log Φ((t − μ_out) / σ_out) (§VI-A).
        fixed_variance: True: one variance per side, the pooled within-record variance (as the
            paper advises below about 64 shadow models); False: per-record variances. None
            (default): fixed when k < 64.

    Returns:
        float64 numpy array (n,); NaN where the target score is not finite or a side used has
        too few finite shadow scores (two for a per-record variance, one for a fixed one).

    Raises:
        ValueError naming the argument: arrays of the wrong dimension or shape, empty arrays,
            a ``shadow_in`` that is not boolean, ``online`` / ``fixed_variance`` not a bool.

    Examples:
        >>> import numpy as np
        >>> from privmon import auc
        >>> from privmon.attacks import lira
        >>> rng = np.random.default_rng(0)
        >>> shadow_in = rng.random((16, 200)) < 0.5  # record j in shadow model i
        >>> shadow = rng.normal(size=(16, 200)) + shadow_in  # members score higher
        >>> member = rng.random(200) < 0.5  # the target model's members
        >>> scores = lira(rng.normal(size=200) + member, shadow, shadow_in)
        >>> scores.shape
        (200,)
        >>> round(auc(scores[member], scores[~member]), 2)
        0.69
    """
    online = check_flag(online, name="online")
    fixed_variance = _check_fixed_variance(fixed_variance)
    t, s, m = reference_inputs(target_scores, shadow_scores, shadow_in, kind="scores")
    assert m is not None  # mask_required (the default): a missing shadow_in raised
    return to_numpy(lira_tensor(t, s, m, online=online, fixed_variance=fixed_variance))


def rmia(
    target_probs: Any,
    shadow_probs: Any,
    shadow_in: Any = None,
    *,
    population: Any,
    online: bool = True,
    a: float = 0.3,
    gamma: float = 1.0,
) -> np.ndarray:
    """RMIA membership scores (Zarifzadeh et al., "Low-Cost High-Power Membership Inference
    Attacks"), shape (n,), in [0, 1], higher = member.

    With r(x) = Pr(x | θ) / Pr(x), the likelihood ratio of x against a population record z is
    LR(x, z) = r(x) / r(z) and the score is the fraction of population records z
    with LR(x, z) ≥ γ. Pr(x | θ) is the target model's probability of x's true label; Pr(x) is
    the reference models' (online: the mean over all of them, in and out; offline: the
    approximation ½((1 + a)·Pr_out(x) + (1 − a)) from the models trained without x). The
    population records' r(z) are computed the same way.

    Args:
        target_probs: (n,) the target model's probability of each record's true label.
        shadow_probs: (k, n) the same under k reference models.
        shadow_in: (k, n) bool membership of the records in the reference models; needed only
            offline, where None means no reference model saw any record.
        population: which of the n records are the population records z (records the target
            did not train on): a bool mask (n,) or integer indices, positions rather than the
            records :class:`privmon.queries.ReferenceModelQuery` takes. A scored record among
            them has LR = 1 against itself. Separate population records: append their
            probabilities (and False columns of ``shadow_in``) and pass their indices.
        online: the Pr(x) estimate (above).
        a: offline only, the slope of Pr_in(x) ≈ a·Pr_out(x) + (1 − a), in [0, 1]; the paper
            tunes it on reference models (0.3 is a common value for small datasets).
        gamma: the likelihood-ratio threshold γ > 0 (the paper uses 1 to 2).

    Returns:
        float64 numpy array (n,); NaN where Pr(x | θ) is not finite or Pr(x) cannot be formed
        (no finite reference probability on the side needed). A Pr(x) of exactly 0 makes
        r(x) infinite (the top score), or NaN when Pr(x | θ) is 0 too.

    Examples:
        >>> import numpy as np
        >>> from privmon import auc
        >>> from privmon.attacks import rmia
        >>> rng = np.random.default_rng(0)
        >>> def sigmoid(z):
        ...     return 1 / (1 + np.exp(-z))
        >>> shadow_in = rng.random((8, 200)) < 0.5
        >>> shadow_probs = sigmoid(rng.normal(size=(8, 200)) + shadow_in)
        >>> member = np.arange(200) < 100  # the target trained on the first 100 records
        >>> target_probs = sigmoid(rng.normal(size=200) + member)
        >>> scores = rmia(target_probs, shadow_probs, shadow_in, population=~member)
        >>> round(auc(scores[member], scores[~member]), 2)
        0.76
    """
    online = check_flag(online, name="online")
    a = check_unit(a, name="a")
    gamma = check_positive(gamma, name="gamma")
    t, s, m = reference_inputs(
        target_probs, shadow_probs, shadow_in, kind="probs", mask_required=False
    )
    pop = population_mask(population, n=t.shape[0], device=t.device)
    return to_numpy(rmia_tensor(t, s, m, pop, online=online, a=a, gamma=gamma))


def calibrated_score(target_scores: Any, shadow_scores: Any, shadow_in: Any = None) -> np.ndarray:
    """Difficulty-calibrated score (Watson et al., "On the Importance of Difficulty Calibration
    in Membership Inference Attacks"): s(θ, x) − mean_i s(θ_i, x) over the reference models
    trained without x.

    With a higher-is-member statistic (e.g. −loss, as :func:`privmon.audit.specific.
    default_score` returns, or the logit-scaled confidence) the result is higher-is-member too:
    for −loss it is the reference models' mean loss minus the target's loss.

    Args:
        target_scores: (n,) the target model's statistic.
        shadow_scores: (k, n) the statistic under k reference models.
        shadow_in: (k, n) bool; the models with ``shadow_in`` True are left out of each record's
            mean. None: every reference model was trained without every record.

    Returns:
        float64 numpy array (n,); NaN where the target score is not finite or the record has no
        finite score from a model trained without it.

    Examples:
        >>> import numpy as np
        >>> from privmon.attacks import calibrated_score
        >>> target = -np.array([0.1, 2.0, 0.5])  # the target model's -loss of 3 records
        >>> shadow = -np.array([[0.2, 2.1, 0.1], [0.4, 1.9, 0.3]])  # 2 models without them
        >>> calibrated_score(target, shadow).round(2)  # record 0 is easier for the target
        array([ 0.2,  0. , -0.3])
    """
    t, s, m = reference_inputs(
        target_scores, shadow_scores, shadow_in, kind="scores", mask_required=False
    )
    return to_numpy(calibrated_tensor(t, s, m))


def population_mask(population: Any, *, n: int, device: torch.device) -> torch.Tensor:
    """``population`` (a bool mask (n,) or integer indices into n records) as a bool mask."""
    what = f"a bool mask of shape ({n},) or a 1-D array of integer indices"
    p = as_tensor(population, name="population", what=what).to(device)
    if p.dtype == torch.bool:
        if tuple(p.shape) != (n,):
            raise ValueError(
                f"population as a bool mask must have shape ({n},), got {tuple(p.shape)}"
            )
        mask = p
    else:
        if p.is_floating_point() or p.is_complex() or p.ndim != 1:
            raise ValueError(
                f"population must be {what}, got dtype {p.dtype} and shape {tuple(p.shape)}"
            )
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n):
            raise ValueError(
                f"population indices must lie in [0, {n - 1}], got range "
                f"[{int(p.min())}, {int(p.max())}]"
            )
        mask = torch.zeros(n, dtype=torch.bool, device=device)
        mask[p.long()] = True
    if not bool(mask.any()):
        raise ValueError("population must name at least one record")
    return mask


LOMO_ATTACKS = ("loss", "lira", "lira_offline", "rmia", "rmia_offline", "calibrated")
"""The attacks :func:`leave_one_out` evaluates (its ``attack`` argument)."""

LOMO_MIN_MODELS = {attack: 1 if attack == "loss" else 3 for attack in LOMO_ATTACKS}
"""The fewest models :func:`leave_one_out` takes per attack: the reference attacks score a
record only with other models on its sides (three give LiRA's fixed variance a side of two)."""


def leave_one_out(
    statistic: Any,
    masks: Any,
    *,
    attack: str,
    fixed_variance: bool | None = None,
    a: float = 0.3,
    gamma: float = 1.0,
) -> np.ndarray:
    """Scores of every record under every model, each model in turn the target and the others
    its reference models: Carlini et al.'s leave-one-model-out evaluation (§V), shape (k, n).

    Args:
        statistic: (k, n) the logit-scaled confidence φ = log(p_y / (1 − p_y)) of record j
            under model i. The LiRA attacks use it as is (any roughly Gaussian per-record
            statistic works for them); ``"loss"`` and ``"calibrated"`` read it as the
            cross-entropy −log p_y = softplus(−φ), RMIA as the probability p_y = sigmoid(φ).
        masks: (k, n) bool, record j in model i's training set.
        attack: one of ``"loss"`` (−cross-entropy under the target, no reference), ``"lira"``
            (online), ``"lira_offline"``, ``"rmia"`` (online), ``"rmia_offline"`` and
            ``"calibrated"`` (the target's −loss minus the mean −loss of the references trained
            without the record). RMIA's population for target i are the records it did not
            train on (each non-member is also compared with itself, LR = 1).
        fixed_variance, a, gamma: as in :func:`lira` and :func:`rmia` (with k − 1 references).

    Returns:
        float64 numpy array (k, n), higher = member; NaN as the attacks give it.

    Examples:
        >>> import numpy as np
        >>> from privmon import auc
        >>> from privmon.attacks import leave_one_out
        >>> rng = np.random.default_rng(0)
        >>> masks = rng.random((8, 100)) < 0.5
        >>> phi = rng.normal(size=(8, 100)) + masks  # members: a higher confidence
        >>> scores = leave_one_out(phi, masks, attack="lira_offline")
        >>> scores.shape
        (8, 100)
        >>> round(auc(scores[masks], scores[~masks]), 2)
        0.75
    """
    if attack not in LOMO_ATTACKS:
        raise ValueError(f"attack must be one of {LOMO_ATTACKS}, got {attack!r}")
    fixed_variance = _check_fixed_variance(fixed_variance)
    a = check_unit(a, name="a")
    gamma = check_positive(gamma, name="gamma")
    stat = as_array(statistic, name="statistic", ndim=2)
    k = stat.shape[0]
    if k < LOMO_MIN_MODELS[attack]:
        raise ValueError(
            f"statistic must come from at least {LOMO_MIN_MODELS[attack]} models for "
            f"{attack!r}, got {k}"
        )
    m = as_mask(masks, name="masks", shape=tuple(stat.shape), device=stat.device)
    if attack.startswith("rmia"):
        stat = torch.sigmoid(stat)
    elif attack in ("loss", "calibrated"):
        stat = -torch.nn.functional.softplus(-stat)
    if attack == "loss":
        return to_numpy(stat)
    out = torch.empty_like(stat)
    for i in range(k):
        others = torch.arange(k, device=stat.device) != i
        t, s, mi = stat[i], stat[others], m[others]
        if attack.startswith("lira"):
            out[i] = lira_tensor(t, s, mi, online=attack == "lira", fixed_variance=fixed_variance)
        elif attack.startswith("rmia"):
            if not bool(torch.isfinite(t[~m[i]]).any()):  # a model that scores nothing (diverged)
                out[i] = math.nan
                continue
            out[i] = rmia_tensor(t, s, mi, ~m[i], online=attack == "rmia", a=a, gamma=gamma)
        else:
            out[i] = calibrated_tensor(t, s, mi)
    return to_numpy(out)
