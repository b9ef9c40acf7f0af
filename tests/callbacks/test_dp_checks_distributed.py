"""The DP mechanism checks on a real 2-process gloo group: every rank reports the same outcome —
a deterministic test that fired on any rank fires on all, a statistical test's p-value is the
smallest over the ranks times their number (Bonferroni), a rank whose ``mechanism()`` failed is
said on every rank while the others' findings still count, a test one rank gave no p-value for is
decided on the other's and said, and ``strict`` raises on every rank.
Collectives time out after 30 s and the spawn fails the test when it outlives the deadline of
tests/callbacks/test_distributed.py."""

from __future__ import annotations

import datetime
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ranks import rank_results, spawned_results

from privmon import PrivacyMonitor, PrivacyViolationWarning
from privmon.audit.mechanism import MechanismFinding
from privmon.queries import CallableQuery
from privmon.report import tags as T

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
CLIPPING = "clipping: a row of norm 100 contributed 100.0, above C = 1.0"
SAMPLING = "sampling: 60 rows in each of 40 steps, the accountant assumes Binomial(600, 0.1)"


class RankChecks:
    """This rank's findings: clipping fires on ``fires``, the mean test's p-value by rank,
    ``mechanism()`` raises on ``fails``."""

    statistical_tests = (("sampling", "mean"), ("sampling", "dispersion"))

    def __init__(self, rank, *, fires=(), p=(0.2, 0.01), fails=()):
        self.rank, self.fires, self.p, self.fails = rank, fires, p, fails

    def mechanism(self, accountant=None):
        if self.rank in self.fails:
            raise RuntimeError(f"the probe broke on rank {self.rank}")
        return (
            MechanismFinding(
                "clipping", "probe", "deterministic", self.rank in self.fires, None, CLIPPING
            ),
            MechanismFinding("sampling", "mean", "statistical", False, self.p[self.rank], SAMPLING),
            MechanismFinding("sampling", "dispersion", "statistical", False, 0.9, SAMPLING),
        )


CASES = {
    "fired_on_rank_1": {"fires": (1,)},
    "failed_on_rank_1": {"fires": (0,), "fails": (1,)},
    "failed_strict": {"fails": (1,), "strict": True},
    "undecided_on_rank_1": {"p": (1e-7, float("nan"))},
}


def _outcome(monitor, step):
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = monitor.check(step)
    except Exception as err:
        return {"raised": f"{type(err).__name__}: {err}"}
    warned = [str(w.message) for w in caught if w.category is PrivacyViolationWarning]
    return {
        "scalars": {t: v for t, v in report.scalars.items() if T.parse_dp_check(t)},
        "violation": report.dp_violation,
        "causes": report.dp_causes,
        "failures": report.failures,
        "warned": warned,
        "level": report.scalars[T.DP_ALARM_DELTA],
    }


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=GROUP_TIMEOUT * 4)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    rng = np.random.default_rng(rank)
    members, nonmembers = [rng.normal(0.0, 1.0, 100)], [rng.normal(0.0, 1.0, 100)]
    with rank_results(rank, tmp) as out:
        for i, (name, case) in enumerate(CASES.items()):
            case = dict(case)
            strict = case.pop("strict", False)
            monitor = PrivacyMonitor(
                CallableQuery(lambda b: b, name="q", higher_is_member=True),
                members,
                nonmembers,
                every_n_steps=1,
                methods=("histogram",),
                canaries=RankChecks(rank, **case),
                strict=strict,
            )
            out[name] = _outcome(monitor, i + 1)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo_dp")
    out = spawned_results(_worker, tmp)  # fails, never hangs
    return out


def test_a_check_that_fired_on_one_rank_fires_on_every_rank(ranks):
    a, b = (r["fired_on_rank_1"] for r in ranks)
    assert a == b  # the same report, causes and warnings on both ranks
    assert a["violation"] and a["causes"] == (f"{CLIPPING} (rank 1)",)
    assert a["scalars"] == {
        T.dp_check_fired("clipping"): 1.0,
        T.dp_check_fired("sampling"): float(0.02 < a["level"]),
        T.dp_check_p_value("sampling", "mean"): 0.02,  # min over 2 ranks (0.01) × 2
        T.dp_check_p_value("sampling", "dispersion"): 1.0,  # min(1, 0.9 × 2)
    }
    assert len(a["warned"]) == 1 and "clipping — a row of norm 100" in a["warned"][0]


def test_a_rank_whose_mechanism_failed_is_said_and_the_others_count(ranks):
    a, b = (r["failed_on_rank_1"] for r in ranks)
    assert a == b
    assert a["failures"] == {
        "dp_checks/rankchecks": "failed on rank 1: RuntimeError: the probe broke on rank 1"
    }
    assert a["violation"] and a["causes"] == (f"{CLIPPING} (rank 0)",)
    assert a["scalars"][T.dp_check_p_value("sampling", "mean")] == 0.2  # rank 0's alone


def test_strict_raises_on_every_rank(ranks):
    a, b = (r["failed_strict"] for r in ranks)
    assert b["raised"] == "RuntimeError: the probe broke on rank 1"
    # each rank reads its findings before the check's one exchange: that stage is named
    assert a["raised"].startswith("RankFailure: privmon: the DP mechanism checks failed on rank 1")


def test_a_test_without_a_p_value_on_one_rank_is_decided_on_the_other_and_said(ranks):
    a, b = (r["undecided_on_rank_1"] for r in ranks)
    assert a == b
    assert a["failures"] == {
        "dp_checks/sampling/mean": "the mean test of the sampling check gave no p-value on "
        "rank 1: decided on the others' alone"
    }
    # rank 0's p-value alone (one rank gave one: no Bonferroni factor), below the level: fired
    assert a["scalars"][T.dp_check_p_value("sampling", "mean")] == 1e-7 < a["level"]
    assert a["violation"] and a["causes"][0].startswith(f"{SAMPLING} (rank 0) (mean test")
