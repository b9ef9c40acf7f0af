"""Memory and checkpoint size of the monitor's kept history over a long run.

One real check of four queries gives the tags a report carries; the run then appends reports with
those tags and fresh values (a real check costs milliseconds; 100,000 of them would take minutes
and measure the same storage). RAM is what tracemalloc sees allocated by the history; the
checkpoint is ``torch.save(monitor.state_dict())``. The goal (issue #13): 100,000 checks of four
queries under 50 MB of each.

    python benchmarks/history.py [--checks 100000]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import time
import tracemalloc

import numpy as np
import torch

import privmon
from privmon.callbacks.history import ReportHistory
from privmon.queries import CallableQuery


def _template() -> tuple[privmon.PrivacyMonitor, privmon.Report]:
    rng = np.random.default_rng(0)
    queries = [
        CallableQuery(lambda b, k=k: torch.as_tensor(b[:, k]), name=f"q{k}") for k in range(4)
    ]
    monitor = privmon.PrivacyMonitor(
        queries, [rng.normal(0.2, 1, (500, 4))], [rng.normal(0, 1, (500, 4))], every_n_steps=1
    )
    return monitor, monitor.check(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=100_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    monitor, report = _template()
    rng = np.random.default_rng(1)
    tags = list(report.scalars)
    values = rng.random((args.checks, len(tags)))
    reports = (
        dataclasses.replace(report, step=i + 1, scalars=dict(zip(tags, row, strict=True)))
        for i, row in enumerate(values.tolist())
    )
    tracemalloc.start()  # slows allocation down: the append time is measured apart
    before = tracemalloc.get_traced_memory()[0]
    history = ReportHistory()
    for r in reports:
        history.append(r)
    ram = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    timed = ReportHistory()
    t0 = time.perf_counter()
    for _ in range(args.checks):
        timed.append(report)
    seconds = time.perf_counter() - t0
    monitor.history, monitor.n_certified_checks = history, args.checks
    buf = io.BytesIO()
    t0 = time.perf_counter()
    torch.save(monitor.state_dict(), buf)
    save_s = time.perf_counter() - t0
    size = buf.tell()
    buf.seek(0)
    t0 = time.perf_counter()
    monitor.load_state_dict(torch.load(buf, weights_only=True))
    load_s = time.perf_counter() - t0
    if len(monitor.history) != args.checks:
        raise SystemExit("the history did not survive the checkpoint")
    print(f"{args.checks} checks x 4 queries, {len(tags)} figures per check")
    print(f"{'RAM (MB)':>10} {'checkpoint (MB)':>16} {'append (us/check)':>18} "
          f"{'save (s)':>9} {'load (s)':>9}")  # fmt: skip
    print(f"{ram / 1e6:>10.1f} {size / 1e6:>16.1f} {seconds / args.checks * 1e6:>18.1f} "
          f"{save_s:>9.2f} {load_s:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
