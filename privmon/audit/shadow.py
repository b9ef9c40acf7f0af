"""Shadow-model audit: how far each membership attack gets against models of one recipe.

:func:`shadow_audit` trains ``n_models`` models on random halves of a dataset
(:func:`privmon.audit.random_halves`, each record in about half of them) as one batched
ensemble (:func:`privmon.audit.train_ensemble`), reads every record's logit-scaled
confidence φ under every model, and evaluates each attack as Carlini et al. do
("Membership Inference Attacks From First Principles", §V): each model in turn is the target
and the others are its reference models (:func:`privmon.attacks.reference.leave_one_out`); the
scores are pooled over records and targets, members being the (model, record) pairs with the
record in that model's training set. Reported per attack: AUC and the TPR at FPR 10⁻¹, 10⁻²,
10⁻³ (:func:`privmon.estimators.roc.roc_summary`; with N non-member pairs a target FPR below
about 10 / N is noisy), and the per-record scores. :func:`evaluate` does the same for a
statistic matrix the caller computed (e.g. from models trained with ``train_fn``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from privmon._validation import as_array, as_mask, check_fprs, check_int, to_numpy
from privmon.attacks.metric import logit_confidence_from_logits
from privmon.attacks.reference import LOMO_ATTACKS, LOMO_MIN_MODELS, leave_one_out
from privmon.audit.loops import LossFn, OptimizerFn
from privmon.audit.records import as_xy, frozen
from privmon.audit.train import random_halves, train_ensemble
from privmon.estimators.roc import roc_curve, roc_summary

__all__ = ["ShadowAudit", "evaluate", "shadow_audit"]

_DEFAULT_FPR = (0.1, 0.01, 0.001)


@dataclass(frozen=True, repr=False, eq=False)
class ShadowAudit:
    """Leave-one-model-out results of several attacks on the same models.

    Attributes:
        masks: (k, n) bool, record j in model i's training set.
        statistic: (k, n) the logit-scaled confidence of record j under model i.
        scores: attack name -> (k, n) float64 scores, higher = member (model i the target).
        summary: attack name -> ``{"auc": ..., "tpr@fpr=0.1": ..., ...,
            "accuracy_at_median": ...}``, pooled over all (model, record) pairs.
        fpr: the target false-positive rates of the summary.
        n_nonfinite: attack name -> number of NaN / infinite scores left out of its summary.
        seeds: (k,) the models' seeds (None when the statistic came from the caller).
        elapsed_s: wall time of the audit (training included).

    Examples:
        >>> import numpy as np
        >>> from privmon.audit import evaluate
        >>> rng = np.random.default_rng(0)
        >>> masks = rng.random((8, 100)) < 0.5
        >>> audit = evaluate(rng.normal(size=(8, 100)) + masks, masks, attacks=["lira_offline"])
        >>> audit.n_models, audit.n_records
        (8, 100)
        >>> round(audit.tpr("lira_offline", 0.1), 2)
        0.39
        >>> audit.exposure("lira_offline", fpr=0.1).shape  # per record: how often it is caught
        (100,)
    """

    masks: np.ndarray
    statistic: np.ndarray
    scores: dict[str, np.ndarray]
    summary: dict[str, dict[str, float]]
    fpr: tuple[float, ...]
    n_nonfinite: dict[str, int]
    seeds: np.ndarray | None = None
    elapsed_s: float = field(default=0.0)

    @property
    def n_models(self) -> int:
        """Number of shadow models (rows of ``masks``)."""
        return int(self.masks.shape[0])

    @property
    def n_records(self) -> int:
        """Number of audited records (columns of ``masks``)."""
        return int(self.masks.shape[1])

    def tpr(self, attack: str, fpr: float) -> float:
        """The pooled TPR of ``attack`` at one of the audit's target FPRs."""
        row = self._summary(attack)
        key = f"tpr@fpr={float(fpr)!r}"
        if key not in row:
            raise ValueError(f"fpr must be one of the audit's target FPRs {self.fpr}, got {fpr!r}")
        return row[key]

    def _summary(self, attack: str) -> dict[str, float]:
        if attack not in self.summary:
            raise ValueError(f"attack must be one of {tuple(self.summary)}, got {attack!r}")
        return self.summary[attack]

    def exposure(self, attack: str, fpr: float = 0.01) -> np.ndarray:
        """Per record, the fraction of the models that trained on it in which ``attack`` flags
        it at the pooled threshold of false-positive rate ``fpr`` (the threshold of the ROC
        point with the largest TPR among those with FPR <= ``fpr``), shape (n,); among the
        models where the attack could score it, NaN where there is none (the record is in no
        model, or never scored)."""
        self._summary(attack)
        s = self.scores[attack]
        f = check_fprs(fpr)[0]
        finite = np.isfinite(s)
        fprs, _, thresholds = roc_curve(s[self.masks & finite], s[~self.masks & finite])
        tau = thresholds[np.searchsorted(fprs, f, side="right") - 1]
        caught = (s >= tau) & self.masks  # NaN compares False
        scored = (self.masks & finite).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(scored > 0, caught.sum(axis=0) / scored, np.nan)

    def ranking(self, attack: str, fpr: float = 0.01) -> np.ndarray:
        """Record indices from the most exposed down: by :meth:`exposure`, ties broken by the
        record's mean score over the models that trained on it; unmeasured records last."""
        e = np.nan_to_num(self.exposure(attack, fpr), nan=-1.0)
        s = np.where(self.masks & np.isfinite(self.scores[attack]), self.scores[attack], 0.0)
        mean = s.sum(axis=0) / np.maximum(self.masks.sum(axis=0), 1)
        return np.lexsort((-mean, -e))

    def table(self) -> str:
        """Every attack side by side: AUC and TPR at each target FPR (in %), and how many
        scores were left out (NaN / infinite)."""
        heads = [f"TPR@{f:g}" for f in self.fpr]
        lines = [
            f"{'attack':<14} {'AUC':>6} " + " ".join(f"{h:>10}" for h in heads) + f" {'dropped':>8}"
        ]
        for name, row in self.summary.items():
            tprs = " ".join(f"{100 * row[f'tpr@fpr={f!r}']:>9.2f}%" for f in self.fpr)
            lines.append(f"{name:<14} {row['auc']:>6.3f} {tprs} {self.n_nonfinite[name]:>8d}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ShadowAudit(n_models={self.n_models}, n_records={self.n_records}, "
            f"attacks={tuple(self.summary)})"
        )


def _check_attacks(attacks: Any) -> tuple[str, ...]:
    names = (attacks,) if isinstance(attacks, str) else tuple(attacks)
    bad = [a for a in names if a not in LOMO_ATTACKS]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"attacks must be distinct names from {LOMO_ATTACKS}, got {attacks!r}")
    return names


def evaluate(
    statistic: Any,
    masks: Any,
    *,
    attacks: Sequence[str] = LOMO_ATTACKS,
    fpr: Sequence[float] = _DEFAULT_FPR,
    fixed_variance: bool | None = None,
    a: float = 0.3,
    gamma: float = 1.0,
) -> ShadowAudit:
    """Leave-one-model-out evaluation of ``attacks`` on a (k, n) statistic matrix.

    Args:
        statistic: (k, n) logit-scaled confidence φ of record j under model i (see
            :func:`privmon.attacks.reference.leave_one_out`).
        masks: (k, n) bool, record j in model i's training set. Every model needs members and
            non-members.
        attacks: names from :data:`privmon.attacks.reference.LOMO_ATTACKS`.
        fpr: target false-positive rates, each in (0, 1).
        fixed_variance, a, gamma: the attacks' options (:func:`privmon.attacks.lira`,
            :func:`privmon.attacks.rmia`).

    Examples:
        >>> import numpy as np
        >>> from privmon.audit import evaluate
        >>> rng = np.random.default_rng(0)
        >>> masks = rng.random((8, 200)) < 0.5  # record j in model i
        >>> phi = rng.normal(size=(8, 200)) + masks  # members: a higher confidence
        >>> audit = evaluate(phi, masks, attacks=["loss", "lira", "rmia"])
        >>> {attack: round(row["auc"], 2) for attack, row in audit.summary.items()}
        {'loss': 0.75, 'lira': 0.68, 'rmia': 0.73}
    """
    names = _check_attacks(attacks)
    targets = tuple(check_fprs(fpr))
    stat = as_array(statistic, name="statistic", ndim=2)
    m = as_mask(masks, name="masks", shape=tuple(stat.shape), device=stat.device)
    per_model = m.sum(dim=1)
    if bool((per_model == 0).any() or (per_model == m.shape[1]).any()):
        raise ValueError("masks: every model needs at least one member and one non-member")
    mask_np = to_numpy(m)
    scores, summary, bad = {}, {}, {}
    for name in names:
        s = leave_one_out(stat, m, attack=name, fixed_variance=fixed_variance, a=a, gamma=gamma)
        finite = np.isfinite(s)
        bad[name] = int((~finite).sum())
        members, nonmembers = s[mask_np & finite], s[~mask_np & finite]
        if members.size == 0 or nonmembers.size == 0:
            raise ValueError(f"attack {name!r} scored no member or no non-member finitely")
        summary[name] = roc_summary(members, nonmembers, fpr=targets)
        scores[name] = frozen(s)
    return ShadowAudit(
        masks=frozen(mask_np),
        statistic=frozen(to_numpy(stat)),
        scores=scores,
        summary=summary,
        fpr=targets,
        n_nonfinite=bad,
    )


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def shadow_audit(
    model_fn: Callable[[], nn.Module],
    data: Any,
    *,
    n_models: int,
    seed: int,
    optimizer: OptimizerFn,
    epochs: int,
    batch_size: int | None = None,
    loss_fn: LossFn = _cross_entropy,
    attacks: Sequence[str] = LOMO_ATTACKS,
    fpr: Sequence[float] = _DEFAULT_FPR,
    fixed_variance: bool | None = None,
    a: float = 0.3,
    gamma: float = 1.0,
    stacked: bool = True,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    distributed: bool = True,
) -> ShadowAudit:
    """Train ``n_models`` classifiers on random halves of ``data`` and evaluate every attack
    leave-one-model-out (module docstring).

    Args:
        model_fn: ``model_fn() -> nn.Module`` returning logits (n, C).
        data: the records ``(x, y)``, ``y`` class indices (formats as in
            :func:`privmon.audit.train_ensemble`).
        n_models: number of models (>= 3 with a reference attack, else >= 2; Carlini et al.
            use 64 to 256).
        seed: non-negative integer; the halves and the models' seeds derive from it.
        optimizer, epochs, batch_size, loss_fn, stacked: the training recipe
            (:func:`privmon.audit.train_ensemble`); ``loss_fn`` defaults to the
            per-record cross-entropy.
        attacks, fpr, fixed_variance, a, gamma: as in :func:`evaluate`.
        checkpoint_dir, distributed: as in :func:`privmon.audit.train_ensemble`:
            each model saved as soon as it is trained, and resumed from; the models split over
            the ranks of an initialised default process group (call on every rank), every rank
            returning the audit of one process.

    Returns:
        A :class:`ShadowAudit` with the models' seeds.

    Examples:
        >>> import torch
        >>> from privmon.audit import shadow_audit
        >>> gen = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(64, 10, generator=gen), torch.randint(0, 2, (64,), generator=gen)
        >>> audit = shadow_audit(
        ...     lambda: torch.nn.Linear(10, 2),
        ...     (x, y),
        ...     n_models=16,
        ...     seed=0,
        ...     optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
        ...     epochs=50,
        ...     attacks=["loss", "lira_offline"],
        ... )
        >>> print(audit.table())
        attack            AUC    TPR@0.1   TPR@0.01  TPR@0.001  dropped
        loss            0.693     13.28%      1.37%      0.20%        0
        lira_offline    0.672     16.99%      2.34%      0.20%        0
    """
    start = time.perf_counter()
    names = _check_attacks(attacks)
    k = check_int(n_models, name="n_models", minimum=max(2, *(LOMO_MIN_MODELS[a] for a in names)))
    seed = check_int(seed, name="seed")
    x, y = as_xy(data, name="data")
    if y is None:
        raise ValueError("data must be a pair (x, y) of inputs and class indices")
    masks = random_halves(x.shape[0], k, seed=seed)
    ens = train_ensemble(
        model_fn,
        (x, y),
        masks,
        loss_fn=loss_fn,
        optimizer=optimizer,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        stacked=stacked,
        checkpoint_dir=checkpoint_dir,
        distributed=distributed,
    )
    logits = ens(x).to(torch.float64)
    labels = y.to(logits.device).long().expand(k, -1)
    stat = logit_confidence_from_logits(logits, labels)
    result = evaluate(
        stat, masks, attacks=names, fpr=fpr, fixed_variance=fixed_variance, a=a, gamma=gamma
    )
    return replace(result, seeds=frozen(ens.seeds), elapsed_s=time.perf_counter() - start)
