"""A learned Bayes rule for high-dimensional queries (d ≥ 3): cross-fitted logistic regression.

Density estimates lose most of a leak above two dimensions, so there the Bayes rule "member iff
p·P(x) > (1−p)·Q(x)" (MACE eq. 7-8) is learned as a classifier: logistic regression on the
standardised scores z and their squares z², the decision shifted by the prior
(member iff ℓ(x) − log(n1/n2) + log(p/(1−p)) > 0). Each rule first picks, on its own training
records, the blocks it uses (z, z², both or none) by Rao's score test at 5 %
(``SELECTION_LEVEL``), which keeps the null quiet; the ridge penalty of each block is set by the
evidence approximation; no random numbers are drawn. K-fold cross-fitting: rule k learns on the
other folds and is applied to fold k; the certificate's rule learns on folds 2..K−1 and is
applied to folds 0-1. All K + 1 fits run as one batch on the scores' device. A tie (decision
within 1e-9 of 0) counts 1/2, and for the certificate goes to the prior's side.

Derivation, measurements and cost: Theory, *The learned rule above two dimensions*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from privmon.estimators.folds import fold_of

__all__ = ["HIGH_DIM_CERTIFY_FOLDS", "RuleCounts", "learned_rule_counts"]

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
SELECTION_LEVEL = 0.05  # a block enters a rule only if its score test rejects at this level
RANK_TOLERANCE = 1e-9  # eigenvalues of a block's Gram matrix below this share of its largest: 0
# the folds the certificate scores; its rule learns on the other half (a rule learned on one
# fold of four certified half as much: a mean lower bound of 0.07 against 0.15 over 6 seeds of
# benchmarks/learned.py's "shift 64" at 500 + 500 records, δ = 0.003)
HIGH_DIM_CERTIFY_FOLDS = (0, 1)


@dataclass(frozen=True)
class RuleCounts:
    """Held-out positives of the learned rules. ``tp`` / ``fp``: members / non-members the K
    cross-fitted rules call members on their held-out folds, summed over folds (ties 1/2).
    ``cert_tp`` / ``cert_fp``: the same for the certificate's rule (learned on folds 2..K−1)
    on folds 0-1 (``HIGH_DIM_CERTIFY_FOLDS``), which hold ``n1_cert`` members and ``n2_cert``
    non-members (ties on the prior's side)."""

    tp: float
    fp: float
    cert_tp: float
    cert_fp: float
    n1_cert: int
    n2_cert: int


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
        # evidence re-estimation of each block's penalty, in log α
        covariance = torch.cholesky_inverse(chol).diagonal(dim1=-2, dim2=-1)
        gamma = ((1 - penalty * covariance) @ block.T).clamp_min(0)
        norm = (theta**2) @ block.T
        target = torch.where(
            (gamma > 0) & (norm > 0), gamma.log() - norm.log(), torch.full_like(norm, high)
        )
        gap = target.clamp(low, high) - log_alpha
        if previous is None:
            move = gap
        else:  # secant on the gap; where it does not shrink, move faster along it
            slope = (gap - previous[1]) / (log_alpha - previous[0])
            slope = torch.where(torch.isfinite(slope), slope, torch.zeros_like(slope))
            move = gap / (-slope).clamp_min(SECANT_FLOOR)
        move = move.clamp(-MAX_MOVE, MAX_MOVE)
        previous = (log_alpha, gap)
        log_alpha = (log_alpha + move).clamp(low, high)
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


def _splits(n1: int, n2: int, folds: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out records of each fit, two (K + 1, n1 + n2) boolean masks over the
    members then the non-members, K = ``folds``: rows 0..K−1 the cross-fitted rules (rule k
    learns on every fold but k and is applied to fold k), row K the certificate's rule (learns
    on folds 2..K−1, applied to folds 0-1)."""
    position = torch.cat([torch.arange(n1, device=device), torch.arange(n2, device=device)])
    fold = fold_of(position, folds)
    certified = torch.isin(fold, torch.tensor(HIGH_DIM_CERTIFY_FOLDS, device=device))
    held_out = torch.cat(
        [fold == torch.arange(folds, device=device).unsqueeze(1), certified.unsqueeze(0)]
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


def _chosen_features(
    phi: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, gram: torch.Tensor
) -> torch.Tensor:
    """Each fit's features, (R, F) 0/1: the intercept, and the candidate block set
    (:func:`_block_masks`) whose score test (:func:`_score_tests`) has the smallest p-value if
    that is below ``SELECTION_LEVEL``; the intercept alone otherwise."""
    statistic, dof = _score_tests(phi, y, weight, gram)
    # χ²_ν survival function: the regularised upper incomplete gamma Q(ν/2, s/2)
    p_value = torch.where(
        dof > 0, torch.special.gammaincc(dof.clamp_min(1) / 2, statistic / 2), 1.0
    )
    best, choice = p_value.min(dim=1)
    masks = _block_masks(phi.shape[1], dtype=phi.dtype, device=phi.device)
    chosen = masks[choice] * (best < SELECTION_LEVEL).to(phi.dtype).unsqueeze(1)
    chosen[:, 0] = 1
    return chosen


def learned_rule_counts(
    m: torch.Tensor, h: torch.Tensor, *, prior: float, folds: int = 4
) -> RuleCounts:
    """Cross-fitted and certificate counts of the learned Bayes rule (module docstring).

    Args:
        m, h: member / non-member scores (n1, d) and (n2, d), finite float64 on one device,
            already validated (n1, n2 ≥ 1, d ≥ 1).
        prior: P(member) in (0, 1), which the rule's decision threshold includes.
        folds: the fold split K ≥ 3 (4 in privmon's callers): cross-fitted rule k learns on
            every fold but k; the certificate's rule learns on folds 2..K−1 and is applied to
            folds 0-1. The fit draws no random numbers: the counts are a function of the
            scores.

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
    chosen = _chosen_features(phi_train, y_train, weight, gram)
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
    member = record < n1
    cross = fit < folds
    figures = torch.stack(
        [
            (said * (cross & member)).sum(),
            (said * (cross & ~member)).sum(),
            (said * (~cross & member)).sum(),
            (said * (~cross & ~member)).sum(),
            (~cross & member).sum().to(dtype),
            (~cross & ~member).sum().to(dtype),
        ]
    ).tolist()  # one transfer
    return RuleCounts(
        tp=figures[0],
        fp=figures[1],
        cert_tp=figures[2],
        cert_fp=figures[3],
        n1_cert=int(figures[4]),
        n2_cert=int(figures[5]),
    )
