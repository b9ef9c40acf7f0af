"""A new estimator method is one object registered in one place (issue #41): a toy method
defined here — a histogram of 25 cells per dimension — is registered, measured by ``analyse``
and ``optimal_advantage`` beside the built-in methods, and checked against its peer, the
built-in histogram on the same 25 cells. Nothing of privmon is patched; the registry is left as
it was found."""

from __future__ import annotations

import numpy as np
import pytest

from privmon import analyse, individual_risk, optimal_advantage
from privmon.estimators import HistogramMethod, register_method, unregister_method
from privmon.estimators.methods import METHODS, check_method, registered_methods

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Histogram25(HistogramMethod):
    """The histogram method on a fixed grid of 25 cells per dimension."""

    name = "histogram25"

    def default_bins(self, d: int) -> int:
        return 25


@pytest.fixture
def toy():
    before = registered_methods()
    register_method(Histogram25())
    yield "histogram25"
    unregister_method("histogram25")
    assert registered_methods() == before


def _scores(n1, n2, d, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(0.5, 1.0, (n1, d)).squeeze(1 if d == 1 else ()), rng.normal(
        0.0, 1.0, (n2, d)
    ).squeeze(1 if d == 1 else ())


@pytest.mark.parametrize("d", [1, 2, 3])
def test_a_registered_method_equals_its_peer(toy, d):
    m, h = _scores(400, 300, d, seed=d)
    got = optimal_advantage(m, h, method=toy, prior=0.4)
    peer = optimal_advantage(m, h, method="histogram", prior=0.4, bins=25)
    assert got.as_dict() == {**peer.as_dict(), "method": toy}


@pytest.mark.parametrize("d", [1, 2])
def test_analyse_reports_it_beside_the_built_in_methods(toy, d):
    m, h = _scores(500, 500, d, seed=10 + d)
    result = analyse(m, h, methods=("histogram", "kde", toy), prior=0.5)
    assert list(result.estimates) == ["histogram", "kde", toy]
    peer = optimal_advantage(m, h, method="histogram", bins=25)
    assert result.estimates[toy].value == pytest.approx(peer.value, abs=1e-12)
    assert result.estimates[toy].plugin == pytest.approx(peer.plugin, abs=1e-12)
    assert result.estimates[toy].lower == pytest.approx(peer.lower, abs=1e-12)
    assert f"{toy}/lower" in result.scalars()
    # the built-in figures do not move when a method joins them
    alone = analyse(m, h, methods=("histogram", "kde"), prior=0.5)
    for method in ("histogram", "kde"):
        assert result.estimates[method] == alone.estimates[method]


def test_separated_scores_read_the_analytic_advantage(toy):
    # members and non-members never overlap: the optimal advantage is exactly 1, which W_N
    # reads exactly and the smoothed rule nearly
    rng = np.random.default_rng(0)
    m, h = rng.uniform(2.0, 3.0, 400), rng.uniform(0.0, 1.0, 400)
    est = optimal_advantage(m, h, method=toy)
    assert est.plugin == 1.0
    assert 0.85 < est.lower <= est.value <= 1.0


def test_individual_risk_and_the_registry_name_it(toy):
    m, h = _scores(400, 300, 1, seed=5)
    q = np.array([-1.0, 0.0, 2.0])
    got = individual_risk(q, m, h, method=toy)
    peer = individual_risk(q, m, h, method="histogram", bins=25)
    assert np.array_equal(got.value, peer.value) and np.array_equal(got.upper, peer.upper)
    assert got.method == toy and peer.method == "histogram"
    assert check_method(toy) == toy and toy in registered_methods() and toy not in METHODS


def test_registering_refuses_a_name_taken_or_an_object_of_another_kind(toy):
    with pytest.raises(ValueError, match="not yet registered"):
        register_method(Histogram25())
    with pytest.raises(TypeError, match="EstimatorMethod"):
        register_method(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="built-in"):
        unregister_method("histogram")


def test_an_unregistered_method_is_refused():
    with pytest.raises(ValueError, match="methods must be"):
        analyse(np.zeros(10), np.ones(10), methods=("histogram25",))


def test_the_monitor_reports_it_and_the_run_reader_reads_it(toy, tmp_path):
    import torch

    from privmon import PrivacyMonitor
    from privmon.report import tags
    from privmon.report.runs import read_checks
    from privmon.sinks import JsonlSink

    m, h = (torch.as_tensor(x) for x in _scores(300, 300, 1, seed=7))
    path = tmp_path / "checks.jsonl"
    monitor = PrivacyMonitor(
        lambda batch: batch, [m], [h], methods=("histogram", toy), sinks=JsonlSink(str(path))
    )
    report = monitor.check(1)
    monitor.close()
    name = monitor.queries[0].name
    lower = tags.lower(name, toy)
    assert tags.parse_advantage(lower) == (name, toy, "lower")
    certify = report.scalars[tags.CERTIFY_DELTA]
    peer = analyse(m, h, methods=("histogram", toy), delta=0.05, certify_delta=certify)
    assert report.scalars[lower] == peer.estimates[toy].lower
    assert read_checks(str(path)).methods(name) == ["histogram", toy]
