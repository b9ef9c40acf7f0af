"""`privmon report` and `privmon demo` on bad input and real faults (a full device, a file-size
limit, paths under a regular file, symbolic links): each ends with one line on stderr,
``privmon <command>: error: ...``, and exit code 2, never a traceback. A JSON-lines file whose
last line was cut off mid-write still gives a report, with a warning. The report never writes
through a symbolic link and never leaves a half-written page behind."""

from __future__ import annotations

import json
import os
import resource
import signal

import pytest

from privmon.cli import main
from privmon.report import SeveralRunsError, read_checks, verdict

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPUS = os.cpu_count() or 1

LINE = {
    "run_id": "c3" * 16,  # first, as a JsonlSink writes it
    "step": 10,
    "scalars": {
        "privacy/q/histogram/value": 0.1,
        "privacy/q/histogram/lower": 0.0,
        "privacy/q/histogram/epsilon_lower_bound": 0.0,
    },
    "epsilon": None,
    "dp_violation": False,
    "top_records": {"q": [3, 1]},
    "top_risks": {"q": [0.4, None]},
    "top_tied": {"q": 0},
    "messages": [],
    "seconds": 0.01,
}


def _line(step: int, **fields) -> str:
    return json.dumps({**LINE, "step": step, **fields})


def _jsonl(path, *lines: str, tail: str | bytes = b"") -> str:
    """``lines`` each ended by a newline, then ``tail`` as is (a line cut off mid-write)."""
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(data + (tail.encode() if isinstance(tail, str) else tail))
    return str(path)


def _fails(capsys, argv: list[str], *needles: str) -> str:
    """``main(argv)`` returns 2 with one line on stderr naming the command and every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"privmon {argv[0]}: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _warns(capsys, argv: list[str], warning: str) -> str:
    """``main(argv)`` writes the report with exactly one warning line on stderr; its stdout."""
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == f"privmon {argv[0]}: warning: {warning}\n"
    assert "report: " in captured.out
    return captured.out


# --- reading the JSON lines -----------------------------------------------------------------------
def test_truncated_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    cut = _line(30)[:45]  # the writer was killed mid-line: no newline, not valid JSON
    src = _jsonl(tmp_path / "checks.jsonl", _line(10), _line(20), tail=cut)
    out = tmp_path / "r.html"
    _warns(
        capsys,
        ["report", src, "--out", str(out)],
        f"skipped 1 line of {src}: line 3 was cut off mid-write (the run was interrupted while "
        "writing it)",
    )
    checks = read_checks(src)
    assert checks.steps == [10, 20] and checks.skipped_line == 3
    page = out.read_text(encoding="utf-8")
    assert "2 checks, steps 10–20" in page and "Line 3 of" in page and "cut off" in page


def test_truncated_last_line_mid_character_and_alone(tmp_path, capsys):
    # A cut inside a UTF-8 character: not text either, still the interrupted last line.
    src = _jsonl(tmp_path / "a.jsonl", _line(10), tail=_line(20, messages=["ε"]).encode()[:-4])
    assert read_checks(src).steps == [10]
    # The only line cut off: an empty run, with the warning.
    alone = _jsonl(tmp_path / "b.jsonl", tail=_line(10)[:30])
    assert main(["report", alone, "--out", str(tmp_path / "b.html")]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 line" in captured.err and "No checks recorded" in captured.out


def test_cut_off_line_with_a_resumed_run_line_appended_is_read(tmp_path, capsys):
    # A writer that does not repair a cut-off last line appends right after it; the
    # report refused the whole file. The cut-off start is skipped and said; the rest is read.
    src = _jsonl(
        tmp_path / "checks.jsonl",
        _line(10),
        _line(20)[:40] + _line(20, scalars={**LINE["scalars"], "privacy/q/histogram/value": 0.3}),
        _line(30),
    )
    out = tmp_path / "r.html"
    _warns(
        capsys,
        ["report", src, "--out", str(out)],
        f"skipped the start of line 2 of {src}: a line cut off mid-write, with a resumed run's "
        "line appended to it (that line is read)",
    )
    checks = read_checks(src)
    assert checks.steps == [10, 20, 30] and checks.torn_lines == [2]
    assert checks.records[1]["scalars"]["privacy/q/histogram/value"] == 0.3
    assert checks.skipped_line is None
    page = out.read_text(encoding="utf-8")
    assert "Line 2 of" in page and "begins with a line cut off mid-write" in page
    # two cut-off starts in a row (killed twice) before the whole line
    twice = _jsonl(tmp_path / "twice.jsonl", _line(10)[:30] + _line(20)[:50] + _line(30))
    assert read_checks(twice).steps == [30]


def test_complete_last_line_without_newline_is_read(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", _line(10), tail=_line(20))
    checks = read_checks(src)
    assert checks.steps == [10, 20] and checks.skipped_line is None


@pytest.mark.parametrize(
    ("lines", "tail", "needles"),
    [
        # a corrupt line before the last one is never skipped: it could hold the certificate
        ([_line(10), _line(20)[:40], _line(30)], "", ["line 2", "not valid JSON"]),
        # a cut line that is not followed by a whole one on the same line is no crash's trace
        ([_line(10), _line(20)[:40] + '{"step": 30, "scal'], "", ["line 2", "not valid JSON"]),
        ([_line(10, run_id=7)], "", ["line 1", "run_id must be a string, got 7"]),
        # a corrupt last line that was ended by a newline was written whole: an error
        ([_line(10), _line(20)[:40]], "", ["line 2", "not valid JSON"]),
        ([_line(10), '["step", 20]'], "", ["line 2", "must be a JSON object, got list"]),
        (['{"run_id": "c3", "scalars": {}}'], "", ["line 1", "step is missing"]),
        ([_line(10).replace('"step": 10', '"step": NaN')], "", ["line 1", "step must be"]),
        ([_line(10).replace('"step": 10', '"step": 1e400')], "", ["line 1", "step", "got 1e400"]),
        ([_line(2**63)], "", ["line 1", "step must be an integer in [0, 2**63 - 1]"]),
        ([_line(-5)], "", ["line 1", "step must be an integer in [0, 2**63 - 1], got -5"]),
        ([_line("abc")], "", ["line 1", "step must be an integer", "'abc'"]),
        ([_line(10.0)], "", ["line 1", "step must be an integer", "10.0"]),
        ([_line(True)], "", ["line 1", "step must be an integer", "True"]),
        ([_line(10, scalars="x")], "", ["line 1", "scalars must be a JSON object", "'x'"]),
        ([_line(10, scalars={"privacy/q/auc": "high"})], "", ["scalars['privacy/q/auc']"]),
        ([_line(10, scalars={"a": True})], "", ["line 1", "scalars['a'] must be a number"]),
        ([_line(10, scalars={"a": 10**400})], "", ["scalars['a']", "out of range"]),
        ([_line(10, epsilon="3")], "", ["line 1", "epsilon must be a number or null"]),
        ([_line(10, dp_violation="no")], "", ["line 1", "dp_violation must be true or false"]),
        ([_line(10, top_records="x")], "", ["line 1", "top_records must be a JSON object"]),
        ([_line(10, top_records={"q": [1, "a"]})], "", ["top_records['q'][1] must be an integer"]),
        ([_line(10, top_records={"q": [-1]})], "", ["top_records['q'][0] must be an integer >= 0"]),
        ([_line(10, top_risks={"q": [0.5, "x"]})], "", ["top_risks['q'][1] must be a number"]),
        ([_line(10, top_risks={"q": 0.5})], "", ["top_risks['q'] must be a list"]),
        ([_line(10, top_tied={"q": 1.5})], "", ["top_tied['q'] must be an integer >= 0"]),
        ([_line(10, messages="hi")], "", ["line 1", "messages must be a list of strings"]),
        ([_line(10, seconds=[1])], "", ["line 1", "seconds must be a number or null"]),
        (["[" * 100_000], "", ["line 1", "not valid JSON"]),  # too deep for the parser
    ],
)
def test_bad_lines_name_the_line_and_the_field(tmp_path, capsys, lines, tail, needles):
    src = _jsonl(tmp_path / "checks.jsonl", *lines, tail=tail)
    err = _fails(capsys, ["report", src, "--out", str(tmp_path / "r.html")], *needles)
    assert f"{src}, line " in err
    assert not (tmp_path / "r.html").exists()


def test_largest_step_is_read_and_rendered(tmp_path, capsys):
    src = _jsonl(tmp_path / "checks.jsonl", _line(2**63 - 2), _line(2**63 - 1))
    assert read_checks(src).steps == [2**63 - 2, 2**63 - 1]
    assert main(["report", src, "--out", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().err == ""


def test_binary_garbage_and_empty_and_missing_inputs(tmp_path, capsys):
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(128, 256)) + b"\n")
    _fails(capsys, ["report", str(garbage)], f"{garbage}, line 1: not UTF-8 text")
    empty = _jsonl(tmp_path / "empty.jsonl")
    assert main(["report", empty]) == 0  # a run that has not reached its first check
    assert "No checks recorded" in capsys.readouterr().out
    _fails(capsys, ["report", str(tmp_path / "missing")], "missing", "does not exist")
    (tmp_path / "nothing").mkdir()
    _fails(capsys, ["report", str(tmp_path / "nothing")], "no checks.jsonl")


# --- several runs in one file ---------------------------------------------------------------------
LEAKY = "a1" * 16  # run ids as PrivacyMonitor writes them (uuid4 hex)
CLEAN = "b2" * 16
LEAK_SCALARS = {
    "privacy/q/histogram/value": 0.6,
    "privacy/q/histogram/lower": 0.543,
    "privacy/q/histogram/epsilon_lower_bound": 1.2,
}


def _leaky(step: int) -> str:
    return _line(step, run_id=LEAKY, scalars=LEAK_SCALARS)


def test_a_second_run_in_the_same_file_is_never_merged(tmp_path, capsys):
    # A leaking run, then a clean run written into the same log directory: keeping one line per
    # step turned "Leakage detected" into "No measurable membership leakage", with no note.
    logdir = tmp_path / "run"
    logdir.mkdir()
    lines = [_leaky(10), _leaky(20), *(_line(s, run_id=CLEAN) for s in (10, 20, 30))]
    src = _jsonl(logdir / "checks.jsonl", *lines)
    err = _fails(
        capsys,
        ["report", str(logdir)],
        "holds 2 runs",
        "never merges",
        f"{LEAKY} (steps 10–20, 2 lines)",
        f"{CLEAN} (steps 10–30, 3 lines, the latest)",
        "--run ID",
    )
    assert err.index(LEAKY) < err.index(CLEAN)
    assert not (logdir / "privacy_report.html").exists()
    with pytest.raises(SeveralRunsError) as info:
        read_checks(src)
    assert [(r.run_id, r.n_written, r.first_step, r.last_step) for r in info.value.runs] == [
        (LEAKY, 2, 10, 20),
        (CLEAN, 3, 10, 30),
    ]
    # Each run on its own: by a prefix of its id, or the latest.
    out = _warns(
        capsys,
        ["report", str(logdir), "--run", LEAKY[:6]],
        f"reported run {LEAKY} only; {src} also holds {CLEAN} (steps 10–30, 3 lines)",
    )
    assert out.splitlines()[0] == "Leakage detected: certified advantage ≥ 0.543 at step 10."
    page = (logdir / "privacy_report.html").read_text(encoding="utf-8")
    assert f"run <code>{LEAKY}</code>" in page and "2 checks, steps 10–20" in page
    assert f"Left out, never merged into it: {CLEAN} (steps 10–30, 3 lines)" in page
    assert main(["report", str(logdir), "--run", "latest"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("No measurable membership leakage.")
    assert f"also holds {LEAKY} (steps 10–20, 2 lines)" in captured.err
    checks = read_checks(src, run=CLEAN)
    assert checks.steps == [10, 20, 30] and checks.run_id == CLEAN
    assert [r.run_id for r in checks.other_runs] == [LEAKY]


def test_two_runs_writing_at_the_same_time_are_separated(tmp_path):
    # Interleaved lines (two runs appending at once): each run gets exactly its own lines.
    lines = []
    for step in (10, 20, 30):
        lines += [_leaky(step), _line(step, run_id=CLEAN)]
    src = _jsonl(tmp_path / "checks.jsonl", *lines)
    with pytest.raises(SeveralRunsError, match="holds 2 runs"):
        read_checks(src)
    leaky = read_checks(src, run=LEAKY)
    assert leaky.steps == [10, 20, 30]
    assert all(r["scalars"] == LEAK_SCALARS for r in leaky.records)
    assert verdict(leaky).level == "leakage"
    clean = read_checks(src, run=CLEAN)
    assert all(r["scalars"] == LINE["scalars"] for r in clean.records)
    assert verdict(clean).level == "none"


def test_lines_without_a_run_id_are_refused_as_written_before_run_ids(tmp_path, capsys):
    # Lines written by a privmon before run ids are not read: the error says where they come from.
    without_id = json.dumps({k: v for k, v in json.loads(_leaky(20)).items() if k != "run_id"})
    src = _jsonl(tmp_path / "checks.jsonl", _line(10, run_id=CLEAN), without_id)
    needles = ["line 2", "run_id is missing", "written by a privmon before run ids"]
    _fails(capsys, ["report", src, "--out", str(tmp_path / "r.html")], *needles)
    with pytest.raises(ValueError, match="line 2: run_id is missing"):
        read_checks(src)
    with pytest.raises(ValueError, match="line 1: run_id is missing"):
        read_checks(_jsonl(tmp_path / "old.jsonl", without_id))


def test_a_resumed_run_replaces_its_repeated_steps(tmp_path, capsys):
    # The same run id again at steps it wrote (resumed from a checkpoint): the later line wins.
    resumed = _line(20, run_id=LEAKY, scalars={**LEAK_SCALARS, "privacy/q/histogram/lower": 0.4})
    src = _jsonl(tmp_path / "checks.jsonl", _leaky(10), _leaky(20), _leaky(30), resumed)
    checks = read_checks(src)
    assert checks.steps == [10, 20, 30] and checks.other_runs == []
    assert checks.records[1]["scalars"]["privacy/q/histogram/lower"] == 0.4
    assert main(["report", src, "--out", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("run", "needles"),
    [
        ("ffff", ["run 'ffff' matches no run of", f"{LEAKY} (step 10, 1 line)"]),
        ("a", ["run 'a' is the prefix of several runs"]),
        ("legacy", ["run 'legacy' matches no run"]),
        ("", ["run must be None or a non-empty string, got ''"]),
    ],
)
def test_run_that_names_no_single_run(tmp_path, capsys, run, needles):
    other = "a3" * 16
    src = _jsonl(tmp_path / "checks.jsonl", _leaky(10), _line(10, run_id=other))
    _fails(capsys, ["report", src, "--run", run, "--out", str(tmp_path / "r.html")], *needles)


# --- writing the page -----------------------------------------------------------------------------
@pytest.fixture
def run(tmp_path):
    """A log directory with two checks; the report of it is a few hundred kB."""
    logdir = tmp_path / "run"
    logdir.mkdir()
    _jsonl(logdir / "checks.jsonl", _line(10), _line(20))
    return logdir


def test_out_is_a_directory(run, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    _fails(capsys, ["report", str(run), "--out", str(folder)], f"{folder}", "is a directory")
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("out", ["", "newdir/"])
def test_out_not_a_file_name(run, tmp_path, capsys, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    _fails(capsys, ["report", str(run), "--out", out], "is not a file name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_out_on_a_full_device(run, capsys):
    # /dev/full refuses every write with ENOSPC, as a full disk does
    _fails(capsys, ["report", str(run), "--out", "/dev/full"], "No space left on device")


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE (POSIX)")
def test_write_cut_short_leaves_the_old_report_whole(run, tmp_path, capsys):
    """A file-size limit below the page's size: the write fails part-way (EFBIG), as on a disk
    that fills up; the previous report stays whole and no temporary file is left."""
    out = tmp_path / "r.html"
    out.write_text("previous report")
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        rc = main(["report", str(run), "--out", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert rc == 2
    err = capsys.readouterr().err
    assert err == f"privmon report: error: {out}: File too large\n"
    assert out.read_text() == "previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "run"]


def test_out_parent_missing_is_created_parent_a_file_fails(run, tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "r.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    capsys.readouterr()
    (tmp_path / "afile").write_text("x")
    _fails(capsys, ["report", str(run), "--out", str(tmp_path / "afile" / "r.html")], "afile")
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("explicit", [True, False])
def test_a_symlink_at_the_output_path_is_refused(run, tmp_path, capsys, explicit):
    target = tmp_path / "precious.txt"
    target.write_text("do not touch")
    link = tmp_path / "r.html" if explicit else run / "privacy_report.html"
    link.symlink_to(target)
    argv = ["report", str(run)] + (["--out", str(link)] if explicit else [])
    _fails(capsys, argv, f"{link}", "symbolic link")
    assert target.read_text() == "do not touch" and link.is_symlink()
    # a dangling link: following it would create its target
    link.unlink()
    link.symlink_to(tmp_path / "created.html")
    _fails(capsys, argv, "symbolic link")
    assert not (tmp_path / "created.html").exists()


def test_existing_report_is_replaced_keeping_its_mode(run, tmp_path, capsys):
    out = tmp_path / "r.html"
    out.write_text("old")
    out.chmod(0o640)
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert out.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "run"]  # no temporary left


def test_out_the_input_file_is_refused(run, capsys):
    src = run / "checks.jsonl"
    before = src.read_bytes()
    _fails(capsys, ["report", str(src), "--out", str(src)], "is the input file")
    assert src.read_bytes() == before


# --- privmon demo ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dp", "--epsilon", "-1"], "argument --epsilon: must be finite and > 0, got -1"),
        (["--dp", "--epsilon", "nan"], "argument --epsilon: must be finite and > 0, got nan"),
        (["--dp", "--epsilon", "inf"], "argument --epsilon: must be finite and > 0, got inf"),
        (["--budget", "nan"], "argument --budget: must be an advantage in [0, 1], got nan"),
        (["--budget", "inf"], "argument --budget: must be an advantage in [0, 1], got inf"),
        (["--budget", "3"], "argument --budget: must be an advantage in [0, 1], got 3"),
        (["--seed", "-1"], "argument --seed: must be an integer in [0, 2**64 - 1], got -1"),
        (["--seed", str(2**64)], "argument --seed: must be an integer in [0, 2**64 - 1]"),
        # torch.set_num_threads(100_000) is accepted, and the next matrix product segfaults
        (["--threads", "100000"], f"argument --threads: must be an integer in [1, {CPUS}]"),
    ],
)
def test_demo_bad_numbers_fail_before_anything_runs(tmp_path, capsys, argv, message):
    logdir = tmp_path / "logs"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--logdir", str(logdir), "--steps", "1", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    # argparse's form: the usage line, then the one error line
    last = err.splitlines()[-1]
    assert last.startswith("privmon demo: error: ") and message in last, err
    assert "Traceback" not in err
    assert not logdir.exists()


@pytest.mark.parametrize(
    ("under", "message"),
    [("afile/sub", "cannot be written: Not a directory"), ("afile", "is a file, not a directory")],
)
def test_demo_unwritable_logdir(tmp_path, capsys, under, message):
    # a path under a regular file (or a regular file itself) cannot be a directory, for root as
    # for anyone else (a chmod-0o500 directory does not stop root)
    (tmp_path / "afile").write_text("x")
    logdir = tmp_path / under
    argv = ["demo", "--logdir", str(logdir), "--steps", "1", "--quiet"]
    _fails(capsys, argv, f"logdir {str(logdir)!r} {message}")
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_demo_read_only_logdir(tmp_path, capsys):
    logdir = tmp_path / "ro"
    logdir.mkdir(mode=0o500)
    try:
        argv = ["demo", "--logdir", str(logdir), "--steps", "1", "--quiet"]
        _fails(capsys, argv, "cannot be written: Permission denied")
    finally:
        logdir.chmod(0o700)


def test_debug_variable_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVMON_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(["report", str(tmp_path / "missing")])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("target_epsilon", float("nan"), "target_epsilon must be finite and > 0"),
        ("target_epsilon", -1.0, "target_epsilon must be finite and > 0"),
        ("seed", -1, "seed must be an integer >= 0"),
    ],
)
def test_run_demo_checks_its_config_before_anything_runs(tmp_path, field, value, message):
    from privmon.demo import DemoConfig, run_demo

    logdir = tmp_path / "logs"
    with pytest.raises(ValueError, match=message):
        run_demo(DemoConfig(logdir=str(logdir), steps=1, progress=False, **{field: value}))
    assert not logdir.exists()
