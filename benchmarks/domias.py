"""Benchmark DOMIAS and its baselines: privmon (torch, vectorized) against the published code.

Run from the repository root::

    python benchmarks/domias.py            # the speed case of issue 4 (about a minute)
    python benchmarks/domias.py --quick    # smaller sets, a few seconds
    python benchmarks/domias.py --threads 2
    python benchmarks/domias.py --section monitor   # only the monitor table (about 20 s)
    python benchmarks/domias.py --section flow      # BNAF fits: Table 3 vs FAST_CPU (minutes)

It prints the machine and its load average, then the attack table and the monitor table
(``--section attacks|monitor|flow|all``; ``all`` leaves out the slow flow section; progress goes
to stderr).

**Data.** d = 8 features, a correlated Gaussian population. As in the published DOMIAS code's
toy pipeline, the "generator" is a Gaussian KDE fitted to the members and the synthetic set is
drawn from it; the reference set is drawn from the population; the test set is the members and
as many non-members. Full run: 2,000 test records (1,000 members), 10,000 synthetic and 10,000
reference records (the speed case of issue 4: the paper's Sec. 5.1 sizes).

**What is compared.** Each row runs privmon's function and a reference implementation on the
same data, in the same process:

- DOMIAS-KDE vs ``scipy.stats.gaussian_kde(...).logpdf`` for p_G and p_R (and, in its own row,
  ``gaussian_kde.__call__``, the linear-space path of the paper's code, ``p_G / (p_R + 1e-30)``);
- Eq. 1 vs ``gaussian_kde(syn).logpdf`` and a per-record numpy loop (log-sum-exp of the kernels);
- GAN-Leaks, GAN-Leaks CAL and MC vs the published per-record loops (``d(x, X_G)`` per record,
  squared Euclidean distances);
- LOGAN-D1 (default 15 epochs) vs the published training loop as published: a ``torch.nn.Linear``
  MLP with two softmax outputs, ``int(300 * n_test / 256)`` batches of 256 drawn with
  ``np.random.choice(num, 256)`` — from the first ``num`` rows only, which are all synthetic, so
  the published classifier never sees a reference record (its AUC shows it). Training an MLP is
  minibatch arithmetic in both versions, with no per-record loop to remove: the speedup is the
  ratio of gradient steps, not the 20× of the distance baselines. Different random draws give
  different classifiers, so only their AUCs are comparable.

**Timing.** Each function is called once to warm up (not counted), then timed ``--repeats``
times (default 3) with ``time.perf_counter``; the table shows the median. The references and
privmon run with one torch thread (scipy and the loops are single-threaded), and privmon again,
in a second column, with ``--threads`` (default: torch's default). On a shared machine, torch's
OpenMP threads spin while waiting; with other processes on the cores, multi-threaded runs can be
much slower than one thread (``OMP_WAIT_POLICY=PASSIVE``, set before the run, avoids it). The
first line shows the load average before and after the run.

Agreement columns: the largest absolute difference of the scores (in the published code's
units: log densities, or the log of GAN-Leaks' ``exp(-d)`` scores; MC fractions) and the
Spearman rank correlation with the reference implementation.

**Monitor section: the per-check cost of DOMIAS**
(:class:`privmon.queries.GeneratorQuery`). The digits-sized setting of
``privmon demo``: the demo's MLP GAN trained for ``--gan-steps`` steps (default 1,000, not
timed) on 200 digits; the audit set is those 200 members and 400
non-members in batches of 256 (as the demo passes them); 1,000 synthetic records per check; a
reference set of 400 records (and, in a second block, all 1,197 remaining digits); PCA to 10
dimensions. One check is what the monitor runs: ``prepare`` (sample the generator, embed, fit
p_G), the three audit batches, ``release``. Rows:

- ``domias_scores`` from scratch: sample, then :func:`privmon.domias_scores` on the 600 audit
  records with ``embed="pca"`` (PCA fit, p_R and p_G fitted, both evaluated) — what a monitor
  without state would do;
- ``GeneratorQuery(cache=False)``: PCA axes and p_R fitted once at construction, ``log p_R``
  of every audit record evaluated again at every check;
- ``GeneratorQuery`` (default, cached): ``log p_R`` of each audit record and its embedding
  cached by batch content after the first check.

Every variant draws the same synthetic set per check (the global torch RNG is seeded with the
check's index), so their scores agree (``max |Δ|`` column, against the first row). Times are the
median over ``--checks`` checks (default 30) after one warm-up check, with one torch thread;
``log p_R evals`` counts audit records whose reference density was evaluated per check (steady
state). The last row of each block is a whole ``PrivacyMonitor.check`` with the cached query
(both estimators, ROC figures and per-record risk included).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import scipy
import torch
from scipy.special import logsumexp
from scipy.stats import gaussian_kde, spearmanr

from privmon.attacks.baselines import eq1, gan_leaks, gan_leaks_cal, logan_d1, monte_carlo
from privmon.attacks.domias import domias_scores
from privmon.estimators.flow import FAST_CPU, fit_flow
from privmon.estimators.roc import auc
from privmon.queries import GeneratorQuery

D = 8


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_data(n_mem: int, n_syn: int, n_ref: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    mix = np.eye(D) + 0.3 * rng.normal(size=(D, D))
    draw = lambda n: rng.normal(size=(n, D)) @ mix.T  # noqa: E731
    mem, non, ref = draw(n_mem), draw(n_mem), draw(n_ref)
    syn = gaussian_kde(mem.T).resample(n_syn, seed=rng).T  # an overfitted "generator"
    test = np.r_[mem, non]
    return test, syn, ref, n_mem


# --- reference implementations (the published code's definitions, per record) -----------------


def d(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.sum((x - y) ** 2, axis=1)


def loop_gan_leaks(test, syn):
    return np.array([np.exp(-np.min(d(x, syn))) for x in test])


def loop_gan_leaks_cal(test, syn, ref):
    return np.array([np.exp(-np.min(d(x, syn)) + np.min(d(x, ref))) for x in test])


def loop_mc(test, syn):
    distances = np.zeros((test.shape[0], syn.shape[0]))
    for i, x in enumerate(test):
        distances[i] = d(x, syn)
    eps = np.median(np.min(distances, 1))
    scores = np.zeros(test.shape[0])
    for i in range(test.shape[0]):
        scores[i] = np.sum(distances[i] < eps)
    return scores / syn.shape[0]


def loop_eq1(test, syn):
    kde = gaussian_kde(syn.T)
    prec = np.linalg.inv(kde.covariance)
    norm = -0.5 * np.linalg.slogdet(2 * np.pi * kde.covariance)[1] - np.log(len(syn))
    out = np.empty(len(test))
    for i, x in enumerate(test):
        diff = syn - x
        out[i] = logsumexp(-0.5 * np.einsum("ij,jk,ik->i", diff, prec, diff)) + norm
    return out


def scipy_domias_logpdf(test, syn, ref):
    return gaussian_kde(syn.T).logpdf(test.T) - gaussian_kde(ref.T).logpdf(test.T)


def scipy_domias_pdf(test, syn, ref):  # the paper's code: linear space, + 1e-30
    return gaussian_kde(syn.T)(test.T) / (gaussian_kde(ref.T)(test.T) + 1e-30)


def published_logan_d1(test, syn, ref, steps: int, seed: int = 0):
    """The published LOGAN_D1 loop (CPU), for ``steps`` batches of 256."""
    torch.manual_seed(seed)
    rs = np.random.RandomState(seed)
    num = min(len(syn), len(ref))

    class Net(torch.nn.Module):
        def __init__(self, input_dim, hidden_dim=256, out_dim=2):
            super().__init__()
            self.fc1 = torch.nn.Linear(input_dim, hidden_dim)
            self.fc2 = torch.nn.Linear(hidden_dim, hidden_dim)
            self.fc3 = torch.nn.Linear(hidden_dim, out_dim)

        def forward(self, x):
            x = torch.relu(self.fc1(x))
            x = torch.relu(self.fc2(x))
            return self.fc3(x)

    clf = Net(test.shape[1])
    opt = torch.optim.Adam(clf.parameters(), lr=1e-3)
    loss_func = torch.nn.CrossEntropyLoss()
    all_x = torch.as_tensor(np.vstack([syn[:num], ref[:num]])).float()
    all_y = torch.as_tensor(np.concatenate([np.ones(num), np.zeros(num)])).long()
    for _ in range(steps):
        idx = rs.choice(num, 256)  # (the published code draws from the first num rows only)
        loss = loss_func(clf(all_x[idx]), all_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return clf(torch.as_tensor(test).float())[:, 1].numpy()


# --- timing ------------------------------------------------------------------------------------


def timed(fn: Callable[[], np.ndarray], repeats: int, threads: int | None = None):
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        out = fn()  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(previous)
    return statistics.median(times), np.asarray(out, dtype=np.float64)


# --- monitor section: per-check cost of GeneratorQuery(attack="domias") ---------------------------


def _train_demo_gan(members: torch.Tensor, steps: int, seed: int = 0) -> torch.nn.Module:
    """The demo's GAN training loop (privmon.demo.run_demo without the monitor)."""
    from privmon.demo import gan_step, make_gan

    torch.manual_seed(seed)
    generator, discriminator = make_gan(members.shape[1])
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(members), batch_size=64, shuffle=True, drop_last=True
    )
    step = 0
    while step < steps:
        for (real,) in loader:
            step += 1
            gan_step(generator, discriminator, opt_g, opt_d, real)
            if step >= steps:
                break
    return generator


def monitor_table(n_checks: int, gan_steps: int) -> list[str]:
    from privmon.callbacks import PrivacyMonitor
    from privmon.demo import LATENT, digits_splits

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        members, nonmembers, rest = digits_splits(0, 200, 400, 1197)
        log(f"monitor section: training the demo GAN for {gan_steps} steps ...")
        generator = _train_demo_gan(members, gan_steps)
        audit = [members] + [nonmembers[i : i + 256] for i in range(0, len(nonmembers), 256)]
        test = torch.cat(audit)
        lines = [
            "| reference | per check | ms / check | vs from scratch | log p_R evals / check "
            "| max abs Δ score |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for n_ref in (400, 1197):
            reference = rest[:n_ref]
            log(f"monitor section: {n_ref} reference records ...")

            def scratch(i, reference=reference):
                torch.manual_seed(i)
                with torch.no_grad():
                    syn = generator(torch.randn(1000, LATENT))
                return torch.as_tensor(domias_scores(test, syn, reference, embed="pca"))

            def query_check(q, i):
                torch.manual_seed(i)
                q.prepare()
                try:
                    return torch.cat([q(b) for b in audit])
                finally:
                    q.release()

            kw = {"n_samples": 1000, "latent_dim": LATENT, "embed": "pca", "name": "domias"}
            plain = GeneratorQuery(generator, reference, cache=False, **kw)
            cached = GeneratorQuery(generator, reference, **kw)
            monitored = GeneratorQuery(generator, reference, **kw)
            monitor = PrivacyMonitor(monitored, [audit[0]], audit[1:], strict=True)
            variants = [
                ("`domias_scores` from scratch", scratch, None),
                ("`GeneratorQuery(cache=False)`", lambda i, q=plain: query_check(q, i), plain),
                (
                    "`GeneratorQuery` (cached, default)",
                    lambda i, q=cached: query_check(q, i),
                    cached,
                ),
            ]
            base_ms = None
            base_scores = {}
            for label, fn, q in variants:
                fn(-1)  # warm-up (fills the cache)
                evals0 = q.n_reference_evaluations if q is not None else None
                times, diffs = [], []
                for i in range(n_checks):
                    t = time.perf_counter()
                    out = fn(i)
                    times.append(time.perf_counter() - t)
                    if base_ms is None:
                        base_scores[i] = out
                    else:
                        diffs.append(float((out - base_scores[i]).abs().max()))
                ms = 1e3 * statistics.median(times)
                if q is None:
                    evals = f"{len(test)}"
                else:
                    evals = f"{(q.n_reference_evaluations - evals0) / n_checks:.0f}"
                diff = "—" if base_ms is None else f"{max(diffs):.1e}"
                speed = "1.0×" if base_ms is None else f"{base_ms / ms:.2f}×"
                lines.append(f"| {n_ref} | {label} | {ms:.2f} | {speed} | {evals} | {diff} |")
                if base_ms is None:
                    base_ms = ms
            monitor.check(0)  # warm-up
            evals0 = monitored.n_reference_evaluations
            times = []
            for i in range(1, n_checks + 1):
                t = time.perf_counter()
                monitor.check(i)
                times.append(time.perf_counter() - t)
            lines.append(
                f"| {n_ref} | whole `PrivacyMonitor.check` (cached query, histogram + kde) | "
                f"{1e3 * statistics.median(times):.2f} | — | "
                f"{(monitored.n_reference_evaluations - evals0) / n_checks:.0f} | — |"
            )
        return lines
    finally:
        torch.set_num_threads(previous)


def flow_table(args: argparse.Namespace) -> None:
    """DOMIAS with BNAF densities: DOMIAS Table 3 (the defaults) against FAST_CPU, one thread."""
    n_mem, n_syn, n_ref = (250, 2_500, 2_500) if args.quick else (1_000, 10_000, 10_000)
    test, syn, ref, n_mem = make_data(n_mem, n_syn, n_ref)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    lines = [
        "| setting | fit (s), reference set | epochs run (best) | s / epoch | "
        "best validation NLL | DOMIAS-flow AUC (both fits) | wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    try:
        for name, kwargs in (("DOMIAS Table 3 (default)", {}), ("FAST_CPU", FAST_CPU)):
            log(f"flow section: {name} ...")
            t = time.perf_counter()
            flow = fit_flow(ref, **kwargs)
            fit_s = time.perf_counter() - t
            h = flow.history
            t = time.perf_counter()
            scores = domias_scores(test, syn, ref, density="flow", flow_kwargs=kwargs)
            wall = time.perf_counter() - t
            lines.append(
                f"| {name} | {fit_s:.1f} | {h['epochs_run']} ({h['best_epoch'] + 1}) | "
                f"{fit_s / h['epochs_run']:.2f} | {min(h['val_nll']):.4f} | "
                f"{auc(scores[:n_mem], scores[n_mem:]):.3f} | {wall:.1f} |"
            )
    finally:
        torch.set_num_threads(previous)
    kde = domias_scores(test, syn, ref)
    print(
        f"Flow section: d = {D}, {len(test)} test, {n_syn} synthetic, {n_ref} reference records; "
        f"1 torch thread; DOMIAS-KDE AUC on the same data {auc(kde[:n_mem], kde[n_mem:]):.3f}.\n"
    )
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sets (a few seconds)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--section",
        choices=("all", "attacks", "monitor", "flow"),
        default="all",
        help="which table(s) to run: the attack comparison, the monitor's per-check cost, or both",
    )
    ap.add_argument("--checks", type=int, default=30, help="monitor section: timed checks")
    ap.add_argument(
        "--gan-steps", type=int, default=1000, help="monitor section: GAN training steps"
    )
    args = ap.parse_args()
    if args.section == "flow":
        flow_table(args)
    if args.section in ("all", "attacks"):
        attack_table(args)
    if args.section in ("all", "monitor"):
        load0 = os.getloadavg()
        lines = monitor_table(args.checks, args.gan_steps)
        load1 = os.getloadavg()
        print()
        print(
            f"Monitor section (digits, 200 members + 400 non-members audit, 1000 synthetic, "
            f"PCA to 10 dims, demo GAN after {args.gan_steps} steps, 1 torch thread, median of "
            f"{args.checks} checks): load average before {load0[0]:.2f} / after {load1[0]:.2f}."
        )
        print()
        print("\n".join(lines))


def attack_table(args: argparse.Namespace) -> None:
    n_mem, n_syn, n_ref = (250, 2_500, 2_500) if args.quick else (1_000, 10_000, 10_000)
    load0 = os.getloadavg()
    test, syn, ref, n_mem = make_data(n_mem, n_syn, n_ref)
    epochs = 5 if args.quick else 15  # privmon's default: 15
    steps = int(300 * len(test) / 256)  # the published code's count

    rows = [
        # name, privmon call, reference name, reference call, agreement transform (ref -> ours)
        (
            "DOMIAS-KDE",
            lambda: domias_scores(test, syn, ref),
            "scipy gaussian_kde.logpdf",
            lambda: scipy_domias_logpdf(test, syn, ref),
            lambda r: r,
        ),
        (
            "DOMIAS-KDE",
            lambda: domias_scores(test, syn, ref),
            "scipy gaussian_kde() (paper's code)",
            lambda: scipy_domias_pdf(test, syn, ref),
            lambda r: np.log(r),
        ),
        (
            "Eq. 1",
            lambda: eq1(test, syn),
            "per-record numpy loop",
            lambda: loop_eq1(test, syn),
            None,
        ),
        (
            "Eq. 1",
            lambda: eq1(test, syn),
            "scipy gaussian_kde.logpdf",
            lambda: gaussian_kde(syn.T).logpdf(test.T),
            None,
        ),
        (
            "GAN-Leaks",
            lambda: gan_leaks(test, syn),
            "published per-record loop",
            lambda: loop_gan_leaks(test, syn),
            lambda r: np.log(r),
        ),
        (
            "GAN-Leaks CAL",
            lambda: gan_leaks_cal(test, syn, ref),
            "published per-record loop",
            lambda: loop_gan_leaks_cal(test, syn, ref),
            lambda r: np.log(r),
        ),
        (
            "MC",
            lambda: monte_carlo(test, syn),
            "published per-record loop",
            lambda: loop_mc(test, syn),
            None,
        ),
        (
            f"LOGAN-D1 ({epochs} epochs)",
            lambda: logan_d1(test, syn, ref, epochs=epochs),
            f"published training loop ({steps} steps)",
            lambda: published_logan_d1(test, syn, ref, steps),
            "auc",
        ),
    ]
    t_threads = args.threads
    header = (
        f"| attack | reference | reference s | privmon s (1 thread) | speedup | "
        f"privmon s ({t_threads} threads) | speedup | max abs diff | Spearman | AUC |"
    )
    lines = [header, "|" + "---|" * 10]
    for name, ours, ref_name, theirs, transform in rows:
        log(f"{name} vs {ref_name} ...")
        t_ref, r = timed(theirs, args.repeats, threads=1)
        t_1, o = timed(ours, args.repeats, threads=1)
        t_n, _ = timed(ours, args.repeats, threads=t_threads)
        a = auc(o[:n_mem], o[n_mem:])
        if transform == "auc":
            diff, rho = "—", f"AUC ref {auc(r[:n_mem], r[n_mem:]):.3f}"
        else:
            rr = r if transform is None else transform(r)
            diff, rho = f"{np.max(np.abs(o - rr)):.1e}", f"{spearmanr(o, r).statistic:.6f}"
        lines.append(
            f"| {name} | {ref_name} | {t_ref:.3f} | {t_1:.4f} | {t_ref / t_1:.1f}× | "
            f"{t_n:.4f} | {t_ref / t_n:.1f}× | {diff} | {rho} | {a:.3f} |"
        )
    load1 = os.getloadavg()
    print(
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"scipy {scipy.__version__}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
        f"; load average before {load0[0]:.2f} / after {load1[0]:.2f} (1 min). "
        f"d = {D}, {len(test)} test, {n_syn} synthetic, {n_ref} reference records; "
        f"median of {args.repeats} runs after a warm-up."
    )
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
