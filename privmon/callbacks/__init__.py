"""The training-loop monitor and privacy-aware early stopping (framework-agnostic)."""

from privmon.callbacks.early_stopping import PrivacyEarlyStopping, stopping_decision
from privmon.callbacks.monitor import PrivacyMonitor, PrivacyViolationWarning

__all__ = ["PrivacyEarlyStopping", "PrivacyMonitor", "PrivacyViolationWarning", "stopping_decision"]
