"""Benchmark privmon's estimators: speed / peak memory, and accuracy against analytic truth.

Run from the repository root::

    python benchmarks/estimators.py            # full run (a few minutes on 2 cores)
    python benchmarks/estimators.py --quick    # smoke test (under a minute)
    python benchmarks/estimators.py --sizes 1e3,2e4,1e5 --table 1

It prints the machine, then two markdown tables ready to paste into a README (progress goes to
stderr, so ``> bench.md`` captures only the tables).

**Table 1 — time and peak memory.** ``n`` is the *total* number of scores, split evenly: n/2
members ~ N(1, 1) and n/2 non-members ~ N(0, 1) (2-D rows: N((1, 1), I) vs N((0, 0), I)).
n = 2·10⁴ is the goal case (1-D, 20k scores). Each (estimator, n) cell runs in a fresh process
forked from a forkserver that has already imported torch / numpy / scipy / sklearn / privmon:

1. a warm-up call on 200 scores (one-time lazy initialisation is not counted),
2. the data are generated, then ``ru_maxrss`` (KiB on Linux) is read,
3. one call is made and ``ru_maxrss`` read again: the difference is the call's extra peak RSS,
4. the call is repeated (at least 3 times, more while under ~1.5 s in all) and the median
   ``time.perf_counter`` duration is reported (the call of step 3 is the warm-up).

Why a forkserver rather than 'spawn' / ``subprocess``: on Linux ``ru_maxrss`` survives
``execve``, so a child started by fork+exec from a parent that has already peaked high (e.g.
after Table 1's 10⁶ rows) reports the parent's peak and hides its own increase. A child forked
from the small forkserver starts with its own high-water mark.

**Shared machines.** torch's CPU backend here is OpenMP (libgomp), whose idle threads spin.
When other processes keep the cores busy, a call with the default intra-op threads (= cores)
can run 10-40x slower than with one thread. ``--threads 1`` or ``OMP_WAIT_POLICY=PASSIVE``
(an environment variable, read when torch loads) avoids it. The first output line shows both
settings and the load average, so you can tell whether a run was contended.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import scipy
import scipy.stats
import sklearn
import torch
from scipy.integrate import quad, trapezoid
from sklearn.metrics import roc_auc_score

import privmon

PRELOAD = ["__main__", "numpy", "scipy.stats", "scipy.integrate", "sklearn.metrics", "torch"]
FULL_SIZES = (1_000, 10_000, 20_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 20_000)
GOAL_N = 20_000
SCIPY_KDE_MAX_N = 100_000  # direct gaussian_kde evaluation: O(n · grid), no binning
KDE_GRID = 2048
HIST_BINS = 100
DELTA = 0.05


# -- estimators under test ---------------------------------------------------------------------
def numpy_wn(m: np.ndarray, h: np.ndarray, prior: float = 0.5) -> float:
    """W_N by hand: 100 bins over the pooled data range, sum |p·P̂ − (1−p)·Q̂|."""
    lo, hi = min(m.min(), h.min()), max(m.max(), h.max())
    c1, _ = np.histogram(m, bins=HIST_BINS, range=(lo, hi))
    c0, _ = np.histogram(h, bins=HIST_BINS, range=(lo, hi))
    return float(np.abs(prior * c1 / len(m) - (1 - prior) * c0 / len(h)).sum())


def scipy_un(m: np.ndarray, h: np.ndarray, prior: float = 0.5) -> float:
    """U_N by hand: scipy gaussian_kde (Scott) on a 2048-point grid, trapezoid quadrature."""
    km, kh = scipy.stats.gaussian_kde(m), scipy.stats.gaussian_kde(h)
    sd = math.sqrt(max(float(km.covariance[0, 0]), float(kh.covariance[0, 0])))
    lo = min(m.min(), h.min()) - 4 * sd
    hi = max(m.max(), h.max()) + 4 * sd
    x = np.linspace(lo, hi, KDE_GRID)
    return float(trapezoid(np.abs(prior * km(x) - (1 - prior) * kh(x)), x))


def sklearn_auc(m: np.ndarray, h: np.ndarray) -> float:
    y = np.concatenate([np.ones(len(m)), np.zeros(len(h))])
    return float(roc_auc_score(y, np.concatenate([m, h])))


ESTIMATORS: dict[str, tuple[str, Callable]] = {
    "adv_hist": (
        '`privmon.optimal_advantage(method="histogram")`',
        lambda m, h: privmon.optimal_advantage(m, h, method="histogram"),
    ),
    "adv_kde": (
        '`privmon.optimal_advantage(method="kde")`',
        lambda m, h: privmon.optimal_advantage(m, h, method="kde"),
    ),
    "risk_hist": (
        "`privmon.individual_risk` (histogram, all members scored)",
        lambda m, h: privmon.individual_risk(m, m, h, method="histogram"),
    ),
    "auc": ("`privmon.auc`", lambda m, h: privmon.auc(m, h)),
    "sk_auc": ("`sklearn.metrics.roc_auc_score` (pooled + labels)", sklearn_auc),
    "np_wn": ("numpy `np.histogram` W_N plug-in (100 bins)", numpy_wn),
    "sp_un": (f"`scipy.stats.gaussian_kde` U_N plug-in ({KDE_GRID}-pt grid)", scipy_un),
}
ROWS_1D = ["adv_hist", "np_wn", "adv_kde", "sp_un", "risk_hist", "auc", "sk_auc"]
ROWS_2D = ["adv_hist", "adv_kde"]


def make_data(n_total: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = n_total // 2
    shape = (k,) if d == 1 else (k, d)
    return rng.normal(1.0, 1.0, shape), rng.normal(0.0, 1.0, shape)


def maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# -- Table 1 worker (runs in a fresh forked process) -------------------------------------------
def _worker(key, n, d, threads, budget_s, min_reps, max_reps, conn) -> None:
    try:
        if threads:
            torch.set_num_threads(threads)
        fn = ESTIMATORS[key][1]
        fn(*make_data(200, d, seed=1))  # lazy imports / thread pools / FFT set-up
        m, h = make_data(n, d, seed=0)
        gc.collect()
        before = maxrss_kib()
        t0 = time.perf_counter()
        fn(m, h)
        first = time.perf_counter() - t0
        after = maxrss_kib()
        reps = int(min(max_reps, max(min_reps, budget_s // max(first, 1e-9))))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(m, h)
            times.append(time.perf_counter() - t0)
        conn.send(
            {
                "ok": True,
                "ms": 1e3 * statistics.median(times),
                "mib": (after - before) / 1024,
                "reps": reps,
                "base_mib": before / 1024,
            }
        )
    except BaseException as err:  # report, never hang the parent
        conn.send({"ok": False, "error": f"{type(err).__name__}: {err}"})
    finally:
        conn.close()


def run_cell(ctx, key, n, d, threads, budget_s, min_reps, max_reps) -> dict:
    recv, send = ctx.Pipe(duplex=False)
    args = (key, n, d, threads, budget_s, min_reps, max_reps, send)
    p = ctx.Process(target=_worker, args=args)
    p.start()
    send.close()
    try:
        out = recv.recv()
    except EOFError:
        out = {"ok": False, "error": "worker died"}
    p.join()
    if p.exitcode not in (0, None) and out.get("ok"):
        out = {"ok": False, "error": f"exit code {p.exitcode}"}
    return out


def fmt_ms(ms: float) -> str:
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def fmt_n(n: int) -> str:
    e = math.log10(n)
    if abs(e - round(e)) < 1e-9:
        return f"10^{round(e)}"
    mant = n / 10 ** math.floor(e)
    if abs(mant - round(mant)) < 1e-9:
        return f"{round(mant)}·10^{math.floor(e)}"
    return f"{n:,}"


def table1(sizes, sizes_2d, *, threads, budget_s, min_reps, max_reps, log) -> list[str]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    cols = sorted(set(sizes) | set(sizes_2d))
    plan = [(key, 1, n) for key in ROWS_1D for n in sizes]
    plan += [(key, 2, n) for key in ROWS_2D for n in sizes_2d]
    results: dict[tuple[str, int, int], dict] = {}
    for i, (key, d, n) in enumerate(plan, 1):
        if key == "sp_un" and n > SCIPY_KDE_MAX_N:
            results[key, d, n] = {"ok": False, "skip": True}
            continue
        t0 = time.perf_counter()
        res = run_cell(ctx, key, n, d, threads, budget_s, min_reps, max_reps)
        results[key, d, n] = res
        detail = (
            f"{fmt_ms(res['ms'])} ms ×{res['reps']}, +{res['mib']:.1f} MiB"
            if res["ok"]
            else res["error"]
        )
        log(
            f"[table 1 {i}/{len(plan)}] {key} d={d} n={n}: {detail} "
            f"({time.perf_counter() - t0:.1f} s)"
        )

    head = ["Estimator", "d"] + [
        f"n = {fmt_n(n)}" + (" (goal)" if n == GOAL_N else "") for n in cols
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * len(cols)]
    skipped = False
    for d, keys, ns in ((1, ROWS_1D, sizes), (2, ROWS_2D, sizes_2d)):
        for key in keys:
            cells = []
            for n in cols:
                res = results.get((key, d, n))
                if n not in ns or res is None:
                    cells.append("—")
                elif res.get("skip"):
                    cells.append("skipped¹")
                    skipped = True
                elif not res["ok"]:
                    cells.append(f"error: {res['error']}")
                else:
                    cells.append(f"{fmt_ms(res['ms'])} ms / {res['mib']:.1f} MiB")
            lines.append("| " + " | ".join([ESTIMATORS[key][0], str(d), *cells]) + " |")
    notes = [
        "",
        "Cells: median wall time of one call (ms) / extra peak RSS of one call (MiB). "
        "n is the total number of scores: n/2 members ~ N(1, 1), n/2 non-members ~ N(0, 1) "
        "(d = 2: N((1, 1), I) vs N(0, I)). Float64 numpy inputs; torch on CPU. "
        f"Time: median of ≥ {min_reps} repetitions after a warm-up call (more reps while under "
        f"~{budget_s:g} s per cell, at most {max_reps}). Memory: ru_maxrss increase over one call "
        "in a fresh forked process that has imported everything, made a small warm-up call and "
        "generated the data; allocator caching puts values under ~0.5 MiB near 0.",
    ]
    if skipped:
        notes.append(
            f"¹ scipy `gaussian_kde` evaluates every kernel at every grid point "
            f"(O(n · {KDE_GRID}), no binning): skipped above n = {fmt_n(SCIPY_KDE_MAX_N)}."
        )
    notes += ["", cross_check(GOAL_N)]
    return lines + notes


def cross_check(n: int) -> str:
    """The comparison rows compute the same figures: largest difference at n (both priors)."""
    m, h = make_data(n, 1, seed=0)
    d_wn = d_un = 0.0
    for prior in (0.5, 0.2):
        d_wn = max(
            d_wn, abs(privmon.optimal_advantage(m, h, prior=prior).plugin - numpy_wn(m, h, prior))
        )
        kde = privmon.optimal_advantage(m, h, prior=prior, method="kde")
        d_un = max(d_un, abs(kde.plugin - scipy_un(m, h, prior)))
    d_auc = abs(privmon.auc(m, h) - sklearn_auc(m, h))
    return (
        f"Cross-check at n = {fmt_n(n)}, priors 0.5 and 0.2: "
        f"|privmon W_N − numpy W_N| ≤ {d_wn:.1e}, "
        f"|privmon U_N − scipy U_N| ≤ {d_un:.1e} (privmon bins the data on its 2000-cell grid "
        f"before the KDE), |privmon.auc − roc_auc_score| = {d_auc:.1e}."
    )


# -- Table 2: accuracy against analytic truth --------------------------------------------------
def true_advantage(mu: float, prior: float) -> float:
    """∫ |p·φ(x − μ) − (1 − p)·φ(x)| dx for μ >= 0, in closed form.

    For μ > 0 the members' term wins right of x* = μ/2 + log((1 − p)/p)/μ, so the integral is
    p·(1 − 2Φ(x* − μ)) + (1 − p)·(2Φ(x*) − 1); at μ = 0 it is |2p − 1|.
    """
    if mu == 0:
        return abs(2 * prior - 1)
    xs = mu / 2 + math.log((1 - prior) / prior) / mu
    phi = scipy.stats.norm.cdf
    return prior * (1 - 2 * phi(xs - mu)) + (1 - prior) * (2 * phi(xs) - 1)


def _check_truth(mu: float, prior: float) -> None:
    pdf = scipy.stats.norm.pdf

    def integrand(x: float) -> float:
        return abs(prior * pdf(x - mu) - (1 - prior) * pdf(x))

    num, _ = quad(integrand, -12, 12 + mu, points=[mu / 2], limit=200)
    exact = true_advantage(mu, prior)
    if abs(num - exact) > 1e-7:
        raise AssertionError(f"truth mismatch at mu={mu}, p={prior}: {exact} vs quad {num}")


def table2(reps: int, *, mus, priors, ns, methods, log) -> list[str]:
    acc: dict[tuple, dict[str, list[float]]] = {}
    for mu in mus:
        for prior in priors:
            _check_truth(mu, prior)
    total = len(mus) * len(ns)
    t_start = time.perf_counter()
    for i, (mu, n) in enumerate(((mu, n) for mu in mus for n in ns), 1):
        t0 = time.perf_counter()
        for r in range(reps):
            rng = np.random.default_rng([r, n, round(mu * 1000)])
            m, h = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)
            for prior in priors:
                for method in methods:
                    est = privmon.optimal_advantage(m, h, prior=prior, method=method, delta=DELTA)
                    rec = acc.setdefault((mu, prior, n, method), {"plugin": [], "value": []})
                    rec["plugin"].append(est.plugin)
                    rec["value"].append(est.value)
                    rec.setdefault("lower", []).append(est.lower)
        log(f"[table 2 {i}/{total}] mu={mu} n={n}: {time.perf_counter() - t0:.1f} s")
    log(f"[table 2] {time.perf_counter() - t_start:.1f} s")

    head = [
        "μ",
        "prior",
        "n / class",
        "method",
        "truth",
        "plug-in bias",
        "plug-in RMSE",
        "value bias",
        "value RMSE",
        "P(lower > truth)",
        "mean(truth − lower)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * 3 + "---|" + "---:|" * 7]
    for mu in mus:
        for prior in priors:
            truth = true_advantage(mu, prior)
            for n in ns:
                for method in methods:
                    rec = acc[mu, prior, n, method]
                    row = [f"{mu:g}", f"{prior:g}", f"{n:,}", method, f"{truth:.4f}"]
                    for k in ("plugin", "value"):
                        err = np.asarray(rec[k]) - truth
                        row += [f"{err.mean():+.4f}", f"{math.sqrt((err**2).mean()):.4f}"]
                    lower = np.asarray(rec["lower"])
                    row += [
                        f"{(lower > truth + 1e-12).mean():.2f}",
                        f"{(truth - lower).mean():.4f}",
                    ]
                    lines.append("| " + " | ".join(row) + " |")
    notes = [
        "",
        f"Members ~ N(μ, 1), non-members ~ N(0, 1), n of each (equal class sizes at every prior); "
        f"truth = ∫|p·φ(x − μ) − (1 − p)·φ(x)| dx (closed form, checked by quadrature). "
        f"{reps} seeded repetitions per row (the same samples serve every prior and method). "
        f"plug-in = `.plugin` (W_N / U_N), value = `.value` (debiased, cross-fitted); "
        f"P(lower > truth) is the certified bound's miss rate (goal ≤ δ = {DELTA:g}; resolution "
        f"1/{reps}). At μ = 0 the truth is the floor |2p − 1|, which `.value` and `.lower` never "
        f"go below.",
    ]
    return lines + notes


# -- main ----------------------------------------------------------------------------------------
def privmon_revision() -> str:
    """Short git commit of the checkout and whether privmon/ differs from it (read-only git)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(privmon.__file__)))
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "privmon"],
            cwd=root,
            env=env,
            capture_output=True,
            timeout=10,
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return ""
    return f" (git {rev}{', privmon/ modified' if dirty else ''})"


def machine_lines(label: str) -> list[str]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return [
        f"Machine: {model}; os.cpu_count() = {os.cpu_count()} (usable: {usable}); "
        f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}; "
        f"Python {platform.python_version()}, numpy {np.__version__}, scipy {scipy.__version__}, "
        f"scikit-learn {sklearn.__version__}, privmon {privmon.__version__}{privmon_revision()}. "
        "OMP_NUM_THREADS="
        + os.environ.get("OMP_NUM_THREADS", "unset")
        + ", OMP_WAIT_POLICY="
        + os.environ.get("OMP_WAIT_POLICY", "unset")
        + f". Load average {label}: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + ".",
    ]


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(float(s)) for s in text.split(",") if s.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes takes numbers like 1e3,2e4, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 8:
        raise argparse.ArgumentTypeError("--sizes needs total sizes >= 8")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and repetitions")
    ap.add_argument(
        "--sizes",
        type=parse_sizes,
        help="Table 1 total sizes, comma-separated (default 1e3,1e4,2e4,1e5,1e6; quick 1e3,2e4)",
    )
    ap.add_argument("--reps", type=int, help="Table 2 repetitions (default 50; quick 10)")
    ap.add_argument("--table", choices=("1", "2", "both"), default="both")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads (default: torch's default)"
    )
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    sizes_2d = (10_000,) if args.quick else (10_000, 100_000)
    reps = args.reps or (10 if args.quick else 50)
    if args.threads:
        torch.set_num_threads(args.threads)
    busy = os.getloadavg()[0]
    if busy > 0.5 * (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
            log(
                f"warning: load average {busy:.1f} on {os.cpu_count()} cores with "
                f"{torch.get_num_threads()} spinning OpenMP threads: timings will be inflated; "
                "rerun with OMP_WAIT_POLICY=PASSIVE or --threads 1 (see the module docstring)"
            )
    t_start = time.perf_counter()
    out = machine_lines("at start (1, 5, 15 min)")
    if args.table in ("1", "both"):
        out += ["", "### Table 1 — time and peak memory per call", ""]
        out += table1(
            sizes,
            sizes_2d,
            threads=args.threads,
            budget_s=0.3 if args.quick else 1.5,
            min_reps=3,
            max_reps=5 if args.quick else 15,
            log=log,
        )
    if args.table in ("2", "both"):
        out += ["", "### Table 2 — accuracy against the analytic advantage", ""]
        out += table2(
            reps,
            mus=(0.0, 0.25, 1.0, 2.0),
            priors=(0.5, 0.2),
            ns=(1_000, 10_000),
            methods=("histogram", "kde"),
            log=log,
        )
    out += [
        "",
        f"Total benchmark time: {time.perf_counter() - t_start:.0f} s. Load average at end: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + ".",
    ]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
