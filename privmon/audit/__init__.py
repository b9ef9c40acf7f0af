"""Offline audits: the specific-setup per-record audit (only the training seed varies), shadow
models trained as one batched ensemble, the leave-one-model-out shadow audit of every
reference-model attack, and one-run DP audits: canaries (gradient canaries inside an Opacus
optimizer, input canaries for any model) and the ε lower bound their scores give; and the audit
of a released synthetic table (DOMIAS, its baselines and DCR)."""

from privmon.audit.canaries import GradientCanaries
from privmon.audit.input_canaries import InputCanaries
from privmon.audit.mechanism import MECHANISM_CHECKS, MechanismFinding
from privmon.audit.mechanism_check import MechanismCheck, StepContext
from privmon.audit.mechanism_checks import MechanismChecks
from privmon.audit.one_run import OneRunAudit, epsilon_from_guesses, one_run_epsilon
from privmon.audit.record_canaries import RecordCanaries
from privmon.audit.results import AuditResult, SetupComparison, compare
from privmon.audit.shadow import ShadowAudit, evaluate, shadow_audit
from privmon.audit.specific import average, default_score, logit_score, specific
from privmon.audit.synthetic import TABLE_ATTACKS, AttackFigures, SyntheticAudit, audit_synthetic
from privmon.audit.train import random_halves, train_ensemble
from privmon.models import Ensemble

__all__ = [
    "MECHANISM_CHECKS",
    "TABLE_ATTACKS",
    "AttackFigures",
    "AuditResult",
    "Ensemble",
    "GradientCanaries",
    "InputCanaries",
    "MechanismCheck",
    "MechanismChecks",
    "MechanismFinding",
    "OneRunAudit",
    "RecordCanaries",
    "SetupComparison",
    "ShadowAudit",
    "StepContext",
    "SyntheticAudit",
    "audit_synthetic",
    "average",
    "compare",
    "default_score",
    "epsilon_from_guesses",
    "evaluate",
    "logit_score",
    "one_run_epsilon",
    "random_halves",
    "shadow_audit",
    "specific",
    "train_ensemble",
]
