"""Offline audit of saved membership scores: ``privmon audit MEMBERS NONMEMBERS``.

:func:`load_scores` reads a score file (.npy, .csv or .pt), and :func:`audit_scores` computes
what the monitor computes at a check, from the functional API alone: the optimal membership
advantage per method (:func:`privmon.optimal_advantage`: ``value``, certified ``lower``,
``plugin`` and ``upper`` — the plug-in's McDiarmid figure, *not* a certified upper bound), the
threshold attack on the raw 1-D score (:func:`privmon.roc_summary`) and the ε lower bound of each
certified lower bound (:func:`privmon.epsilon_lower_bound`). With ``delta`` = δ and k methods
each bound is certified at δ/k, so all hold together with probability at least 1 − δ. The ε
bounds assume members and non-members are exchangeable: a shifted held-out set looks like
leakage. :func:`format_audit` prints the result as the command does.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from privmon._validation import as_scores, check_open_unit, check_subset
from privmon.bounds import epsilon_lower_bound
from privmon.estimators.advantage import optimal_advantage
from privmon.estimators.methods import METHODS, check_method
from privmon.estimators.roc import roc_summary

__all__ = ["SCORE_SUFFIXES", "ScoreFileError", "audit_scores", "format_audit", "load_scores"]

SCORE_SUFFIXES = (".npy", ".csv", ".pt")
"""The score files :func:`load_scores` reads: numpy, comma-separated text, a saved tensor."""


class ScoreFileError(ValueError):
    """A score file that cannot be read as an (n,) or (n, d) array of numbers.

    Examples:
        >>> from privmon.offline import ScoreFileError, load_scores
        >>> try:
        ...     load_scores("scores.json")
        ... except ScoreFileError as err:
        ...     print(err)
        scores.json: scores must be a .npy, .csv, .pt file
    """


def load_scores(path: str | os.PathLike[str]) -> np.ndarray:
    """Read scores of shape (n,) or (n, d) from ``path`` as a float64 numpy array.

    ``.npy``: ``numpy.load(allow_pickle=False)`` of a real array (bool, integer or float).
    ``.csv``: comma-separated numbers with ``.`` as the decimal mark, one record per row, an
    optional header row. ``.pt``: ``torch.load(weights_only=True)`` of a real tensor (no code is
    run from the file). NaN / inf rows are kept here; the estimators drop and count them.

    Nothing is guessed: a complex array (its imaginary parts would be lost), a CSV with ``;``
    between fields or whose header names fewer columns than its rows hold (a decimal comma,
    ``0,53``), a CSV whose rows are all two whole numbers (``0,53`` — a decimal comma or two
    integer columns?), and a CSV whose first column is a row index (an empty, ``index`` or
    ``Unnamed: 0`` header cell, as pandas writes it, or the values 0, 1, …, n − 1) are refused
    with a message that says how to save the scores.

    Raises:
        ScoreFileError (a ValueError): the file is missing, has another suffix, or does not hold
            a real numeric array of one or two dimensions; the message names the file.

    Examples:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from privmon.offline import load_scores
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "member_losses.npy")
        ...     np.save(path, np.array([0.25, 1.5, 0.75], dtype=np.float32))
        ...     scores = load_scores(path)
        >>> scores.dtype, scores.tolist()
        (dtype('float64'), [0.25, 1.5, 0.75])
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
            if data.dtype.kind not in "biuf":
                raise ScoreFileError(
                    f"{path}: {_not_real(str(data.dtype), data.dtype.kind == 'c')}"
                )
        elif suffix == ".csv":
            data = _load_csv(path)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(data, torch.Tensor):
                raise ScoreFileError(
                    f"{path}: expected a saved tensor (torch.save(scores, path)), "
                    f"got {type(data).__name__}"
                )
            if data.is_complex():
                raise ScoreFileError(f"{path}: {_not_real(str(data.dtype), True)}")
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


def _not_real(dtype: str, complex_: bool) -> str:
    if complex_:
        return (
            f"scores must be real numbers, got a complex array ({dtype}); its imaginary parts "
            "would be lost: save the real scores (e.g. .real or abs()) if that is what you mean"
        )
    return f"scores must be numbers (bool, integer or float), got an array of {dtype}"


_INDEX_HEADERS = ("", "index", "unnamed: 0")  # pandas' to_csv() / reset_index() names
_TWO_WHOLE_NUMBERS = re.compile(r"^\s*[+-]?\d+\s*,\s*\d+\s*$")


def _load_csv(path: str) -> np.ndarray:
    """Comma-separated numbers, one record per row, an optional header row; refuses what can
    be read two ways (see :func:`load_scores`)."""
    with open(path, encoding="utf-8-sig") as f:  # a spreadsheet's byte-order mark
        rows = [
            (i, line)
            for i, line in enumerate(f, start=1)
            if line.strip() and not line.lstrip().startswith("#")  # numpy.savetxt's header
        ]
    if not rows:
        return np.empty(0)
    if any(";" in line for _, line in rows):
        raise ScoreFileError(
            f"{path}: fields are separated by ';' (a decimal-comma CSV, as spreadsheets write "
            "it in many locales?): privmon audit reads comma-separated numbers with '.' as the "
            "decimal mark"
        )
    fields = [(i, [v.strip() for v in line.split(",")]) for i, line in rows]
    header = None
    if not all(_is_number(v) for v in fields[0][1]):
        header = fields[0][1]
        rows, fields = rows[1:], fields[1:]
        if not rows:
            return np.empty(0)
    width = len(fields[0][1])
    for i, values in fields:
        if len(values) != width:
            raise ScoreFileError(
                f"{path}: line {i} has {len(values)} field(s), the first record {width} (a "
                "decimal comma, 0,53, read as a separator?)"
            )
    if header is not None and len(header) != width:
        raise ScoreFileError(
            f"{path}: the header names {len(header)} column(s) but the rows hold {width} "
            "fields (a decimal comma, 0,53, read as a separator?): write numbers with '.' as "
            "the decimal mark"
        )
    if width == 2 and header is None and all(_TWO_WHOLE_NUMBERS.match(line) for _, line in rows):
        raise ScoreFileError(
            f"{path}: every row is two whole numbers separated by a comma, which is either a "
            "decimal comma (0,53 for 0.53) or two integer columns (a row index and a score?): "
            "write numbers with '.' as the decimal mark, or save the array as .npy"
        )
    try:
        data = np.array([[float(v) for v in values] for _, values in fields], dtype=np.float64)
    except ValueError:
        i, values = next((i, vs) for i, vs in fields if not all(_is_number(v) for v in vs))
        field = next(j for j, v in enumerate(values, 1) if not _is_number(v))
        raise ScoreFileError(
            f"{path}: cannot read scores (line {i}: field {field} is not a number)"
        ) from None
    if width >= 2 and len(data) >= 3:
        named_index = header is not None and header[0].lower() in _INDEX_HEADERS
        counts = np.arange(len(data), dtype=np.float64)
        if named_index or any(np.array_equal(data[:, 0], counts + s) for s in (0, 1)):
            why = (
                f"its header cell is {header[0]!r}"
                if named_index and header
                else f"it counts {_first_values(data[:, 0])}"
            )
            raise ScoreFileError(
                f"{path}: the first column is a row index ({why}), not a score: save the "
                "scores without it (pandas: to_csv(path, index=False))"
            )
    return data[0] if len(data) == 1 else (data[:, 0] if width == 1 else data)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _first_values(column: np.ndarray) -> str:
    shown = ", ".join(f"{v:g}" for v in column[:3])
    return shown + (", …" if len(column) > 3 else "")


def audit_scores(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    prior: float = 0.5,
    delta: float = 0.05,
    methods: Sequence[str] = METHODS,
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
        higher_is_member: the 1-D threshold attack's orientation: True as given, False negated
            (a loss), None the better of the two (optimistic); the advantage ignores it.

    Returns:
        ``{"n_members", "n_nonmembers", "dim", "prior", "delta", "advantage": {method: {...}},
        "roc": {...} or None, "epsilon_lower_bound": {method: ε}}``.

    Examples:
        >>> import torch
        >>> from privmon.offline import audit_scores
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> result = audit_scores(members, torch.randn(500, generator=gen))
        >>> round(result["advantage"]["histogram"]["lower"], 3), round(result["roc"]["auc"], 3)
        (0.16, 0.649)
        >>> round(result["epsilon_lower_bound"]["histogram"], 3)
        0.322
    """
    prior = check_open_unit(prior, name="prior")
    delta = check_open_unit(delta, name="delta")
    methods = check_subset(methods, METHODS, name="methods")
    per_method = delta / len(methods)
    advantage: dict[str, dict[str, Any]] = {}
    eps: dict[str, float] = {}
    for method in methods:
        est = optimal_advantage(
            member_scores,
            nonmember_scores,
            prior=prior,
            method=check_method(method),
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
    """The console table of :func:`audit_scores`' result, each figure named for what it is.

    Examples:
        >>> import torch
        >>> from privmon.offline import audit_scores, format_audit
        >>> gen = torch.Generator().manual_seed(0)
        >>> members = torch.randn(500, generator=gen) + 0.5
        >>> table = format_audit(audit_scores(members, torch.randn(500, generator=gen)))
        >>> for line in table.splitlines()[3:6]:
        ...     print(line)
          method       value   lower  plugin   upper
          histogram   0.2300  0.1598  0.2900  0.3836
          kde         0.2200  0.1598  0.2171  0.3107
    """
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
