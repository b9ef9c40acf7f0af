"""The figures' names: every ``privacy/...`` tag is built and parsed here, and nowhere else.

A check's figures are a flat ``{tag: float}`` dict (:attr:`privmon.report.Report.scalars`).
Per query and method: ``privacy/<query>/<method>/<field>`` (the estimate's fields, and the ε its
certified lower bound implies); per query: ``privacy/<query>/<figure>`` with the analysis' own
names for its figures (:meth:`privmon.estimators.analysis.QueryResult.scalars`: ``auc``,
``tpr@fpr=…``, ``risk/q50``, ``n_dropped`` …) and ``detectable``; per check: ε, the DP ceilings,
the δ the check certifies at, ``dp_violation``, the canaries' one-run bounds
(``privacy/canaries/…``; several canaries objects: :func:`canary_source`) and the DP mechanism
checks' outcomes (``privacy/dp_checks/<check>/fired``, ``…/<check>/<test>/p_value``) with the
level their statistical tests fire below (``privacy/dp_alarm_delta``); early
stopping's decision (``privacy/stopping/…``). The sinks' own names (TensorBoard's run-id,
DP-causes, stopping and most-exposed texts, histograms, PR curves, the named series of its
first charts; MLflow's run tags; W&B's step axis, run keys, ROC and ε charts) are here too. The
method list is the estimators' registry (:func:`privmon.estimators.methods.registered_methods`).

Examples:
    >>> from privmon.report import tags
    >>> tags.lower("loss", "histogram"), tags.tpr_at_fpr("loss", 0.01)
    ('privacy/loss/histogram/lower', 'privacy/loss/tpr@fpr=0.01')
    >>> tags.parse_advantage("privacy/loss/kde/value")
    ('loss', 'kde', 'value')
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping

from privmon.estimators.methods import registered_methods

# fmt: off
__all__ = [
    "ADVANTAGE_FIELDS", "CANARY_COUNT", "CEILINGS", "CEILING_EPS_DELTA", "CEILING_TANH",
    "CERTIFY_DELTA", "DETAIL_CATEGORY", "DP_ALARM_DELTA", "DP_CAUSES_EVENT_TAG",
    "DP_CAUSES_TEXT_TAG", "DP_CHECKS_CATEGORY", "DP_VIOLATION", "EPSILON", "EPSILON_CHART",
    "ESTIMATE_FIGURES", "GLANCE_EPSILON", "LAYOUT_CATEGORY", "MLFLOW_LT_IQR_TAG",
    "MLFLOW_RUN_ID_TAG", "MLFLOW_STOPPING_TAG", "PLUGIN_FIELDS", "RUN_ID_EVENT_TAG",
    "RUN_ID_TEXT_TAG", "SERIES", "SERIES_ACCOUNTANT", "SERIES_BLACK_BOX", "SERIES_CANARIES",
    "SERIES_CEILING", "SERIES_ESTIMATE", "SERIES_LOWER", "SERIES_THRESHOLD", "STOPPING_EVENT_TAG",
    "STOPPING_FIGURE", "STOPPING_HIGHEST", "STOPPING_HIGHEST_STEP", "STOPPING_OUTCOME_KEY",
    "STOPPING_RESTORED_STEP", "STOPPING_STOP", "STOPPING_STOPPED", "STOPPING_STOPPED_STEP",
    "STOPPING_TEXT_TAG", "STOPPING_THRESHOLD", "STOPPING_WAIT", "TRAINING_LOOP", "WANDB_FIGURES",
    "WANDB_RUN_ID_KEY", "WANDB_STEP", "WANDB_STOPPING_KEY", "auc", "band_edges", "canary_count",
    "canary_epsilon", "canary_source", "ceilings", "console_advantage", "console_lower",
    "detectable", "dp_check_fired", "dp_check_p_value", "epsilon_lower_bound", "estimate",
    "fired_checks", "glance_advantage", "is_advantage_estimate", "is_debiased_estimate",
    "is_epsilon_lower_bound", "is_privacy_figure", "loss_tnr", "lower", "member_risk",
    "membership_pr", "most_exposed", "most_exposed_event", "most_vulnerable", "n_dropped",
    "out_of_range", "parse_advantage", "parse_canary", "parse_dp_check", "parse_loss_tnr",
    "parse_membership_pr", "parse_operating_point", "parse_risk", "plugin", "plugin_upper",
    "query_figure", "roc", "tpr_at_fpr", "valid_range", "value", "watched_tags",
]
# fmt: on

_PREFIX = "privacy/"

# -- per check --------------------------------------------------------------------------------
EPSILON = "privacy/epsilon"
"""ε read from the accountant at the monitor's δ."""
CERTIFY_DELTA = "privacy/certify_delta"
"""The δ each certified figure of the check holds at (its share of ``interval_delta``)."""
DP_ALARM_DELTA = "privacy/dp_alarm_delta"
"""The level each statistical test of the DP mechanism checks fires below at the check (its
share of the monitor's ``dp_alarm_delta``); written when a test is statistical."""
DP_VIOLATION = "privacy/dp_violation"
"""1.0 when the check found a DP violation (a certified figure above what the accountant's ε
allows, or a DP mechanism check that fired), else 0.0."""
CEILING_TANH = "privacy/ceiling/tanh"
"""The ε-DP ceiling on the advantage (:func:`privmon.tanh_bound` at δ = 0)."""
CEILING_EPS_DELTA = "privacy/ceiling/eps_delta"
"""The (ε, δ)-DP ceiling on the advantage."""
CEILINGS = (CEILING_TANH, CEILING_EPS_DELTA)
"""Both ceilings, in the order a check reports them."""
_CEILING_PREFIX = "privacy/ceiling/"
CANARY_COUNT = "privacy/canaries/n_canaries"
"""How many canaries the one-run audit scored (one canaries object; several:
:func:`canary_count`)."""
_DP_CHECKS = "privacy/dp_checks/"

# -- per query and method -----------------------------------------------------------------------
ESTIMATE_FIGURES = ("value", "lower", "lower_check", "plugin", "plugin_upper")
"""The fields of a method's advantage estimate a check reports, in the analysis' order."""
ADVANTAGE_FIELDS = (*ESTIMATE_FIGURES, "epsilon_lower_bound")
"""Every per-method field: the estimate's, and the ε its certified lower bound implies."""
PLUGIN_FIELDS = ("plugin", "plugin_upper", "upper")
"""The paper's plug-in figures (biased up, no bound on the advantage); ``upper`` is refused
too, as it reads like one."""
_ADVANTAGE_ESTIMATES = ("value", "lower", "lower_check")  # estimates of the advantage itself

# -- the sinks' own names ---------------------------------------------------------------------
RUN_ID_TEXT_TAG = "privacy/run_id"
"""TensorBoard's text (``add_text``) of the run's id, before each check's figures."""
RUN_ID_EVENT_TAG = RUN_ID_TEXT_TAG + "/text_summary"
"""What TensorBoard stores :data:`RUN_ID_TEXT_TAG` under in the event files."""
MLFLOW_RUN_ID_TAG = "privmon.run_id"
"""The MLflow run tag that names the privmon run logging into it."""
DP_CAUSES_TEXT_TAG = "privacy/dp_causes"
"""TensorBoard's text of a DP violation's causes (:attr:`~privmon.report.Report.dp_causes`)."""
DP_CAUSES_EVENT_TAG = DP_CAUSES_TEXT_TAG + "/text_summary"
"""What TensorBoard stores :data:`DP_CAUSES_TEXT_TAG` under in the event files."""
WANDB_STEP = "privacy/step"
"""The step axis a :class:`~privmon.sinks.WandbSink` logs beside each check's figures (the
check's training step), and draws every ``privacy/`` figure against (``define_metric``)."""
WANDB_FIGURES = "privacy/*"
"""The W&B ``define_metric`` pattern of every figure drawn against :data:`WANDB_STEP`."""
WANDB_RUN_ID_KEY = "privmon_run_id"
"""The W&B run's config key that names the privmon run logging into it."""
EPSILON_CHART = "privacy/epsilon_chart"
"""The W&B line chart of ε over the checks: the accountant's and every ε lower bound."""
LAYOUT_CATEGORY = "privacy"
"""The Custom Scalars category of the first charts (each query's advantage, ε)."""
DP_CHECKS_CATEGORY = "privacy: DP mechanism checks"
"""The Custom Scalars category of the DP mechanism checks (second)."""
DETAIL_CATEGORY = "privacy: every figure, by query and method"
"""The Custom Scalars category of every figure by query and method (last)."""

# -- early stopping -------------------------------------------------------------------------------
STOPPING_THRESHOLD = "privacy/stopping/threshold"
"""The budget: early stopping's threshold, at each check it decides."""
STOPPING_FIGURE = "privacy/stopping/figure"
"""The figure early stopping watches, at this check (its tag: the decision's)."""
STOPPING_STOP = "privacy/stopping/stop"
"""1.0 from the check that stopped training on, else 0.0."""
STOPPING_WAIT = "privacy/stopping/wait"
"""Consecutive checks above the budget so far (a stop once it exceeds the patience)."""
STOPPING_STOPPED = "privacy/stopping/stopped"
"""The run's outcome, logged once at its end: 1.0 when the budget stopped it, else 0.0."""
STOPPING_STOPPED_STEP = "privacy/stopping/stopped_step"
"""The run's outcome: the step of the check that stopped it (NaN: none did)."""
STOPPING_HIGHEST = "privacy/stopping/highest"
"""The run's outcome: the highest value the watched figure reached."""
STOPPING_HIGHEST_STEP = "privacy/stopping/highest_step"
"""The run's outcome: the step of that highest value."""
STOPPING_RESTORED_STEP = "privacy/stopping/restored_step"
"""The run's outcome: the step whose weights an adapter restored (NaN: none)."""
STOPPING_TEXT_TAG = "privacy/stopping"
"""TensorBoard's text of each decision (and why) and, at the run's end, of its outcome."""
STOPPING_EVENT_TAG = STOPPING_TEXT_TAG + "/text_summary"
"""What TensorBoard stores :data:`STOPPING_TEXT_TAG` under in the event files."""
STOPPING_OUTCOME_KEY = "stopping_outcome"
"""The key of a JSON line holding the run's early-stopping outcome (not a check)."""
MLFLOW_LT_IQR_TAG = "privmon.lt_iqr"
"""The MLflow run tags of the last check's most vulnerable records: ``privmon.lt_iqr.<source>``."""
MLFLOW_STOPPING_TAG = "privmon.stopping"
"""MLflow run tags' prefix: ``.budget``, ``.decision`` (the last check's), ``.outcome``."""
WANDB_STOPPING_KEY = "privmon_stopping"
"""The W&B config key of the budget, and the summary keys' prefix (decision, outcome)."""

# -- TensorBoard's first charts: one named series a run folder, on one tag ------------------------
SERIES_ESTIMATE = "advantage estimate"
"""The named series of a query's debiased advantage estimate (``…/value``)."""
SERIES_LOWER = "certified lower bound"
"""The named series of its lower bound certified over the run (``…/lower``)."""
SERIES_CEILING = "(ε, δ)-DP ceiling"
"""The named series of the (ε, δ)-DP ceiling on the advantage."""
SERIES_THRESHOLD = "stopping threshold"
"""The named series of early stopping's threshold, on the chart of its figure."""
SERIES_ACCOUNTANT = "ε (accountant)"
"""The named series of ε read from the accountant."""
SERIES_CANARIES = "ε lower bound (one-run canary audit)"
"""The named series of the largest one-run canary audit's ε lower bound."""
SERIES_BLACK_BOX = "ε lower bound (black-box attacks)"
"""The named series of the largest black-box ε lower bound (over queries, methods)."""
SERIES = (SERIES_ESTIMATE, SERIES_LOWER, SERIES_CEILING, SERIES_THRESHOLD, SERIES_ACCOUNTANT,
          SERIES_CANARIES, SERIES_BLACK_BOX)  # fmt: skip
"""The named series of TensorBoard's first charts, each a run of its own (a folder of its name in
the log directory: its own colour, named in the runs list) holding only the first charts' tags,
which a reader of the checks skips (:func:`is_privacy_figure`)."""
_GLANCE = "privacy/1 "  # TensorBoard sorts a digit before any letter: these cards come first
GLANCE_EPSILON = "privacy/2 epsilon: accountant, one-run canary audit, black-box lower bound"
"""The first ε chart's tag (its card's title): the accountant's ε and the largest ε lower bounds
of the canaries and of the black-box attacks (all hold over the run: so does the largest)."""


def glance_advantage(query: str, method: str) -> str:
    """The tag (its card's title) of ``query``'s first chart, the membership advantage by
    ``method``: estimate, certified lower bound, DP ceiling, stopping threshold. No parentheses
    (brackets instead): the Custom Scalars tab reads a series' run from its last ``(…)``.

    Examples:
        >>> from privmon.report import tags
        >>> tags.glance_advantage("loss", "histogram")
        'privacy/1 loss: membership advantage, histogram'
    """
    return f"{_GLANCE}{_bare(query)}: membership advantage, {method}"


def _bare(query: str) -> str:
    return query.replace("(", "[").replace(")", "]")


def band_edges(query: str, method: str) -> tuple[str, str]:
    """The tags of the lower and upper edges of each series' band on ``query``'s first chart
    (the Custom Scalars tab draws them): the estimate's band holds the advantages the run has
    not ruled out, from its certified lower bound up to the (ε, δ)-DP ceiling, or to 1 without
    an accountant; every other series' band is its line. In a group of their own, after every
    ``privacy/`` card.

    Examples:
        >>> from privmon.report import tags
        >>> tags.band_edges("loss", "kde")[1]
        'privacy band/loss, kde: upper edge'
    """
    where = f"privacy band/{_bare(query)}, {method}"
    return f"{where}: lower edge", f"{where}: upper edge"


_CANARY = re.compile(r"^privacy/canaries/(.+)/epsilon_lower_bound$")
_DP_CHECK = re.compile(r"^privacy/dp_checks/([^/]+)/(?:fired|([^/]+)/p_value)$")
_SOURCE_KINDS = {  # the name of a canaries object, by its class, when it has no ``name``
    "GradientCanaries": "gradient",
    "RecordCanaries": "records",
    "InputCanaries": "input",
    "MechanismChecks": "mechanism",
}
_RISK = re.compile(r"^privacy/(.+)/risk/(q\d+|max|n_above_[0-9.]+)$")
_ROC = re.compile(r"^privacy/(.+)/(auc|tpr@fpr=.+|accuracy_at_median)$")
_PR = re.compile(r"^privacy/(.+)/membership_pr$")
_TPR_AT = "tpr@fpr="


# -- building -----------------------------------------------------------------------------------
def query_figure(query: str, figure: str) -> str:
    """The tag of one of the analysis' figures of ``query`` (``figure``: its name relative to
    the query, as :meth:`~privmon.estimators.analysis.QueryResult.scalars` gives it)."""
    return f"privacy/{query}/{figure}"


def _advantage(query: str, method: str, field: str) -> str:
    return f"privacy/{query}/{method}/{field}"


def value(query: str, method: str) -> str:
    """The debiased advantage estimate of ``query`` by ``method``."""
    return _advantage(query, method, "value")


def lower(query: str, method: str) -> str:
    """Its lower bound certified over the whole run."""
    return _advantage(query, method, "lower")


def plugin(query: str, method: str) -> str:
    """The paper's plug-in W_N / U_N."""
    return _advantage(query, method, "plugin")


def plugin_upper(query: str, method: str) -> str:
    """The plug-in plus McDiarmid's half-width."""
    return _advantage(query, method, "plugin_upper")


def estimate(query: str, method: str, field: str) -> str:
    """The field ``field`` (one of :data:`ESTIMATE_FIGURES`) of ``query``'s estimate by
    ``method``."""
    return _advantage(query, method, field)


def epsilon_lower_bound(query: str, method: str) -> str:
    """The ε implied by the certified lower bound of ``query`` by ``method``."""
    return _advantage(query, method, "epsilon_lower_bound")


def auc(query: str) -> str:
    """The threshold attack's AUC on ``query``'s 1-D scores."""
    return f"privacy/{query}/auc"


def tpr_at_fpr(query: str, fpr: float) -> str:
    """The threshold attack's TPR at false-positive rate ``fpr``."""
    return f"privacy/{query}/{_TPR_AT}{fpr!r}"


def n_dropped(query: str) -> str:
    """How many records with NaN / inf scores the analysis dropped."""
    return f"privacy/{query}/n_dropped"


def detectable(query: str) -> str:
    """The smallest advantage the check certifies for ``query`` in half the runs."""
    return f"privacy/{query}/detectable"


def member_risk(query: str) -> str:
    """TensorBoard histogram of ``query``'s per-record member risks."""
    return f"privacy/{query}/member_risk"


def membership_pr(query: str) -> str:
    """TensorBoard PR curve of ``query``'s per-record membership posteriors."""
    return f"privacy/{query}/membership_pr"


def most_exposed(query: str) -> str:
    """The table of ``query``'s most exposed member records at a check (their indices, risks
    and how often each was among the most exposed): a TensorBoard text summary, a W&B table.

    Examples:
        >>> from privmon.report import tags
        >>> tags.most_exposed("loss")
        'privacy/loss/most_exposed'
    """
    return f"privacy/{query}/most_exposed"


TRAINING_LOOP = "training_loop"
"""The source of the loss traces the training loop fed (``PrivacyMonitor.record_losses``)."""
_LOSS_TNR = re.compile(r"^privacy/(.+)/loss_tnr@fpr=(.+)$")


def loss_tnr(query: str, fpr: float) -> str:
    """LOSS TNR of ``query``'s losses: an estimate (no confidence) of LiRA's TPR at ``fpr``."""
    return f"privacy/{query}/loss_tnr@fpr={fpr!r}"


def parse_loss_tnr(tag: str) -> tuple[str, str] | None:
    """(query, FPR as written) of a :func:`loss_tnr` figure, else None."""
    m = _LOSS_TNR.match(tag)
    return None if m is None else (m.group(1), m.group(2))


def most_vulnerable(source: str) -> str:
    """The table (TensorBoard text, W&B table) of the records most vulnerable by LT-IQR."""
    return f"privacy/{source}/lt_iqr/most_vulnerable"


def most_exposed_event(query: str) -> str:
    """What TensorBoard stores :func:`most_exposed` under in the event files.

    Examples:
        >>> from privmon.report import tags
        >>> tags.most_exposed_event("loss")
        'privacy/loss/most_exposed/text_summary'
    """
    return most_exposed(query) + "/text_summary"


def roc(query: str) -> str:
    """The W&B line chart of the ROC of ``query``'s membership posterior at a check.

    Examples:
        >>> from privmon.report import tags
        >>> tags.roc("loss")
        'privacy/loss/roc'
    """
    return f"privacy/{query}/roc"


def console_advantage(query: str) -> str:
    """The Hugging Face console's advantage of ``query`` (its best-certified method)."""
    return f"privacy/{query}/adv"


def console_lower(query: str) -> str:
    """The Hugging Face console's certified lower bound of ``query``."""
    return f"privacy/{query}/lower"


def canary_source(canaries: object) -> str:
    """The name of a canaries object among several given to one monitor: its ``name``
    attribute when it is a string, else its kind by class (``GradientCanaries``: ``gradient``,
    ``RecordCanaries``: ``records``, ``InputCanaries``: ``input``, ``MechanismChecks``:
    ``mechanism``; another class: its name in lower case). The tags of a monitor with one
    canaries object carrying ``scores()`` have no such name (``privacy/canaries/fdp/…``); with
    several, each object's bounds are ``privacy/canaries/<name>/<method>/…`` (the monitor
    refuses two objects of one name, and a name holding ``/``).

    Examples:
        >>> from privmon.report import tags
        >>> class RecordCanaries: ...
        >>> tags.canary_source(RecordCanaries()), tags.canary_epsilon("fdp", "records")
        ('records', 'privacy/canaries/records/fdp/epsilon_lower_bound')
    """
    name = getattr(canaries, "name", None)
    if isinstance(name, str):
        return name
    kind = type(canaries).__name__
    return _SOURCE_KINDS.get(kind, kind.lower())


def canary_epsilon(method: str, source: str | None = None) -> str:
    """The one-run canary audit's ε lower bound by ``method`` (of the canaries named ``source``
    when the monitor has several)."""
    where = "" if source is None else f"{source}/"
    return f"privacy/canaries/{where}{method}/epsilon_lower_bound"


def canary_count(source: str | None = None) -> str:
    """How many canaries the one-run audit scored (of the canaries named ``source`` when the
    monitor has several: :data:`CANARY_COUNT` without).

    Examples:
        >>> from privmon.report import tags
        >>> tags.canary_count("records")
        'privacy/canaries/records/n_canaries'
    """
    return CANARY_COUNT if source is None else f"privacy/canaries/{source}/n_canaries"


def dp_check_fired(check: str) -> str:
    """1.0 when the DP mechanism check ``check`` (e.g. ``clipping``) fired at the check: one
    of its deterministic tests failed, or a statistical one's p-value fell below the check's
    per-figure δ; else 0.0.

    Examples:
        >>> from privmon.report import tags
        >>> tags.dp_check_fired("clipping")
        'privacy/dp_checks/clipping/fired'
    """
    return f"{_DP_CHECKS}{check}/fired"


def dp_check_p_value(check: str, test: str) -> str:
    """The p-value of the statistical test ``test`` of the DP mechanism check ``check`` (e.g.
    ``sampling``, ``dispersion``): small when the mechanism is not the one accounted.

    Examples:
        >>> from privmon.report import tags
        >>> tags.dp_check_p_value("sampling", "dispersion")
        'privacy/dp_checks/sampling/dispersion/p_value'
    """
    return f"{_DP_CHECKS}{check}/{test}/p_value"


def watched_tags(metric: str, use: str) -> tuple[str, str]:
    """The tags early stopping on ``metric`` reads, first found first: the full tag (``metric``
    when it is one, else ``privacy/<metric>/<use>``), then ``privacy/<metric>``."""
    full = metric if metric.startswith(_PREFIX) else f"privacy/{metric}/{use}"
    return full, f"privacy/{metric}"


# -- reading ------------------------------------------------------------------------------------
def is_privacy_figure(tag: str) -> bool:
    """Whether a TensorBoard scalar is one of the check's figures (not a named series of the
    first charts, :data:`SERIES`)."""
    return tag.startswith(_PREFIX) and not tag.startswith((_GLANCE, GLANCE_EPSILON))


def is_advantage_estimate(tag: str) -> bool:
    """Whether ``tag`` names an estimate of an advantage (``value``, ``lower``,
    ``lower_check``): a figure never below the trivial floor |2p − 1|."""
    return tag.rsplit("/", 1)[-1] in _ADVANTAGE_ESTIMATES


def is_debiased_estimate(tag: str) -> bool:
    """Whether ``tag`` names a method's debiased advantage estimate (``value``): an estimate,
    not a bound, that moves with the audit's noise.

    Examples:
        >>> from privmon.report import tags
        >>> tags.is_debiased_estimate(tags.value("loss", "histogram")), tags.is_debiased_estimate(
        ...     tags.lower("loss", "histogram"))
        (True, False)
    """
    return tag.rsplit("/", 1)[-1] == "value"


def valid_range(tag: str) -> tuple[float, float, str] | None:
    """(low, high, what) of the closed range a computed figure lies in (NaN: not computed), or
    None when privmon does not bound it: an advantage estimate ``[-1, 1]`` (privmon clips them
    into [|2p − 1|, 1]), a DP ceiling ``[0, 1]``, an ε (the accountant's, or a lower bound)
    ``[0, inf]``, a DP mechanism check's p-value or fired flag ``[0, 1]``.

    Examples:
        >>> from privmon.report import tags
        >>> tags.valid_range("privacy/loss/histogram/lower")
        (-1.0, 1.0, 'an advantage')
        >>> tags.valid_range("privacy/loss/auc") is None
        True
    """
    if tag in CEILINGS:
        return 0.0, 1.0, "a DP ceiling on the advantage"
    if is_advantage_estimate(tag):
        return -1.0, 1.0, "an advantage"
    if tag == EPSILON or is_epsilon_lower_bound(tag):
        return 0.0, math.inf, "an ε"
    if parse_dp_check(tag) is not None:
        return 0.0, 1.0, "a p-value or a flag"
    if parse_loss_tnr(tag) is not None:
        return 0.0, 1.0, "a LOSS TNR estimate"
    return None


def out_of_range(tag: str, value: float) -> str | None:
    """The range ``value`` should be in, as the figure ``tag`` (:func:`valid_range`), when it is
    not; None when it is in range, not computed (NaN) or unbounded. The readers add where they
    read it and the value as written.

    Examples:
        >>> from privmon.report import tags
        >>> tags.out_of_range("privacy/loss/histogram/lower", 7.0)
        'must be in [-1, 1] (an advantage)'
        >>> tags.out_of_range("privacy/loss/histogram/lower", 0.2) is None
        True
    """
    bounds = valid_range(tag)
    if bounds is None or math.isnan(value) or bounds[0] <= value <= bounds[1]:
        return None
    low, high, what = bounds
    return f"must be in [{low:g}, {high:g}] ({what})"


def is_epsilon_lower_bound(tag: str) -> bool:
    """Whether ``tag`` is an ε lower bound (a query's method's, or the canaries')."""
    return tag.endswith("epsilon_lower_bound")


def ceilings(scalars: Mapping[str, float]) -> dict[str, float]:
    """The DP ceilings among ``scalars``, by kind (``tanh``, ``eps_delta``), in their order."""
    return {
        tag.removeprefix(_CEILING_PREFIX): v
        for tag, v in scalars.items()
        if tag.startswith(_CEILING_PREFIX)
    }


@functools.lru_cache(maxsize=8)
def _advantage_pattern(methods: tuple[str, ...]) -> re.Pattern[str]:
    names = "|".join(re.escape(m) for m in methods)
    return re.compile(rf"^privacy/(.+)/({names})/({'|'.join(ADVANTAGE_FIELDS)})$")


def parse_advantage(tag: str) -> tuple[str, str, str] | None:
    """(query, method, field) of a per-method figure of a registered estimator method
    (:func:`~privmon.estimators.methods.registered_methods`), else None."""
    m = _advantage_pattern(registered_methods()).match(tag)
    return None if m is None else (m.group(1), m.group(2), m.group(3))


def parse_canary(tag: str) -> str | None:
    """The method of a canary ε lower bound, else None."""
    m = _CANARY.match(tag)
    return None if m is None else m.group(1)


def parse_dp_check(tag: str) -> tuple[str, str | None] | None:
    """(check, None) of a DP mechanism check's fired flag, (check, test) of one of its p-values,
    else None.

    Examples:
        >>> from privmon.report import tags
        >>> tags.parse_dp_check(tags.dp_check_p_value("noise", "variance"))
        ('noise', 'variance')
        >>> tags.parse_dp_check(tags.dp_check_fired("ledger"))
        ('ledger', None)
        >>> tags.parse_dp_check(tags.EPSILON) is None
        True
    """
    m = _DP_CHECK.match(tag)
    return None if m is None else (m.group(1), m.group(2))


def fired_checks(scalars: Mapping[str, float]) -> list[str]:
    """The DP mechanism checks whose fired flag (:func:`dp_check_fired`, 0/1) is set in a
    check's ``scalars``, in their order.

    Examples:
        >>> from privmon.report import tags
        >>> tags.fired_checks({tags.dp_check_fired("clipping"): 1.0,
        ...                    tags.dp_check_fired("noise"): 0.0,
        ...                    tags.dp_check_p_value("noise", "variance"): 0.3})
        ['clipping']
    """
    return [
        parsed[0]
        for tag, value in scalars.items()
        if (parsed := parse_dp_check(tag)) is not None and parsed[1] is None and value >= 0.5
    ]


def parse_risk(tag: str) -> tuple[str, str, str] | None:
    """(query, kind, level) of a per-record risk figure, else None: kind ``"quantile"`` (level
    the percentile, e.g. ``"50"``), ``"max"`` (level ``"max"``) or ``"above"`` (the members
    above a risk level, e.g. ``"0.5"``)."""
    m = _RISK.match(tag)
    if m is None:
        return None
    stat = m.group(2)
    if stat == "max":
        return m.group(1), "max", stat
    if stat.startswith("q"):
        return m.group(1), "quantile", stat[1:]
    return m.group(1), "above", stat.rsplit("_", 1)[1]


def parse_operating_point(tag: str) -> tuple[str, str] | None:
    """(query, false-positive rate as written) of a TPR-at-FPR figure, else None."""
    m = _ROC.match(tag)
    if m is None or not m.group(2).startswith(_TPR_AT):
        return None
    return m.group(1), m.group(2)[len(_TPR_AT) :]


def parse_membership_pr(tag: str) -> str | None:
    """The query of a membership PR curve, else None."""
    m = _PR.match(tag)
    return None if m is None else m.group(1)
