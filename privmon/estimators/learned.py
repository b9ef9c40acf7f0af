"""A learned Bayes rule for high-dimensional queries (d ≥ 3): cross-fitted logistic regression.

The optimal accuracy advantage at prior p is reached by the Bayes rule "member iff
p·P(x) > (1−p)·Q(x)" (MACE eq. 7-8). Density estimates lose most of a leak above two dimensions,
so here the rule is learned as a classifier: logistic regression on the standardised scores z
and their squares z² (one coefficient per feature), which holds the exact log-likelihood ratio of
two Gaussians with a shifted mean or a changed per-coordinate scale. The decision includes the
prior: with ℓ(x) the fitted logit under the training class balance n1/n2,

    member  iff  ℓ(x) − log(n1/n2) + log(p/(1−p)) > 0,

so the rule targets the accuracy advantage 2p·TPR − 2(1−p)·FPR + 1 − 2p at prior p.

**Fit.** Penalised maximum likelihood by Newton's method with a backtracking line search. The
ridge penalty of each block of coefficients (the linear block z, the quadratic block z²; the
intercept is free) is set by the evidence approximation — the Laplace approximation of the
posterior and the re-estimation α = γ / ‖w‖², γ = Σ_j (1 − α·(H⁻¹)_jj) of "Pattern Recognition
and Machine Learning" (Bishop, 2006; eqs. 3.91-3.92, applied to logistic regression as in
"The evidence framework applied to classification networks", MacKay, 1992) — interleaved with the
Newton steps. A block that carries no signal gets a large α and drops out: the rule pays for the
z² features only where the data ask for them (a 64-D mean shift loses 0.02 of advantage with both
blocks under evidence, 0.04 with one fixed ridge penalty, measured). Columns that are constant
on the training records (dead ReLU units) get the feature 0; collinear columns are handled by the
penalty, which keeps the Hessian positive definite. No random numbers are drawn.

**Folds.** As in the rest of privmon (``fold_of`` by position within each class): the K
cross-fitted rules are learned on all folds but k and applied to fold k; the certificate's rule
is learned on folds 2..K−1 and applied to folds 0-1. All K + 1 fits run as one batch on the
scores' device. A fit whose training records lack a class learns nothing: its rule is the
prior's alone (a tie at p = 1/2).

**Ties.** A record whose decision value lies within 1e-9 of 0 counts 1/2 for the cross-fitted
rules and, for the certificate's, as a member iff p > 1/2 (the prior's side).

**Cost.** F = 2d + 1 features; each Newton step forms K + 1 Hessians (F × F, over the training
records) and factors them: O((K+1)·(N·F² + F³)) per step, typically 10-30 steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from privmon.estimators.streaming import fold_of

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


@dataclass(frozen=True)
class RuleCounts:
    """Held-out positives of the learned rules. ``tp`` / ``fp``: members / non-members the K
    cross-fitted rules call members, summed over folds (ties 1/2). ``cert_tp`` / ``cert_fp``:
    the same for the certificate's rule (learned on folds 2..K−1) on folds 0-1, which hold
    ``n1_cert`` members and ``n2_cert`` non-members (ties on the prior's side)."""

    tp: float
    fp: float
    cert_tp: float
    cert_fp: float
    n1_cert: int
    n2_cert: int


def _standardise(x: torch.Tensor, train: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Columns of x (R, N, c) centred and scaled by their mean and standard deviation over each
    fit's training records (``train`` (R, N) 0/1, ``n`` (R, 1) their counts); 0 where a column
    is constant there (spread below ``CONSTANT`` of its magnitude)."""
    mean = torch.einsum("rn,rnc->rc", train, x) / n
    centred = x - mean.unsqueeze(1)
    sd = torch.sqrt(torch.einsum("rn,rnc->rc", train, centred**2) / n)
    size = torch.einsum("rn,rnc->rc", train, x.abs()) / n
    varies = sd > CONSTANT * size
    scale = torch.where(varies, sd, torch.ones_like(sd))
    return torch.where(varies.unsqueeze(1), centred / scale.unsqueeze(1), torch.zeros_like(x))


def _features(x: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """[1, z, z²] (R, N, 2d + 1): z the scores standardised on each fit's training records, z²
    standardised the same way."""
    n = train.sum(dim=1, keepdim=True).clamp_min(1)
    z = _standardise(x.unsqueeze(0).expand(train.shape[0], -1, -1), train, n)
    z2 = _standardise(z**2, train, n)
    return torch.cat([torch.ones_like(z[..., :1]), z, z2], dim=-1)


def _fit(phi: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, start: torch.Tensor):
    """Evidence-penalised logistic regression of y on phi, batched over fits.

    phi (R, F, T) training features ([1, z, z²], features first: batched products with a
    row vector are several times faster in this layout), y (R, T) labels, weight (R, T) 0/1 (padding
    rows 0), ``start`` (R,) the intercept the penalty shrinks towards. Returns the coefficients
    (R, F).

    The penalised likelihood is maximised by minorise-maximise steps with the fixed curvature
    bound B = ¼·ΦᵀΦ ≥ −∇²(log-likelihood) ("Monotonicity of quadratic-approximation
    algorithms", Böhning and Lindsay, 1988): B is formed once per fit, every step decreases the
    objective, and a step costs two products with phi. Between runs of steps each block's
    penalty is re-estimated from the evidence, α = γ / ‖w‖² with γ = Σ_j (1 − α·Σ_jj) and
    Σ = (B + A)⁻¹, by a safeguarded secant iteration on log α."""
    r, f, _ = phi.shape
    d = (f - 1) // 2
    block = torch.zeros(2, f, dtype=phi.dtype, device=phi.device)  # (blocks, F) indicators
    block[0, 1 : 1 + d] = 1
    block[1, 1 + d :] = 1
    free = torch.zeros(f, dtype=phi.dtype, device=phi.device)
    free[0] = INTERCEPT_PENALTY
    centre = torch.zeros(r, f, dtype=phi.dtype, device=phi.device)
    centre[:, 0] = start
    theta = centre.clone()
    bound = 0.25 * torch.bmm(phi * weight.unsqueeze(1), phi.mT)
    low, high = (math.log(a) for a in ALPHA_RANGE)
    log_alpha = torch.zeros(r, 2, dtype=phi.dtype, device=phi.device)
    previous = None
    for _ in range(MAX_UPDATES):
        penalty = log_alpha.exp() @ block + free
        chol, _ = torch.linalg.cholesky_ex(bound + torch.diag_embed(penalty))
        for _ in range(STEPS_PER_UPDATE):
            eta = torch.bmm(theta.unsqueeze(1), phi).squeeze(1)
            residual = weight * (torch.sigmoid(eta) - y)
            grad = torch.bmm(residual.unsqueeze(1), phi.mT).squeeze(1) + penalty * (theta - centre)
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
        done = torch.stack([step.abs().amax() / STEP_TOLERANCE, gap.abs().amax() / ALPHA_TOLERANCE])
        if float(done.amax()) <= 1:  # one transfer per update
            break
    # a block whose evidence-optimal penalty is unbounded is pruned (its weights are 0); with
    # both pruned the model is the intercept alone, whose maximum-likelihood value is ``start``
    kept = (log_alpha < high).to(phi.dtype)
    theta = theta * (kept @ block + (1 - block.sum(dim=0)))
    return torch.where(kept.any(dim=1, keepdim=True), theta, centre)


def learned_rule_counts(
    m: torch.Tensor, h: torch.Tensor, *, prior: float, folds: int = 4
) -> RuleCounts:
    """Cross-fitted and certificate counts of the learned Bayes rule (module docstring).

    Args:
        m, h: member / non-member scores (n1, d) and (n2, d), finite float64 on one device,
            already validated (n1, n2 ≥ 1, d ≥ 1).
        prior: P(member) in (0, 1), which the rule's decision threshold includes.
        folds: cross-fitting folds K (≥ 4 in privmon's callers; the certificate uses folds 0-1).
            The fit draws no random numbers: the counts are a function of the scores.

    Returns:
        :class:`RuleCounts`.
    """
    n1, n2 = m.shape[0], h.shape[0]
    device, dtype = m.device, m.dtype
    x = torch.cat([m, h])
    y = torch.cat([torch.ones(n1, dtype=dtype, device=device), h.new_zeros(n2)])
    fold = torch.cat(
        [
            fold_of(torch.arange(n1, device=device), folds),
            fold_of(torch.arange(n2, device=device), folds),
        ]
    )
    ks = torch.arange(folds, device=device)
    train = torch.cat([fold != ks.unsqueeze(1), (fold >= 2).unsqueeze(0)])  # (K + 1, N)
    test = ~train
    w_train = train.to(dtype)
    phi = _features(x, w_train)
    # gather each fit's training rows (padded with weight 0) so the Hessians skip the rest
    counts = train.sum(dim=1)
    width = int(counts.max())
    order = torch.argsort((~train).to(torch.int8), dim=1, stable=True)[:, :width]
    weight = (torch.arange(width, device=device) < counts.unsqueeze(1)).to(dtype)
    phi_train = torch.gather(phi, 1, order.unsqueeze(-1).expand(-1, -1, phi.shape[-1]))
    phi_train = phi_train.transpose(1, 2).contiguous()
    n1_train = (w_train * y).sum(dim=1)
    n2_train = counts.to(dtype) - n1_train
    learns = (n1_train > 0) & (n2_train > 0)
    balance = torch.where(learns, torch.log(n1_train / n2_train), torch.zeros_like(n1_train))
    theta = _fit(phi_train, y[order], weight, balance)
    logit = torch.einsum("rnf,rf->rn", phi, theta) - balance.unsqueeze(1)
    score = torch.where(learns.unsqueeze(1), logit, torch.zeros_like(logit))
    score = score + math.log(prior / (1 - prior))
    tie = torch.full((folds + 1, 1), 0.5, dtype=dtype, device=device)
    tie[folds] = float(prior > 0.5)
    said = torch.where(score.abs() <= TIE_TOLERANCE, tie, (score > 0).to(dtype)) * test
    said_members = said @ y  # (K + 1,)
    said_all = said.sum(dim=1)
    certify = test[folds]
    figures = torch.stack(
        [
            said_members[:folds].sum(),
            (said_all - said_members)[:folds].sum(),
            said_members[folds],
            said_all[folds] - said_members[folds],
            (certify[:n1]).sum().to(dtype),
            (certify[n1:]).sum().to(dtype),
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
