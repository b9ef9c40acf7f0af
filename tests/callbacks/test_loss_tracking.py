"""A monitor's loss traces (LossTracing): what the training loop records is what the traces
hold, bad input is refused naming the argument, training is bit for bit what it is without
them, each check reports LOSS TNR and LT-IQR as the functional core computes them from the
same losses, and the traces are saved, loaded and read back with the run."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon import PrivacyMonitor
from privmon.attacks import LossTraces, loss_tnr, lt_iqr
from privmon.callbacks import LossTracing
from privmon.callbacks.loss_tracking import FLUSH_BATCHES, FLUSH_LOSSES
from privmon.queries import LossQuery
from privmon.report import Report, Vulnerable, checks_from_reports, tags
from privmon.report.read_jsonl import BadLine, check_record

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(n=160):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 2, (n,), generator=g)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def _monitor(model, x, y, tracing=None, **kw):
    members = [(x[i : i + 40], y[i : i + 40]) for i in range(0, 80, 40)]
    nonmembers = [(x[i : i + 40], y[i : i + 40]) for i in range(80, 160, 40)]
    return PrivacyMonitor(
        LossQuery(model), members, nonmembers, every_n_steps=5, strict=True,
        loss_traces=tracing, **kw,
    )  # fmt: skip


def _train(model, x, y, monitor=None, *, epochs=3):
    """SGD on the 80 members, shuffled by a seeded generator; each step's per-sample losses
    recorded (when a monitor traces them) and a check every 5 steps."""
    loader = DataLoader(
        TensorDataset(torch.arange(80), x[:80], y[:80]),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    step, fed = 0, []
    for _ in range(epochs):
        for idx, xb, yb in loader:
            step += 1
            opt.zero_grad()
            losses = F.cross_entropy(model(xb), yb, reduction="none")
            losses.mean().backward()
            opt.step()
            if monitor is not None:
                if monitor.loss_traces is not None:
                    monitor.record_losses(idx, losses, step=step)
                    fed.append((idx, losses.detach().clone(), step))
                monitor.step(step)
    return fed


def test_the_losses_recorded_are_the_loop_traces():
    x, y = _data()
    mon = _monitor(_model(), x, y, LossTracing(80, slots=8))
    for step in range(4):  # record r's loss at step s: 10 r + s, twice at step 3
        idx = torch.tensor([0, 1, 79, 1]) if step == 3 else torch.tensor([0, 1, 79])
        mon.record_losses(idx, idx.double() * 10 + step, step=step)
    means = mon.loss_traces.loop.means()
    assert means[[0, 1, 79], :4].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13], [790, 791, 792, 793]]
    assert torch.isnan(means[2:79]).all() and torch.isnan(means[:, 4:]).all()
    # a subset: the others' losses are left out; 256 bytes a traced record, 4 a training record
    sub = _monitor(_model(), x, y, LossTracing(80, records=[3, 5], slots=32))
    sub.record_losses(torch.tensor([3, 4, 5]), torch.tensor([1.0, 2.0, 3.0]), step=0)
    assert sub.loss_traces.loop.means()[:, 0].tolist() == [1.0, 3.0]
    assert sub.loss_traces.nbytes == 2 * 256 + 4 * 80 and LossTracing(80).nbytes == 80 * 256
    for step in range(0, 100_000, 997):  # the memory stays as it was, whatever the steps
        sub.record_losses(torch.tensor([3]), torch.tensor([1.0]), step=step)
    assert sub.loss_traces.loop.state_dict()["sums"].shape == (2, 32)


@pytest.mark.parametrize(
    ("indices", "losses", "step", "match"),
    [
        (torch.tensor([0.0, 1.0]), torch.ones(2), 0, "indices must be a 1-D integer array"),
        (torch.tensor([0, 1]), torch.ones(3), 0, "indices and losses must have the same length"),
        (torch.tensor([0, 1]), torch.ones(2, 2), 0, "losses must be a 1-D float array"),
        (torch.tensor([0, 1]), torch.tensor([1, 2]), 0, "losses must be a 1-D float array"),
        (torch.tensor([0, 1]), torch.ones(2), -1, "step must be an integer >= 0"),
        (torch.tensor([0, 1]), torch.ones(2), 1.5, "step must be an integer >= 0"),
        ("abc", torch.ones(2), 0, "indices must be"),
    ],
)
def test_bad_input_to_record_losses_is_refused_naming_the_argument(indices, losses, step, match):
    x, y = _data()
    mon = _monitor(_model(), x, y, LossTracing(80))
    with pytest.raises(ValueError, match=match):
        mon.record_losses(indices, losses, step=step)
    assert mon.loss_traces.loop.steps == 0  # nothing was kept


def test_indices_out_of_range_are_refused_naming_the_batchs_step():
    """The range is checked where the kept batches are added together (every FLUSH_BATCHES
    batches of one, and before a check reads them): the error names the step of the bad batch, and
    the batches kept with it are left out; the traces go on from there."""
    x, y = _data()
    mon = _monitor(_model(), x, y, LossTracing(80))
    mon.record_losses(torch.tensor([0, 1]), torch.ones(2), step=0)
    mon.record_losses(torch.tensor([0, 80]), torch.ones(2), step=1)
    with pytest.raises(ValueError, match=r"indices of the batch at step 1 must lie in \[0, 79\]"):
        for step in range(2, FLUSH_BATCHES):
            mon.record_losses(torch.tensor([2]), torch.ones(1), step=step)
    assert mon.loss_traces.loop.steps == 0
    mon.record_losses(torch.tensor([-1]), torch.ones(1), step=3)
    with pytest.raises(ValueError, match="indices of the batch at step 3"):
        mon.check(5)  # strict: the check raises what it could not add
    mon.record_losses(torch.tensor([5]), torch.tensor([2.0]), step=4)
    assert mon.loss_traces.loop.means()[5, 4].item() == 2.0


def test_the_kept_batches_are_added_once_they_hold_flush_losses_losses():
    """Large batches are added by their count of losses, long before FLUSH_BATCHES of them: the
    call whose batch brings the kept losses to FLUSH_LOSSES raises for an earlier bad index."""
    tracing = LossTracing(80)
    size = FLUSH_LOSSES // 4
    tracing.record(torch.full((size,), 80), torch.ones(size), step=0)  # out of range: kept
    for step in (1, 2):
        tracing.record(torch.zeros(size, dtype=torch.int64), torch.ones(size), step=step)
    with pytest.raises(ValueError, match=r"indices of the batch at step 0"):
        tracing.record(torch.zeros(size, dtype=torch.int64), torch.ones(size), step=3)
    tracing.record(torch.tensor([4]), torch.tensor([2.0]), step=4)  # nothing kept from before
    assert tracing.loop.means()[4, 4].item() == 2.0
    assert tracing.loop.steps == 5 and torch.isnan(tracing.loop.means()[0, :4]).all()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LossTracing(0), "n_records must be an integer >= 1"),
        (lambda: LossTracing(10, slots=5), "slots must be an even integer >= 4"),
        (lambda: LossTracing(10, records=[1, 1]), "records must not repeat an index"),
        (lambda: LossTracing(10, records=[10]), r"records must be indices in \[0, 9\]"),
        (lambda: LossTracing(records=[1]), "records needs n_records"),
        (lambda: LossTracing(10, checks="yes"), "checks must be True or False"),
        (lambda: LossTracing(10, top_k=0), "top_k must be an integer >= 1"),
        (lambda: LossTracing(10, fpr=1.5), "fpr must be"),
    ],
)
def test_a_bad_loss_tracing_is_refused_naming_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_monitor_without_loop_traces_says_what_record_losses_needs():
    x, y = _data()
    with pytest.raises(ValueError, match="loss_traces must be a LossTracing or None"):
        _monitor(_model(), x, y, tracing=80)
    for tracing in (None, LossTracing()):  # none, or the checks' traces only
        with pytest.raises(ValueError, match=r"record_losses needs .*LossTracing\("):
            _monitor(_model(), x, y, tracing).record_losses([0], [1.0], step=0)


def test_a_query_named_as_the_loops_traces_is_refused_only_beside_loss_traces():
    x, y = _data()
    model = _model()
    members, nonmembers = [(x[:40], y[:40])], [(x[80:120], y[80:120])]
    query = LossQuery(model, name=tags.TRAINING_LOOP)
    with pytest.raises(ValueError, match=r"a query is named 'training_loop'.*name the query"):
        PrivacyMonitor(query, members, nonmembers, loss_traces=LossTracing(80))
    assert PrivacyMonitor(query, members, nonmembers).queries[0].name == tags.TRAINING_LOOP


def test_recording_leaves_the_losses_and_their_graph_untouched():
    model = _model()
    x, y = _data()
    mon = _monitor(model, x, y, LossTracing(80))
    losses = F.cross_entropy(model(x[:8]), y[:8], reduction="none")
    before = losses.detach().clone()
    mon.record_losses(torch.arange(8), losses, step=0)
    assert torch.equal(losses.detach(), before) and losses.requires_grad
    losses.mean().backward()  # the graph is still there, for the loop's own backward
    assert all(p.grad is not None for p in model.parameters())
    assert not mon.loss_traces.loop.state_dict()["sums"].requires_grad


def test_training_is_bit_identical_with_and_without_the_traces():
    """Seeded runs (dropout, a shuffled loader, momentum): the weights after training with a
    monitor that records every step's losses and checks every 5 steps equal, bit for bit, the
    weights after the same training without any monitor."""
    x, y = _data()
    plain = _model()
    torch.manual_seed(7)
    _train(plain, x, y)
    traced = _model()
    mon = _monitor(traced, x, y, LossTracing(80))
    torch.manual_seed(7)
    fed = _train(traced, x, y, mon)
    assert len(fed) == 15 and len(mon.history) == 3 and mon.n_failed == 0
    for a, b in zip(plain.parameters(), traced.parameters(), strict=True):
        assert torch.equal(a, b)


def test_each_check_reports_lt_iqr_and_loss_tnr_as_the_functions_compute_them():
    x, y = _data()
    model = _model()
    mon = _monitor(model, x, y, LossTracing(80, top_k=7))
    members, nonmembers = [], []
    query = LossQuery(model)

    class Peek:  # the scores each check saw, recomputed with the model as it is at the check
        def write(self, report):
            model.eval()
            members.append(torch.cat([query(b) for b in mon.members]))
            nonmembers.append(torch.cat([query(b) for b in mon.nonmembers]))
            model.train()

        def close(self):
            pass

    mon.sinks.append(Peek())
    fed = _train(model, x, y, mon)
    report = mon.last_report
    # LOSS TNR at 0.1 % and 1 %: the functional core's, on the last check's losses
    est = loss_tnr(members[-1], nonmembers[-1])
    assert {t: v for t, v in report.scalars.items() if tags.parse_loss_tnr(t)} == {
        tags.loss_tnr("loss", 0.001): est.estimate[0],
        tags.loss_tnr("loss", 0.01): est.estimate[1],
    }
    # the loop's LT-IQR: the same batches fed to a LossTraces by hand
    by_hand = LossTraces(n_records=80)
    for idx, losses, step in fed:
        by_hand.update(idx, losses, step=step)
    risk = lt_iqr(by_hand)
    loop = report.vulnerable[tags.TRAINING_LOOP]
    assert list(loop.records) == risk.most_vulnerable(7).tolist()
    assert list(loop.scores) == risk.scores[risk.most_vulnerable(7)].tolist()
    assert (loop.n_scored, loop.steps) == (80, 16)
    # the members' LT-IQR over the checks: their losses at each check, a slot per check
    at_checks = LossTraces(n_records=80)
    for k, m in enumerate(members):
        at_checks.update(torch.arange(80), m.float(), step=k)
    risk = lt_iqr(at_checks)
    got = report.vulnerable["loss"]
    assert list(got.records) == risk.most_vulnerable(7).tolist() and got.steps == 3
    assert list(got.scores) == pytest.approx(risk.scores[list(got.records)].tolist(), abs=1e-6)


def test_the_traces_are_saved_and_loaded_with_the_monitor():
    x, y = _data()
    model = _model()
    mon = _monitor(model, x, y, LossTracing(80))
    _train(model, x, y, mon, epochs=1)
    buffer = io.BytesIO()
    torch.save(mon.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    again = _monitor(model, x, y, LossTracing(80))
    again.load_state_dict(state)
    pairs = [(mon.loss_traces.loop, again.loss_traces.loop)]
    pairs.append((mon.loss_traces.at_checks["loss"], again.loss_traces.at_checks["loss"]))
    for a, b in pairs:
        assert torch.equal(a.means().nan_to_num(-1), b.means().nan_to_num(-1))
        assert (a.stride, a.steps) == (b.stride, b.steps)
    # the next check reads the same from both
    assert mon.check(100).vulnerable == again.check(100).vulnerable
    # a monitor set up otherwise refuses the state, applying none of it
    for other, match in (
        (LossTracing(81), "state tracks other records"),
        (None, "disagree on whether loss traces are kept"),
        (LossTracing(), "disagree on tracing the loop"),
    ):
        fresh = _monitor(model, x, y, other)
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(state)
        assert fresh.history == []


def test_the_most_vulnerable_records_are_read_back_from_the_json_lines():
    top = Vulnerable(records=(7, 2), scores=(1.5, 0.25), n_scored=80, steps=16)
    report = Report(step=5, scalars={tags.loss_tnr("loss", 0.01): 0.2}, run_id="r",
                    vulnerable={tags.TRAINING_LOOP: top})  # fmt: skip
    line = json.loads(json.dumps(report.to_json()))
    assert check_record(line)["lt_iqr"] == {tags.TRAINING_LOOP: top.to_json()}
    assert checks_from_reports([report]).records[0]["lt_iqr"][tags.TRAINING_LOOP] == top.to_json()
    line["lt_iqr"][tags.TRAINING_LOOP]["scores"] = [1.5]
    with pytest.raises(BadLine, match=r"lt_iqr\['training_loop'\] must hold as many scores"):
        check_record(line)
    line["lt_iqr"][tags.TRAINING_LOOP] = {"records": [-1], "scores": [1.0]}
    with pytest.raises(BadLine, match=r"lt_iqr\['training_loop'\]\['records'\]\[0\] must be an"):
        check_record(line)
    with pytest.raises(BadLine, match=r"tag|LOSS TNR"):
        check_record({**report.to_json(), "scalars": {tags.loss_tnr("loss", 0.01): 1.5}})
