"""Benchmark shadow-model training: one model after another vs one stacked ensemble, and one
process vs the models split over the ranks of a torch.distributed group.

Run from the repository root::

    python benchmarks/ensemble.py                  # 64 MLPs, CPU, 1 torch thread
    python benchmarks/ensemble.py --threads 2      # torch intra-op threads in both paths
    python benchmarks/ensemble.py --device cuda    # on a GPU
    python benchmarks/ensemble.py --world-size 2   # 1 process vs 2 gloo ranks (stacked)
    python benchmarks/ensemble.py --checkpoint     # the cost of checkpoint_dir (stacked)

With ``--world-size N`` (N > 1) the stacked ensemble trains in one process, then on N processes
of a gloo group (a ``FileStore`` in a temporary folder), each rank training its share of the
models (:func:`privmon.audit.train_ensemble` splits them) and receiving the others; the rounds
alternate as below. The table shows each layout's per-rank wall and CPU time (median over the
rounds of the slowest rank: the call returns on every rank once the last share is in), the
models each rank trained, the speed-up over one process, and the largest parameter difference
between the layouts (0: bit for bit). A rank uses ``--threads`` intra-op threads: N ranks want
N times as many free cores. On GPUs, launch one rank per GPU with ``torchrun`` and NCCL instead
(``docs/guide/reference-models.md``); this script starts gloo ranks on one machine.

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
import queue
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run(stacked: bool, args: argparse.Namespace, checkpoint: str = "") -> dict:
    """Train in this (child) process; return timings, memory and the parameters. ``checkpoint``:
    "" none; "save": the timed training saves every model to a fresh folder; "resume": the
    timed call finds every model saved there (by an untimed training before it)."""
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

    def train(epochs: int, folder: str | None = None):
        ens = train_ensemble(
            mlp,
            (x, y),
            masks,
            loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none"),
            optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
            epochs=epochs,
            seed=0,
            stacked=stacked,
            checkpoint_dir=folder,
        )
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return ens

    train(1)  # warm-up: kernels, allocator, vmap tracing
    folder = tempfile.mkdtemp() if checkpoint else None
    if checkpoint == "resume":
        train(args.epochs, folder)
    rss_before = _status_kib("VmRSS")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    ens = train(args.epochs, folder)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    if folder is not None:
        shutil.rmtree(folder)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if dev.type == "cuda"
        else _status_kib("VmHWM") / 1024
    )
    growth = None if dev.type == "cuda" else (_status_kib("VmHWM") - rss_before) / 1024
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return {
        "trained_here": int((ens.trained_by == rank).sum()),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "peak_mib": peak,
        "growth_mib": growth,
        "params": {k: v.cpu().numpy() for k, v in ens.params.items()},
    }


def run_rank(rank: int, world: int, store: str, args: argparse.Namespace, out: mp.Queue) -> None:
    """One rank of a gloo group of ``world`` processes (a lone process when ``world`` is 1):
    the stacked ensemble's share of this rank, timed by :func:`run`."""
    import datetime

    import torch.distributed as dist

    if world > 1:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=10),
        )
    try:
        out.put((rank, run(True, args)))
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_group(world: int, args: argparse.Namespace) -> list[dict]:
    """Each rank's result of one training on ``world`` processes, in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=run_rank, args=(r, world, f"{tmp}/store", args, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, dict] = {}
        while len(results) < world:
            try:
                rank, result = out.get(timeout=1)
                results[rank] = result
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    for p in procs:
                        p.kill()
                    raise RuntimeError("a rank failed (its traceback is above)") from None
        for p in procs:
            p.join()
    return [results[r] for r in range(world)]


def machine(args: argparse.Namespace) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {load:.2f}, "
        f"device {args.device}, torch threads {args.threads}; {args.models} MLPs 64-32-10, "
        f"Adam, {args.epochs} full-batch epochs on random halves of {args.records} digits"
    )


def compare_world_sizes(args: argparse.Namespace) -> None:
    """One process vs ``args.world_size`` gloo ranks, alternating over ``args.repeat`` rounds."""
    print(machine(args) + f"; 1 process vs {args.world_size} gloo ranks, stacked")
    layouts = (1, args.world_size)
    runs: dict[int, list[list[dict]]] = {w: [] for w in layouts}
    for _ in range(args.repeat):
        for world in layouts:
            runs[world].append(run_group(world, args))
    slowest = {
        (w, key): [max(r[key] for r in ranks) for ranks in runs[w]]
        for w in layouts
        for key in ("seconds", "cpu_seconds")
    }
    one = runs[1][0][0]["params"]
    diff = max(
        float(np.abs(ranks[r]["params"][k] - one[k]).max())
        for ranks in runs[args.world_size]
        for r in range(args.world_size)
        for k in one
    )
    print()
    print(
        "| processes | per-rank wall s (median) | per-rank CPU s (median) | models per rank "
        "| speed-up, wall (per round) | speed-up, fastest rounds | speed-up, CPU |"
    )
    print("|---:|---:|---:|---|---:|---:|---:|")
    base = statistics.median(slowest[1, "seconds"])
    base_cpu = statistics.median(slowest[1, "cpu_seconds"])
    for w in layouts:
        t = statistics.median(slowest[w, "seconds"])
        cpu = statistics.median(slowest[w, "cpu_seconds"])
        per_round = " / ".join(
            f"{a / b:.2f}x"
            for a, b in zip(slowest[1, "seconds"], slowest[w, "seconds"], strict=True)
        )
        shares = "+".join(str(r["trained_here"]) for r in runs[w][0])
        print(
            f"| {w} | {t:.2f} | {cpu:.2f} | {shares} | {base / t:.2f}x ({per_round}) | "
            f"{min(slowest[1, 'seconds']) / min(slowest[w, 'seconds']):.2f}x | "
            f"{base_cpu / cpu:.2f}x |"
        )
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nload average after the runs: {load_after:.2f}")
    print(f"largest parameter difference, {args.world_size} ranks vs 1 process: {diff:.2e}")


def compare_checkpoints(args: argparse.Namespace) -> None:
    """Stacked training without a checkpoint folder, saving every model to one, and resuming
    from a full one, alternating over ``args.repeat`` rounds (each in a fresh child)."""
    print(machine(args) + "; checkpoint_dir: none / saving every model / all saved")
    modes = {"": "no checkpoint_dir", "save": "saving each model", "resume": "resuming, all saved"}
    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeat):
        for mode in modes:
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                runs[mode].append(pool.submit(run, True, args, mode).result())
    print()
    print("| checkpoint_dir | wall s (median) | CPU s (median) | vs none, wall | models trained |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(r["seconds"] for r in runs[""])
    for mode, name in modes.items():
        t = statistics.median(r["seconds"] for r in runs[mode])
        cpu = statistics.median(r["cpu_seconds"] for r in runs[mode])
        trained = runs[mode][0]["trained_here"]
        print(f"| {name} | {t:.3f} | {cpu:.3f} | {t - base:+.3f} s | {trained} |")
    diff = max(
        float(np.abs(runs[m][0]["params"][k] - runs[""][0]["params"][k]).max())
        for m in modes
        for k in runs[""][0]["params"]
    )
    print(f"\nlargest parameter difference, saved or resumed vs none: {diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--records", type=int, default=250)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5, help="alternating rounds per path")
    parser.add_argument(
        "--world-size", type=int, default=1, help="> 1: 1 process vs this many gloo ranks"
    )
    parser.add_argument(
        "--checkpoint", action="store_true", help="none vs saving to vs resuming from a folder"
    )
    args = parser.parse_args()
    if args.world_size > 1:
        compare_world_sizes(args)
        return
    if args.checkpoint:
        compare_checkpoints(args)
        return

    print(machine(args))
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
