"""What an advantage estimate is and how a rule's counts become one: the estimate records,
the accuracy advantage of a rule and McDiarmid's half-width (see
:mod:`privmon.estimators.advantage` for what each figure means; the certificate's arithmetic is
in :mod:`privmon.estimators.certificate`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

__all__ = [
    "AdvantageEstimate",
    "Estimate",
    "accuracy_advantage",
    "check_bins",
    "describe_error",
    "make_estimate",
    "mcdiarmid_halfwidth",
]


class Estimate:
    """Shared behaviour of the estimate records: ``float(est)`` is ``est.value``."""

    value: float
    # set by @dataclass on every subclass; declared so that type checkers accept asdict(self)
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def __float__(self) -> float:
        return self.value

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (``dataclasses.asdict``)."""
        return asdict(self)


@dataclass(frozen=True)
class AdvantageEstimate(Estimate):
    """One estimate of the optimal membership advantage (accuracy metric, MACE eq. 7).

    ``value`` debiased point estimate; ``lower`` certified lower bound at level 1 − ``lower_delta``
    (``delta`` in the functional API; a check's share of the run's δ in the monitor, so that it
    holds over the whole run); ``lower_check`` the same certificate at level 1 − ``delta``, valid
    for this one estimate alone; ``plugin`` the paper's W_N / U_N; ``upper`` the paper's
    plugin + ``halfwidth`` (McDiarmid), capped at 1 — a plug-in figure, not a bound on the
    advantage (:mod:`privmon.estimators.advantage`).
    ``floor`` = |2·prior − 1|, the advantage of always guessing the majority class: at a prior
    other than 0.5 read the figures against it, or use the generalized metrics
    (:func:`privmon.generalized_advantage`, e.g. the AM metric) which do not reward that guess.

    Examples:
        >>> import torch
        >>> from privmon import optimal_advantage
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> est = optimal_advantage(members, torch.randn(500, generator=gen), prior=0.3)
        >>> est.floor, round(float(est), 3), round(est.lower, 3)
        (0.4, 0.4, 0.4)
        >>> est.as_dict()["n_members"]
        500
    """

    value: float
    lower: float
    upper: float
    plugin: float
    halfwidth: float
    prior: float
    method: str
    delta: float
    lower_check: float
    lower_delta: float
    n_members: int
    n_nonmembers: int
    n_dropped: int
    floor: float


def check_bins(bins: int | None) -> None:
    """Raise ValueError unless ``bins`` is None or a positive integer."""
    if bins is not None and (isinstance(bins, bool) or not isinstance(bins, int) or bins < 1):
        raise ValueError(f"bins must be a positive integer or None, got {bins!r}")


def mcdiarmid_halfwidth(prior: float, n1: float, n2: float, delta: float) -> float:
    """sqrt(2·(p²/N1 + (1−p)²/N2)·log(2/δ)): bounded differences 2p/N1, 2(1−p)/N2 (Thm 2 (2))."""
    return math.sqrt(2.0 * (prior**2 / n1 + (1 - prior) ** 2 / n2) * math.log(2.0 / delta))


def accuracy_advantage(tpr, fpr, prior: float):
    """2p·TPR − 2(1−p)·FPR + 1 − 2p: the accuracy advantage 2·P(correct) − 1 of a rule."""
    return 2 * prior * tpr - 2 * (1 - prior) * fpr + 1 - 2 * prior


def make_estimate(
    *, plugin, tp, fp, n1, n2, cert, cert_check, prior, delta, lower_delta, method, n_dropped
) -> AdvantageEstimate:
    """The estimate of a rule with held-out ``tp`` / ``fp`` positives among ``n1`` / ``n2``
    records, its certificates and the plug-in, each clipped into [|2p − 1|, 1]."""
    floor = abs(2 * prior - 1)
    value = accuracy_advantage(tp / n1, fp / n2, prior)
    halfwidth = mcdiarmid_halfwidth(prior, n1, n2, delta)
    return AdvantageEstimate(
        value=float(min(max(value, floor), 1.0)),
        lower=float(min(max(cert, floor), 1.0)),
        lower_check=float(min(max(cert_check, floor), 1.0)),
        lower_delta=float(lower_delta),
        upper=float(min(plugin + halfwidth, 1.0)),
        # W_N and U_N lie in [|2p − 1|, 1] exactly; only rounding (an ulp) can step outside
        plugin=float(min(max(plugin, floor), 1.0)),
        halfwidth=float(halfwidth),
        prior=prior,
        method=method,
        delta=delta,
        n_members=int(n1),
        n_nonmembers=int(n2),
        n_dropped=int(n_dropped),
        floor=floor,
    )


def describe_error(err: BaseException) -> str:
    """How a failed method or stage is reported: the exception's type and message."""
    return f"{type(err).__name__}: {err}"
