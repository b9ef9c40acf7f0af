"""Offline audit of saved membership scores: ``privmon audit MEMBERS NONMEMBERS``.

One call reads two score files (.npy, .csv or .pt), and :func:`audit_scores` computes what the
monitor computes at a check, from the functional API alone:

- the optimal membership advantage per method (:func:`privmon.optimal_advantage`): ``value``
  (debiased point estimate), ``lower`` (certified lower bound), ``plugin`` (MACE's W_N / U_N)
  and ``upper`` (plug-in + McDiarmid half-width: it bounds the plug-in's spread, not its bias, so
  it is *not* a certified upper bound on the advantage);
- the threshold attack on the raw 1-D score (:func:`privmon.roc_summary`): AUC, TPR at low FPR,
  accuracy at the median;
- ε lower bounds (:func:`privmon.epsilon_lower_bound`) from each certified lower bound.

The confidence level is for all methods together: with ``delta`` = δ and k methods each
certified bound is computed at δ/k (union bound), so every ``lower`` and every ε lower bound hold
simultaneously with probability at least 1 − δ. The ε bounds assume members and non-members are
exchangeable (the member set a random part of the same pool as the held-out set): a shifted
held-out set looks like leakage.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from privmon._validation import as_scores, check_open_unit, check_subset
from privmon.bounds import epsilon_lower_bound
from privmon.estimators.advantage import optimal_advantage
from privmon.estimators.estimates import Method
from privmon.estimators.roc import roc_summary

__all__ = ["SCORE_SUFFIXES", "ScoreFileError", "audit_scores", "format_audit", "load_scores"]

SCORE_SUFFIXES = (".npy", ".csv", ".pt")
"""The score files :func:`load_scores` reads: numpy, comma-separated text, a saved tensor."""


class ScoreFileError(ValueError):
    """A score file that cannot be read as an (n,) or (n, d) array of numbers."""


def load_scores(path: str | os.PathLike[str]) -> np.ndarray:
    """Read scores of shape (n,) or (n, d) from ``path`` as a float64 numpy array.

    ``.npy``: ``numpy.load(allow_pickle=False)``. ``.csv``: comma-separated numbers, one record
    per row, an optional header row. ``.pt``: ``torch.load(weights_only=True)`` of a tensor (no
    code is run from the file). NaN / inf rows are kept here; the estimators drop and count them.

    Raises:
        ScoreFileError (a ValueError): the file is missing, has another suffix, or does not hold
            a numeric array of one or two dimensions; the message names the file.
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SCORE_SUFFIXES:
        raise ScoreFileError(f"{path}: scores must be a {', '.join(SCORE_SUFFIXES)} file")
    if not os.path.isfile(path):
        raise ScoreFileError(f"{path}: no such file")
    try:
        if suffix == ".npy":
            data: Any = np.load(path, allow_pickle=False)
        elif suffix == ".csv":
            data = _load_csv(path)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(data, torch.Tensor):
                raise ScoreFileError(
                    f"{path}: expected a saved tensor (torch.save(scores, path)), "
                    f"got {type(data).__name__}"
                )
            data = data.detach().to(torch.float64).numpy()
        arr = np.asarray(data, dtype=np.float64)
    except ScoreFileError:
        raise
    except Exception as err:  # the readers' own errors, reduced to one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ScoreFileError(f"{path}: cannot read scores ({first})") from None
    if arr.ndim not in (1, 2) or arr.shape[0] == 0 or arr.size == 0:
        raise ScoreFileError(
            f"{path}: scores must have shape (n,) or (n, d) with n >= 1, got {arr.shape}"
        )
    return arr


def _load_csv(path: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "input contained no data": reported as a shape error
        try:
            return np.loadtxt(path, delimiter=",", ndmin=1)
        except ValueError:  # a header row
            return np.loadtxt(path, delimiter=",", ndmin=1, skiprows=1)


def audit_scores(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    prior: float = 0.5,
    delta: float = 0.05,
    methods: Sequence[str] = ("histogram", "kde"),
    fpr: Sequence[float] = (0.1, 0.01, 0.001),
    higher_is_member: bool | None = True,
) -> dict[str, Any]:
    """Every offline figure of one pair of score sets, as a JSON-ready dict.

    Args:
        member_scores, nonmember_scores: shape (n,) or (n, d), numpy or torch.
        prior: P(member) in (0, 1).
        delta: 1 − the joint confidence level of every certified figure, in (0, 1); each of
            the k methods is certified at delta / k.
        methods: advantage estimators, from ("histogram", "kde").
        fpr: target false-positive rates for the TPR-at-low-FPR figures (1-D scores only).
        higher_is_member: orientation of the threshold attack (1-D scores only): True reads the
            scores as given, False their negation (a loss), None the better of the two (what an
            attacker would pick; optimistic). The advantage figures do not depend on it.

    Returns:
        ``{"n_members", "n_nonmembers", "dim", "prior", "delta", "advantage": {method: {...}},
        "roc": {...} or None, "epsilon_lower_bound": {method: ε}}``.
    """
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    methods = check_subset(methods, ("histogram", "kde"), name="methods")
    per_method = delta / len(methods)
    advantage: dict[str, dict[str, Any]] = {}
    eps: dict[str, float] = {}
    for method in methods:
        est = optimal_advantage(
            member_scores,
            nonmember_scores,
            prior=prior,
            method=cast(Method, method),  # checked by check_subset above
            delta=per_method,
        )
        advantage[method] = {
            "value": est.value,
            "lower": est.lower,
            "plugin": est.plugin,
            "upper": est.upper,
            "delta": per_method,
            "n_members": est.n_members,
            "n_nonmembers": est.n_nonmembers,
            "n_dropped": est.n_dropped,
        }
        eps[method] = float(epsilon_lower_bound(est.lower, prior=prior))
    dim = int(as_scores(member_scores, name="member_scores", drop=False)[0].shape[1])
    roc = None
    if dim == 1:
        roc = roc_summary(
            member_scores, nonmember_scores, fpr=list(fpr), higher_is_member=higher_is_member
        )
    first = advantage[methods[0]]
    return {
        "n_members": first["n_members"],
        "n_nonmembers": first["n_nonmembers"],
        "n_dropped": first["n_dropped"],
        "dim": dim,
        "prior": prior,
        "delta": delta,
        "advantage": advantage,
        "roc": roc,
        "higher_is_member": higher_is_member,
        "epsilon_lower_bound": eps,
    }


def _num(v: float, spec: str = ".4f") -> str:
    return "inf" if math.isinf(v) else format(v, spec)


def format_audit(result: dict[str, Any]) -> str:
    """The console table of :func:`audit_scores`' result, each figure named for what it is."""
    lines = [
        f"{result['n_members']} member and {result['n_nonmembers']} non-member scores "
        f"(d = {result['dim']}, {result['n_dropped']} non-finite dropped), prior "
        f"{result['prior']:g}, joint confidence {1 - result['delta']:g}",
        "",
        "optimal membership advantage (MACE eq. 7)",
        f"  {'method':<10} {'value':>7} {'lower':>7} {'plugin':>7} {'upper':>7}",
    ]
    for method, a in result["advantage"].items():
        lines.append(
            f"  {method:<10} {a['value']:7.4f} {a['lower']:7.4f} {a['plugin']:7.4f} "
            f"{a['upper']:7.4f}"
        )
    k = len(result["advantage"])
    lines += [
        "  value:  debiased point estimate (cross-fitted Bayes rule), the number to read",
        f"  lower:  certified LOWER BOUND on the true advantage (each at level "
        f"1 - {result['delta']:g}/{k}; all together at {1 - result['delta']:g})",
        "  plugin: the paper's W_N / U_N plug-in (over-reports small leaks); an estimate",
        "  upper:  plugin + McDiarmid half-width: bounds the plug-in's spread, NOT a certified "
        "upper bound",
        "",
    ]
    roc = result["roc"]
    if roc is None:
        lines.append("threshold attack: skipped (scores have more than one dimension)")
    else:
        orientation = {True: "higher = member", False: "lower = member", None: "best of both"}[
            result["higher_is_member"]
        ]
        lines.append(f"threshold attack on the raw score ({orientation})")
        lines.append(f"  AUC                 {roc['auc']:.4f}")
        for key, v in roc.items():
            if key.startswith("tpr@fpr="):
                lines.append(f"  TPR at FPR {key[len('tpr@fpr=') :]:<8} {v:.4f}")
        lines.append(f"  accuracy at median  {roc['accuracy_at_median']:.4f}")
    lines += ["", "epsilon lower bounds (MACE Thm 4, from the certified lower bounds)"]
    for method, e in result["epsilon_lower_bound"].items():
        lines.append(f"  {method:<10} epsilon >= {_num(e)}")
    lines.append(
        "  valid only when members and non-members are exchangeable (the same pool, split at "
        "random)"
    )
    return "\n".join(lines)
