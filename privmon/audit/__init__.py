"""Offline audits: the specific-setup per-record audit (only the training seed varies)."""

from privmon.audit.specific import (
    AuditResult,
    SetupComparison,
    average,
    compare,
    default_score,
    specific,
)

__all__ = ["AuditResult", "SetupComparison", "average", "compare", "default_score", "specific"]
