"""The figures' names have one owner, privmon.report.tags: every tag a check writes is built there
and parses back there, and no other module of the package writes a ``privacy/`` tag."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import privmon
from privmon.estimators.methods import METHODS
from privmon.queries import CallableQuery
from privmon.report import tags

ROOT = pathlib.Path(privmon.__file__).parent


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_no_module_but_the_tag_owner_writes_a_privacy_tag():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "report" / "tags.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and "privacy/" in node.value
                and id(node) not in docstrings
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert found == []


def _report(**kwargs):
    rng = np.random.default_rng(0)
    members = [rng.normal(0.5, 1.0, 200)]
    nonmembers = [rng.normal(0.0, 1.0, 200)]
    query = CallableQuery(lambda b: b, name="q/x", higher_is_member=True)
    monitor = privmon.PrivacyMonitor(query, members, nonmembers, every_n_steps=1, **kwargs)
    return monitor.check(1)


def test_every_tag_a_check_writes_is_built_and_parsed_by_the_tag_owner():
    report = _report()
    scalars = report.scalars
    for method in METHODS:
        for field in tags.ESTIMATE_FIGURES:
            tag = tags.estimate("q/x", method, field)
            assert tag in scalars and tags.parse_advantage(tag) == ("q/x", method, field)
        assert tags.value("q/x", method) == tags.estimate("q/x", method, "value")
        assert tags.parse_advantage(tags.epsilon_lower_bound("q/x", method))[2] in (
            tags.ADVANTAGE_FIELDS
        )
    for tag in (tags.auc("q/x"), tags.detectable("q/x"), tags.n_dropped("q/x")):
        assert tag in scalars
    assert tags.parse_operating_point(tags.tpr_at_fpr("q/x", 0.01)) == ("q/x", "0.01")
    risks = [parsed for tag in scalars if (parsed := tags.parse_risk(tag)) is not None]
    assert ("q/x", "quantile", "50") in risks and ("q/x", "max", "max") in risks
    assert ("q/x", "above", "0.5") in risks
    assert tags.CERTIFY_DELTA in scalars and tags.EPSILON not in scalars
    assert all(tags.is_privacy_figure(tag) for tag in scalars)
    # the first charts' named series and their bands are TensorBoard's, not figures (#38)
    helpers = [tags.glance_advantage("q", "histogram"), tags.GLANCE_EPSILON]
    assert not any(tags.is_privacy_figure(tag) for tag in [*helpers, *tags.band_edges("q", "kde")])


def test_the_parsers_read_only_their_own_tags():
    assert tags.parse_advantage(tags.auc("q")) is None
    assert tags.parse_advantage("privacy/q/flow/value") is None  # not an estimator method
    assert tags.parse_canary(tags.canary_epsilon("fdp")) == "fdp"
    assert tags.parse_canary(tags.epsilon_lower_bound("q", "kde")) is None
    assert tags.parse_membership_pr(tags.membership_pr("a/b")) == "a/b"
    assert tags.parse_operating_point(tags.auc("q")) is None
    assert tags.parse_risk(tags.member_risk("q")) is None
    assert tags.ceilings({tags.CEILING_EPS_DELTA: 0.4, tags.EPSILON: 1.0}) == {"eps_delta": 0.4}
    assert tags.watched_tags("q/histogram", "lower") == (
        tags.lower("q", "histogram"),
        "privacy/q/histogram",
    )
    assert tags.watched_tags(tags.auc("q"), "lower")[0] == tags.auc("q")
    assert tags.is_advantage_estimate(tags.lower("q", "kde"))
    assert not tags.is_advantage_estimate(tags.plugin("q", "kde"))


@pytest.mark.parametrize(
    ("tag", "name"),
    [(tags.RUN_ID_TEXT_TAG, "privacy/run_id"), (tags.MLFLOW_RUN_ID_TAG, "privmon.run_id")],
)
def test_the_two_run_id_tags_keep_their_names(tag, name):
    assert tag == name
