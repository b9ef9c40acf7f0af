"""Attack scores: DOMIAS (density ratio against synthetic data) and its baselines; Song & Mittal's
metric attacks with class-dependent thresholds and the privacy risk score; a generator query that
runs DOMIAS in the monitor; subgroup risk; reference-model attacks (LiRA, RMIA, difficulty
calibration) and their leave-one-model-out evaluation."""

from privmon.attacks.baselines import eq1, gan_leaks, gan_leaks_cal, logan_d1, monte_carlo
from privmon.attacks.domias import domias_scores
from privmon.attacks.generator import GeneratorQuery
from privmon.attacks.metric import (
    MetricAttack,
    confidence,
    correctness,
    entropy,
    metric_values,
    modified_entropy,
)
from privmon.attacks.reference import (
    LOMO_ATTACKS,
    calibrated_score,
    leave_one_out,
    lira,
    rmia,
)
from privmon.attacks.risk_score import Calibration, PrivacyRiskScore, calibration
from privmon.attacks.subgroups import subgroup_risk

__all__ = [
    "LOMO_ATTACKS",
    "Calibration",
    "GeneratorQuery",
    "MetricAttack",
    "PrivacyRiskScore",
    "calibrated_score",
    "calibration",
    "confidence",
    "correctness",
    "domias_scores",
    "entropy",
    "eq1",
    "gan_leaks",
    "gan_leaks_cal",
    "leave_one_out",
    "lira",
    "logan_d1",
    "metric_values",
    "modified_entropy",
    "monte_carlo",
    "rmia",
    "subgroup_risk",
]
