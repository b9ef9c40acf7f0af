"""privmon's reference-model attacks next to TensorFlow Privacy's and ML Privacy Meter's, on the
same per-record statistics.

Runs in an environment with the peers installed (not privmon's: TensorFlow never enters the
shared one); it only loads arrays that ``benchmarks/peers_run.py`` saved from a privmon shadow
audit (64 digits MLPs on random halves, logit-scaled confidence φ of every record under every
model) and needs numpy, scipy and scikit-learn besides the peers::

    /work/venv-peers/bin/python benchmarks/peers_lira.py DIR

Each model in turn is the target and the others its shadow models (leave-one-model-out, as
privmon's shadow audit and Carlini et al. §V); the peers get the same target statistic and the
same in / out shadow statistics per record. Compared, per attack:

* TensorFlow Privacy ``advanced_mia.compute_score_lira`` (option "both", the online LiRA; "out",
  its offline form) and ``compute_score_offset`` (option "out": the difficulty-calibrated
  score), with the mean over shadow models (privmon's convention) and with their default
  median; their scores are lower-is-member, negated here;
* ML Privacy Meter's reference attack (``ReferenceMetric``) decides "member" when the target's
  loss is below the α-quantile threshold its hypothesis test fits to the out models' losses
  (``logit_rescale_threshold_func``: a Gaussian fitted to log(p / (1 − p)), LiRA offline);
  its decisions at each α are compared with privmon's offline LiRA test at the same level.

Printed: the largest per-record difference to privmon's score where the two compute the same
formula, the Pearson / Spearman correlation otherwise, and AUC and TPR at FPR 1 % and 0.1 %
(the ROC point with the largest TPR among those with FPR at most the target) of every score,
computed here the same way for all.

The conventions that differ: TensorFlow Privacy's fixed variance is the spread of all
deviations from the per-record means pooled together (records with more shadow models weigh
more), privmon's the mean of the per-record variances; its offline ("out") LiRA score is the
Gaussian log-density log N(t; μ_out, σ²_out), two-sided (a target far *below* the out models
scores as member-like as one far above), where privmon, Carlini et al. §VI-A and ML Privacy
Meter take the one-sided log Φ((t − μ_out) / σ_out). ML Privacy Meter adds 1e-6 to each loss
before its logit transform, which caps φ near 13.8; without it its decisions are privmon's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import norm, pearsonr, spearmanr

try:
    from tensorflow_privacy.privacy.privacy_tests.membership_inference_attack import (
        advanced_mia,
    )
except ImportError as err:  # absent, or installed without a TensorFlow it can import
    advanced_mia = None
    TFP_ERROR = f"{type(err).__name__}: {err}"
try:
    from privacy_meter import hypothesis_test
except ImportError:
    hypothesis_test = None

FPRS = (0.01, 0.001)


def roc_points(members: np.ndarray, nonmembers: np.ndarray) -> tuple[float, dict[float, float]]:
    """AUC (ties 1/2) and the TPR at each of :data:`FPRS` (largest TPR with FPR <= target)."""
    from sklearn.metrics import roc_auc_score, roc_curve

    labels = np.r_[np.ones(members.size), np.zeros(nonmembers.size)]
    scores = np.r_[members, nonmembers]
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    tprs = {f: float(tpr[fpr <= f].max()) for f in FPRS}
    return float(roc_auc_score(labels, scores)), tprs


def split(stat: np.ndarray, masks: np.ndarray, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Record j's statistic under the shadow models (all but i) with it in / out, (m, 1)."""
    others = np.arange(stat.shape[0]) != i
    s, m = stat[others, j], masks[others, j]
    return s[m].reshape(-1, 1), s[~m].reshape(-1, 1)


# (name, advanced_mia function, its options, the privmon score it is compared with, whether
# the two compute the same formula)
TFP_RUNS = (
    ("tfp lira (mean)", "lira", {"option": "both", "median_or_mean": "mean"}, "lira", True),
    ("tfp lira (median)", "lira", {"option": "both"}, "lira", False),
    (
        "tfp lira fixed var (mean)",
        "lira",
        {"option": "both", "median_or_mean": "mean", "fix_variance": True},
        "lira fixed",
        False,
    ),
    (
        "tfp lira out (mean)",
        "lira",
        {"option": "out", "median_or_mean": "mean"},
        "lira_offline",
        False,
    ),
    (
        "tfp offset out (mean)",
        "offset",
        {"option": "out", "median_or_mean": "mean"},
        "calibrated (phi)",
        True,
    ),
    ("tfp offset both (median)", "offset", {"option": "both"}, "calibrated (phi)", False),
)


def tfp_scores(stat: np.ndarray, masks: np.ndarray) -> dict[str, np.ndarray]:
    """TensorFlow Privacy's scores of every (target, record), higher = member, (k, n) each."""
    k, n = stat.shape
    out = {run[0]: np.empty((k, n)) for run in TFP_RUNS}
    for i in range(k):
        pairs = [split(stat, masks, i, j) for j in range(n)]
        stat_in = [p[0] for p in pairs]
        stat_out = [p[1] for p in pairs]
        target = stat[i].reshape(-1, 1)
        for name, kind, kw, _, _ in TFP_RUNS:
            if kind == "lira":  # lower is member: log Pr(out) - log Pr(in), or log Pr(out)
                out[name][i] = -advanced_mia.compute_score_lira(target, stat_in, stat_out, **kw)
            else:
                out[name][i] = advanced_mia.compute_score_offset(target, stat_in, stat_out, **kw)
    return out


def privacy_meter_decisions(
    stat: np.ndarray, masks: np.ndarray, alphas: np.ndarray, *, offset: bool = True
) -> np.ndarray:
    """ML Privacy Meter's reference attack, (len(alphas), k, n) bool: "member" when the
    target's loss is below the threshold ``logit_rescale_threshold_func`` fits to the record's
    out-model losses at level α. The loss is the cross-entropy softplus(−φ). With
    ``offset=False`` the same formula without the 1e-6 their function adds to the losses
    before the logit transform (written out here, numpy and scipy only)."""
    k, n = stat.shape
    loss = np.logaddexp(0.0, -stat)
    member = np.empty((alphas.size, k, n), dtype=bool)
    for i in range(k):
        others = np.arange(k) != i
        for j in range(n):
            out_losses = loss[others, j][~masks[others, j]]
            if offset:
                thr = hypothesis_test.logit_rescale_threshold_func(out_losses[None], alphas)[:, 0]
            else:
                loc, scale = norm.fit(np.log(np.expm1(out_losses) ** -1))  # log(p / (1 - p))
                t = norm.ppf(1 - alphas, loc=loc, scale=scale)
                thr = np.log(np.exp(t) + 1) - t
            member[:, i, j] = loss[i, j] < thr
    return member


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="arrays saved by benchmarks/peers_run.py")
    args = parser.parse_args()
    if advanced_mia is None:
        print(f"skipped: tensorflow_privacy not installed ({TFP_ERROR})")
        return
    saved = np.load(args.dir / "audit.npz")
    meta = json.loads((args.dir / "audit.json").read_text())
    stat, masks = saved["statistic"], saved["masks"]
    privmon = {
        key.removeprefix("privmon "): saved[key]
        for key in saved.files
        if key.startswith("privmon ")
    }
    k, n = stat.shape
    print(
        f"{meta['setup']}; {k} models x {n} records, leave-one-model-out "
        f"({int(masks.sum())} member and {int((~masks).sum())} non-member scores)"
    )
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {meta['peers']}")
    print()

    peers = tfp_scores(stat, masks)
    print("| score | AUC | TPR@1% | TPR@0.1% | against privmon's |")
    print("|---|---:|---:|---:|---|")
    for name, s in privmon.items():
        auc, tprs = roc_points(s[masks], s[~masks])
        print(
            f"| privmon {name} | {auc:.4f} | {100 * tprs[0.01]:.2f}% | {100 * tprs[0.001]:.2f}% | |"
        )
    for name, _, _, ref, equal in TFP_RUNS:
        s, r = peers[name], privmon[ref]
        auc, tprs = roc_points(s[masks], s[~masks])
        if equal:
            note = f"{ref}: largest |difference| {np.abs(s - r).max():.1e}"
        else:
            note = (
                f"{ref}: Pearson {pearsonr(s.ravel(), r.ravel())[0]:.4f}, "
                f"Spearman {spearmanr(s.ravel(), r.ravel())[0]:.4f}"
            )
        print(
            f"| {name} | {auc:.4f} | {100 * tprs[0.01]:.2f}% | {100 * tprs[0.001]:.2f}% | {note} |"
        )

    if hypothesis_test is None:
        print("\nML Privacy Meter: skipped: privacy_meter not installed")
        return
    alphas = np.array([0.001, 0.01, 0.05, 0.1, 0.3])
    pm = privacy_meter_decisions(stat, masks, alphas)
    pm_exact = privacy_meter_decisions(stat, masks, alphas, offset=False)
    offline = privmon["lira_offline"]
    print()
    print("ML Privacy Meter's reference attack (logit_rescale_threshold_func) vs privmon's")
    print("offline LiRA test log Phi((phi - mu_out) / sigma_out) >= log(1 - alpha), per record")
    print("(last column: their formula without the 1e-6 they add to the loss, which caps phi):")
    print("| alpha | PM FPR | PM TPR | privmon FPR | privmon TPR | same decision | without 1e-6 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for a, decided, exact in zip(alphas, pm, pm_exact, strict=True):
        mine = offline >= np.log1p(-a)
        print(
            f"| {a:g} | {decided[~masks].mean():.4f} | {decided[masks].mean():.4f} | "
            f"{mine[~masks].mean():.4f} | {mine[masks].mean():.4f} | "
            f"{(decided == mine).mean():.4%} | {(exact == mine).mean():.4%} |"
        )


if __name__ == "__main__":
    main()
