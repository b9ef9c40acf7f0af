"""Issue #31, on checkpoints, run files and the monitor's settings: each case its reproduction.

A checkpoint folder written in a spawned process resumes in the main one, and a damaged one is
refused; TensorBoard runs beside a JSON-lines run stop ``privmon report``, naming them; figures
out of their range are errors naming the line; a run id, a δ and an early-stopping threshold that
would mislead are refused or said; a run that outlives its plan is told so; and the pooled
certificate's floor at one success in ten."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from privmon import PrivacyEarlyStopping, PrivacyMonitor
from privmon._validation import check_count, check_open_unit, check_positive, check_unit
from privmon.audit import random_halves, train_ensemble
from privmon.audit.checkpoints import qualified_name
from privmon.cli import main
from privmon.estimators.certificate import poisson_binomial_lower
from privmon.queries import CallableQuery
from privmon.report import Report, SeveralRunsError, checks_from_reports, read_checks
from privmon.sinks import JsonlSink, TensorBoardSink

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- checkpoints ----------------------------------------------------------------------------------
def per_record_ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _as_module(fn, module):
    """``fn`` as defined in the module named ``module`` (``'__mp_main__'``: the main script in a
    process started by ``mp.spawn``)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
    copy.__qualname__, copy.__module__ = fn.__qualname__, module
    return copy


def test_a_function_of_the_main_script_has_one_fingerprint_in_every_process():
    spawned, main_ = _as_module(per_record_ce, "__mp_main__"), _as_module(per_record_ce, "__main__")
    assert qualified_name(spawned) == qualified_name(main_) == "__main__.per_record_ce"
    assert qualified_name(per_record_ce).endswith("test_reliability_runs.per_record_ce")


SPAWNED = """
import multiprocessing, sys
import torch
import torch.nn.functional as F
from privmon.audit import random_halves, train_ensemble

def loss(out, y):
    return F.cross_entropy(out, y, reduction="none")

def other_loss(out, y):
    return F.cross_entropy(out, y, reduction="none")

def loss_changed(out, y):
    return F.cross_entropy(out, y, reduction="none") * 2

def train(folder, loss_fn=loss):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=gen), torch.randint(0, 2, (16,), generator=gen)
    return train_ensemble(
        lambda: torch.nn.Linear(3, 2), (x, y), random_halves(16, 2, seed=0), loss_fn=loss_fn,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), epochs=2, seed=0, checkpoint_dir=folder,
    )

if __name__ == "__main__":
    folder = sys.argv[1]
    child = multiprocessing.get_context("spawn").Process(target=train, args=(folder,))
    child.start()
    child.join()
    assert child.exitcode == 0, child.exitcode
    print("resumed", train(folder).trained_by.tolist())
    for name in ("other_loss", "loss_changed"):
        renamed = "loss" if name == "loss_changed" else name
        loss_changed.__name__ = loss_changed.__qualname__ = renamed
        try:
            train(folder, loss_fn=loss_changed if name == "loss_changed" else other_loss)
        except ValueError as err:
            print(name, "refused:", err)
"""


def test_a_checkpoint_folder_written_by_a_spawned_process_resumes_in_the_main_one(tmp_path):
    # Partial 8: the spawned process saw loss.__module__ == '__mp_main__', the main one
    # '__main__': the folder was refused although the function is the same. A really different
    # function (another name; the same name with another body) is still refused.
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SPAWNED))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "resumed [-1, -1]", run.stdout  # both models loaded, none trained again
    assert lines[1].startswith("other_loss refused:") and "loss_fn (" in lines[1]
    assert "'__main__.loss' in the folder, '__main__.other_loss' here" in lines[1]
    assert lines[2].startswith("loss_changed refused:") and "loss_fn code (" in lines[2]


def _data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(40, 6, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (40,), generator=gen
    )


def _train(folder):
    x, y = _data()
    return train_ensemble(
        lambda: torch.nn.Linear(6, 3, dtype=torch.float64),
        (x, y),
        random_halves(40, 3, seed=0),
        loss_fn=per_record_ce,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        epochs=2,
        seed=0,
        checkpoint_dir=folder,
    )


def test_one_flipped_bit_in_a_checkpoints_parameters_is_refused(tmp_path):
    # Hazard: model 2's weight, one bit flipped in the file, loaded silently (2.4e-4 off).
    full = _train(tmp_path)
    path = tmp_path / "model-000002.pt"
    data = bytearray(path.read_bytes())
    weight = full.params["weight"][2].contiguous().numpy().tobytes()
    at = data.find(weight)
    assert at >= 0 and data.find(weight, at + 1) < 0
    data[at + len(weight) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model-000002\.pt .*digest.* remove it") as info:
        _train(tmp_path)
    assert "parameters" in str(info.value) or "contents" in str(info.value)
    path.unlink()
    again = _train(tmp_path)  # retrained: the same model, bit for bit
    np.testing.assert_array_equal(again.trained_by, [-1, -1, 0])
    assert torch.equal(again.params["weight"], full.params["weight"])


# --- runs and reports -----------------------------------------------------------------------------
FIGURES = {
    "privacy/q/histogram/value": 0.1,
    "privacy/q/histogram/lower": 0.0,
    "privacy/q/histogram/epsilon_lower_bound": 0.0,
}


def _tensorboard_run(folder, run_id, steps=(10, 20)):
    sink = TensorBoardSink(str(folder))
    for step in steps:
        sink.write(Report(step=step, scalars=FIGURES, run_id=run_id))
    sink.close()


def _jsonl_run(path, run_id, steps=(10, 20, 30)):
    sink = JsonlSink(str(path))
    for step in steps:
        sink.write(Report(step=step, scalars=FIGURES, run_id=run_id))
    sink.close()


@pytest.mark.parametrize("layout", ["top level", "sub-folders"])
def test_tensorboard_runs_beside_a_jsonl_run_stop_the_report_naming_them(tmp_path, capsys, layout):
    # Partial 9: TensorBoard events of runs A and B, the JSON lines of run C: the report read C,
    # exit 0, nothing on stderr. The guide promises it stops, and stderr names the runs left out.
    logdir = tmp_path / "log"
    a, b = (logdir, logdir) if layout == "top level" else (logdir / "a", logdir / "b")
    _tensorboard_run(a, "run-a", steps=(10, 20))
    _tensorboard_run(b, "run-b", steps=(10,))
    _jsonl_run(logdir / "checks.jsonl", "run-c")
    assert main(["report", str(logdir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 3 runs" in err, err
    for needle in ("run-a (steps 10–20, 2 checks", "run-b (step 10, 1 check", "run-c (steps 10–30"):
        assert needle in err, (needle, err)
    assert "--run ID" in err and not (logdir / "privacy_report.html").exists()
    with pytest.raises(SeveralRunsError) as info:
        read_checks(logdir)
    assert [r.run_id for r in info.value.runs] == ["run-a", "run-b", "run-c"]

    # Each run on its own, the others named as left out: C from its lines, A from its events.
    assert main(["report", str(logdir), "--run", "run-c"]) == 0
    err = capsys.readouterr().err
    assert "reported run run-c only" in err and "run-a (" in err and "run-b (" in err
    checks = read_checks(logdir, run="run-c")
    assert (checks.kind, checks.steps) == ("jsonl", [10, 20, 30])
    assert [r.run_id for r in checks.other_runs] == ["run-a", "run-b"]
    assert any("Left out, never merged" in n and "run-a" in n for n in checks.notes)
    checks = read_checks(logdir, run="run-a")
    assert (checks.kind, checks.run_id, checks.steps) == ("tensorboard", "run-a", [10, 20])
    assert sorted(r.run_id for r in checks.other_runs) == ["run-b", "run-c"]
    assert main(["report", str(logdir), "--run", "run-a"]) == 0
    err = capsys.readouterr().err
    assert "reported run run-a only" in err and "run-b (" in err and "run-c (" in err
    # the JSON-lines file named itself: its run alone, as before
    assert read_checks(logdir / "checks.jsonl").run_id == "run-c"


def test_the_same_run_in_json_lines_and_event_files_is_one_run(tmp_path, capsys):
    _tensorboard_run(tmp_path / "tb", "run-c")
    _jsonl_run(tmp_path / "checks.jsonl", "run-c")
    checks = read_checks(tmp_path)
    assert (checks.kind, checks.run_id, checks.other_runs) == ("jsonl", "run-c", [])
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


def test_tensorboard_runs_in_two_sub_folders_name_their_runs(tmp_path):
    _tensorboard_run(tmp_path / "a", "run-a")
    _tensorboard_run(tmp_path / "b", "run-b")
    with pytest.raises(SeveralRunsError, match="holds 2 runs") as info:
        read_checks(tmp_path)
    assert [r.run_id for r in info.value.runs] == ["run-a", "run-b"]
    checks = read_checks(tmp_path, run="run-b")
    assert checks.source == str(tmp_path / "b") and checks.steps == [10, 20]
    assert [r.run_id for r in checks.other_runs] == ["run-a"]


LINE = '{{"run_id": "c3", "step": {step}, "scalars": {{"privacy/q/histogram/lower": {lower}}}}}'


@pytest.mark.parametrize(
    ("lower", "needle"),
    [
        ("1e400", "privacy/q/histogram/lower"),
        ("7.0", "privacy/q/histogram/lower"),
        ("-Infinity", "privacy/q/histogram/lower"),
        ("NaN", "privacy/q/histogram/lower"),
        ("-1.5", "[-1, 1]"),
    ],
)
def test_a_figure_out_of_its_range_is_an_error_naming_the_line(tmp_path, capsys, lower, needle):
    # Partial 10: "Leakage detected: certified advantage ≥ inf" (1e400), "≥ 7.000", "≥ -inf".
    src = tmp_path / "checks.jsonl"
    src.write_text(
        LINE.format(step=10, lower="0.1") + "\n" + LINE.format(step=20, lower=lower) + "\n"
    )
    with pytest.raises(ValueError, match="line 2") as info:
        read_checks(src)
    assert needle in str(info.value)
    assert main(["report", str(src), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and needle in err and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize(
    ("tag", "value", "valid"),
    [
        ("privacy/q/histogram/value", 1.5, "[-1, 1]"),
        ("privacy/q/histogram/epsilon_lower_bound", -0.5, "[0, inf]"),
        ("privacy/ceiling/eps_delta", 2.0, "[0, 1]"),
        ("privacy/canaries/fdp/epsilon_lower_bound", -1.0, "[0, inf]"),
        ("privacy/epsilon", -3.0, "[0, inf]"),
    ],
)
def test_every_bounded_figure_is_checked(tmp_path, tag, value, valid):
    src = tmp_path / "checks.jsonl"
    src.write_text(f'{{"run_id": "c3", "step": 1, "scalars": {{"{tag}": {value}}}}}\n')
    with pytest.raises(ValueError, match="line 1") as info:
        read_checks(src)
    assert tag in str(info.value) and valid in str(info.value)
    with pytest.raises(ValueError, match=r"report 0 \(step 1\)"):
        checks_from_reports([Report(step=1, scalars={tag: value}, run_id="c3")])


def test_figures_in_range_and_not_computed_are_read():
    # null (the sink's NaN / inf), an ε bound of inf from memory, the range's ends
    scalars = {
        "privacy/q/histogram/lower": 1.0,
        "privacy/q/histogram/value": -1.0,
        "privacy/q/histogram/epsilon_lower_bound": float("inf"),
        "privacy/q/kde/lower": float("nan"),
        "privacy/epsilon": float("inf"),
    }
    checks = checks_from_reports([Report(step=1, scalars=scalars, run_id="c3")])
    assert checks.records[0]["scalars"]["privacy/q/histogram/lower"] == 1.0


def test_a_tensorboard_figure_out_of_range_is_an_error_naming_the_file(tmp_path):
    sink = TensorBoardSink(str(tmp_path))
    sink.write(Report(step=5, scalars={"privacy/q/histogram/lower": 7.0}, run_id="c3"))
    sink.close()
    with pytest.raises(ValueError, match=r"tfevents.*step 5.*privacy/q/histogram/lower"):
        read_checks(tmp_path)


def test_a_run_named_legacy_is_selected_like_any_other(tmp_path, capsys):
    # Hazard: "legacy" once named the runs written before run ids; those are no longer read, so
    # a run id "legacy" is one like any other.
    _jsonl_run(tmp_path / "checks.jsonl", "legacy", steps=(10,))
    _jsonl_run(tmp_path / "checks.jsonl", "other", steps=(10, 20))
    checks = read_checks(tmp_path, run="legacy")
    assert (checks.run_id, checks.steps) == ("legacy", [10])
    assert main(["report", str(tmp_path), "--run", "legacy"]) == 0
    assert "reported run legacy only" in capsys.readouterr().err


# --- the monitor's settings -----------------------------------------------------------------------
def _sets(shift=0.3, n=200):
    g = torch.Generator().manual_seed(0)
    members, nonmembers = torch.randn(n, generator=g) + shift, torch.randn(n, generator=g)
    return [members[i : i + 50] for i in range(0, n, 50)], [
        nonmembers[i : i + 50] for i in range(0, n, 50)
    ]


def _monitor(**kw):
    members, nonmembers = _sets()
    kw.setdefault("methods", ("histogram",))
    return PrivacyMonitor(
        CallableQuery(lambda b: b, name="s"), members, nonmembers, every_n_steps=1, **kw
    )


@pytest.mark.parametrize("bad", [12345, None, b"ab", "", "latest"])
def test_a_run_id_that_could_not_be_read_back_is_refused_where_it_is_set(tmp_path, bad):
    # Hazard: monitor.run_id = 12345 wrote lines that privmon report refuses ("run_id must be a
    # string") — the run's own file unreadable.
    monitor = _monitor(sinks=[JsonlSink(str(tmp_path / "checks.jsonl"))])
    with pytest.raises(ValueError, match="run_id must be a non-empty string") as info:
        monitor.run_id = bad
    assert ("latest" in str(info.value)) == (bad == "latest")
    monitor.run_id = "my-run"  # a string is the user's to choose
    monitor.check(1)
    monitor.close()
    assert read_checks(tmp_path).run_id == "my-run"


@pytest.mark.parametrize("check", [check_open_unit, check_unit, check_positive, check_count])
def test_a_number_given_as_a_string_is_refused(check):
    # Hazard: delta="1e-5" was accepted (float("1e-5")).
    for bad in ("1e-5", b"0.5", "1"):
        with pytest.raises(ValueError, match="arg must be") as info:
            check(bad, name="arg")
        assert repr(bad) in str(info.value)


def test_the_monitor_refuses_delta_as_a_string():
    expected = r"delta must be a number in the open interval \(0, 1\), got str '1e-5'"
    with pytest.raises(ValueError, match=expected):
        _monitor(delta="1e-5")
    with pytest.raises(ValueError, match="interval_delta must be a number"):
        _monitor(interval_delta="0.05")
    with pytest.raises(ValueError, match="prior must be a number"):
        _monitor(prior="0.5")


def test_early_stopping_on_value_at_the_priors_floor_says_it_stops_on_noise():
    # Hazard: at prior 0.75 every advantage figure is at least |2p − 1| = 0.5; the debiased
    # estimate of a run that leaks nothing is above 0.5 at about every other check.
    floor = PrivacyEarlyStopping("s/histogram", 0.5, use="value")
    expected = r"use='value'.* 0\.5 at prior 0\.75 stops on noise"
    with pytest.warns(UserWarning, match=expected) as record:
        _monitor(prior=0.75, early_stopping=floor)
    assert record[0].filename == __file__  # said where it is configured
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _monitor(prior=0.75, early_stopping=PrivacyEarlyStopping("s/histogram", 0.5))  # lower
        _monitor(prior=0.75, early_stopping=PrivacyEarlyStopping("s/histogram", 0.6, use="value"))
    with pytest.warns(UserWarning, match="noise"):  # prior ½: the floor is 0
        _monitor(early_stopping=PrivacyEarlyStopping("s/histogram", 0.0, use="value"))
    assert "noise" in (PrivacyEarlyStopping.__doc__ or "")


def test_a_run_that_outlives_its_plan_is_told_once():
    # Hazard: planned_checks=2 and 40 checks: check 3's per-figure δ drops 9.1× with no word.
    monitor = _monitor(planned_checks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = [monitor.check(k) for k in (1, 2)]
    with pytest.warns(UserWarning, match=r"check 3 .*planned_checks=2.* 9\.1× smaller") as record:
        third = monitor.check(3)
    assert len([w for w in record if "planned_checks" in str(w.message)]) == 1
    assert record[0].filename == __file__
    ratio = first[1].scalars["privacy/certify_delta"] / third.scalars["privacy/certify_delta"]
    assert ratio == pytest.approx(9.12, abs=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor.check(4)  # once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unplanned = _monitor()  # a run of unknown length has no plan to outlive
        for k in (1, 2, 3):
            unplanned.check(k)


# --- the certificate ------------------------------------------------------------------------------
def test_the_pooled_bound_is_zero_at_or_below_one_trial_in_n():
    # Mutant: the floor at 1/trials dropped — Clopper–Pearson alone gives 0.028 here, which the
    # lemma does not cover when the rates differ.
    assert poisson_binomial_lower(1, 10, 0.25) == 0.0
    assert poisson_binomial_lower(np.array([0, 1, 2]), 10, 0.25).tolist()[:2] == [0.0, 0.0]
    assert poisson_binomial_lower(5, 10, 0.25) > 0.1
