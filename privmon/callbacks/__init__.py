"""The training-loop monitor and privacy-aware early stopping (framework-agnostic)."""

from privmon.callbacks.early_stopping import PrivacyEarlyStopping, stopping_decision
from privmon.callbacks.loss_tracking import LossTracing
from privmon.callbacks.monitor import PrivacyMonitor, PrivacyViolationWarning

__all__ = [
    "LossTracing",
    "PrivacyEarlyStopping",
    "PrivacyMonitor",
    "PrivacyViolationWarning",
    "stopping_decision",
]
