"""Benchmark shadow-model training: one model after another vs one stacked ensemble.

Run from the repository root::

    python benchmarks/ensemble.py                  # 64 MLPs, CPU, 1 torch thread
    python benchmarks/ensemble.py --threads 2      # torch intra-op threads in both paths
    python benchmarks/ensemble.py --device cuda    # on a GPU

The workload is the one of issue 15 and of ``examples/lira_audit.py``: ``--models`` MLPs
64-32-10 (ReLU), each trained full batch with Adam (lr 1e-2) for ``--epochs`` epochs on a random
half of the first ``--records`` digits of sklearn's ``load_digits`` (privmon.audit.random_halves,
125 records each by default), through :func:`privmon.audit.train_ensemble` with
``stacked=False`` (the same protocol, one model at a time: init, Adam, 150 full-batch steps)
and ``stacked=True`` (``stack_module_state``, the MLP's layers as batched matrix products over the
64 models, one Adam over the stacked tensors).

Both paths run in the same invocation, each training in a fresh child process (spawned one
after the other, never concurrently), so that its peak memory can be read on its own: on the
CPU the process's peak resident set (``VmHWM``) and its growth over the resident set just before
training (after imports, data and a one-epoch warm-up of the same path); on a GPU
``torch.cuda.max_memory_allocated``. With ``--repeat r`` the two paths alternate r times (one
by one, ensemble, one by one, ...; 5 rounds by default), so a change in the machine's load
hits both alike; the table shows the median wall and CPU time of each path (the child's
``process_time``: on a machine other processes load, the CPU-time ratio is the steadier
figure, the wall-time ratio the one a quiet machine shows), each round's speed-up, the ratio of
each path's fastest round (what each costs with the least interference from the rest of the
machine; on a shared 2-core VM single rounds scattered 5.7-11x within one run), and the largest
peak. It also prints the largest parameter difference between the two paths' models (float32:
rounding, amplified over the epochs).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run(stacked: bool, args: argparse.Namespace) -> dict:
    """Train in this (child) process; return timings, memory and the parameters."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch import nn

    from privmon.audit import random_halves, train_ensemble

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    digits = load_digits()
    x = torch.tensor(digits.data[: args.records] / 16.0, dtype=torch.float32, device=dev)
    y = torch.tensor(digits.target[: args.records], device=dev)
    masks = random_halves(args.records, args.models, seed=0)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def train(epochs: int):
        ens = train_ensemble(
            mlp,
            (x, y),
            masks,
            loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none"),
            optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
            epochs=epochs,
            seed=0,
            stacked=stacked,
        )
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return ens

    train(1)  # warm-up: kernels, allocator, vmap tracing
    rss_before = _status_kib("VmRSS")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    ens = train(args.epochs)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if dev.type == "cuda"
        else _status_kib("VmHWM") / 1024
    )
    growth = None if dev.type == "cuda" else (_status_kib("VmHWM") - rss_before) / 1024
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "peak_mib": peak,
        "growth_mib": growth,
        "params": {k: v.cpu().numpy() for k, v in ens.params.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--records", type=int, default=250)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5, help="alternating rounds per path")
    args = parser.parse_args()

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {load:.2f}, "
        f"device {args.device}, torch threads {args.threads}; {args.models} MLPs 64-32-10, "
        f"Adam, {args.epochs} full-batch epochs on random halves of {args.records} digits"
    )
    ctx = mp.get_context("spawn")
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.repeat):
        for stacked in (False, True):
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                runs[stacked].append(pool.submit(run, stacked, args).result())
    seq, ens = runs[False][0], runs[True][0]
    diff = max(float(np.abs(seq["params"][k] - ens["params"][k]).max()) for k in seq["params"])
    median = {
        (stacked, key): statistics.median(r[key] for r in runs[stacked])
        for stacked in (False, True)
        for key in ("seconds", "cpu_seconds")
    }
    rounds = " / ".join(
        f"{a['seconds'] / b['seconds']:.1f}x" for a, b in zip(runs[False], runs[True], strict=True)
    )
    mem = "peak GPU MiB" if args.device.startswith("cuda") else "peak RSS MiB (growth)"
    print()
    print(
        f"| path | wall s (median) | CPU s (median) | ms per model | speed-up, wall (per round) "
        f"| speed-up, fastest rounds | speed-up, CPU | {mem} |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    fastest = {stacked: min(r["seconds"] for r in runs[stacked]) for stacked in (False, True)}
    for name, stacked in (("one by one (stacked=False)", False), ("ensemble (stacked=True)", True)):
        rs = runs[stacked]
        t, cpu = median[stacked, "seconds"], median[stacked, "cpu_seconds"]
        peak = max(r["peak_mib"] for r in rs)
        growth = (
            "" if rs[0]["growth_mib"] is None else f" (+{max(r['growth_mib'] for r in rs):.1f})"
        )
        each = f" ({rounds})" if stacked else ""
        print(
            f"| {name} | {t:.2f} | {cpu:.2f} | {1e3 * t / args.models:.1f} | "
            f"{median[False, 'seconds'] / t:.1f}x{each} | "
            f"{fastest[False] / fastest[stacked]:.1f}x | "
            f"{median[False, 'cpu_seconds'] / cpu:.1f}x | {peak:.1f}{growth} |"
        )
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nload average after the runs: {load_after:.2f} (CPU time counts this process only)")
    print()
    print(f"largest parameter difference between the two paths: {diff:.2e}")


if __name__ == "__main__":
    main()
