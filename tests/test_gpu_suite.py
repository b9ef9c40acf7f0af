"""``benchmarks/gpu_suite.py``: run on the CPU at a tiny scale, as a user would run it (a
subprocess), it gives every path a row — a positive time, or a stated reason that is not a bug
(a missing extra, a cap, the budget); a path that raises or runs out of memory fails the test.
Its cells extrapolate the CPU figure affinely and turn failures into rows."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"


@pytest.fixture(scope="module")
def gpu_suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_path_gives_a_row_on_the_cpu(tmp_path: Path, gpu_suite: ModuleType) -> None:
    out = tmp_path / "rows.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--device", "cpu", "--scale", "1e-6", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text(encoding="utf-8"))["rows"]
    assert [row["path"] for row in rows] == [p.name for p in gpu_suite.suite(scale=1e-6)]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # the header and one line per path
    for row in rows:
        cpu = row["cpu"]
        assert row["cuda"] is None and row["speedup"] is None  # --device cpu: the CPU column only
        if "seconds" in cpu:
            assert cpu["seconds"] > 0, row
        else:
            assert cpu["reason"] and cpu["failed"] in {"missing-extra", "timeout", "budget"}, row


def _cell(gpu_suite: ModuleType, run, *, cap: float = 10.0, left: float = 60.0, **path) -> object:
    path = gpu_suite.Path("fake", path.pop("size", 1_000), "records", run, **path)
    return gpu_suite.cell(path, gpu_suite.CPU, cap=cap, deadline=time.monotonic() + left)


def test_the_cpu_figure_above_its_ceiling_is_the_affine_extrapolation(gpu_suite) -> None:
    got = _cell(gpu_suite, lambda device, size: 1.0 + size / 100, cpu_max=100)
    assert got.estimated_from == (25, 100)
    assert got.seconds == pytest.approx(1.0 + 1_000 / 100)
    assert _cell(gpu_suite, lambda device, size: size / 100, cpu_max=None).estimated_from is None


def test_failures_are_rows(gpu_suite) -> None:
    def missing(device, size):
        raise ModuleNotFoundError("No module named 'opacus'", name="opacus")

    def broken(device, size):
        raise ValueError("a bug\nsecond line")

    def slow(device, size):
        time.sleep(5)
        return 1.0

    assert _cell(gpu_suite, missing) == gpu_suite.Failed(
        "missing-extra", "needs opacus (pip install 'privmon[dp]')"
    )
    assert _cell(gpu_suite, broken) == gpu_suite.Failed("error", "ValueError: a bug")
    assert _cell(gpu_suite, slow, cap=0.2).failed == "timeout"
    assert _cell(gpu_suite, slow, left=1.0).failed == "budget"
