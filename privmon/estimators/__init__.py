"""Pure math on scores: the per-query analysis of a check (:func:`analyse`), optimal advantage,
what its certificate can detect (:func:`detectable_advantage`, :func:`audit_records_needed`),
individual risk, generalized metrics, ROC, densities, streaming states; the estimator methods
as objects (:class:`EstimatorMethod`, :func:`register_method`). Functions take numpy arrays or
torch tensors on any device."""

from privmon.estimators.advantage import (
    StreamingAdvantage,
    advantage_from_state,
    optimal_advantage,
)
from privmon.estimators.analysis import QueryResult, analyse
from privmon.estimators.binned_scores import BinnedScores
from privmon.estimators.builtin_methods import HistogramMethod, KDEMethod
from privmon.estimators.certificate import audit_records_needed, detectable_advantage
from privmon.estimators.density import GaussianKDE, MixedKDE
from privmon.estimators.estimates import AdvantageEstimate
from privmon.estimators.generalized import GeneralizedEstimate, generalized_advantage
from privmon.estimators.generalized_metric import GeneralizedMetric
from privmon.estimators.methods import EstimatorMethod, register_method, unregister_method
from privmon.estimators.risk import IndividualRisk, individual_risk
from privmon.estimators.roc import (
    accuracy_at_median,
    auc,
    roc_curve,
    roc_summary,
    top_q_precision,
    tpr_at_fpr,
)

__all__ = [
    "AdvantageEstimate",
    "BinnedScores",
    "EstimatorMethod",
    "GaussianKDE",
    "GeneralizedEstimate",
    "GeneralizedMetric",
    "HistogramMethod",
    "IndividualRisk",
    "KDEMethod",
    "MixedKDE",
    "QueryResult",
    "StreamingAdvantage",
    "accuracy_at_median",
    "advantage_from_state",
    "analyse",
    "auc",
    "audit_records_needed",
    "detectable_advantage",
    "generalized_advantage",
    "individual_risk",
    "optimal_advantage",
    "register_method",
    "roc_curve",
    "roc_summary",
    "top_q_precision",
    "tpr_at_fpr",
    "unregister_method",
]
