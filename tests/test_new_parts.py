"""The architecture page's "Where a new part goes", shown: a query and a sink added as a user
adds them, each in one module of its own (here, this test) and nothing else changed; the
monitor's figures for the new query are the estimators' on its scores, and the new sink gets
every report and the budget's outcome. (A new estimator method: test_estimator_method_toy.py; a
diffusion statistic: test_diffusion_statistic_toy.py; a DP check: test_dp_check_toy.py.)"""

from __future__ import annotations

import torch

from privmon import PrivacyEarlyStopping, PrivacyMonitor
from privmon.estimators import optimal_advantage
from privmon.queries import Query
from privmon.report import tags


class DistanceQuery(Query):
    """A toy query: each record's distance to a fixed centre (members are drawn nearer)."""

    discrete = False
    higher_is_member = False

    def __init__(self, centre: torch.Tensor) -> None:
        super().__init__(name="distance")
        self.centre = centre

    def __call__(self, batch):
        return torch.linalg.vector_norm(batch - self.centre, dim=1)


class ListSink:
    """A toy sink: ``write`` and ``close`` are all a sink needs; ``write_outcome`` is optional."""

    def __init__(self) -> None:
        self.reports, self.outcomes, self.closed = [], [], False

    def write(self, report):
        self.reports.append(report)

    def write_outcome(self, outcome):
        self.outcomes.append(outcome)

    def close(self):
        self.closed = True


def _records(n: int, scale: float, seed: int) -> torch.Tensor:
    return scale * torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def test_a_new_query_and_a_new_sink_need_no_change_elsewhere():
    members, held_out = _records(300, 0.8, 0), _records(300, 1.2, 1)
    query, sink = DistanceQuery(torch.zeros(4)), ListSink()
    stopping = PrivacyEarlyStopping(tags.lower("distance", "histogram"), threshold=0.6)
    monitor = PrivacyMonitor(
        query,
        [members[:150], members[150:]],
        [held_out],
        methods=("histogram",),
        sinks=sink,
        early_stopping=stopping,
        every_n_steps=1,
    )
    for step in (1, 2):
        monitor.step(step)
    monitor.close()
    # the sink got each check's report, then the budget's outcome, then was closed
    assert [r.step for r in sink.reports] == [1, 2]
    assert len(sink.outcomes) == 1 and sink.outcomes[0].checks == 2 and sink.closed
    # the new query's figures are the estimators' on its scores (the monitor adds nothing)
    expected = optimal_advantage(
        torch.linalg.vector_norm(members, dim=1), torch.linalg.vector_norm(held_out, dim=1)
    )
    scalars = sink.reports[-1].scalars
    assert scalars[tags.value("distance", "histogram")] == expected.value
    assert 0.1 < expected.value < 0.6  # the two spreads differ: a real, partial leak
