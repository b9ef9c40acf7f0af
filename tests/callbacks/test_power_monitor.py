"""What a monitor can certify, and its planned checks: ``PrivacyMonitor.detectable_advantage``,
``privacy/<query>/detectable`` in every report, the early-stopping warning, and
``PrivacyMonitor.plan`` (never a user's plan, never mid-run, resumed runs keep theirs).

Every figure is compared with :func:`privmon.detectable_advantage` called directly at the audit
sizes and the δ share (:func:`~privmon.estimators.spending.check_delta` over the figures of a
check) the check certifies at.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import privmon
from privmon import PrivacyEarlyStopping, PrivacyMonitor
from privmon._digest import sealed
from privmon.estimators.spending import check_delta
from privmon.queries import CallableQuery

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DELTA = 0.05


def _scores(n, shift, seed, dim=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) + shift
    return x.squeeze(1) if dim == 1 else x


def _sets(n_members=200, n_nonmembers=200, batch=50, shift=0.3, dim=1):
    """Batches whose records are their own scores (the query is the identity)."""
    mem, non = _scores(n_members, shift, 0, dim), _scores(n_nonmembers, 0.0, 1, dim)
    split = [mem[i : i + batch] for i in range(0, n_members, batch)]
    return split, [non[i : i + batch] for i in range(0, n_nonmembers, batch)]


def _identity(name="s"):
    return CallableQuery(lambda b: b, name=name)


def _monitor(members=None, nonmembers=None, **kw):
    if members is None:
        members, nonmembers = _sets()
    kw.setdefault("every_n_steps", 1)
    return PrivacyMonitor(kw.pop("query", _identity()), members, nonmembers, **kw)


def _share(k, planned=None, figures=2):
    return check_delta(k, delta=DELTA, planned_checks=planned) / figures


# --------------------------------------------------------------------------------------------------
# detectable_advantage and privacy/<query>/detectable
# --------------------------------------------------------------------------------------------------
def test_before_a_check_the_loaders_sizes_give_the_detectable_advantage():
    mon = _monitor()  # 2 methods: 2 certified figures per check
    assert mon.detectable_advantage() == privmon.detectable_advantage(200, 200, delta=_share(1))
    assert mon.detectable_advantage("s", check=7) == privmon.detectable_advantage(
        200, 200, delta=_share(7)
    )
    assert mon.detectable_advantage(threshold=0.2, power=0.9) == privmon.detectable_advantage(
        200, 200, delta=_share(1), threshold=0.2, power=0.9
    )
    # a DataLoader: its sampler's records, whole batches only with drop_last, max_batches caps
    x = torch.randn(230)
    loader = DataLoader(TensorDataset(x), batch_size=50)
    dropping = DataLoader(TensorDataset(x), batch_size=50, drop_last=True)
    query = CallableQuery(lambda b: b[0], name="s")
    for kw, sizes in (({}, (230, 200)), ({"max_batches": 3}, (150, 150))):
        mon = _monitor(loader, dropping, query=query, methods=("histogram",), **kw)
        assert mon.detectable_advantage() == privmon.detectable_advantage(
            *sizes, delta=_share(1, figures=1)
        )


def test_each_report_carries_the_detectable_advantage_of_its_check():
    for planned in (None, 3):
        mon = _monitor(planned_checks=planned)
        for step in (1, 2, 3, 4):
            report = mon.check(step)
            expected = privmon.detectable_advantage(200, 200, delta=_share(step, planned))
            assert report.scalars["privacy/s/detectable"] == expected
            assert report.scalars["privacy/certify_delta"] == _share(step, planned)
        assert mon.detectable_advantage() == privmon.detectable_advantage(
            200, 200, delta=_share(5, planned)
        )


def test_the_detectable_advantage_counts_finite_records_and_the_dimension():
    members, nonmembers = _sets(dim=3)
    members[0][:7, 1] = math.nan  # 7 member records dropped
    mon = _monitor(members, nonmembers, methods=("histogram",))
    report = mon.check(1)
    assert report.scalars["privacy/s/n_dropped"] == 7
    expected = privmon.detectable_advantage(193, 200, delta=_share(1, figures=1), dim=3)
    assert report.scalars["privacy/s/detectable"] == expected
    assert mon.detectable_advantage() == privmon.detectable_advantage(
        193, 200, delta=_share(2, figures=1), dim=3
    )
    # above 2-D the certificate learns on more folds: it detects a little less
    assert expected > privmon.detectable_advantage(193, 200, delta=_share(1, figures=1))


class _Stream(IterableDataset):
    def __init__(self, x):
        self.x = x

    def __iter__(self):
        return iter(self.x)


def test_unknown_sizes_never_break_the_monitor():
    members, nonmembers = _sets()
    stream = DataLoader(_Stream(torch.cat(members)), batch_size=50)
    mon = _monitor(stream, nonmembers, methods=("histogram",))  # no length: nothing said yet
    with pytest.raises(ValueError, match="audit sizes are unknown until the first check"):
        mon.detectable_advantage()
    report = mon.check(1)
    assert report.scalars["privacy/s/detectable"] == privmon.detectable_advantage(
        200, 200, delta=_share(1, figures=1)
    )
    assert mon.detectable_advantage() == privmon.detectable_advantage(
        200, 200, delta=_share(2, figures=1)
    )


def test_detectable_advantage_arguments_are_checked():
    two = _monitor(query=[_identity("a"), _identity("b")])
    with pytest.raises(ValueError, match=r"query must name one of the monitored queries"):
        two.detectable_advantage()
    with pytest.raises(ValueError, match=r"query must be one of \['a', 'b'\], got 'c'"):
        two.detectable_advantage("c")
    with pytest.raises(ValueError, match="check"):
        two.detectable_advantage("a", check=0)
    with pytest.raises(ValueError, match="power"):
        two.detectable_advantage("a", power=1.0)
    with pytest.raises(ValueError, match="threshold"):
        two.detectable_advantage("a", threshold=1.0)
    # 4 certified figures per check: 2 queries × 2 methods
    assert two.detectable_advantage("b") == privmon.detectable_advantage(
        200, 200, delta=_share(1, figures=4)
    )


def test_a_tiny_audit_detects_nothing_and_says_so_with_inf():
    members, nonmembers = _sets(4, 4, batch=4)
    report = _monitor(members, nonmembers).check(1)
    assert report.scalars["privacy/s/detectable"] == math.inf


# --------------------------------------------------------------------------------------------------
# early stopping out of reach
# --------------------------------------------------------------------------------------------------
def test_early_stopping_out_of_reach_is_warned_once_with_the_records_that_reach_it():
    es = PrivacyEarlyStopping("s/histogram", 0.85)  # use="lower"
    members, nonmembers = _sets(40, 40, batch=20)
    assert math.isinf(privmon.detectable_advantage(40, 40, delta=_share(1), threshold=0.85))
    needed = privmon.audit_records_needed(0.925, delta=_share(1), threshold=0.85)
    with pytest.warns(UserWarning, match="cannot fire at check 1") as caught:
        mon = _monitor(members, nonmembers, early_stopping=es)
    (message,) = [str(w.message) for w in caught if "cannot fire" in str(w.message)]
    assert "privacy/s/histogram/lower > 0.85" in message
    assert f"About {needed} records per class would let a true advantage of 0.925" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per monitor
        mon.check(1)


@pytest.mark.parametrize(
    "es",
    [
        PrivacyEarlyStopping("s/histogram", 0.3),  # reachable with 200 + 200 records
        PrivacyEarlyStopping("s/histogram", 0.99, use="value"),  # not a certified figure
        PrivacyEarlyStopping("privacy/s/auc", 0.99),  # not an advantage bound
    ],
)
def test_early_stopping_in_reach_or_on_another_figure_is_not_warned(es):
    assert math.isfinite(privmon.detectable_advantage(200, 200, delta=_share(1), threshold=0.3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _monitor(early_stopping=es).check(1)


def test_early_stopping_out_of_reach_only_later_is_warned_at_that_check():
    # unplanned, δ_k shrinks: with 30 + 30 records a threshold of 0.75 is in reach at check 1
    # and out of reach from the first check k where no advantage crosses it in half the runs
    threshold, n = 0.75, 30
    reach = [
        math.isfinite(
            privmon.detectable_advantage(n, n, delta=_share(k, figures=1), threshold=threshold)
        )
        for k in range(1, 30)
    ]
    first_out = reach.index(False) + 1
    assert first_out > 1
    members, nonmembers = _sets(n, n, batch=n)
    es = PrivacyEarlyStopping("s/histogram", threshold, min_checks=10**6)  # never stops
    mon = _monitor(members, nonmembers, early_stopping=es, methods=("histogram",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(1, first_out):
            mon.check(step)
    with pytest.warns(UserWarning, match=f"cannot fire at check {first_out}"):
        mon.check(first_out)


# --------------------------------------------------------------------------------------------------
# plan()
# --------------------------------------------------------------------------------------------------
def test_plan_counts_the_due_steps_and_keeps_a_users_plan():
    mon = _monitor(every_n_steps=10)
    assert mon.plan(total_steps=155) == 15  # checks at 10, 20, …, 150
    assert mon.planned_checks == 15
    assert mon.detectable_advantage() == privmon.detectable_advantage(
        200, 200, delta=_share(1, planned=15)
    )
    assert mon.plan(total_steps=40) == 4  # no check yet: the latest length counts
    mine = _monitor(every_n_steps=10, planned_checks=20)
    with pytest.warns(UserWarning, match=r"planned_checks=20 is kept, but .* has 15 checks"):
        assert mine.plan(total_steps=150) == 20
    assert mine.planned_checks == 20
    with pytest.raises(ValueError, match="total_steps"):
        mon.plan(total_steps=0)
    with pytest.warns(UserWarning, match="no check is due in this run"):
        assert _monitor(every_n_steps=100).plan(total_steps=99) is None
    with pytest.warns(UserWarning, match="no check is due in this run"):
        assert mon.plan(total_steps=9) is None  # the earlier plan no longer describes the run
    with pytest.warns(UserWarning, match="no check is due in this run"):  # said as such
        assert _monitor(every_n_steps=100, planned_checks=5).plan(total_steps=30) == 5


def test_plan_is_kept_once_a_check_spent_part_of_the_budget():
    for planned in (None, 5):
        mon = _monitor(every_n_steps=10, planned_checks=None)
        if planned is not None:
            mon.plan(total_steps=planned * 10)
        mon.step(10)
        with pytest.warns(UserWarning, match="which is kept: spending interval_delta"):
            assert mon.plan(total_steps=300) == planned
        assert mon.planned_checks == planned
        assert mon.plan(total_steps=300) == planned  # said once
        report = mon.check(20)
        assert report.scalars["privacy/certify_delta"] == _share(2, planned)


def _saved(mon):
    buf = io.BytesIO()
    torch.save(mon.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_a_resumed_run_goes_on_under_its_saved_plan():
    first = _monitor(every_n_steps=10)
    first.plan(total_steps=60)
    for step in (10, 20):
        first.step(step)
    state = _saved(first)
    # a monitor given no plan takes the run's, before or after its own plan() call
    for plan_first in (False, True):
        second = _monitor(every_n_steps=10)
        if plan_first:
            second.plan(total_steps=100)
        second.load_state_dict(state)
        assert second.planned_checks == 6
        with pytest.warns(UserWarning, match="which is kept"):
            assert second.plan(total_steps=100) == 6
        report = second.check(30)
        assert report.scalars["privacy/certify_delta"] == _share(3, planned=6)
    # a user's plan that differs from the run's is another setup; the same one loads
    with pytest.raises(ValueError, match=r"another setup .*planned_checks: 6 != 9"):
        _monitor(every_n_steps=10, planned_checks=9).load_state_dict(state)
    same = _monitor(every_n_steps=10, planned_checks=6)
    same.load_state_dict(state)
    assert same.n_certified_checks == 2
    # a run saved unplanned stays unplanned
    unplanned = _monitor(every_n_steps=10)
    unplanned.step(10)
    resumed = _monitor(every_n_steps=10)
    resumed.plan(total_steps=100)
    resumed.load_state_dict(_saved(unplanned))
    assert resumed.planned_checks is None
    with pytest.raises(ValueError, match="planned_checks"):
        _monitor().load_state_dict(sealed({**state, "planned_checks": 0}))


def test_the_verdict_and_the_page_say_what_the_run_could_detect():
    from privmon.report import checks_from_reports, render_html, verdict

    pytest.importorskip("matplotlib")
    members, nonmembers = _sets(shift=0.0)  # nothing leaks
    mon = _monitor(members, nonmembers, planned_checks=2)
    reports = [mon.check(1), mon.check(2)]
    detectable = reports[-1].scalars["privacy/s/detectable"]
    assert detectable == privmon.detectable_advantage(200, 200, delta=_share(2, planned=2))
    checks = checks_from_reports(reports)
    found = verdict(checks)
    assert found.level == "none"
    assert any(f"an advantage of at least {detectable:.3g} (query 's')" in d for d in found.details)
    page = render_html(checks)
    assert ">detectable</th>" in page and f"{detectable:.4g}" in page
