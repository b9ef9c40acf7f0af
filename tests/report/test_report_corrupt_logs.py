"""`privmon report` on damaged logs: a TensorBoard event file with a flipped byte, zeros over a
stretch, or cut off is said on the page and on stderr (the file, the byte and the step from which
its records were lost), for one run and for a comparison, and the checks before it are read as
written; a plain text file given as a log is refused as no privmon log; the page is never
written onto a file it read (JSON lines or event files, with or without --compare); the
comparison page keeps its runs' notes and drops only those about runs left out."""

from __future__ import annotations

import html
import json
import struct

import pytest
import torch

from privmon import PrivacyMonitor
from privmon.cli import main
from privmon.queries import CallableQuery
from privmon.report import Report, read_checks
from privmon.sinks import JsonlSink

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS = (1, 2, 3, 4, 5, 6)


def _run(logdir, *, jsonl=False):
    """A leaking score checked at 6 steps, written as TensorBoard event files (and JSON lines)."""
    g = torch.Generator().manual_seed(0)
    members, nonmembers = torch.randn(300, generator=g) + 0.5, torch.randn(300, generator=g)
    monitor = PrivacyMonitor(
        CallableQuery(lambda b: b, name="score"),
        [members],
        [nonmembers],
        every_n_steps=1,
        methods=("histogram",),
        writer=str(logdir),
        sinks=JsonlSink(logdir / "checks.jsonl") if jsonl else None,
    )
    for step in STEPS:
        monitor.step(step)
    monitor.close()
    (path,) = logdir.glob("*tfevents*")
    return path


def _frames(blob: bytes) -> list[tuple[int, int]]:
    """(first byte, step) of each record of an event file (TFRecord framing: length (8 bytes),
    its checksum (4), the serialized Event, its checksum (4))."""
    from tensorboard.compat.proto import event_pb2

    out, pos = [], 0
    while pos < len(blob):
        (length,) = struct.unpack("<Q", blob[pos : pos + 8])
        out.append((pos, event_pb2.Event.FromString(blob[pos + 12 : pos + 12 + length]).step))
        pos += 16 + length
    assert pos == len(blob)
    return out


def _damage(path, how: str) -> tuple[int, int]:
    """Damage the event file as ``how`` says; the first byte of the record it hit, and the step
    of the last event before that record."""
    blob = path.read_bytes()
    frames = _frames(blob)
    at = {"flip": 0.6, "zeros": 0.3, "cut": 0.8}[how]
    pos = int(len(blob) * at)
    data = bytearray(blob)
    if how == "flip":
        data[pos] ^= 0xFF
    elif how == "zeros":
        data[pos : pos + 64] = bytes(64)
    else:
        del data[pos:]
    path.write_bytes(bytes(data))
    hit = max(i for i, (start, _) in enumerate(frames) if start <= pos)
    return frames[hit][0], frames[hit - 1][1]


@pytest.mark.parametrize("how", ["flip", "zeros", "cut"])
def test_a_damaged_event_file_is_said_on_the_page_and_on_stderr(tmp_path, capsys, how):
    logdir = tmp_path / "run"
    logdir.mkdir()
    path = _run(logdir)
    intact = read_checks(logdir)
    assert intact.steps == list(STEPS) and intact.lost_events == []
    size = path.stat().st_size
    start, step = _damage(path, how)
    said = (
        f"The TensorBoard event file {path} is cut off or damaged at byte {start} of its "
        f"{path.stat().st_size} (after the event of step {step}): its events from there on are "
        "lost"
    )
    assert main(["report", str(logdir), "--out", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert f"privmon report: warning: {said}" in err
    page = (tmp_path / "r.html").read_text()
    assert html.escape(said) in page
    # the checks before the damage are read as written; those after it are gone
    damaged = read_checks(logdir)
    assert damaged.lost_events == [f"{said}, and this report lacks whatever they held."]
    assert damaged.steps == [s for s in STEPS if s <= step] and step < STEPS[-1]
    for got, want in zip(damaged.records[:-1], intact.records, strict=False):
        assert got == want
    assert 0 < start < size


def test_an_event_file_damaged_at_its_first_record_is_named_in_the_error(tmp_path, capsys):
    logdir = tmp_path / "run"
    logdir.mkdir()
    path = _run(logdir)
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF  # the first record's length
    path.write_bytes(bytes(data))
    assert main(["report", str(logdir)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is cut off or damaged at byte 0 of its {len(data)} (before its first" in err


def _two_runs_jsonl(path) -> str:
    sink = JsonlSink(path)
    for run in ("a1" * 16, "b2" * 16):
        sink.write(Report(step=10, scalars={}, run_id=run))
    sink.close()
    return str(path)


def test_the_comparison_says_a_damaged_event_file_and_keeps_its_runs_notes(tmp_path, capsys):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    path = _run(damaged)
    _damage(path, "flip")
    both = tmp_path / "both"
    both.mkdir()
    _two_runs_jsonl(both / "checks.jsonl")  # two runs: each one's note names the other
    out = tmp_path / "compare.html"
    assert main(["report", str(damaged), str(both), "--compare", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"privmon report: warning: The TensorBoard event file {path} is cut off" in captured.err
    assert captured.err.count("warning:") == 1
    page = out.read_text()
    assert html.escape(f"The TensorBoard event file {path} is cut off or damaged") in page
    assert "Read from TensorBoard event files" in page  # another note of a run: kept
    assert "never merged into it" not in page  # all runs are on the page: nothing left out


def test_the_page_is_never_written_onto_a_log_it_read(tmp_path, capsys):
    logdir = tmp_path / "run"
    logdir.mkdir()
    events = _run(logdir, jsonl=True)
    jsonl = logdir / "checks.jsonl"
    logs = {p: p.read_bytes() for p in (jsonl, events)}
    for argv in (
        ["report", str(jsonl), "--compare", "--out", str(jsonl)],
        ["report", str(logdir), "--compare", "--out", str(jsonl)],
        ["report", str(logdir), "--compare", "--out", str(events)],
        ["report", str(logdir), "--out", str(events)],  # the ROC is read from it
        ["report", str(jsonl), "--out", str(jsonl)],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "is the input file: pass another --out" in err, (argv, err)
        assert {p: p.read_bytes() for p in logs} == logs  # both logs whole
    only_events = tmp_path / "events"
    only_events.mkdir()
    moved = only_events / events.name
    moved.write_bytes(logs[events])
    assert main(["report", str(only_events), "--out", str(moved)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert moved.read_bytes() == logs[events]


@pytest.mark.parametrize(
    ("name", "content", "first"),
    [
        ("notes.txt", b"hello world, this is text", "not valid JSON"),  # no newline: one line
        ("notes.md", b"# notes\n\nsome text\n", "not valid JSON"),
        ("checks.jsonl", b"42\n", "no privmon check"),  # JSON, but no check
        ("config.json", json.dumps({"lr": 0.1}).encode(), "no privmon check"),
        ("events.out.tfevents.1.host", b"\x18\x00\x00\x00\x00\x00\x00\x00\xa3\x7f", "not UTF-8"),
    ],
)
def test_a_file_that_is_no_privmon_log_is_refused_naming_it(tmp_path, capsys, name, content, first):
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "r.html"
    assert main(["report", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"privmon report: error: {path}, line 1: {first}")
    assert "the file is not a privmon log" in err and not out.exists()
    if "tfevents" in name:
        assert "a TensorBoard event file: pass the folder that holds it" in err


def test_only_what_a_crash_leaves_is_skipped_as_a_cut_off_line(tmp_path, capsys):
    path = tmp_path / "checks.jsonl"
    _two_runs_jsonl(path)
    whole = path.read_bytes()
    cut_line = whole.splitlines(keepends=True)[1]
    for tail, skipped in [
        (cut_line[:30], True),  # killed mid-line
        (cut_line[:4], True),  # killed within the line's first bytes
        (cut_line[:30] + bytes(40), True),  # and the NUL bytes a machine crash leaves
        (bytes(16), True),
        (b"hello", False),  # no line a JsonlSink writes: an error, never skipped
        (b"[1, 2", False),
    ]:
        path.write_bytes(whole + tail)
        rc = main(["report", str(path), "--compare", "--out", str(tmp_path / "r.html")])
        err = capsys.readouterr().err
        if skipped:
            assert rc == 0 and err == "", (tail, err)  # the comparison reads both runs
            assert (
                main(["report", str(path), "--run", "a1", "--out", str(tmp_path / "r.html")]) == 0
            )
            assert "line 3 was cut off mid-write" in capsys.readouterr().err
        else:
            assert rc == 2 and f"{path}, line 3: not valid JSON" in err, (tail, err)
