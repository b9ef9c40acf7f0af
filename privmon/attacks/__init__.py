"""Attack scores: DOMIAS (density ratio against synthetic data) and its baselines; Song & Mittal's
metric attacks with class-dependent thresholds and the privacy risk score; the attacks of a
generator query (:mod:`privmon.attacks.generator`); subgroup risk; reference-model attacks (LiRA,
RMIA, difficulty calibration) and their leave-one-model-out evaluation; language-model
statistics (loss, zlib, Min-K%, Min-K%++, reference) and secret-sharer exposure; diffusion-model
statistics (loss at a timestep, PIA / PIAN, SecMI, SimA)."""

from privmon.attacks.baselines import dcr, eq1, gan_leaks, gan_leaks_cal, logan_d1, monte_carlo
from privmon.attacks.diffusion import (
    alphas_cumprod,
    diffusion_statistic,
    model_calls,
    noise_prediction,
)
from privmon.attacks.domias import domias_scores
from privmon.attacks.language_model import (
    causal_lm_logits,
    decode_texts,
    lm_statistic,
    lowest_k_mean,
    predicted_tokens,
    token_log_probs,
    token_z_scores,
    zlib_sizes,
)
from privmon.attacks.loss_tail import LossTnr, loss_tnr
from privmon.attacks.loss_traces import LossTraces, LtIqr, lt_iqr
from privmon.attacks.metric import (
    MetricAttack,
    confidence,
    correctness,
    entropy,
    metric_values,
    modified_entropy,
)
from privmon.attacks.reference import (
    LOMO_ATTACKS,
    calibrated_score,
    leave_one_out,
    lira,
    rmia,
)
from privmon.attacks.risk_score import Calibration, PrivacyRiskScore, calibration
from privmon.attacks.secret_sharer import (
    SecretSharerCanaries,
    canary_exposure,
    exposure,
    secret_sharer_canaries,
    sequence_losses,
)
from privmon.attacks.subgroups import subgroup_risk
from privmon.attacks.tables import TableEncoder, TableLayout

__all__ = [
    "LOMO_ATTACKS",
    "Calibration",
    "LossTnr",
    "LossTraces",
    "LtIqr",
    "MetricAttack",
    "PrivacyRiskScore",
    "SecretSharerCanaries",
    "TableEncoder",
    "TableLayout",
    "alphas_cumprod",
    "calibrated_score",
    "calibration",
    "canary_exposure",
    "causal_lm_logits",
    "confidence",
    "correctness",
    "dcr",
    "decode_texts",
    "diffusion_statistic",
    "domias_scores",
    "entropy",
    "eq1",
    "exposure",
    "gan_leaks",
    "gan_leaks_cal",
    "leave_one_out",
    "lira",
    "lm_statistic",
    "logan_d1",
    "loss_tnr",
    "lowest_k_mean",
    "lt_iqr",
    "metric_values",
    "model_calls",
    "modified_entropy",
    "monte_carlo",
    "noise_prediction",
    "predicted_tokens",
    "rmia",
    "secret_sharer_canaries",
    "sequence_losses",
    "subgroup_risk",
    "token_log_probs",
    "token_z_scores",
    "zlib_sizes",
]
