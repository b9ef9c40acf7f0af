"""A learned Bayes rule for high-dimensional queries (d ≥ 3): cross-fitted logistic regression
beside threshold rules on the scores' 1-D summaries.

Density estimates lose most of a leak above two dimensions, so there the Bayes rule "member iff
p·P(x) > (1−p)·Q(x)" (MACE eq. 7-8) is learned: each rule picks, on its own training records, one
candidate — logistic regression on the standardised scores z, their squares z² or both (the
decision shifted by the prior: member iff ℓ(x) − log(n1/n2) + log(p/(1−p)) > 0), or a threshold
on one of the scores' summaries (the entropy of their softmax, the largest coordinate, the norm;
a leak a function of the scores shows is one the rule can read) — the one whose test on those
records has the smallest p-value: Rao's score test for a block set, Kolmogorov–Smirnov for a
summary. A cross-fitted rule takes it only if that p-value is below 5 % (``SELECTION_LEVEL``),
which keeps the null quiet; a certificate's rule always takes it (its certificate holds
whatever its rule). The ridge penalty of each block is set by the evidence approximation; no
random numbers are drawn. K-fold cross-fitting: rule k learns on the other folds and is applied
to fold k; each certificate's rule learns on the folds its certificate does not read
(``HIGH_DIM_CERTIFY_FOLDS``). All fits run as one batch on the scores' device. A tie (decision
within 1e-9 of 0) counts 1/2, and for a certificate goes to the prior's side.

Derivation, measurements and cost: Theory, *The learned rule above two dimensions*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from privmon.estimators.folds import HIGH_DIM_CERTIFY_FOLDS, fold_of

__all__ = ["RuleCounts", "learned_rule_counts"]

TIE_TOLERANCE = 1e-9
MAX_UPDATES = 40
STEPS_PER_UPDATE = 8
STEP_TOLERANCE = 1e-6  # largest coefficient change in the last step
ALPHA_TOLERANCE = 0.05  # largest |log α − log(γ / ‖w‖²)|
ALPHA_RANGE = (1e-3, 1e6)  # the upper end counts as unbounded: the block is pruned
MAX_MOVE = math.log(10.0)  # at most a factor 10 per update of α
SECANT_FLOOR = 0.1  # slowest contraction the secant assumes: moves up to 10 gaps
INTERCEPT_PENALTY = 1e-8  # keeps a fit without training records well posed
CONSTANT = 1e-12  # relative spread below which a training column counts as constant
SELECTION_LEVEL = 0.05  # a cross-fitted rule takes a candidate only if its test rejects at 5 %
RANK_TOLERANCE = 1e-9  # eigenvalues of a block's Gram matrix below this share of its largest: 0
BLOCK_SETS = 3  # the candidate block sets (z, z², both); the summaries' threshold rules follow
# terms of Kolmogorov's series: at t ≥ 0.2 the first one left out is below e^-800
KOLMOGOROV_TERMS = 100
KOLMOGOROV_ONE = 0.2  # below this t, P(K > t) is 1 to 1e-12


@dataclass(frozen=True)
class RuleCounts:
    """Held-out positives of the learned rules. ``tp`` / ``fp``: members / non-members the K
    cross-fitted rules call members on their held-out folds, summed over folds (ties 1/2).
    ``cert_tp`` / ``cert_fp``: one per certificate (``HIGH_DIM_CERTIFY_FOLDS``), the same for
    its rule (learned on the other folds) on its folds, which hold ``n1_cert`` members and
    ``n2_cert`` non-members (ties on the prior's side)."""

    tp: float
    fp: float
    cert_tp: tuple[float, ...]
    cert_fp: tuple[float, ...]
    n1_cert: tuple[int, ...]
    n2_cert: tuple[int, ...]


@dataclass(frozen=True)
class _Scaling:
    """Per-fit centre and scale of each column (R, c), and whether it varies on the fit's
    training records (spread above ``CONSTANT`` of its magnitude); constant columns map to 0."""

    mean: torch.Tensor
    scale: torch.Tensor
    varies: torch.Tensor

    @staticmethod
    def fitted(x: torch.Tensor, weight: torch.Tensor) -> _Scaling:
        """Mean and standard deviation of the columns of x (R, T, c) over each fit's training
        rows (``weight`` (R, T) 0/1; padding rows 0)."""
        n = weight.sum(dim=1, keepdim=True).clamp_min(1)
        mean = torch.einsum("rt,rtc->rc", weight, x) / n
        sd = torch.sqrt(torch.einsum("rt,rtc->rc", weight, (x - mean.unsqueeze(1)) ** 2) / n)
        size = torch.einsum("rt,rtc->rc", weight, x.abs()) / n
        varies = sd > CONSTANT * size
        return _Scaling(mean, torch.where(varies, sd, torch.ones_like(sd)), varies)

    def fits(self, x: torch.Tensor) -> torch.Tensor:
        """Each fit's rows x (R, T, c) standardised with its own scaling."""
        return self._apply(
            x, self.mean.unsqueeze(1), self.scale.unsqueeze(1), self.varies.unsqueeze(1)
        )

    def rows(self, x: torch.Tensor, fit: torch.Tensor) -> torch.Tensor:
        """Rows x (rows, c) standardised with the scaling of fit ``fit[i]`` for row i."""
        return self._apply(x, self.mean[fit], self.scale[fit], self.varies[fit])

    @staticmethod
    def _apply(x, mean, scale, varies) -> torch.Tensor:
        z = (x - mean) / scale
        return torch.where(varies, z, torch.zeros_like(z))


def _features(z: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """[1, z, z²] (…, 2d + 1) from the standardised scores and their standardised squares."""
    return torch.cat([torch.ones_like(z[..., :1]), z, z2], dim=-1)


def _fit(
    phi: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    start: torch.Tensor,
    gram: torch.Tensor,
):
    """Evidence-penalised logistic regression of y on phi, batched over fits.

    phi (R, F, T) training features ([1, z, z²], features first: batched products with a
    row vector are several times faster in this layout), y (R, T) labels, weight (R, T) 0/1 (padding
    rows 0), ``start`` (R,) the intercept the penalty shrinks towards, ``gram`` (R, F, F) the
    weighted Gram matrix ΦᵀWΦ of the training features. Returns the coefficients (R, F).

    The penalised likelihood is maximised by minorise-maximise steps with the fixed curvature
    bound B = ¼·ΦᵀΦ ≥ −∇²(log-likelihood) ("Monotonicity of quadratic-approximation
    algorithms", Böhning and Lindsay, 1988): B is formed once per fit, every step decreases the
    objective, and a step costs two products with phi. Between runs of steps each block's
    penalty is re-estimated from the evidence, α = γ / ‖w‖² with γ = Σ_j (1 − α·Σ_jj) and
    Σ = (B + A)⁻¹, by a safeguarded secant iteration on log α."""
    r, f, _ = phi.shape
    block = _block_masks(f, dtype=phi.dtype, device=phi.device)[:2]  # linear, quadratic
    free = torch.zeros(f, dtype=phi.dtype, device=phi.device)
    free[0] = INTERCEPT_PENALTY
    centre = torch.zeros(r, f, dtype=phi.dtype, device=phi.device)
    centre[:, 0] = start
    bound = 0.25 * gram
    low, high = (math.log(a) for a in ALPHA_RANGE)
    # every fit stops at its own convergence: the batch keeps only the fits still iterating
    # (``active``), so no fit's result depends on how long the others take
    theta_all, log_alpha_all = centre.clone(), centre.new_zeros(r, 2)
    active = torch.arange(r, device=phi.device)
    theta, log_alpha, origin, previous = theta_all, log_alpha_all, centre, None
    for _ in range(MAX_UPDATES):
        penalty = log_alpha.exp() @ block + free
        chol, _ = torch.linalg.cholesky_ex(bound + torch.diag_embed(penalty))
        for _ in range(STEPS_PER_UPDATE):
            eta = torch.bmm(theta.unsqueeze(1), phi).squeeze(1)
            residual = weight * (torch.sigmoid(eta) - y)
            grad = torch.bmm(residual.unsqueeze(1), phi.mT).squeeze(1) + penalty * (theta - origin)
            step = torch.cholesky_solve(grad.unsqueeze(-1), chol).squeeze(-1)
            theta = theta - step
        gap = _evidence_gap(chol, penalty, theta, block, log_alpha, (low, high))
        previous, log_alpha = (log_alpha, gap), _secant_step(gap, log_alpha, previous, (low, high))
        converged = torch.maximum(
            step.abs().amax(dim=1) / STEP_TOLERANCE, gap.abs().amax(dim=1) / ALPHA_TOLERANCE
        ).le(1)
        finished = converged.tolist()  # one transfer per update
        if any(finished):
            theta_all[active], log_alpha_all[active] = theta, log_alpha
            if all(finished):
                break
            going = ~converged
            active, theta, log_alpha, origin = (
                t[going] for t in (active, theta, log_alpha, origin)
            )
            previous = (previous[0][going], previous[1][going])
            phi, y, weight, bound = phi[going], y[going], weight[going], bound[going]
    else:
        theta_all[active], log_alpha_all[active] = theta, log_alpha
    theta, log_alpha = theta_all, log_alpha_all
    # a block whose evidence-optimal penalty is unbounded is pruned (its weights are 0); with
    # both pruned the model is the intercept alone, whose maximum-likelihood value is ``start``
    kept = (log_alpha < high).to(phi.dtype)
    theta = theta * (kept @ block + (1 - block.sum(dim=0)))
    return torch.where(kept.any(dim=1, keepdim=True), theta, centre)


def _evidence_gap(chol, penalty, theta, block, log_alpha, limits) -> torch.Tensor:
    """How far each block's log α is from its evidence re-estimate log(γ / ‖w‖²), the
    re-estimate clamped to ``limits``."""
    low, high = limits
    covariance = torch.cholesky_inverse(chol).diagonal(dim1=-2, dim2=-1)
    gamma = ((1 - penalty * covariance) @ block.T).clamp_min(0)
    norm = (theta**2) @ block.T
    target = torch.where(
        (gamma > 0) & (norm > 0), gamma.log() - norm.log(), torch.full_like(norm, high)
    )
    return target.clamp(low, high) - log_alpha


def _secant_step(gap, log_alpha, previous, limits) -> torch.Tensor:
    """The next log α: along the gap, by the secant on it where the last update is known
    (where the gap does not shrink, faster), each move bounded, clamped to ``limits``."""
    if previous is None:
        move = gap
    else:  # secant on the gap; where it does not shrink, move faster along it
        slope = (gap - previous[1]) / (log_alpha - previous[0])
        slope = torch.where(torch.isfinite(slope), slope, torch.zeros_like(slope))
        move = gap / (-slope).clamp_min(SECANT_FLOOR)
    move = move.clamp(-MAX_MOVE, MAX_MOVE)
    return (log_alpha + move).clamp(*limits)


def _splits(n1: int, n2: int, folds: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out records of each fit, two (K + C, n1 + n2) boolean masks over the
    members then the non-members, K = ``folds``: rows 0..K−1 the cross-fitted rules (rule k
    learns on every fold but k and is applied to fold k), row K + j the j-th certificate's rule
    (applied to the folds of ``HIGH_DIM_CERTIFY_FOLDS[j]``, learned on the others)."""
    position = torch.cat([torch.arange(n1, device=device), torch.arange(n2, device=device)])
    fold = fold_of(position, folds)
    certified = [
        torch.isin(fold, torch.tensor(held, device=device)) for held in HIGH_DIM_CERTIFY_FOLDS
    ]
    held_out = torch.cat(
        [fold == torch.arange(folds, device=device).unsqueeze(1), torch.stack(certified)]
    )
    return ~held_out, held_out


def _block_masks(f: int, *, dtype, device) -> torch.Tensor:
    """The candidate feature sets over [1, z, z²] (F = 2d + 1 features), (3, F) 0/1: the linear
    block, the quadratic block, both. The intercept is in none (it is in every rule)."""
    d = (f - 1) // 2
    masks = torch.zeros(3, f, dtype=dtype, device=device)
    masks[0, 1 : 1 + d] = 1
    masks[1, 1 + d :] = 1
    masks[2, 1:] = 1
    return masks


def _score_tests(
    phi: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, gram: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rao's score test of each candidate block set (:func:`_block_masks`) against the
    intercept-only model, on each fit's training records: statistics and degrees of freedom,
    two (R, 3) tensors.

    At the intercept-only fit the members' share is p̄ = n1/n, the score of the block's
    coefficients is U = Φ_bᵀW(y − p̄) and their information p̄(1 − p̄)·Φ_bᵀWΦ_b (the
    features are centred on the training records, so the intercept's share of the information
    is 0); the statistic Uᵀ I⁻¹ U is asymptotically χ² with rank(Φ_bᵀWΦ_b) degrees of freedom
    when the block carries nothing. Constant and collinear columns only lower the rank (the
    inverse is taken on the eigenvalues above ``RANK_TOLERANCE`` of the largest). For a single
    binary column the statistic is Pearson's χ² of the 2 × 2 table."""
    count = weight.sum(dim=1)
    share = (weight * y).sum(dim=1) / count.clamp_min(1)
    score = torch.bmm(phi, (weight * (y - share.unsqueeze(1))).unsqueeze(2)).squeeze(2)
    masks = _block_masks(phi.shape[1], dtype=phi.dtype, device=phi.device).unsqueeze(1)
    block_gram = gram.unsqueeze(0) * masks.unsqueeze(-1) * masks.unsqueeze(-2)  # (3, R, F, F)
    eigenvalues, eigenvectors = torch.linalg.eigh(block_gram)
    kept = eigenvalues > RANK_TOLERANCE * eigenvalues.amax(dim=-1, keepdim=True)
    projection = (eigenvectors.mT @ (score.unsqueeze(0) * masks).unsqueeze(-1)).squeeze(-1)
    quadratic = torch.where(
        kept, projection**2 / torch.where(kept, eigenvalues, 1.0), torch.zeros_like(eigenvalues)
    ).sum(dim=-1)
    variance = share * (1 - share)
    statistic = torch.where(variance > 0, quadratic / variance.clamp_min(1e-300), 0.0)
    return statistic.T, kept.sum(dim=-1).T.to(phi.dtype)


def _block_p_values(
    phi: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, gram: torch.Tensor
) -> torch.Tensor:
    """The p-values (R, 3) of the score tests (:func:`_score_tests`) of the candidate block sets
    (:func:`_block_masks`): the χ²_ν survival function Q(ν/2, s/2), 1 for a set of rank 0."""
    statistic, dof = _score_tests(phi, y, weight, gram)
    return torch.where(dof > 0, torch.special.gammaincc(dof.clamp_min(1) / 2, statistic / 2), 1.0)


def _summaries(x: torch.Tensor) -> torch.Tensor:
    """The 1-D summaries (n, S) of scores x (n, d) in the caller's units: the entropy of
    softmax(x) (of logits: the prediction's entropy), the largest coordinate and the log of the
    Euclidean norm (−inf for a row of zeros), without overflow for any finite x."""
    logp = torch.log_softmax(x, dim=1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1)
    size = x.abs().amax(dim=1)
    safe = torch.where(size > 0, size, torch.ones_like(size))
    log_norm = torch.where(
        size > 0,
        safe.log() + torch.linalg.vector_norm(x / safe.unsqueeze(1), dim=1).log(),
        -math.inf,
    )
    return torch.stack([entropy, x.amax(dim=1), log_norm], dim=1)


@dataclass(frozen=True)
class _Thresholds:
    """Each fit's threshold rule on each summary, (R, S) tensors: records whose summary lies
    above ``cut`` are called members where ``high`` (else those at or below it), and the
    two-sample Kolmogorov–Smirnov test's asymptotic ``p_value`` on the fit's training
    records."""

    cut: torch.Tensor
    high: torch.Tensor
    p_value: torch.Tensor


def _threshold_rules(
    values: torch.Tensor, order: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, prior: float
) -> _Thresholds:
    """The threshold rule of each summary ``values`` (n, S) on each fit's training records
    (``order`` (R, T), ``weight`` 1, padding 0; labels ``y`` (R, T)): the cut between two
    distinct training values, and the side, with the highest accuracy advantage
    2p·TPR − 2(1−p)·FPR + 1 − 2p on them (the Bayes rule where the likelihood ratio is
    monotone in the summary), placed midway between the two values. Its selection p-value is
    the Kolmogorov–Smirnov statistic D = max |F̂1 − F̂2| at the same cuts, read off the limiting
    distribution: P(K > D·sqrt(n1·n2 / (n1 + n2))), K Kolmogorov's ("Sulla determinazione
    empirica di una legge di distribuzione", Kolmogorov, 1933; scipy's ``kstwobign``)."""
    r = order.shape[0]
    # padding sorts after every summary (none is +inf)
    train = torch.where(weight.unsqueeze(2) > 0, values[order], math.inf).transpose(1, 2)
    ranked, index = torch.sort(train, dim=2)  # (R, S, T)
    label = y.unsqueeze(1).expand_as(ranked).gather(2, index)
    kept = weight.unsqueeze(1).expand_as(ranked).gather(2, index)
    n1 = (weight * y).sum(dim=1).view(r, 1, 1)
    n2 = weight.sum(dim=1).view(r, 1, 1) - n1
    tpr = torch.cumsum(label * kept, dim=2) / n1.clamp_min(1)  # F̂1 at each training value
    fpr = torch.cumsum((1 - label) * kept, dim=2) / n2.clamp_min(1)
    after = torch.cat([ranked[..., 1:], torch.full_like(ranked[..., :1], math.inf)], dim=2)
    cuts = (kept > 0) & (ranked < after)  # the last of each run of equal values
    low_gain = prior * tpr - (1 - prior) * fpr  # member iff summary ≤ cut, less the constant
    gain = torch.where(cuts, torch.maximum(low_gain, (2 * prior - 1) - low_gain), -math.inf)
    best = gain.argmax(dim=2, keepdim=True)
    high = (2 * prior - 1) - low_gain.gather(2, best) > low_gain.gather(2, best)
    below, above = ranked.gather(2, best), after.gather(2, best)
    # halves, so no overflow; the last cut, above every training value, is +inf
    cut = torch.where(above == math.inf, above, below / 2 + above / 2)
    distance = torch.where(cuts, (tpr - fpr).abs(), 0.0).amax(dim=2)
    size = (n1 * n2 / (n1 + n2).clamp_min(1)).view(r, 1)
    return _Thresholds(cut.squeeze(2), high.squeeze(2), _kolmogorov_sf(distance * size.sqrt()))


def _kolmogorov_sf(t: torch.Tensor) -> torch.Tensor:
    """P(K > t) of Kolmogorov's limiting distribution, 2·Σ_k (−1)^(k−1)·exp(−2k²t²)."""
    k = torch.arange(1, KOLMOGOROV_TERMS + 1, dtype=t.dtype, device=t.device)
    sign = 1 - 2 * (k % 2 == 0).to(t.dtype)
    series = 2 * (sign * torch.exp(-2 * k**2 * t.unsqueeze(-1) ** 2)).sum(dim=-1)
    return torch.where(t < KOLMOGOROV_ONE, 1.0, series.clamp(0.0, 1.0))


def _choice(p_values: torch.Tensor, *, gated: torch.Tensor) -> torch.Tensor:
    """Each fit's candidate (R,) of ``p_values`` (R, C): the one with the smallest p-value (the
    first of equal ones); for the ``gated`` fits (R,) only if that is below
    ``SELECTION_LEVEL``, else −1 (none: the prior's rule)."""
    best, choice = p_values.min(dim=1)
    return torch.where(gated & (best >= SELECTION_LEVEL), -1, choice)


def _chosen_features(choice: torch.Tensor, f: int, *, dtype, device) -> torch.Tensor:
    """Each fit's logistic features (R, F) 0/1 for its ``choice`` (:func:`_choice`): the
    intercept, and the candidate block set (:func:`_block_masks`) where the choice is one."""
    masks = _block_masks(f, dtype=dtype, device=device)
    logistic = ((choice >= 0) & (choice < BLOCK_SETS)).to(dtype).unsqueeze(1)
    chosen = masks[choice.clamp(0, BLOCK_SETS - 1)] * logistic
    chosen[:, 0] = 1
    return chosen


def learned_rule_counts(
    m: torch.Tensor,
    h: torch.Tensor,
    *,
    prior: float,
    folds: int = 4,
    scale: torch.Tensor | None = None,
) -> RuleCounts:
    """Cross-fitted and certificate counts of the learned Bayes rule (module docstring).

    Args:
        m, h: member / non-member scores (n1, d) and (n2, d), finite float64 on one device,
            already validated (n1, n2 ≥ 1, d ≥ 1).
        prior: P(member) in (0, 1), which the rule's decision threshold includes.
        folds: the fold split K ≥ 3 (4 in privmon's callers): cross-fitted rule k learns on
            every fold but k; each certificate's rule is applied to its folds
            (``HIGH_DIM_CERTIFY_FOLDS``: 0-1, then 0-2) and learns on the others. The fit
            draws no random numbers: the counts are a function of the scores.
        scale: the per-column powers of two the scores were multiplied by
            (:func:`~privmon.estimators.magnitude.magnitude_scale`; None: as given), divided
            out for the summaries, which read the scores in the caller's units.

    Returns:
        :class:`RuleCounts`.
    """
    n1, n2 = m.shape[0], h.shape[0]
    device, dtype = m.device, m.dtype
    x = torch.cat([m, h])
    y = torch.cat([torch.ones(n1, dtype=dtype, device=device), h.new_zeros(n2)])
    train, test = _splits(n1, n2, folds, device)
    # each fit's training rows, gathered and padded with weight 0: the fit and its feature
    # scaling read only these
    counts = train.sum(dim=1)
    width = int(counts.max())
    order = torch.argsort((~train).to(torch.int8), dim=1, stable=True)[:, :width]
    weight = (torch.arange(width, device=device) < counts.unsqueeze(1)).to(dtype)
    x_train = x[order]
    linear = _Scaling.fitted(x_train, weight)
    z = linear.fits(x_train)
    square = _Scaling.fitted(z**2, weight)
    phi_train = _features(z, square.fits(z**2)).transpose(1, 2).contiguous()
    n1_train = (weight * y[order]).sum(dim=1)
    n2_train = counts.to(dtype) - n1_train
    learns = (n1_train > 0) & (n2_train > 0)
    balance = torch.where(learns, torch.log(n1_train / n2_train), torch.zeros_like(n1_train))
    y_train = y[order]
    gram = torch.bmm(phi_train * weight.unsqueeze(1), phi_train.mT)
    summary = _summaries(x if scale is None else x / scale)  # in the caller's units
    thresholds = _threshold_rules(summary, order, weight, y_train, prior)
    p_values = torch.cat([_block_p_values(phi_train, y_train, weight, gram), thresholds.p_value], 1)
    cross_fit = torch.arange(order.shape[0], device=device) < folds
    choice = torch.where(learns, _choice(p_values, gated=cross_fit), -1)
    chosen = _chosen_features(choice, phi_train.shape[1], dtype=dtype, device=device)
    theta = _fit(
        phi_train * chosen.unsqueeze(2),
        y_train,
        weight,
        balance,
        gram * chosen.unsqueeze(2) * chosen.unsqueeze(1),
    )
    # the held-out (fit, record) pairs, each record scored with its own fit's scaling
    fit, record = test.nonzero(as_tuple=True)
    z = linear.rows(x[record], fit)
    phi = _features(z, square.rows(z**2, fit))
    logit = (phi * theta[fit]).sum(dim=-1) - balance[fit]
    score = torch.where(learns[fit], logit, torch.zeros_like(logit))
    score = score + math.log(prior / (1 - prior))
    tie = torch.where(fit < folds, 0.5, float(prior > 0.5)).to(dtype)
    said = torch.where(score.abs() <= TIE_TOLERANCE, tie, (score > 0).to(dtype))
    # a fit that chose a summary's threshold rule calls the records on its side members
    which = (choice[fit] - BLOCK_SETS).clamp_min(0)
    above = summary[record, which] > thresholds.cut[fit, which]
    threshold_said = (above == thresholds.high[fit, which]).to(dtype)
    said = torch.where(choice[fit] >= BLOCK_SETS, threshold_said, said)
    return _counts(said, fit, record, n1=n1, folds=folds)


def _counts(said: torch.Tensor, fit: torch.Tensor, record: torch.Tensor, *, n1: int, folds: int):
    """The :class:`RuleCounts` of the held-out (``fit``, ``record``) pairs' calls ``said``:
    the cross-fitted fits are the first ``folds``, the certificates' the others."""
    dtype, device = said.dtype, said.device
    member = record < n1
    cross = fit < folds
    certificates = len(HIGH_DIM_CERTIFY_FOLDS)
    held = fit.unsqueeze(0) == folds + torch.arange(certificates, device=device).unsqueeze(1)
    figures = torch.cat(
        [
            torch.stack([(said * (cross & member)).sum(), (said * (cross & ~member)).sum()]),
            (said * (held & member)).sum(dim=1),
            (said * (held & ~member)).sum(dim=1),
            (held & member).sum(dim=1).to(dtype),
            (held & ~member).sum(dim=1).to(dtype),
        ]
    ).tolist()  # one transfer
    c = certificates
    return RuleCounts(
        tp=figures[0],
        fp=figures[1],
        cert_tp=tuple(figures[2 : 2 + c]),
        cert_fp=tuple(figures[2 + c : 2 + 2 * c]),
        n1_cert=tuple(int(n) for n in figures[2 + 2 * c : 2 + 3 * c]),
        n2_cert=tuple(int(n) for n in figures[2 + 3 * c :]),
    )
