"""The training-loop monitor and privacy-aware early stopping (framework-agnostic)."""

from privmon.callbacks.early_stopping import PrivacyEarlyStopping, should_stop
from privmon.callbacks.monitor import PrivacyMonitor, PrivacyViolationWarning

__all__ = ["PrivacyEarlyStopping", "PrivacyMonitor", "PrivacyViolationWarning", "should_stop"]
