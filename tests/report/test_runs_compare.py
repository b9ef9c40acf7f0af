"""Runs kept apart and compared (issue #32, points 3 and 5): a monitor that writes where another
run wrote says so at construction, and a resumed run does not; ``privmon report --compare``
puts a DP-SGD run and a run without DP side by side, its table holding each run's figures as
read back; the report page's verdict figure sits in its table, its terms are explained, its
legends sit outside the data and its tables scroll inside the column."""

from __future__ import annotations

import html
import re
import shutil
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

from privmon import PrivacyMonitor
from privmon.cli import main
from privmon.queries import LossQuery
from privmon.report import (
    Report,
    read_checks,
    read_runs,
    render_html,
    runs_in,
    verdict,
    version_dir,
)
from privmon.report.blocks import GLOSSARY
from privmon.report.compare import run_summary
from privmon.report.figures import advantage_figure, risk_figure, roc_figure
from privmon.report.verdict import certificates
from privmon.sinks import JsonlSink, TensorBoardSink

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS, EVERY, DELTA = 100, 25, 1e-5


def _data():
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(x))
    x = torch.from_numpy((x[perm] / 16.0).astype(np.float32))
    y = torch.from_numpy(y[perm]).long()
    return (x[:200], y[:200]), (x[200:400], y[200:400])


def _loop(logdir, *, dp, run_id=None, steps=STEPS, writer=None):
    """A wide MLP trained on 200 digits under the monitor (TensorBoard + JSON lines in
    ``logdir``): with Opacus DP-SGD (``dp``) or plain Adam, which memorises its members."""
    members, nonmembers = _data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    loader = DataLoader(TensorDataset(*members), batch_size=50, shuffle=True)
    engine = None
    if dp:
        from opacus import PrivacyEngine

        engine = PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus: secure RNG off, on a test
            model, optimizer, loader = engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                noise_multiplier=2.0,
                max_grad_norm=1.0,
            )
    monitor = PrivacyMonitor(
        LossQuery(model),
        [members],
        [nonmembers],
        every_n_steps=EVERY,
        planned_checks=STEPS // EVERY,
        writer=str(logdir) if writer is None else writer,
        sinks=[JsonlSink(logdir / "checks.jsonl")],
        accountant=engine,
        delta=DELTA,
        run_id=run_id,
    )
    step = 0
    while step < steps:
        for x, y in loader:
            if step == steps:
                break
            if len(x) == 0:  # Poisson sampling may draw an empty batch
                continue
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
            monitor.step(step)
    monitor.close()
    return monitor


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The DP and no-DP runs, each in a fresh version folder of one root."""
    root = tmp_path_factory.mktemp("compare")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = _loop(root / "version_0", dp=True)
        no_dp = _loop(root / "version_1", dp=False)
    return root, dp, no_dp


def _other_run_warnings(record):
    return [str(w.message) for w in record if "already holds another run" in str(w.message)]


# --- point 3: a monitor writing where another run wrote ---------------------------------------
def test_a_monitor_in_another_runs_folder_warns_and_a_resumed_run_does_not(two_runs, tmp_path):
    root, dp, _ = two_runs
    folder = root / "version_0"
    assert [r.run_id for r in runs_in(folder)] == [dp.run_id]  # the event files' run
    assert [r.run_id for r in runs_in(folder / "checks.jsonl")] == [dp.run_id]
    members, nonmembers = _data()
    model = nn.Linear(64, 10)
    cases = (
        (lambda at: str(at), lambda at: [], "writer"),  # TensorBoard event files, from a path
        (lambda at: SummaryWriter(str(at)), lambda at: [], "writer"),  # from a SummaryWriter
        (lambda at: None, lambda at: [JsonlSink(at / "checks.jsonl")], "JsonlSink"),
        (lambda at: None, lambda at: [TensorBoardSink(str(at))], "writer"),  # given as a sink
    )
    for i, (writer_at, sinks_at, where) in enumerate(cases):
        at = shutil.copytree(folder, tmp_path / f"case{i}")  # the run's files, written again
        writer = writer_at(at)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fresh = PrivacyMonitor(
                LossQuery(model), [members], [nonmembers], writer=writer, sinks=sinks_at(at)
            )
        assert _other_run_warnings(record) == []  # said before the first write, not before
        with pytest.warns(UserWarning, match="already holds another run") as record:
            fresh.check(1)
        (message,) = _other_run_warnings(record)
        assert message.startswith(f"privmon: the {where} path")
        assert f"{dp.run_id} (steps {EVERY}–{STEPS}, {STEPS // EVERY} " in message
        assert "version_dir" in message and f"run_id={dp.run_id!r}" in message
        assert fresh.run_id in message
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fresh.check(2)
        assert _other_run_warnings(record) == []  # once
        fresh.close()
        if writer is not None and not isinstance(writer, str):
            writer.close()
    # the same run resumed (its id given): no warning at its checks, and it keeps its id
    at = shutil.copytree(folder, tmp_path / "resumed")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resumed = PrivacyMonitor(
            LossQuery(model),
            [members],
            [nonmembers],
            writer=str(at),
            sinks=[JsonlSink(at / "checks.jsonl")],
            run_id=dp.run_id,
        )
        resumed.check(STEPS + EVERY)
    assert _other_run_warnings(record) == []
    assert resumed.run_id == dp.run_id
    resumed.close()
    # a folder with a user's own TensorBoard scalars, or nothing: no warning
    own = SummaryWriter(str(tmp_path / "own"))
    own.add_scalar("train/loss", 1.0, 1)
    own.flush()
    for writer in (own, str(tmp_path / "new")):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            PrivacyMonitor(LossQuery(model), [members], [nonmembers], writer=writer).close()
        assert _other_run_warnings(record) == []
    own.close()


def test_version_dir_gives_a_fresh_folder_per_run(tmp_path):
    made = [version_dir(tmp_path / "runs") for _ in range(3)]
    assert [p.rsplit("/", 1)[1] for p in made] == ["version_0", "version_1", "version_2"]
    (tmp_path / "runs" / "version_5").mkdir()
    assert version_dir(tmp_path / "runs").endswith("version_3")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="root must be a directory path"):
        version_dir(tmp_path / "file.txt")


# --- point 3: privmon report --compare --------------------------------------------------------
def _rows(page, caption_id="The runs"):
    """The comparison table's rows: a list of cell texts per run."""
    section = page.split(f"<h2>{caption_id}</h2>", 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", section)[1:]  # the header first
    return [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r)] for r in rows]


def test_compare_renders_the_two_runs_side_by_side(two_runs, capsys):
    pytest.importorskip("matplotlib")
    root, dp, no_dp = two_runs
    assert main(["report", str(root)]) == 2  # one page per run: refused, naming both
    err = capsys.readouterr().err
    assert dp.run_id in err and no_dp.run_id in err
    assert main(["report", str(root), "--compare"]) == 0
    out = capsys.readouterr().out
    path = root / "privacy_comparison.html"
    assert f"report: {path}" in out
    page = path.read_text(encoding="utf-8")
    runs = {c.run_id: c for c in read_runs(root)}
    assert list(runs) == [dp.run_id, no_dp.run_id]
    rows = {row[1]: row for row in _rows(page)}
    assert set(rows) == {dp.run_id, no_dp.run_id}
    for monitor in (dp, no_dp):
        row, checks = rows[monitor.run_id], runs[monitor.run_id]
        assert row[0] == f"version_{0 if monitor is dp else 1}: {monitor.run_id[:8]}"
        assert row[2] == f"{STEPS // EVERY} ({EVERY}–{STEPS})"
        assert row[3] == verdict(checks).headline
        # the largest certified advantage, as the monitor computed it and the files hold it
        hits = certificates(checks)
        if hits:
            lower, step = max((h[3], -h[0]) for h in hits)
            assert row[4].startswith(f"{lower:.3f} (step {-step}, loss/")
            best = max(
                r.scalars[f"privacy/loss/{m}/lower"]
                for r in monitor.history
                for m in ("histogram", "kde")
            )
            assert lower == pytest.approx(best, abs=1e-6)
        else:
            assert row[4] == "none certified"
        eps = monitor.history[-1].epsilon
        if monitor is dp:
            assert eps is not None and eps > 0
            assert row[6] == f"{eps:.4g}"
            assert float(row[6]) == pytest.approx(monitor.accountant.get_epsilon(DELTA), rel=1e-3)
        else:
            assert row[6] == "— (no accountant)"
    # memorised without DP, bounded with it: the runs differ as they should
    assert run_summary(runs[no_dp.run_id])["level"] == "leakage"
    assert run_summary(runs[dp.run_id])["lower"] is None or (
        run_summary(runs[dp.run_id])["lower"] < run_summary(runs[no_dp.run_id])["lower"]
    )
    # one chart per query and method, one line per run on each; ε drawn for the DP run
    assert page.count('alt="loss (histogram): runs compared"') == 1
    assert 'alt="epsilon: runs compared"' in page
    # several folders name the same runs
    assert main(["report", str(root / "version_0"), str(root / "version_1"), "--compare"]) == 0
    assert "report: " in capsys.readouterr().out
    assert main(["report", str(root / "version_0"), str(root / "version_1")]) == 2
    assert "pass --compare" in capsys.readouterr().err


def test_comparison_chart_draws_one_line_per_run(two_runs):
    pytest.importorskip("matplotlib")
    from privmon.report.figures import comparison_figure

    root, dp, no_dp = two_runs
    runs = read_runs(root)
    fig = comparison_figure(runs, "loss", "histogram")
    left, right = fig.axes
    for ax, figure in ((left, "value"), (right, "lower")):
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == [c.label for c in runs]
        for line, monitor in zip(lines, (dp, no_dp), strict=True):
            ys = [r.scalars[f"privacy/loss/histogram/{figure}"] for r in monitor.history]
            np.testing.assert_allclose(line.get_ydata(), ys, rtol=1e-6)
        assert len({line.get_color() for line in lines}) == 2


# --- point 5: the page's reader ---------------------------------------------------------------
def test_the_verdicts_figure_is_in_the_table_it_summarises(two_runs):
    pytest.importorskip("matplotlib")
    root, *_ = two_runs
    checks = read_checks(root / "version_1")
    headline = verdict(checks).headline
    figure = re.search(r"≥ (\d\.\d{3}) at step (\d+)", headline)
    assert figure, headline
    page = render_html(checks)
    table = page.split("<h2>At the last check", 1)[1].split("</table>", 1)[0]
    assert f"{figure.group(1)} (step {figure.group(2)})" in html.unescape(table)


def test_terms_are_explained_and_tables_scroll(two_runs):
    pytest.importorskip("matplotlib")
    root, *_ = two_runs
    page = render_html(read_checks(root / "version_0"))
    glossary = page.split("<h2>Terms used on this page</h2>", 1)[1]
    for term in ("plug-in + McDiarmid", "W_N / U_N", "|f_p|", "MACE eq. 8", "certified lower"):
        # a link with the explanation as its tooltip where it is used, and an entry at the end
        assert f'title="{html.escape(GLOSSARY[term])}">{html.escape(term)}<' in page, term
        assert "<dt id=" in glossary and f">{html.escape(term)}</dt>" in glossary, term
    # every table header that is a term carries its explanation
    for header in ("plug-in + McDiarmid", "detectable", "TPR@FPR=1%", "AUC"):
        assert f'title="{html.escape(GLOSSARY[header])}">{html.escape(header)}</th>' in page
    # every table sits in a block that scrolls sideways inside the column
    assert ".scroll{overflow-x:auto" in page
    assert page.count("<table>") == page.count('<div class="scroll"><table>') > 0


def test_legends_sit_outside_the_data(two_runs):
    pytest.importorskip("matplotlib")
    root, *_ = two_runs
    checks = read_checks(root / "version_0")
    figures = [
        advantage_figure(checks, "loss", None),
        roc_figure(checks, "loss")[0],
        risk_figure(checks, "loss"),
    ]
    for fig in figures:
        fig.draw_without_rendering()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        assert legends
        for legend in legends:
            box = legend.get_window_extent()
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent()), fig
            # whole, inside the picture
            assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and 0 <= box.y0, fig


def test_a_run_resumed_through_load_state_dict_is_not_warned_about(tmp_path):
    """The documented resume: a fresh monitor in the run's folder loads the run's state before
    its first check; the folder then holds only this run (its id came with the state)."""
    members, nonmembers = _data()
    model = nn.Linear(64, 10)

    def monitor() -> PrivacyMonitor:
        return PrivacyMonitor(
            LossQuery(model),
            [members],
            [nonmembers],
            writer=str(tmp_path),
            sinks=[JsonlSink(tmp_path / "checks.jsonl")],
        )

    first = monitor()
    first.check(1)
    state = first.state_dict()
    first.close()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resumed = monitor()
        resumed.load_state_dict(state)
        resumed.check(2)
    assert _other_run_warnings(record) == []
    assert resumed.run_id == first.run_id
    resumed.close()
    with pytest.warns(UserWarning, match="already holds another run"):  # not resumed: said
        other = monitor()
        other.check(3)
    other.close()


def test_one_run_id_in_two_folders_is_two_runs_and_one_file_named_twice_is_one(tmp_path):
    """A run_id= given to two runs (two folders) leaves two runs to compare; a folder and its
    own checks.jsonl name one run."""
    for version, lower in (("version_0", 0.1), ("version_1", 0.2)):
        sink = JsonlSink(tmp_path / version / "checks.jsonl")
        sink.write(Report(step=10, scalars={"privacy/loss/histogram/lower": lower}, run_id="dp"))
        sink.close()
    runs = read_runs([tmp_path / "version_0", tmp_path / "version_1"])
    assert [c.run_id for c in runs] == ["dp", "dp"]
    assert [c.records[0]["scalars"]["privacy/loss/histogram/lower"] for c in runs] == [0.1, 0.2]
    once = read_runs([tmp_path / "version_0", tmp_path / "version_0" / "checks.jsonl"])
    assert [c.run_id for c in once] == ["dp"]
