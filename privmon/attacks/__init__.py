"""Attack scores: DOMIAS (density ratio against synthetic data) and its baselines."""

from privmon.attacks.baselines import eq1, gan_leaks, gan_leaks_cal, logan_d1, monte_carlo
from privmon.attacks.domias import domias_scores

__all__ = ["domias_scores", "eq1", "gan_leaks", "gan_leaks_cal", "logan_d1", "monte_carlo"]
