"""The HTML privacy report: real monitor runs (JSON lines + TensorBoard) rendered into one
self-contained page whose verdict matches the data — a leaking run, a clean run, a DP run whose
ceiling is exceeded — plus the reading rules (TensorBoard-only, JSONL-only, resumed runs, two
runs in one log directory never merged), the charts (titles that say what is drawn, a colour per
line, query names drawn literally) and the verdict's rules on hand-made check lines."""

from __future__ import annotations

import base64
import html
import json
import math
import re
import shutil
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import traced_run
from opacus.accountants import RDPAccountant
from sklearn.datasets import load_digits
from torch import nn

from privmon import PrivacyMonitor, epsilon_lower_bound, tanh_bound
from privmon.cli import main
from privmon.queries import LossQuery
from privmon.report import SeveralRunsError, read_checks, verdict, write_report
from privmon.report.figures import advantage_figure
from privmon.sinks.jsonl import JsonlSink

PNG = b"\x89PNG\r\n\x1a\n"
STEPS, EVERY = 200, 50


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def mpl():
    return pytest.importorskip("matplotlib")


def _run(logdir, *, leak, accountant=None, jsonl=True, writer=True):
    """A wide MLP on 200 digits. leak=True trains on the audited members (it memorises them);
    leak=False trains on other records, so members and non-members are both unseen."""
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(x))
    x = torch.from_numpy((x[perm] / 16.0).astype(np.float32))
    y = torch.from_numpy(y[perm]).long()
    members, nonmembers, other = (
        (x[:200], y[:200]),
        (x[200:400], y[200:400]),
        (x[400:600], y[400:600]),
    )
    train = members if leak else other
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    monitor = PrivacyMonitor(
        LossQuery(model),
        [members],
        [nonmembers],
        every_n_steps=EVERY,
        planned_checks=STEPS // EVERY,  # the run's length is known: spend δ evenly
        writer=str(logdir) if writer else None,
        sinks=[JsonlSink(logdir / "checks.jsonl")] if jsonl else [],
        accountant=accountant,
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        F.cross_entropy(model(train[0]), train[1]).backward()
        opt.step()
        if accountant is not None:
            accountant.step(noise_multiplier=20.0, sample_rate=0.01)
        monitor.step(step)
    monitor.close()
    return monitor


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    out = {}
    for name, kw in {
        "leak": {"leak": True},
        "clean": {"leak": False},
        "jsonl_only": {"leak": True, "writer": False},
        "tb_only": {"leak": True, "jsonl": False},
    }.items():
        out[name] = (root / name, _run(root / name, **kw))
    with pytest.warns(UserWarning, match="exceeds the ceiling"):  # PrivacyViolationWarning
        with warnings.catch_warnings():  # Opacus: a tiny ε is reached at its largest RDP order
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            out["dp"] = (root / "dp", _run(root / "dp", leak=True, accountant=RDPAccountant()))
    return out


def _pngs(page):
    blobs = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    return [base64.b64decode(b, validate=True) for b in blobs]


def _certified(monitor):
    """(lower, step) of the largest certified lower bound over checks and methods."""
    best = None
    for r in monitor.history:
        for m in ("histogram", "kde"):
            lower = r.scalars[f"privacy/loss/{m}/lower"]
            if r.scalars[f"privacy/loss/{m}/epsilon_lower_bound"] > 0 and (
                best is None or lower > best[0]
            ):
                best = (lower, r.step)
    return best


def test_leaking_run_report(mpl, runs):
    logdir, monitor = runs["leak"]
    path = write_report(logdir)
    assert path == str(logdir / "privacy_report.html")
    page = open(path, encoding="utf-8").read()
    images = _pngs(page)
    # advantage, ROC, per-record risk
    assert len(images) >= 3
    assert all(img.startswith(PNG) and len(img) > 1000 for img in images)
    # Self-contained: no external resources.
    assert not re.search(r"""(src|href)=["']https?:""", page)
    lower, step = _certified(monitor)
    assert lower > 0.05  # the MLP memorised its 200 members
    assert f"Leakage detected: certified advantage ≥ {lower:.3f} at step {step}." in page
    assert "No measurable membership leakage" not in page
    # The most exposed records of the last check, and the ROC rebuilt from the PR curve.
    top = monitor.history[-1].queries["loss"].top_records
    assert len(top) == 10
    for rank, i in enumerate(top, 1):
        assert f"<td>{rank}</td><td>{i}</td>" in page
    assert "from the monitor&#x27;s membership PR curve" in page
    assert f"steps {EVERY}–{STEPS}" in page


def test_clean_run_report(mpl, runs, tmp_path):
    logdir, monitor = runs["clean"]
    assert all(
        r.scalars[f"privacy/loss/{m}/epsilon_lower_bound"] == 0.0
        for r in monitor.history
        for m in ("histogram", "kde")
    )
    out = tmp_path / "sub" / "clean.html"
    assert write_report(logdir, out=out) == str(out)
    page = out.read_text(encoding="utf-8")
    assert len(_pngs(page)) >= 2 and all(p.startswith(PNG) for p in _pngs(page))
    assert "No measurable membership leakage." in page
    assert "Leakage detected" not in page and "DP violation" not in page
    assert "not a proof of privacy" in page


def test_dp_violation_report(mpl, runs):
    # The run's certified bounds (level 1 − δ over all its checks) pass the ceiling ε ≈ 0.1
    # allows once the model has memorised its members.
    logdir, monitor = runs["dp"]
    flagged = [r for r in monitor.history if r.dp_violation]
    assert flagged and flagged[-1].step == STEPS
    page = open(write_report(logdir), encoding="utf-8").read()
    first = flagged[0]
    assert f"DP violation: at step {first.step} the certified lower bound" in page
    assert f"exceeds the ceiling {first.scalars['privacy/ceiling/eps_delta']:.3f}" in page
    assert "exchangeable" in page  # the caveat every ceiling statement carries
    assert len(_pngs(page)) >= 4  # + ε: accountant vs measured lower bounds


def test_tensorboard_only_gives_the_same_verdict(mpl, runs):
    logdir, monitor = runs["tb_only"]
    assert not (logdir / "checks.jsonl").exists()
    checks = read_checks(logdir)
    assert checks.kind == "tensorboard"
    assert checks.steps == [r.step for r in monitor.history]
    assert "loss" in checks.roc  # ROC from the PR curve
    page = open(write_report(logdir), encoding="utf-8").read()
    lower, step = _certified(monitor)
    # Event files hold float32 scalars.
    assert re.search(
        rf"Leakage detected: certified advantage ≥ (\d\.\d{{3}}) at step {step}\.", page
    )
    got = float(re.search(r"certified advantage ≥ (\d\.\d{3})", page).group(1))
    assert got == pytest.approx(lower, abs=1.5e-3)
    assert "not recorded there" in page  # top records exist only in the JSON lines


def test_jsonl_only_shows_operating_points(mpl, runs):
    logdir, _ = runs["jsonl_only"]
    checks = read_checks(logdir / "checks.jsonl")  # the file itself is accepted too
    assert checks.kind == "jsonl" and checks.roc == {}
    page = open(write_report(logdir), encoding="utf-8").read()
    assert "Only scalars were recorded" in page
    assert "Leakage detected" in page


def test_cli_entry_point(mpl, runs, tmp_path, capsys):
    logdir, _ = runs["clean"]
    out = tmp_path / "r.html"
    assert main(["report", str(logdir), "--out", str(out), "--title", "Run A"]) == 0
    text = capsys.readouterr().out
    assert "No measurable membership leakage." in text and str(out) in text
    assert "<title>Run A</title>" in out.read_text(encoding="utf-8")
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2


def test_a_second_run_in_the_same_logdir_is_never_merged(mpl, runs, tmp_path, capsys):
    # The false all-clear: a clean run written after a leaking one into the same log
    # directory replaced its checks step by step, and the page said "No measurable membership
    # leakage" with no note. JSON lines and event files both.
    (leak_dir, leak), (clean_dir, clean) = runs["leak"], runs["clean"]
    both, events_only = tmp_path / "both", tmp_path / "events"
    both.mkdir()
    with open(both / "checks.jsonl", "wb") as f:
        f.write((leak_dir / "checks.jsonl").read_bytes())
        f.write((clean_dir / "checks.jsonl").read_bytes())
    for src in (leak_dir, clean_dir):
        for event_file in src.glob("events.out.tfevents*"):
            shutil.copy(event_file, both)
    shutil.copytree(both, events_only, ignore=shutil.ignore_patterns("*.jsonl"))
    alone = {m.run_id: verdict(read_checks(d)) for d, m in (runs["leak"], runs["clean"])}
    assert alone[leak.run_id].level == "leakage" and alone[clean.run_id].level == "none"
    for source in (both, events_only):
        with pytest.raises(SeveralRunsError) as info:
            read_checks(source)
        assert [r.run_id for r in info.value.runs] == [leak.run_id, clean.run_id]
        assert f"{leak.run_id} (steps {EVERY}–{STEPS}, 4 " in str(info.value)
        for monitor in (leak, clean):
            checks = read_checks(source, run=monitor.run_id)
            assert checks.steps == [r.step for r in monitor.history]
            assert verdict(checks).level == alone[monitor.run_id].level
            assert "loss" in checks.roc  # the ROC of the same run's PR curve
    assert main(["report", str(both)]) == 2
    assert "holds 2 runs" in capsys.readouterr().err
    assert not (both / "privacy_report.html").exists()
    page = open(write_report(both, run=leak.run_id), encoding="utf-8").read()
    assert "Leakage detected" in page and f"run <code>{leak.run_id}</code>" in page
    assert f"Left out, never merged into it: {clean.run_id}" in page


def test_advantage_chart_says_what_it_draws(mpl, runs):
    from matplotlib.colors import to_hex

    # Without an accountant there is no ceiling: the chart must not say "vs DP ceiling".
    page = open(write_report(runs["clean"][0]), encoding="utf-8").read()
    assert 'alt="loss: advantage estimate and certified lower bound"' in page
    assert "ceiling" not in page.split("<h2>Advantage over training</h2>")[1].split("<h2>")[0]
    expected = {
        "clean": ("loss: advantage estimate and certified lower bound", 4),
        "dp": ("loss: advantage estimate and certified lower bound vs DP ceilings", 6),
    }
    for name, (title, n_lines) in expected.items():
        checks = read_checks(runs[name][0])
        fig = advantage_figure(checks, "loss", None)
        (ax,) = fig.axes
        assert ax.get_title() == title
        assert ax.get_ylim() == (-0.02, 1.02)  # a fixed range: nothing is clipped
        handles, labels = ax.get_legend_handles_labels()
        assert len(handles) == n_lines  # estimate and bound per method (+ the two ceilings)
        colors = [to_hex(h.get_color()) for h in handles]
        assert len(set(colors)) == n_lines, dict(zip(labels, colors, strict=True))


def test_query_names_are_drawn_literally(mpl, tmp_path):
    # A "$" starts matplotlib's mathtext: "$x^$" or "$\\alpha_$" failed to draw, and the report
    # with them. Every name is drawn as written and shown escaped on the page.
    names = ["$x^$", "cost $5, $\\alpha_$ {}^_\\"]
    lines = []
    for step in (10, 20):
        scalars = {}
        for name in names:
            scalars.update(
                {
                    f"privacy/{name}/histogram/value": 0.3,
                    f"privacy/{name}/histogram/lower": 0.1,
                    f"privacy/{name}/histogram/epsilon_lower_bound": 0.2,
                    f"privacy/{name}/auc": 0.6,
                    f"privacy/{name}/tpr@fpr=0.01": 0.05,
                    f"privacy/{name}/risk/q50": 0.2,
                    f"privacy/{name}/risk/n_above_0.5": 3.0,
                }
            )
        scalars.update({"privacy/epsilon": 1.0, "privacy/ceiling/eps_delta": 0.46})
        lines.append({"step": step, "scalars": scalars, "epsilon": 1.0})
    checks = _write(tmp_path, lines)
    assert checks.queries() == names
    page = open(write_report(tmp_path), encoding="utf-8").read()
    assert len(_pngs(page)) == 1 + 3 * len(names)  # ε, and advantage, ROC, risk per query
    for name in names:
        assert f'alt="{html.escape(name)}: advantage estimate' in page


# --- the verdict's rules on hand-made check lines ------------------------------------------------
def _line(step, lower, value=None, prior=0.5, **extra):
    s = {
        "privacy/q/histogram/value": value if value is not None else lower,
        "privacy/q/histogram/lower": lower,
        "privacy/q/histogram/epsilon_lower_bound": float(epsilon_lower_bound(lower, prior=prior)),
    }
    s.update(extra)
    return {"step": step, "scalars": s, "top_records": {"q": [3, 1]}, "dp_violation": False}


def _write(tmp_path, lines):
    with open(tmp_path / "checks.jsonl", "w", encoding="utf-8") as f:
        for line in lines:  # one run, its id first as a JsonlSink writes it
            f.write(json.dumps({"run_id": "c3" * 16, **line}) + "\n")
    return read_checks(tmp_path)


def test_verdict_tiers(tmp_path):
    v = verdict(_write(tmp_path, [_line(10, 0.0, 0.02), _line(20, 0.0, 0.01)]))
    assert v.level == "none" and v.headline == "No measurable membership leakage."
    # One certificate at an earlier check only: the bounds hold over the whole run, so it is
    # leakage all the same.
    v = verdict(_write(tmp_path, [_line(10, 0.12), _line(20, 0.0), _line(30, 0.0)]))
    assert v.level == "leakage"
    assert v.headline == "Leakage detected: certified advantage ≥ 0.120 at step 10."
    # A certificate at the last check: leakage detected, the largest certificate is quoted.
    v = verdict(_write(tmp_path, [_line(10, 0.0), _line(20, 0.3), _line(30, 0.2)]))
    assert v.level == "leakage"
    assert v.headline == "Leakage detected: certified advantage ≥ 0.300 at step 20."


def test_verdict_reads_the_floor_from_the_epsilon_bound(tmp_path):
    # Prior 0.2: the floor |2p − 1| = 0.6 needs no leakage; the verdict must not call it leakage.
    v = verdict(_write(tmp_path, [_line(10, 0.6, prior=0.2), _line(20, 0.6, prior=0.2)]))
    assert v.level == "none"
    v = verdict(_write(tmp_path, [_line(10, 0.6, prior=0.2), _line(20, 0.7, prior=0.2)]))
    assert v.level == "leakage"
    assert "trivial floor at this run's prior is 0.600" in v.details[0]


def test_verdict_dp_violation_and_resumed_lines(tmp_path):
    ceiling = float(tanh_bound(0.5, delta=1e-5))
    lines = [
        _line(10, 0.05, **{"privacy/epsilon": 0.5, "privacy/ceiling/eps_delta": ceiling}),
        _line(20, 0.4, **{"privacy/epsilon": 0.5, "privacy/ceiling/eps_delta": ceiling}),
        # A run resumed from the step-10 checkpoint re-wrote step 20: the later line wins.
        _line(20, 0.1, **{"privacy/epsilon": 0.5, "privacy/ceiling/eps_delta": ceiling}),
    ]
    for line in lines:
        line["epsilon"] = 0.5
    checks = _write(tmp_path, lines)
    assert checks.steps == [10, 20]
    assert checks.records[1]["scalars"]["privacy/q/histogram/lower"] == 0.1
    assert verdict(checks).level == "leakage"  # 0.1 < ceiling 0.245
    lines[2]["scalars"]["privacy/q/histogram/lower"] = 0.3
    lines[2]["dp_violation"] = True
    v = verdict(_write(tmp_path, lines))
    assert v.level == "violation"
    assert v.headline == (
        f"DP violation: at step 20 the certified lower bound on the membership advantage "
        f"(q/histogram: 0.300) exceeds the ceiling {ceiling:.3f} that (ε = 0.5, δ)-DP allows."
    )
    assert any("exchangeable" in d for d in v.details)


def test_nan_scalars_and_empty_runs(tmp_path, mpl):
    line = _line(10, 0.0)
    line["scalars"]["privacy/q/histogram/value"] = None  # the sink writes NaN as null
    checks = _write(tmp_path, [line])
    assert math.isnan(checks.records[0]["scalars"]["privacy/q/histogram/value"])
    assert verdict(checks).level == "none"
    assert "No measurable" in open(write_report(tmp_path), encoding="utf-8").read()
    (tmp_path / "checks.jsonl").write_text("")
    assert verdict(read_checks(tmp_path)).level == "empty"
    assert "No checks recorded" in open(write_report(tmp_path), encoding="utf-8").read()


def test_the_page_shows_loss_tnr_beside_the_advantage_and_the_most_vulnerable_records(
    mpl, tmp_path
):
    """LOSS TNR named as an estimate beside the advantage and its certified lower bound; each
    source's most vulnerable records by LT-IQR, as the last check's report lists them."""
    _, reports = traced_run([JsonlSink(tmp_path / "checks.jsonl")])
    page = open(write_report(tmp_path), encoding="utf-8").read()
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    section = text[text.index("Loss traces and the loss tail") : text.index("All checks")]
    assert "not a certified bound" in section and "LOSS TNR at FPR 0.1%" in section
    last = reports[-1]
    cells = section.split()
    value = last.scalars["privacy/loss/histogram/value"]
    assert cells[cells.index("histogram") + 1] == f"{value:.3g}"
    for source in ("training_loop", "loss"):
        top = last.vulnerable[source]
        after = page[page.index("Loss traces and the loss tail") :]
        after = after[after.index(f"<h3>{source}</h3>") :]
        cells = re.sub(r"<[^>]+>", " ", after[: after.index("</table>")]).split()
        rows = cells[cells.index("LT-IQR") + 1 :]
        assert [int(x) for x in rows[1::3]] == list(top.records)
        assert [float(x) for x in rows[2::3]] == pytest.approx(top.scores, rel=1e-3)
