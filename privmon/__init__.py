"""privmon: membership-inference privacy monitoring for PyTorch training.

:class:`PrivacyMonitor` audits a model every few steps while it trains. The functional core
(:mod:`privmon.estimators`) estimates how much a model's query outputs reveal about membership
(MACE's optimal advantage, individual risk, ROC figures); :mod:`privmon.bounds` relates those
figures to a differential-privacy budget.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from privmon import attacks, audit, queries
from privmon.attacks import MetricAttack, PrivacyRiskScore, domias_scores
from privmon.bounds import (
    epsilon_audit,
    epsilon_from_counts,
    epsilon_from_opacus,
    epsilon_lower_bound,
    tanh_bound,
)
from privmon.callbacks import PrivacyEarlyStopping, PrivacyMonitor, PrivacyViolationWarning
from privmon.estimators import (
    AdvantageEstimate,
    GeneralizedMetric,
    IndividualRisk,
    QueryResult,
    StreamingAdvantage,
    accuracy_at_median,
    analyse,
    auc,
    audit_records_needed,
    detectable_advantage,
    generalized_advantage,
    individual_risk,
    optimal_advantage,
    roc_curve,
    roc_summary,
    top_q_precision,
    tpr_at_fpr,
)

try:  # one version source: the installed distribution's metadata (pyproject.toml)
    __version__ = _version("privmon")
except _PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# ordered as the API page shows them (docs/api/privmon.md orders members as listed here): the
# monitor first, then the functional core, the DP bounds, the attacks and the subpackages
__all__ = [  # noqa: RUF022
    "PrivacyMonitor",
    "PrivacyEarlyStopping",
    "PrivacyViolationWarning",
    "optimal_advantage",
    "AdvantageEstimate",
    "StreamingAdvantage",
    "analyse",
    "QueryResult",
    "detectable_advantage",
    "audit_records_needed",
    "individual_risk",
    "IndividualRisk",
    "generalized_advantage",
    "GeneralizedMetric",
    "auc",
    "roc_curve",
    "roc_summary",
    "tpr_at_fpr",
    "accuracy_at_median",
    "top_q_precision",
    "tanh_bound",
    "epsilon_lower_bound",
    "epsilon_audit",
    "epsilon_from_counts",
    "epsilon_from_opacus",
    "domias_scores",
    "MetricAttack",
    "PrivacyRiskScore",
    "attacks",
    "audit",
    "queries",
]
