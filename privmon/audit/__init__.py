"""Offline audits: the specific-setup per-record audit (only the training seed varies), shadow
models trained as one batched ensemble, and the leave-one-model-out shadow audit of every
reference-model attack."""

from privmon.audit.ensemble import Ensemble, random_halves, train_ensemble
from privmon.audit.results import AuditResult, SetupComparison, compare
from privmon.audit.shadow import ShadowAudit, evaluate, shadow_audit
from privmon.audit.specific import average, default_score, logit_score, specific

__all__ = [
    "AuditResult",
    "Ensemble",
    "SetupComparison",
    "ShadowAudit",
    "average",
    "compare",
    "default_score",
    "evaluate",
    "logit_score",
    "random_halves",
    "shadow_audit",
    "specific",
    "train_ensemble",
]
