"""The reliability table: every fault injected and bad input tried, and what it cost.

Runs the fault-injection test modules (real faults: a kernel-refused disk, a 2-process gloo group
with one rank failing, Opacus hooks, persistent DataLoader workers, corrupt JSON lines, /dev/full,
two runs in one log directory, a cut-off line resumed, two sinks appending at once, score files
that read two ways, scores of extreme magnitude, one-token texts, canaries under Opacus steps that
fail, a checkpoint written by a spawned process or with one bit flipped, out-of-range figures)
and prints one row per case with its outcome. Every case asserts that no check and no record is
lost beyond the fault itself (a sink's reports are written late, not dropped; a failed check is
skipped on every rank and the next one succeeds), so "passed" means the README's "lost: none".

    python benchmarks/reliability.py                          # every module
    python benchmarks/reliability.py tests/estimators/test_extremes.py   # the rows of some modules
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

MODULES = {
    "tests/callbacks/test_training_untouched.py": "training untouched",
    "tests/callbacks/test_faults.py": "monitor faults and bad input",
    "tests/callbacks/test_distributed.py": "torch.distributed (2 gloo ranks)",
    "tests/test_cli_faults.py": "privmon report / demo",
    "tests/sinks/test_sinks.py": "sinks: runs, cut-off lines, concurrency",
    "tests/test_cli.py": "privmon audit / command line",
    "tests/estimators/test_extremes.py": "scores of extreme magnitude",
    "tests/attacks/test_reliability_lm.py": "language-model statistics",
    "tests/audit/test_reliability_canaries.py": "canaries and one-run ε",
    "tests/report/test_reliability_runs.py": "checkpoints, run files and settings",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help=f"of {', '.join(MODULES)} (default: all)")
    modules = parser.parse_args().modules or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        parser.error(f"not a reliability module: {', '.join(unknown)}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "cases.xml")
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", f"--junitxml={xml}",
             *modules],
            cwd=root,
            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
            stdout=subprocess.DEVNULL,
            check=False,
        )  # fmt: skip
        cases = ET.parse(xml).getroot().iter("testcase")
        rows = []
        for case in cases:
            module = case.get("classname", "").replace(".", "/") + ".py"
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "FAILED"
                elif child.tag == "skipped":
                    outcome = "skipped"
            name = case.get("name", "").removeprefix("test_").replace("_", " ")
            rows.append((MODULES.get(module, module), name, outcome, float(case.get("time", 0))))
    width = max(len(r[1]) for r in rows)
    area_width = max(len(r[0]) for r in rows)
    print(f"{'area':<{area_width}} {'case':<{width}} {'outcome':>8} {'s':>6}")
    for area, name, outcome, seconds in rows:
        print(f"{area:<{area_width}} {name:<{width}} {outcome:>8} {seconds:>6.1f}")
    failed = sum(r[2] == "FAILED" for r in rows)
    print(f"\n{len(rows)} cases: {failed} failed, {sum(r[2] == 'skipped' for r in rows)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
