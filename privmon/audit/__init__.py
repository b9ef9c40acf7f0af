"""Offline audits: the specific-setup per-record audit (only the training seed varies), shadow
models trained as one batched ensemble, the leave-one-model-out shadow audit of every
reference-model attack, and canaries for one-run DP audits (gradient canaries inside an Opacus
optimizer, input canaries for any model)."""

from privmon.audit.canaries import GradientCanaries, InputCanaries
from privmon.audit.ensemble import Ensemble, random_halves, train_ensemble
from privmon.audit.shadow import ShadowAudit, evaluate, shadow_audit
from privmon.audit.specific import (
    AuditResult,
    SetupComparison,
    average,
    compare,
    default_score,
    logit_score,
    specific,
)

__all__ = [
    "AuditResult",
    "Ensemble",
    "GradientCanaries",
    "InputCanaries",
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
