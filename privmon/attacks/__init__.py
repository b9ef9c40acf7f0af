"""Attack scores: DOMIAS (density ratio against synthetic data) and its baselines; Song & Mittal's
metric attacks with class-dependent thresholds and the privacy risk score."""

from privmon.attacks.baselines import eq1, gan_leaks, gan_leaks_cal, logan_d1, monte_carlo
from privmon.attacks.domias import domias_scores
from privmon.attacks.metric import (
    MetricAttack,
    confidence,
    correctness,
    entropy,
    metric_values,
    modified_entropy,
)
from privmon.attacks.risk_score import Calibration, PrivacyRiskScore, calibration

__all__ = [
    "Calibration",
    "MetricAttack",
    "PrivacyRiskScore",
    "calibration",
    "confidence",
    "correctness",
    "domias_scores",
    "entropy",
    "eq1",
    "gan_leaks",
    "gan_leaks_cal",
    "logan_d1",
    "metric_values",
    "modified_entropy",
    "monte_carlo",
]
