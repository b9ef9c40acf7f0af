"""The most exposed members are the likeliest members: ranked by their membership posterior
P(member | q) = (1 + f_p)/2, never by |f_p|, which also ranks high a member the attack confidently
calls a non-member — in the analysis of one check, across checks in the monitor, in the CSV
export and in the sinks' tables."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

import privmon
from privmon.queries import CallableQuery
from privmon.report import Report
from privmon.sinks.exposed import ExposedRecords

# Two score values. At 0: 30 members, 90 non-members, so the posterior is 30/120 = 1/4 and
# |f_p| = 1/2 there; at 2: 120 members, 60 non-members, posterior 120/180 = 2/3, |f_p| = 1/3.
# The members at 0 (indices 0-29) have the highest |f_p|, yet the attack calls them non-members.
MEMBERS = np.r_[np.zeros(30), np.full(120, 2.0)]
NONMEMBERS = np.r_[np.zeros(90), np.full(60, 2.0)]
CALLED_NONMEMBERS = np.arange(30)


def _check_the_scores(result):
    post, risk = result.member_posterior, result.member_risk
    # the analytic posteriors, shrunk a little towards 1/2 by the pseudo-records and the folds
    assert post[CALLED_NONMEMBERS] == pytest.approx(0.25, abs=0.06)
    assert post[30:] == pytest.approx(2 / 3, abs=0.05)
    assert int(np.argmax(risk)) in CALLED_NONMEMBERS  # what ranking by |f_p| listed first
    return post


def test_one_checks_most_exposed_are_its_highest_posteriors():
    result = privmon.analyse(MEMBERS, NONMEMBERS, top_k=5)
    post = _check_the_scores(result)
    top = list(result.top_records)
    assert len(top) == 5 and not set(top) & set(CALLED_NONMEMBERS)
    assert result.top_risks == tuple(post[top].tolist())  # their posteriors, highest first
    assert list(result.top_risks) == sorted(result.top_risks, reverse=True)
    rest = np.delete(post, top)
    assert min(result.top_risks) >= rest.max()
    tied = int(np.sum(post == post[top[-1]])) - int(np.sum(post[top] == post[top[-1]]))
    assert result.top_tied == tied


def test_a_dropped_member_is_never_among_the_most_exposed():
    members = MEMBERS.copy()
    members[30:] = np.nan  # every likely member dropped: the called non-members are all left
    result = privmon.analyse(members, NONMEMBERS, top_k=5)
    assert set(result.top_records) <= set(CALLED_NONMEMBERS)
    assert np.isfinite(result.top_risks).all()


def test_the_monitor_ranks_members_across_checks_by_their_posterior(tmp_path):
    def records(scores, first_id):  # (score, a distinct id): no record is in both sets
        ids = torch.arange(first_id, first_id + len(scores), dtype=torch.float64)
        return [torch.stack([torch.as_tensor(scores), ids], dim=1)]

    monitor = privmon.PrivacyMonitor(
        CallableQuery(lambda b: b[:, 0], name="s"),
        records(MEMBERS, 0),
        records(NONMEMBERS, 1000),
        top_k=5,
        strict=True,
    )
    reports = [monitor.check(step) for step in (1, 2)]
    post = _check_the_scores(reports[-1].queries["s"])
    for report in reports:
        assert not set(report.queries["s"].top_records) & set(CALLED_NONMEMBERS)
    for by in ("max", "last", "mean"):
        top = monitor.top_records(5, by=by)
        assert not {i for i, _ in top} & set(CALLED_NONMEMBERS)
        assert [p for _, p in top] == pytest.approx(post[[i for i, _ in top]].tolist())
        assert min(p for _, p in top) >= np.delete(post, [i for i, _ in top]).max()
    with open(monitor.export_records(tmp_path / "records.csv"), encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["max_posterior"]) for r in rows] == pytest.approx(post.tolist(), rel=1e-5)
    assert [float(r["last_posterior"]) for r in rows] == pytest.approx(post.tolist(), rel=1e-5)


def test_the_sinks_tables_show_the_posteriors_they_rank_by():
    result = privmon.analyse(MEMBERS, NONMEMBERS, top_k=3, name="s")
    report = Report(step=1, scalars={}, queries={"s": result}, run_id="r")
    rows = ExposedRecords().rows(report)["s"]
    post = result.member_posterior
    assert [r.index for r in rows] == list(result.top_records)
    assert [r.risk for r in rows] == pytest.approx(post[list(result.top_records)].tolist())
    assert [r.rank for r in rows] == [1, 2, 3]
