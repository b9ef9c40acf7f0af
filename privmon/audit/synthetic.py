"""Auditing a released synthetic table: :func:`audit_synthetic` runs DOMIAS, its baselines and
DCR against one synthetic table, given the member, held-out and reference records, and returns
each attack's AUC, TPR at low FPR and optimal advantage with a certified lower bound (all bounds
of one call hold together), and optionally each subgroup's risk (:class:`SyntheticAudit`)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from privmon._validation import check_int, check_open_unit, check_subset, is_table, to_numpy
from privmon.attacks.baselines import dcr, eq1, gan_leaks, gan_leaks_cal, logan_d1, monte_carlo
from privmon.attacks.domias import domias_scores
from privmon.attacks.subgroups import subgroup_risk
from privmon.attacks.tables import TableEncoder
from privmon.audit.records import frozen
from privmon.estimators.advantage import optimal_advantage
from privmon.estimators.certificate import detectable_advantage
from privmon.estimators.estimates import AdvantageEstimate
from privmon.estimators.methods import METHODS, applicable_methods, check_method
from privmon.estimators.roc import roc_summary

__all__ = ["TABLE_ATTACKS", "AttackFigures", "SyntheticAudit", "audit_synthetic"]

TABLE_ATTACKS = ("domias", "eq1", "gan_leaks", "gan_leaks_cal", "monte_carlo", "logan_d1", "dcr")
"""The attacks :func:`audit_synthetic` runs: DOMIAS (:func:`privmon.domias_scores`), its
baselines (:func:`privmon.attacks.eq1`, ``gan_leaks``, ``gan_leaks_cal``, ``monte_carlo``,
``logan_d1``) and DCR (:func:`privmon.attacks.dcr`)."""

_DISCRETE = ("monte_carlo",)  # few distinct scores (a count): the histogram estimator only
_MISSING_LABEL = "<missing>"


@dataclass(frozen=True, repr=False, eq=False)
class AttackFigures:
    """One attack's figures in a :class:`SyntheticAudit` (one row of its table).

    Attributes:
        attack: the attack's name, one of :data:`TABLE_ATTACKS`.
        auc: :func:`privmon.auc` of the member scores against the held-out scores.
        tpr: ``{fpr: TPR}``, :func:`privmon.tpr_at_fpr` at each target false-positive rate.
        accuracy_at_median: :func:`privmon.accuracy_at_median` (DOMIAS' threshold attack).
        advantage: ``{method: AdvantageEstimate}``, :func:`privmon.optimal_advantage` of the
            scores per estimator (``monte_carlo``'s scores take few values: histogram only);
            ``.value`` is the debiased estimate, ``.lower`` the certified lower bound at the
            audit's ``bound_delta``.
        member_scores, heldout_scores: the attack's scores (higher = member), read-only float64
            arrays in the order of the members and held-out tables.
        subgroups: with ``subgroup=``: ``{label: figures}``, :func:`privmon.attacks.subgroup_risk`
            (AUC, top-q precision, member fraction, counts) and ``"advantage"``:
            ``{method: value}``, the group's debiased advantage estimate (not certified; NaN
            where a side of the group is empty). None without ``subgroup=``.

    Examples:
        >>> import numpy as np, pandas as pd
        >>> from privmon.audit import audit_synthetic
        >>> rng = np.random.default_rng(0)
        >>> def table(n):
        ...     return pd.DataFrame({"x": rng.normal(size=n), "y": rng.normal(size=n)})
        >>> members, heldout, reference = table(100), table(100), table(300)
        >>> row = audit_synthetic(members, members, heldout, reference, attacks=["dcr"])["dcr"]
        >>> row.auc, round(row.lower, 2)  # the release copies its members: DCR sees it
        (1.0, 0.9)
    """

    attack: str
    auc: float
    tpr: dict[float, float]
    accuracy_at_median: float
    advantage: dict[str, AdvantageEstimate]
    member_scores: np.ndarray
    heldout_scores: np.ndarray
    subgroups: dict[Hashable, dict[str, Any]] | None = None

    @property
    def lower(self) -> float:
        """The largest certified lower bound over the methods; certified too, as every bound
        of the audit holds at once."""
        return max(est.lower for est in self.advantage.values())

    def to_dict(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict (string keys; NaN stays a float), scores left out."""
        out: dict[str, Any] = {
            "auc": self.auc,
            "tpr_at_fpr": {repr(f): v for f, v in self.tpr.items()},
            "accuracy_at_median": self.accuracy_at_median,
            "advantage": {
                m: {
                    "value": e.value,
                    "lower": e.lower,
                    "plugin": e.plugin,
                    "upper": e.upper,
                    "delta": e.delta,
                }
                for m, e in self.advantage.items()
            },
            "lower": self.lower,
        }
        if self.subgroups is not None:
            out["subgroups"] = {
                str(label): {
                    **{k: v for k, v in g.items() if k != "top_q_precision"},
                    "top_q_precision": {repr(q): p for q, p in g["top_q_precision"].items()},
                }
                for label, g in self.subgroups.items()
            }
        return out

    def __repr__(self) -> str:
        return f"AttackFigures(attack={self.attack!r}, auc={self.auc:.4f}, lower={self.lower:.4f})"


@dataclass(frozen=True, repr=False, eq=False)
class SyntheticAudit:
    """What :func:`audit_synthetic` returns: one :class:`AttackFigures` per attack.

    ``audit["dcr"]`` is the row of one attack; ``str(audit)`` (or :meth:`table`) the console
    table; :meth:`to_dict` a JSON-ready dict (what ``privmon audit --json`` prints).

    Attributes:
        rows: the attacks' figures, in the order asked for.
        n_members, n_heldout, n_synthetic, n_reference: records in each table.
        prior: P(member), the advantage's prior.
        delta: 1 − the joint confidence of every certified lower bound of the audit.
        n_bounds: certified lower bounds in the audit (attacks × applicable methods).
        bound_delta: the δ each bound is certified at, ``delta / n_bounds``.
        methods: the advantage estimators asked for.
        fprs: the target false-positive rates of the TPR figures.
        detectable: the smallest advantage whose bound clears 0 in half of such audits at these
            sizes and ``bound_delta`` (:func:`privmon.detectable_advantage`); below it a leak may
            be real yet not certified.
        subgroup: the column the subgroup figures are read by, or None.

    Examples:
        >>> import numpy as np, pandas as pd
        >>> from privmon.audit import audit_synthetic
        >>> rng = np.random.default_rng(0)
        >>> def table(n):
        ...     return pd.DataFrame({"x": rng.normal(size=n), "g": rng.choice(["a", "b"], n)})
        >>> members, heldout, reference, fresh = table(100), table(100), table(300), table(100)
        >>> audit = audit_synthetic(fresh, members, heldout, reference, attacks=["gan_leaks"])
        >>> audit.attacks, audit.n_bounds, audit.bound_delta
        (('gan_leaks',), 2, 0.025)
        >>> audit["gan_leaks"].lower  # an independent sample: nothing certified
        0.0
    """

    rows: tuple[AttackFigures, ...]
    n_members: int
    n_heldout: int
    n_synthetic: int
    n_reference: int
    prior: float
    delta: float
    n_bounds: int
    bound_delta: float
    methods: tuple[str, ...]
    fprs: tuple[float, ...]
    detectable: float
    subgroup: str | None = None

    @property
    def attacks(self) -> tuple[str, ...]:
        """The attacks' names, in the order of :attr:`rows`."""
        return tuple(r.attack for r in self.rows)

    def __getitem__(self, attack: str) -> AttackFigures:
        for row in self.rows:
            if row.attack == attack:
                return row
        raise KeyError(f"no attack {attack!r} in this audit; it ran {self.attacks}")

    def to_dict(self) -> dict[str, Any]:
        """Every figure as a JSON-ready dict (string keys; NaN and inf stay floats)."""
        return {
            "n_members": self.n_members,
            "n_heldout": self.n_heldout,
            "n_synthetic": self.n_synthetic,
            "n_reference": self.n_reference,
            "prior": self.prior,
            "delta": self.delta,
            "n_bounds": self.n_bounds,
            "bound_delta": self.bound_delta,
            "methods": list(self.methods),
            "fprs": list(self.fprs),
            "detectable_advantage": self.detectable,
            "subgroup": self.subgroup,
            "attacks": {r.attack: r.to_dict() for r in self.rows},
        }

    def table(self) -> str:
        """The console table: a row per attack, then the subgroups' risk when asked for."""
        return _format(self)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (
            f"SyntheticAudit(attacks={self.attacks}, n_members={self.n_members}, "
            f"n_heldout={self.n_heldout}, delta={self.delta:g})"
        )


def audit_synthetic(
    synthetic: Any,
    members: Any,
    heldout: Any,
    reference: Any,
    *,
    attacks: Sequence[str] = TABLE_ATTACKS,
    categorical: Sequence[str] | None = None,
    fprs: Sequence[float] = (0.001, 0.01, 0.1),
    delta: float = 0.05,
    subgroup: str | None = None,
    prior: float = 0.5,
    methods: Sequence[str] = METHODS,
    seed: int = 0,
) -> SyntheticAudit:
    """Audit a released synthetic table against membership inference: every attack's AUC, TPR
    at low FPR, optimal advantage and certified lower bound, and the risk per subgroup.

    One :class:`~privmon.attacks.TableEncoder`, fitted on ``reference`` alone, reads every
    table for every attack. Each attack scores the members and the held-out records in one call
    (the test set is the members, then the held-out records), so figures that depend on the
    whole test set (MC's ε-ball radius, the median heuristic) are those of the audit. Scores are
    higher = member; DCR's is minus the Gower distance to the closest synthetic record.

    Confidence: the audit certifies ``n_bounds`` lower bounds, one per attack and applicable
    method (``monte_carlo``'s few distinct scores take the histogram only), each at
    ``bound_delta = delta / n_bounds``, so that **every lower bound of the call holds at once
    with probability at least 1 − delta** (a union bound; as :func:`privmon.offline.audit_scores`
    splits δ over methods). The subgroups' figures are estimates, not certified. The bounds
    assume the members and held-out records are exchangeable (one pool, split at random): a
    held-out set from elsewhere looks like leakage. The reference records must come from the
    same population and be disjoint from both.

    Args:
        synthetic: the released table (a pandas DataFrame), the attacks' target.
        members: records the synthesizer was fitted on (a DataFrame, >= 2 rows).
        heldout: records of the same pool it never saw (>= 2 rows; not the members).
        reference: further population records, disjoint from both (>= 2 rows): the encoder's
            and DOMIAS' reference. Every table has the reference's columns (any order).
        attacks: a subset of :data:`TABLE_ATTACKS`, default all, in the order to report.
        categorical: the columns read as categories; default every non-numeric column.
        fprs: target false-positive rates in (0, 1) of the TPR figures.
        delta: 1 − the joint confidence of all the certified lower bounds, in (0, 1).
        subgroup: a column name: each attack's figures within each of its values (DOMIAS
            §5.3; a missing value is the group ``"<missing>"``, and all labels become strings
            then). Meant for a column of categories or few values.
        prior: P(member) in (0, 1) for the advantage (its floor is |2p − 1|).
        methods: the advantage estimators, from ("histogram", "kde").
        seed: LOGAN-D1's training seed (its initialization and batch order).

    Returns:
        :class:`SyntheticAudit`.

    Raises:
        TypeError: a table is not a DataFrame.
        ValueError naming the argument: an empty table or one with fewer than 2 rows, columns
            differing from the reference's, members and heldout the same table (or reference
            one of them), members or held-out records with missing or infinite numbers, an
            unknown attack or method, a ``subgroup`` column the tables lack, a figure out of
            range. No message holds a record's value.

    Examples:
        >>> import numpy as np, pandas as pd
        >>> from privmon.audit import audit_synthetic
        >>> rng = np.random.default_rng(0)
        >>> def table(n):
        ...     return pd.DataFrame({"wage": rng.lognormal(6.0, 0.5, n),
        ...                          "region": rng.choice(["north", "south"], n)})
        >>> members, heldout, reference = table(150), table(150), table(400)
        >>> leaky = members.assign(wage=members.wage * rng.normal(1.0, 0.001, 150))  # a copy
        >>> audit = audit_synthetic(leaky, members, heldout, reference,
        ...                         attacks=["domias", "dcr"], subgroup="region")
        >>> print(audit.table().splitlines()[3])
        attack        AUC  TPR@0.1%  TPR@1%  TPR@10%  histogram [lower]  kde [lower]
        >>> audit.bound_delta, audit["dcr"].lower > 0.5  # 4 bounds, all at once at 0.95
        (0.0125, True)
        >>> sorted(audit["dcr"].subgroups)
        ['north', 'south']
    """
    delta = check_open_unit(delta, name="delta")
    prior = check_open_unit(prior, name="prior")
    seed = check_int(seed, name="seed")
    attacks = check_subset(attacks, TABLE_ATTACKS, name="attacks")
    methods = tuple(check_method(m) for m in check_subset(methods, METHODS, name="methods"))
    targets = _check_fprs(fprs)
    tables = {"synthetic": synthetic, "members": members, "heldout": heldout}
    for name, t in {**tables, "reference": reference}.items():
        _check_table(t, name=name)
    _check_distinct(members, heldout, reference)
    encoder = TableEncoder(reference, categorical=categorical)
    for name, t in tables.items():
        x = encoder.encode(t, name=name)  # the columns, named per table
        if name != "synthetic":
            bad = ~np.isfinite(to_numpy(x)).all(axis=1)
            if bad.any():
                where = np.flatnonzero(bad)
                more = "..." if len(where) > 5 else ""
                raise ValueError(
                    f"{name} holds {len(where)} record(s) with a missing or infinite number "
                    f"(rows {where[:5].tolist()}{more}): every audited record gets a score; drop "
                    "or impute them"
                )
    if subgroup is not None and subgroup not in encoder.columns:
        raise ValueError(
            f"subgroup names column {subgroup!r} that the tables do not have (their columns: "
            f"{encoder.columns})"
        )
    pd = importlib.import_module("pandas")
    test = pd.concat([_named(members, encoder), _named(heldout, encoder)], ignore_index=True)
    n1 = len(members)
    per_attack = {a: applicable_methods(methods, discrete=a in _DISCRETE) for a in attacks}
    if not all(per_attack.values()):
        raise ValueError(
            f"methods={methods} leaves monte_carlo without an estimator: its scores take few "
            "distinct values, which the kde method does not smooth; add 'histogram'"
        )
    n_bounds = sum(len(m) for m in per_attack.values())
    bound_delta = delta / n_bounds
    groups = None
    if subgroup is not None:
        groups = _labels(_named(members, encoder)[subgroup], _named(heldout, encoder)[subgroup])
    rows = []
    for attack in attacks:
        scores = _attack_scores(attack, test, synthetic, reference, encoder=encoder, seed=seed)
        mem, hel = scores[:n1], scores[n1:]
        summary = roc_summary(mem, hel, fpr=targets)
        advantage = {
            m: optimal_advantage(mem, hel, prior=prior, method=check_method(m), delta=bound_delta)
            for m in per_attack[attack]
        }
        rows.append(
            AttackFigures(
                attack=attack,
                auc=summary["auc"],
                tpr={f: summary[f"tpr@fpr={f!r}"] for f in targets},
                accuracy_at_median=summary["accuracy_at_median"],
                advantage=advantage,
                member_scores=frozen(mem),
                heldout_scores=frozen(hel),
                subgroups=None
                if groups is None
                else _subgroups(mem, hel, groups, prior=prior, methods=per_attack[attack]),
            )
        )
    return SyntheticAudit(
        rows=tuple(rows),
        n_members=n1,
        n_heldout=len(heldout),
        n_synthetic=len(synthetic),
        n_reference=len(reference),
        prior=prior,
        delta=delta,
        n_bounds=n_bounds,
        bound_delta=bound_delta,
        methods=methods,
        fprs=tuple(targets),
        detectable=detectable_advantage(n1, len(heldout), delta=bound_delta, prior=prior),
        subgroup=subgroup,
    )


def _check_fprs(fprs: Any) -> list[float]:
    """``fprs`` (a rate or a sequence of them) as a list of distinct rates in (0, 1)."""
    values = [
        check_open_unit(f, name="fprs")
        for f in np.atleast_1d(np.asarray(fprs, dtype=object)).ravel().tolist()
    ]
    if not values:
        raise ValueError("fprs must hold at least one false-positive rate in (0, 1)")
    return list(dict.fromkeys(values))


def _check_table(table: Any, *, name: str) -> None:
    if not is_table(table):
        raise TypeError(f"{name} must be a pandas DataFrame, got {type(table).__name__}")
    rows, cols = table.shape
    if rows == 0 or cols == 0:
        raise ValueError(f"{name} is empty ({rows} rows, {cols} columns)")
    if rows < 2:
        raise ValueError(f"{name} has {rows} row: the audit needs at least 2 records per table")


def _check_distinct(members: Any, heldout: Any, reference: Any) -> None:
    if members is heldout or (members.shape == heldout.shape and members.equals(heldout)):
        raise ValueError(
            "members and heldout are the same table: the held-out records must be records the "
            "synthesizer never saw (a random part of the pool the members came from)"
        )
    for name, t in (("members", members), ("heldout", heldout)):
        if reference is t:
            raise ValueError(
                f"reference is the {name} table: the reference records must be disjoint from "
                "the members and the held-out records"
            )


def _named(table: Any, encoder: TableEncoder) -> Any:
    """``table`` with string column names, in the reference's order."""
    return table.set_axis([str(c) for c in table.columns], axis=1)[encoder.columns]


def _labels(member_col: Any, heldout_col: Any) -> tuple[np.ndarray, np.ndarray]:
    """Group labels of each side: the column's values, or strings (a missing value as
    ``"<missing>"``) when either side has a missing one."""
    if member_col.isna().any() or heldout_col.isna().any():
        member_col, heldout_col = (
            c.astype(object).where(c.notna(), _MISSING_LABEL).astype(str)
            for c in (member_col, heldout_col)
        )
    return np.asarray(member_col.to_numpy()), np.asarray(heldout_col.to_numpy())


def _attack_scores(
    attack: str, test: Any, synthetic: Any, reference: Any, *, encoder: TableEncoder, seed: int
) -> np.ndarray:
    if attack == "domias":
        return domias_scores(test, synthetic, reference, encoder=encoder)
    if attack == "eq1":
        return eq1(test, synthetic, encoder=encoder)
    if attack == "gan_leaks":
        return gan_leaks(test, synthetic, encoder=encoder)
    if attack == "gan_leaks_cal":
        return gan_leaks_cal(test, synthetic, reference, encoder=encoder)
    if attack == "monte_carlo":
        return monte_carlo(test, synthetic, encoder=encoder)
    if attack == "logan_d1":
        return logan_d1(test, synthetic, reference, seed=seed, encoder=encoder)
    return dcr(test, synthetic, reference, encoder=encoder)


def _subgroups(
    mem: np.ndarray,
    hel: np.ndarray,
    groups: tuple[np.ndarray, np.ndarray],
    *,
    prior: float,
    methods: Sequence[str],
) -> dict[Hashable, dict[str, Any]]:
    g_mem, g_hel = groups
    risk = subgroup_risk(mem, hel, g_mem, g_hel)
    for label, figures in risk.items():
        in_mem, in_hel = g_mem == label, g_hel == label
        both = bool(in_mem.any() and in_hel.any())
        figures["advantage"] = {
            m: optimal_advantage(
                mem[in_mem], hel[in_hel], prior=prior, method=check_method(m)
            ).value
            if both
            else math.nan
            for m in methods
        }
    return risk


def _pct(f: float) -> str:
    return f"{100 * f:g}%"


def _format(audit: SyntheticAudit) -> str:
    lines = [
        f"membership inference on a synthetic table: {audit.n_members} members, "
        f"{audit.n_heldout} held-out, {audit.n_synthetic} synthetic, {audit.n_reference} "
        "reference records",
        f"prior {audit.prior:g}; {audit.n_bounds} certified lower bounds, each at δ = "
        f"{audit.delta:g}/{audit.n_bounds}, all together at confidence {1 - audit.delta:g}",
        "",
    ]
    width = max(len("attack"), *(len(a) for a in audit.attacks))
    tpr_heads = [f"TPR@{_pct(f)}" for f in audit.fprs]
    heads = [f"{m} [lower]" for m in audit.methods]
    lines.append(
        f"{'attack':<{width}}  {'AUC':>5}  "
        + "  ".join(tpr_heads)
        + "  "
        + "  ".join(f"{h:>{max(len(h), 15)}}" for h in heads)
    )
    for row in audit.rows:
        cells = [f"{row.attack:<{width}}", f"{row.auc:5.3f}"]
        cells += [f"{row.tpr[f]:>{len(h)}.3f}" for f, h in zip(audit.fprs, tpr_heads, strict=True)]
        for m, h in zip(audit.methods, heads, strict=True):
            est = row.advantage.get(m)
            text = "-" if est is None else f"{est.value:.3f} [{est.lower:.3f}]"
            cells.append(f"{text:>{max(len(h), 15)}}")
        lines.append("  ".join(cells))
    lines += [
        "  AUC, TPR at FPR: the attack's own threshold rule (higher score = member)",
        "  value [lower]: debiased estimate of the optimal membership advantage [its certified "
        "LOWER BOUND]",
        f"  smallest advantage certified in half of such audits: {audit.detectable:.3f}",
    ]
    if min(audit.fprs) < 1.0 / audit.n_heldout:
        lines.append(
            f"  a TPR at FPR below 1/{audit.n_heldout} (the held-out records) counts only the "
            "members above every held-out score"
        )
    lines.append(
        "  certified figures assume members and held-out records are exchangeable (one pool, "
        "split at random): a shifted held-out set looks like leakage"
    )
    if audit.subgroup is not None:
        lines += ["", *_format_subgroups(audit)]
    return "\n".join(lines)


def _format_subgroups(audit: SyntheticAudit) -> list[str]:
    method = audit.methods[0]
    first = audit.rows[0].subgroups or {}
    labels = list(first)
    width = max(len("group"), *(len(str(g)) for g in labels))
    cols = [max(len(a), 11) for a in audit.attacks]
    lines = [
        f"risk by {audit.subgroup}: AUC / advantage estimate ({method}; not certified)",
        f"{'group':<{width}}  {'members':>7}  {'heldout':>7}  "
        + "  ".join(f"{a:>{c}}" for a, c in zip(audit.attacks, cols, strict=True)),
    ]
    for label in labels:
        g0 = first[label]
        cells = [f"{label!s:<{width}}", f"{g0['n_members']:>7}", f"{g0['n_nonmembers']:>7}"]
        for row, c in zip(audit.rows, cols, strict=True):
            g = (row.subgroups or {})[label]
            adv = g["advantage"].get(method, math.nan)
            cells.append(f"{_num(g['auc'])} / {_num(adv)}".rjust(c))
        lines.append("  ".join(cells))
    return lines


def _num(v: float) -> str:
    return "  n/a" if math.isnan(v) else f"{v:.2f}"
