"""The report's figures as base64 PNG (matplotlib, imported only here — the ``privmon[report]``
extra): advantage against the DP ceilings, ε, the ROC at the last check, per-record risk."""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from privmon.estimators.methods import registered_methods
from privmon.report import tags
from privmon.report.formatting import fmt
from privmon.report.runs import Checks

__all__ = [
    "advantage_figure",
    "comparison_figure",
    "epsilon_comparison_figure",
    "legend_outside",
    "plot_advantage",
    "plot_epsilon",
    "plot_risk",
    "plot_roc",
    "png",
    "risk_figure",
    "roc_figure",
]

# one colour per line of the advantage chart: estimate and bound of each method (in the order
# methods are registered), each ceiling
_VALUE_COLORS = ("#1f77b4", "#d62728")
_LOWER_COLORS = ("#17becf", "#ff7f0e")
_RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "0.4")
_CEILINGS = (
    (tags.CEILING_TANH, ":", "#9467bd", "ε-DP ceiling (tanh)"),
    (tags.CEILING_EPS_DELTA, "-.", "#8c564b", "(ε, δ)-DP ceiling"),
)


def _colors(method: str) -> tuple[str, str]:
    """The colours of ``method``'s estimate and certified lower bound (by its place in
    :func:`~privmon.estimators.methods.registered_methods`; grey tones beyond the palette)."""
    i = registered_methods().index(method)
    return (_VALUE_COLORS[i], _LOWER_COLORS[i]) if i < len(_VALUE_COLORS) else ("k", "0.3")


def _literal(text: str) -> str:
    """``text`` as matplotlib shows it literally: a ``$`` would start mathtext (a query named
    ``$x^$`` fails to draw); ``\\$`` is matplotlib's literal dollar."""
    return text.replace("$", r"\$")


def _figure(ncols: int = 1, width: float = 7.0, height: float = 3.6) -> tuple[Any, Any]:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "privmon report needs matplotlib for its plots: pip install 'privmon[report]'"
        ) from err
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def legend_outside(fig: Any, *, per_axes: bool = False) -> None:
    """The figure's legend outside every axes, clear of the data: one legend for the figure's
    lines below the axes (two columns when the labels are short), or, ``per_axes``, each axes'
    own legend to its right (panels whose lines differ); the constrained layout makes room."""
    if per_axes:
        for ax in fig.axes:
            if ax.get_legend_handles_labels()[0]:  # a legend without lines warns
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        return
    handles, labels = [], []
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        ncols = 2 if len(handles) > 1 and max(map(len, labels)) <= 30 else 1
        # "outside …" locations (under constrained layout) need matplotlib 3.7: the extras' floor
        fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=7)


def png(fig: Any) -> str:
    """A matplotlib Figure as base64 PNG, for an ``<img>`` of the page."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _advantage_title(checks: Checks, q: str) -> str:
    """What the advantage chart of ``q`` draws: the ceilings only when an accountant gave them,
    the stopping threshold on the chart of the query early stopping watches."""
    n_ceilings = sum(checks.has(tag) for tag, *_ in _CEILINGS)
    against = f" vs DP ceiling{'s' if n_ceilings > 1 else ''}" if n_ceilings else ""
    if _watched_threshold(checks, q) is None:
        return f"{q}: advantage estimate and certified lower bound{against}"
    return f"{q}: advantage estimate, certified lower bound and stopping threshold{against}"


def _watched_threshold(checks: Checks, q: str) -> float | None:
    """Early stopping's threshold when it watches a figure of query ``q``, else None."""
    records = [r for r in checks.records if tags.STOPPING_THRESHOLD in r["scalars"]]
    said: dict[str, Any] = next((r["stopping"] for r in reversed(records) if r.get("stopping")), {})
    parsed = tags.parse_advantage(said.get("tag", ""))
    if not records or parsed is None or parsed[0] != q:
        return None
    return float(records[-1]["scalars"][tags.STOPPING_THRESHOLD])


def advantage_figure(checks: Checks, q: str, floor: float | None) -> Any:
    """The matplotlib Figure of query ``q``'s advantage over the steps: each method's estimate
    and certified lower bound, the DP ceilings when recorded and the trivial floor |2p − 1| when
    above 0, each line in its own colour, on the fixed range [0, 1]."""
    fig, (ax,) = _figure()
    for m in checks.methods(q):
        value, lower = _colors(m)
        s, v = checks.series(tags.value(q, m))
        ax.plot(s, v, "-o", color=value, ms=3, label=f"{m}: estimate (value)")
        s, v = checks.series(tags.lower(q, m))
        ax.plot(s, v, "--", color=lower, label=f"{m}: certified lower bound")
    for tag, style, color, label in _CEILINGS:
        s, v = checks.series(tag)
        if len(s):
            ax.plot(s, v, style, color=color, label=label)
    if floor is not None and floor > 1e-6:
        ax.axhline(floor, color="0.6", lw=1, label="trivial floor |2p − 1|")
    _stopping_marks(ax, checks, q)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("training step")
    ax.set_ylabel("optimal membership advantage")
    ax.set_title(_literal(_advantage_title(checks, q)))
    ax.grid(alpha=0.3)
    legend_outside(fig)
    return fig


def _stopping_marks(ax: Any, checks: Checks, q: str) -> None:
    """On the chart of the query early stopping watches: its threshold, and the stop's step."""
    threshold = _watched_threshold(checks, q)
    if threshold is None:
        return
    ax.axhline(threshold, color="#e377c2", lw=1.5, label=f"stopping threshold {threshold:g}")
    stops = [r["step"] for r in checks.records if r["scalars"].get(tags.STOPPING_STOP, 0.0) >= 0.5]
    if stops:
        ax.axvline(stops[0], color="#e377c2", ls=":", lw=1.5, label=f"early stop, step {stops[0]}")


def plot_advantage(checks: Checks, q: str, floor: float | None) -> tuple[str, str]:
    """The advantage chart of ``q`` (:func:`advantage_figure`) as base64 PNG, and its title."""
    return png(advantage_figure(checks, q, floor)), _advantage_title(checks, q)


def _epsilon_axes(fig: Any, ax: Any, title: str) -> None:
    """The ε chart's axes: ε from 0 over the training steps, the legend outside."""
    ax.set_ylim(bottom=0.0)
    ax.set_xlabel("training step")
    ax.set_ylabel("ε")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    legend_outside(fig)


def plot_epsilon(checks: Checks) -> str:
    """The ε chart (accountant, audited lower bounds) as base64 PNG."""
    fig, (ax,) = _figure()
    s, v = checks.series(tags.EPSILON)
    ax.plot(s, v, "-", color="k", lw=2, label="ε (accountant)")
    for q in checks.queries():
        for m in checks.methods(q):
            s, v = checks.series(tags.epsilon_lower_bound(q, m))
            ax.plot(s, v, "--o", ms=3, label=_literal(f"ε lower bound ({q}, {m})"))
    for m in checks.canary_methods():
        s, v = checks.series(tags.canary_epsilon(m))
        ax.plot(s, v, "-s", ms=4, lw=1.5, label=f"ε lower bound (one-run canary audit, {m})")
    _epsilon_axes(fig, ax, "ε: accountant vs audited lower bounds")
    return png(fig)


def _operating_points(scalars: dict[str, float], q: str) -> list[tuple[float, float]]:
    pts = []
    for tag, v in scalars.items():
        point = tags.parse_operating_point(tag)
        if point is not None and point[0] == q:
            try:
                pts.append((float(point[1]), float(v)))
            except ValueError:
                continue
    return sorted(pts)


def plot_roc(checks: Checks, q: str) -> tuple[str, str]:
    """The ROC image (:func:`roc_figure`) as base64 PNG, and its caption."""
    fig, caption = roc_figure(checks, q)
    return png(fig), caption


def roc_figure(checks: Checks, q: str) -> tuple[Any, str]:
    """The matplotlib Figure of query ``q``'s ROC at the last check (symlog false positive
    rates, the legend below the axes), and its caption."""
    last = checks.records[-1]
    pts = _operating_points(last["scalars"], q)
    auc = last["scalars"].get(tags.auc(q), math.nan)
    fig, (ax,) = _figure(width=5.0, height=4.2)
    diag = np.concatenate([[0.0], np.logspace(-4, 0, 200)])  # y = x, drawn on the symlog axis
    ax.plot(diag, diag, ":", color="0.5", label="chance")
    curve = checks.roc.get(q)
    if curve is not None:
        step, fpr, tpr = curve
        ax.plot(fpr, tpr, "-", color="#1f77b4", label=f"Bayes-rule attack (posterior), step {step}")
        caption = (
            f"ROC of the histogram Bayes-rule attack at step {step}, from the monitor's membership "
            "PR curve: the per-record posterior is fitted on the records it scores, so this curve "
            "is in-sample and optimistic, like the plug-in W_N."
        )
    else:
        caption = (
            "Only scalars were recorded, so the full ROC curve is not available (it is rebuilt "
            "from TensorBoard's membership PR curve when the event files sit beside the JSON "
            "lines): the points are the threshold attack's TPR at the target FPRs."
        )
    if pts:
        x, y = zip(*pts, strict=True)
        ax.plot(
            x,
            y,
            "o",
            color="#d62728",
            ms=6,
            label=f"threshold attack on the score: TPR@FPR (AUC {fmt(auc, 3)})",
        )
        if curve is not None:
            caption += (
                f" Red points: the threshold attack on the raw score at the last check "
                f"(AUC {fmt(auc, 3)})."
            )
    if curve is None and not pts:
        caption = "No ROC figures were recorded for this query (vector query)."
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("false positive rate (symlog)")
    ax.set_ylabel("true positive rate")
    ax.set_title(_literal(f"{q}: ROC at step {last['step']}"))
    ax.grid(alpha=0.3)
    legend_outside(fig)
    return fig, caption


def _risk_tags(
    checks: Checks, q: str
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """The risk figures of ``q`` as (tag, kind, level): the quantiles and max, by level (max
    last), and the counts above each risk level, by level."""
    quant: set[tuple[str, str, str]] = set()
    counts: set[tuple[str, str, str]] = set()
    for r in checks.records:
        for tag in r["scalars"]:
            parsed = tags.parse_risk(tag)
            if parsed is not None and parsed[0] == q:
                (counts if parsed[1] == "above" else quant).add((tag, *parsed[1:]))

    def key(figure: tuple[str, str, str]) -> float:
        return 1e9 if figure[1] == "max" else float(figure[2])

    return sorted(quant, key=key), sorted(counts, key=key)


def plot_risk(checks: Checks, q: str) -> str | None:
    """The per-record risk chart (:func:`risk_figure`) as base64 PNG (None: no risk figures)."""
    fig = risk_figure(checks, q)
    return None if fig is None else png(fig)


def risk_figure(checks: Checks, q: str) -> Any:
    """The matplotlib Figure of query ``q``'s per-record risk over the steps: its quantiles
    and the member records above each level, side by side (None: no risk figures)."""
    quant, counts = _risk_tags(checks, q)
    if not quant and not counts:
        return None
    fig, (a1, a2) = _figure(ncols=2, width=9.0, height=3.4)
    for tag, kind, level in quant:
        s, v = checks.series(tag)
        label = "max" if kind == "max" else f"{int(level)}th percentile"
        a1.plot(s, v, "-o", ms=3, label=label)
    a1.set_ylim(-0.02, 1.02)
    a1.set_xlabel("training step")
    a1.set_ylabel("|f_p| of member records")
    a1.set_title(_literal(f"{q}: per-record risk quantiles"))
    a1.grid(alpha=0.3)
    for tag, _, level in counts:
        s, v = checks.series(tag)
        a2.plot(s, v, "-o", ms=3, label=f"risk > {level}")
    a2.set_xlabel("training step")
    a2.set_ylabel("member records")
    a2.set_title(_literal(f"{q}: records above each risk level"))
    a2.grid(alpha=0.3)
    legend_outside(fig, per_axes=True)
    return fig


def _run_style(runs: Sequence[Checks]) -> list[tuple[str, str]]:
    """(colour, label) of each run of a comparison: the same on every chart."""
    return [
        (_RUN_COLORS[i % len(_RUN_COLORS)], _literal(checks.label)) for i, checks in enumerate(runs)
    ]


def comparison_figure(runs: Sequence[Checks], q: str, m: str) -> Any:
    """The matplotlib Figure of query ``q``'s advantage by method ``m`` in every run: the
    estimate (left) and the certified lower bound (right), one line per run in the run's colour
    on both, the legend below; a run without the figure draws nothing."""
    fig, (left, right) = _figure(ncols=2, width=9.0, height=4.0)
    for (color, label), checks in zip(_run_style(runs), runs, strict=True):
        steps, values = checks.series(tags.value(q, m))
        if len(steps):
            left.plot(steps, values, "-o", ms=3, color=color, label=label)
        steps, values = checks.series(tags.lower(q, m))
        if len(steps):
            right.plot(steps, values, "--o", ms=3, color=color, label=label)
    for ax, what in ((left, "estimate (value)"), (right, "certified lower bound")):
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("training step")
        ax.set_ylabel("optimal membership advantage")
        ax.set_title(_literal(f"{q} ({m}): {what}"), fontsize=10)
        ax.grid(alpha=0.3)
    legend_outside(fig)
    return fig


def epsilon_comparison_figure(runs: Sequence[Checks]) -> Any:
    """The matplotlib Figure of every run's ε over the steps: the accountant's (solid) and the
    one-run canary audit's lower bounds (dotted), in the run's colour, the legend below."""
    fig, (ax,) = _figure(height=4.0)
    for (color, label), checks in zip(_run_style(runs), runs, strict=True):
        steps, values = checks.series(tags.EPSILON)
        if len(steps):
            ax.plot(steps, values, "-", color=color, lw=2, label=f"{label}: accountant")
        for method in checks.canary_methods():
            steps, values = checks.series(tags.canary_epsilon(method))
            ax.plot(steps, values, ":s", ms=3, color=color, label=f"{label}: canaries, {method}")
    _epsilon_axes(fig, ax, "ε over training: the runs side by side")
    return fig
