"""Names that do not bite: scikit-learn's (y_true, y_score) order is refused by privmon.auc and
privmon.roc_curve with a message that says how to call them; the coefficients of a MACE eq. 4
metric are privmon.GeneralizedMetric."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

import privmon


@pytest.fixture
def labelled():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    return y, rng.normal(size=400) + 1.2 * y


@pytest.mark.parametrize("fn", ["auc", "roc_curve"])
@pytest.mark.parametrize("kind", ["numpy", "torch", "column", "list"])
def test_sklearn_order_is_refused_with_how_to_call(fn, kind, labelled):
    y, s = labelled
    first, second = {
        "numpy": (y, s),
        "torch": (torch.from_numpy(y), torch.from_numpy(s)),
        "column": (y.reshape(-1, 1), s.reshape(-1, 1)),
        "list": (y.tolist(), s.tolist()),
    }[kind]
    with pytest.raises(ValueError) as err:
        getattr(privmon, fn)(first, second)
    msg = str(err.value)
    assert "(member_scores, nonmember_scores)" in msg and "(y_true, y_score)" in msg
    assert f"privmon.{fn}(y_score[y_true == 1], y_score[y_true == 0])" in msg


def test_the_call_the_message_suggests_equals_sklearn(labelled):
    y, s = labelled
    assert privmon.auc(s[y == 1], s[y == 0]) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


@pytest.mark.parametrize(
    ("members", "nonmembers"),
    [
        ([0, 1] * 6, [1, 0, 0, 0] * 3),  # a discrete query: both sides 0/1
        ([0, 1] * 6, [0.2, 0.5, 0.7] * 3),  # different lengths
        ([0.5, 1, 1, 0] * 3, [0.2, 0.5, 0.7, 0.1] * 3),  # first not all 0/1
        ([1] * 12, [0.2, 0.5, 0.7, 0.1] * 3),  # one class only: no label vector
        ([0, 1] * 6, [2, 0, -1] * 4),  # integer scores (counts): not continuous
        ([0, 1, 1, 0], [0.2, 0.5, 0.7, 0.1]),  # too short to tell
        ([[0, 1]] * 12, [[0.3, 0.2]] * 12),  # not 1-D: no label vector
    ],
)
def test_real_score_sets_are_not_mistaken_for_labels(members, nonmembers):
    if np.ndim(members) == 2:
        with pytest.raises(ValueError, match=r"more than one dimension|shape"):
            privmon.auc(members, nonmembers)  # 2-D scores: refused for their shape instead
        return
    a = privmon.auc(members, nonmembers)
    fpr, tpr, _ = privmon.roc_curve(members, nonmembers)
    assert 0.0 <= a <= 1.0 and fpr[-1] == tpr[-1] == 1.0


def test_generalized_metric_name():
    assert privmon.GeneralizedMetric is privmon.estimators.GeneralizedMetric
    assert "Metric" not in privmon.__all__ and "GeneralizedMetric" in privmon.__all__
    for module in (privmon, privmon.estimators, privmon.estimators.generalized):
        assert not hasattr(module, "Metric")  # the pre-release alias is gone
    m = privmon.GeneralizedMetric.am(0.3)
    assert m.prior == 0.3
