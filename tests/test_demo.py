"""End-to-end tests of ``privmon demo``: the GAN on the digits under the monitor, summary.json,
checks.jsonl and the TensorBoard event files agreeing with each other; the budget / early-stopping
path; the Opacus path; the console entry point and its argument errors."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from tensorboard.backend.event_processing import event_accumulator

import privmon
from privmon.cli import main
from privmon.demo import DemoConfig, format_summary, run_demo
from privmon.report import read_checks, verdict

QUERIES = ("disc", "nn_dist", "hybrid", "domias")
METHODS = ("histogram", "kde")
KEYS = [f"{q}/{m}" for q in QUERIES for m in METHODS]
FIELDS = ("value", "lower", "lower_check", "plugin", "plugin_upper")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Two intra-op threads on a shared 2-core machine make the tiny MLPs ~10x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _read_jsonl(path):
    """The checks' lines (a run with a budget ends with a line of its outcome, not a check)."""
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line, parse_constant=pytest.fail) for line in f]
    return [line for line in lines if "step" in line]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("demo")
    summary = run_demo(DemoConfig(logdir=str(logdir), steps=150, every_n_steps=50, progress=False))
    return logdir, summary


def test_summary_json_matches_returned_dict(demo):
    logdir, summary = demo
    with open(logdir / "summary.json", encoding="utf-8") as f:
        on_disk = json.load(f, parse_constant=pytest.fail)
    assert on_disk == summary
    assert summary["steps"] == 150
    assert summary["checks"] == 3
    assert summary["failed_checks"] == 0
    assert summary["stopped_at"] is None and summary["stop_reason"] is None
    assert summary["epsilon"] is None and summary["ceilings"] == {}
    assert summary["dp_violation"] is False
    assert summary["config"]["steps"] == 150 and summary["config"]["every_n_steps"] == 50
    assert summary["config"]["logdir"] == str(logdir)
    assert "progress" not in summary["config"]
    # the verdict from the monitor's history is the one privmon report reads from the files
    assert summary["verdict"] == verdict(read_checks(logdir)).headline
    assert format_summary(summary).splitlines()[-1] == f"verdict: {summary['verdict']}"


def test_the_verdicts_figure_is_in_the_console_table(demo):
    # Issue #32: the console verdict named a certified advantage found nowhere in the table.
    logdir, summary = demo
    checks = _read_jsonl(logdir / "checks.jsonl")
    table = format_summary(summary).splitlines()
    for key in KEYS:
        lowers = [c["scalars"][f"privacy/{key}/lower"] for c in checks]
        peak = summary["peak"][key]
        assert peak["lower"] == pytest.approx(max(lowers), rel=1e-7)
        assert peak["lower_step"] == 50 * (lowers.index(max(lowers)) + 1)
        (row,) = [line for line in table if line.split()[0] == key]
        assert row.endswith(f"{peak['lower']:.3f} ({peak['lower_step']})")
    figure = re.search(r"≥ (\d\.\d{3}) at step (\d+)", summary["verdict"])
    if figure is None:  # nothing certified: every peak lower bound is at the floor
        assert all(summary["peak"][k]["lower"] <= 1e-9 for k in KEYS), summary["verdict"]
    else:
        assert any(line.endswith(f"{figure[1]} ({figure[2]})") for line in table), table


def test_final_and_peak_figures(demo):
    logdir, summary = demo
    checks = _read_jsonl(logdir / "checks.jsonl")
    last = checks[-1]["scalars"]
    expected_keys = set(KEYS) | {f"{q}/top_records" for q in QUERIES}
    assert set(summary["final"]) == expected_keys
    assert set(summary["peak"]) == set(KEYS)
    for key in KEYS:
        f = summary["final"][key]
        for field in FIELDS:
            assert 0.0 <= f[field] <= 1.0, (key, field)
            assert f[field] == last[f"privacy/{key}/{field}"]
        # the run-level bound spends a share of δ: never above the one-check bound
        assert f["lower"] <= f["lower_check"]
        assert f["lower"] <= f["value"] <= f["plugin_upper"]
        assert f["plugin"] <= f["plugin_upper"]
        query = key.split("/")[0]
        if query == "hybrid":  # a 2-d query: no AUC
            assert "auc" not in f
        else:
            assert f["auc"] == last[f"privacy/{query}/auc"]
        # Peak: the first check with the largest debiased value.
        values = [c["scalars"][f"privacy/{key}/value"] for c in checks]
        peak = summary["peak"][key]
        assert peak["step"] in (50, 100, 150)
        assert peak["value"] == pytest.approx(max(values), rel=1e-7)  # the history's float32
        assert peak["step"] == 50 * (values.index(max(values)) + 1)
    for q in QUERIES:
        top = summary["final"][f"{q}/top_records"]
        assert top == checks[-1]["top_records"][q]
        assert len(top) == 10 and len(set(top)) == 10
        assert all(0 <= i < 200 for i in top)  # member indices (n_members = 200)


def test_checks_jsonl_one_line_per_check(demo):
    logdir, summary = demo
    checks = _read_jsonl(logdir / "checks.jsonl")
    assert len(checks) == summary["checks"]
    assert [c["step"] for c in checks] == [50, 100, 150]
    for c in checks:
        for key in KEYS:
            for field in FIELDS:
                assert f"privacy/{key}/{field}" in c["scalars"]
        assert set(c["top_records"]) == set(QUERIES)
        assert c["epsilon"] is None and c["dp_violation"] is False


def test_event_files_hold_the_same_scalars(demo):
    logdir, _ = demo
    events = [p for p in os.listdir(logdir) if p.startswith("events.out.tfevents")]
    assert len(events) == 1
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    )
    acc.Reload()
    checks = _read_jsonl(logdir / "checks.jsonl")
    assert set(acc.Tags()["scalars"]) == set(checks[0]["scalars"])  # no axis series (#38)
    for key in KEYS:
        for field in FIELDS:
            tag = f"privacy/{key}/{field}"
            got = acc.Scalars(tag)
            assert [e.step for e in got] == [50, 100, 150]
            want = [np.float32(c["scalars"][tag]) for c in checks]
            assert [np.float32(e.value) for e in got] == want, tag
    for q in ("disc", "nn_dist", "domias"):  # 1-d queries: risk histogram and PR curve
        assert f"privacy/{q}/member_risk" in acc.Tags()["histograms"]
        assert f"privacy/{q}/membership_pr" in acc.Tags()["tensors"]


def test_budget_stops_at_the_second_check(tmp_path, monkeypatch):
    # The demo's GAN proves no leak in 20 steps, and a budget below 0 is refused: the demo's
    # stopping watches its discriminator's AUC instead, above a budget of 0 at every check.
    def on_auc(metric, budget, *, use, patience):
        assert (metric, budget, use, patience) == ("disc/histogram", 0.0, "lower", 1)
        return privmon.PrivacyEarlyStopping("privacy/disc/auc", budget, patience=patience)

    monkeypatch.setattr("privmon.demo.PrivacyEarlyStopping", on_auc)
    summary = run_demo(
        DemoConfig(logdir=str(tmp_path), steps=150, every_n_steps=10, budget=0.0, progress=False)
    )
    # patience 1: the second check in a row stops.
    assert summary["stopped_at"] == 20
    assert summary["steps"] == 20
    assert summary["checks"] == 2
    checks = _read_jsonl(tmp_path / "checks.jsonl")
    assert [c["step"] for c in checks] == [10, 20]
    auc = checks[-1]["scalars"]["privacy/disc/auc"]
    assert auc > 0 and summary["stop_reason"] == (
        f"step 20: privacy figure {auc:.4f} above the budget 0.0000 "
        "for 2 consecutive check(s) (patience 1)"
    )
    with open(tmp_path / "summary.json", encoding="utf-8") as f:
        assert json.load(f) == summary
    # the console says the budget and the stop (issue #38), as the summary's outcome does
    outcome = summary["stopping"]
    assert (outcome["stopped_step"], outcome["threshold"]) == (20, 0.0)
    assert outcome["sentence"].startswith("Early stopping stopped training at step 20")
    assert outcome["sentence"] in format_summary(summary)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Opacus: secure RNG off, full backward hook
def test_dp_demo_reports_epsilon_and_ceilings(tmp_path):
    summary = run_demo(
        DemoConfig(logdir=str(tmp_path), steps=20, every_n_steps=10, dp=True, progress=False)
    )
    eps = summary["epsilon"]
    assert eps is not None and math.isfinite(eps) and eps > 0
    # Independent RDP accounting: Poisson rate 1 / len(loader) = 1 / ceil(200 / 64), one step
    # per discriminator update, with the noise Opacus chose to spend target_epsilon = 3 over the
    # planned epochs (ceil(20 / 4) = 5 epochs of 4 steps).
    sigma = get_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sample_rate=1 / 4, epochs=5, accountant="rdp"
    )
    shadow = RDPAccountant()
    for _ in range(summary["steps"]):
        shadow.step(noise_multiplier=sigma, sample_rate=1 / 4)
    assert eps == pytest.approx(shadow.get_epsilon(1e-5), rel=1e-9)
    assert eps <= 3.0
    assert summary["ceilings"]["tanh"] == pytest.approx(privmon.tanh_bound(eps), rel=1e-12)
    assert summary["ceilings"]["eps_delta"] == pytest.approx(
        privmon.tanh_bound(eps, delta=1e-5), rel=1e-12
    )
    checks = _read_jsonl(tmp_path / "checks.jsonl")
    assert [c["step"] for c in checks] == [10, 20]
    assert checks[0]["epsilon"] < checks[1]["epsilon"] == eps
    assert "epsilon = " in format_summary(summary)


def test_console_entry_point(tmp_path):
    logdir = tmp_path / "cli"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "privmon.cli", "demo", "--steps", "60", "--every", "30"]
    proc = subprocess.run(
        [*cmd, "--logdir", str(logdir), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "it/s" not in proc.stderr  # --quiet: no progress bar
    with open(logdir / "summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert (summary["steps"], summary["checks"]) == (60, 2)
    out = proc.stdout.splitlines()
    header = ["query/method", "value", "lower", "plugin", "AUC", "peak", "(step)"]
    assert out[0].split() == [*header, "peak", "lower", "(step)"]
    rows = {line.split()[0]: line.split() for line in out[1 : 1 + len(KEYS)]}
    assert list(rows) == KEYS
    for key, cells in rows.items():
        f = summary["final"][key]
        assert cells[1:4] == [format(f[k], ".3f") for k in ("value", "lower", "plugin")]
    assert f"60 steps, 2 checks in {summary['wall_seconds']:.1f} s" in out
    # the one-line verdict, the one privmon report gives the run's files
    headline = verdict(read_checks(logdir)).headline
    assert f"verdict: {headline}" in out and summary["verdict"] == headline
    assert f"summary: {logdir}/summary.json" in out
    assert f"open:    tensorboard --logdir {logdir}" in out
    assert any(p.startswith("events.out.tfevents") for p in os.listdir(logdir))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--steps", "0"], "--steps: must be a positive integer, got 0"),
        (["demo", "--every", "-3"], "--every: must be a positive integer, got -3"),
        (["demo", "--steps", "ten"], "--steps: invalid"),
        (["demo", "--budget", "low"], "--budget: invalid float value"),
        ([], "the following arguments are required: command"),
        (["train"], "invalid choice: 'train'"),
    ],
)
def test_bad_cli_arguments_exit_nonzero_with_a_message(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--logdir", str(tmp_path)] if argv[:1] == ["demo"] else argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("usage: privmon")
    assert os.listdir(tmp_path) == []  # nothing was run
