"""One-run ε lower bounds on the idealised Gaussian mechanism: power, null level, speed, peer.

Run from the repository root::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/one_run_audit.py
    OMP_WAIT_POLICY=PASSIVE python benchmarks/one_run_audit.py --parts jax \\
        --peer-python /work/venv-jaxprivacy/bin/python

The idealised Gaussian mechanism: each of m canaries is included with probability 1/2 and
scored N(1, σ²) when included, N(0, σ²) when not; it is exactly μ-GDP with μ = 1/σ (theory ε
4.37 at σ = 1, 1.99 at σ = 2, δ = 1e-5). Parts (``--parts``, default gaussian,null,timing,cost):

* ``gaussian``: m = 1e5, δ = 1e-5, significance 0.05, seeds 0..4, both methods. privmon's
  default (``selection="split"``, 10 % selection part) beside a 6-point Bonferroni grid
  (``selection="bonferroni"``: k₊ = k₋ = k, k/m in 0.001, 0.002, 0.004, 0.008, 0.016, 0.032,
  each at 0.05 / 6), the best uncorrected guess count (the largest bound over k₊ = k₋ = k, 40
  k geometric from 1 to m/2, each at 0.05: not a valid bound, the ceiling a guess choice can
  reach) and the figures of Mahloujifar et al., Table 1.
* ``null``: in and out scores from one distribution, 200 runs per setting: the fraction of
  runs with ε > 0 (a valid 5 % test: at most 0.05; two-sided 95 % binomial band for a true 5 %
  at 200 runs: 0.02-0.08). Scores continuous N(0, 1), tied (3 levels) or all equal; 1,000 and
  1e5 canaries. The uncorrected sweep (20 k, 1,000 canaries) shows why a correction is needed.
  Power beside it: the same selection on Gaussian canaries at σ = 3 (``--power-sigma``; theory
  ε 1.27 at δ = 1e-5), 50 runs: the fraction with ε > 0 and the mean ε.
* ``timing``: seconds per call at 1e5 canaries (median of 5, one thread).
* ``cost``: CPU seconds and peak traced memory of one count-level p-value at the largest counts,
  ``steinke_p_value(10**7, 10**7, 6*10**6, np.linspace(0, 1, 33), 1e-5)``: its α window runs
  from 40 standard deviations below the binomial mode (``max(0.0, …)`` in
  ``one_run_math.steinke_p_value``): 2.2 CPU s and 827 MiB; a window from 0 (``min`` for
  ``max``, the same value) took 14.0 s and 4669 MiB on the same 2-core box (issue #31). Recorded
  here rather than in a timed test.
* ``jax``: google-deepmind jax_privacy 2.0's ``CanaryScoreAuditor.epsilon_one_run`` /
  ``epsilon_one_run_fdp`` on the same scores (its default: positive guesses only, Bonferroni
  over its threshold hull; and its ``Split`` strategy), run in the peer's own environment
  (``--peer-python``, a separate venv: ``python -m venv /work/venv-jaxprivacy &&
  /work/venv-jaxprivacy/bin/pip install jax-privacy==2.0.0``); only arrays cross over, through
  an .npz file. Its count-level functions are compared with privmon's on the same counts too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DELTA = 1e-5
LEVEL = 0.05
METHODS = ("steinke", "fdp")
PAPER = {1.0: {"steinke": 2.61, "fdp": 3.61}, 2.0: {"steinke": 1.33, "fdp": 1.59}}
THEORY = {1.0: 4.37, 2.0: 1.99}
COUNTS = [(1000, 100, 80), (10_000, 500, 450), (100_000, 2000, 1800), (100_000, 800, 790)]


def canaries(seed: int, m: int, sigma: float, kind: str = "gaussian"):
    """(in_scores, out_scores) of m canaries, each in with probability 1/2. ``kind``:
    "gaussian" (in ~ N(1, σ²), out ~ N(0, σ²)), "continuous" (both N(0, 1)), "tied" (both
    uniform on 3 levels), "equal" (all 0)."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    scores = {
        "gaussian": lambda: rng.normal(included.astype(float), sigma),
        "continuous": lambda: rng.normal(size=m),
        "tied": lambda: rng.integers(0, 3, m).astype(float),
        "equal": lambda: np.zeros(m),
    }[kind]()
    return scores[included], scores[~included]


def sweep(ins, outs, method: str, n_k: int, seed: int) -> float:
    """The largest bound over k₊ = k₋ = k on a geometric grid, uncorrected."""
    from privmon.audit import one_run_epsilon

    m = len(ins) + len(outs)
    ks = np.unique(np.round(np.geomspace(1, m // 2, n_k)).astype(int))
    return max(
        one_run_epsilon(
            ins, outs, delta=DELTA, method=method, selection=(int(k), int(k)), seed=seed
        ).epsilon
        for k in ks
    )


def gaussian_part(seeds: int) -> None:
    from privmon.audit import one_run_epsilon

    print("\n### Idealised Gaussian mechanism, m = 1e5, δ = 1e-5, significance 0.05")
    print(f"mean (min-max) over seeds 0..{seeds - 1}\n")
    print(
        "| σ | method | theory ε | privmon split (default) | 6-pt Bonferroni grid | "
        "best uncorrected k | paper (Mahloujifar et al.) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for sigma in (1.0, 2.0):
        for method in METHODS:
            rows: dict[str, list[float]] = {"split": [], "bonferroni": [], "sweep": []}
            for seed in range(seeds):
                ins, outs = canaries(seed, 100_000, sigma)
                for selection in ("split", "bonferroni"):
                    audit = one_run_epsilon(
                        ins, outs, delta=DELTA, method=method, selection=selection, seed=seed
                    )
                    rows[selection].append(audit.epsilon)
                rows["sweep"].append(sweep(ins, outs, method, 40, seed))
            cells = [f"{np.mean(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in rows.values()]
            print(
                f"| {sigma:g} | {method} | {THEORY[sigma]} | {' | '.join(cells)} | "
                f"{PAPER[sigma][method]} |",
                flush=True,
            )


def null_part(runs: int, sizes: list[int], power_sigma: float) -> None:
    from privmon.audit import one_run_epsilon

    print(f"\n### Null: fraction of {runs} runs with ε > 0 (valid: <= 0.05), δ = 1e-5")
    print(
        f"power: the same selection on Gaussian canaries, σ = {power_sigma:g}, 50 runs: "
        "fraction with ε > 0, mean ε\n"
    )
    print("| canaries | method | selection | continuous | tied (3 levels) | all equal | power |")
    print("|---:|---|---|---:|---:|---:|---|")
    for m in sizes:
        for method in METHODS:
            selections = ["split", "bonferroni"] + (["uncorrected sweep"] if m <= 10_000 else [])
            for selection in selections:

                def bound(ins, outs, seed, method=method, selection=selection):
                    if selection == "uncorrected sweep":
                        return sweep(ins, outs, method, 20, seed)
                    return one_run_epsilon(
                        ins, outs, delta=DELTA, method=method, selection=selection, seed=seed
                    ).epsilon

                cells = []
                for kind in ("continuous", "tied", "equal"):
                    hits = [bound(*canaries(1000 + i, m, 1.0, kind), i) > 0 for i in range(runs)]
                    cells.append(f"{np.mean(hits):.3f}")
                power = [
                    bound(*canaries(5000 + i, m, power_sigma), i) for i in range(min(runs, 50))
                ]
                cells.append(f"{np.mean(np.array(power) > 0):.2f}, {np.mean(power):.2f}")
                print(f"| {m} | {method} | {selection} | {' | '.join(cells)} |", flush=True)


def timing_part() -> None:
    import torch

    from privmon.audit import one_run_epsilon

    torch.set_num_threads(1)
    print("\n### Seconds per call, 1e5 canaries (median of 5, one thread)\n")
    print("| σ | method | split | bonferroni |")
    print("|---:|---|---:|---:|")
    for sigma in (1.0, 2.0):
        ins, outs = canaries(0, 100_000, sigma)
        for method in METHODS:
            cells = []
            for selection in ("split", "bonferroni"):
                times = []
                for seed in range(5):
                    start = time.perf_counter()
                    one_run_epsilon(
                        ins, outs, delta=DELTA, method=method, selection=selection, seed=seed
                    )
                    times.append(time.perf_counter() - start)
                cells.append(f"{np.median(times):.3f}")
            print(f"| {sigma:g} | {method} | {' | '.join(cells)} |", flush=True)


def jax_part(peer_python: str, seeds: int) -> None:
    from privmon.audit import epsilon_from_guesses, one_run_epsilon

    arrays, ours = {}, {}
    for sigma in (1.0, 2.0):
        for seed in range(seeds):
            ins, outs = canaries(seed, 100_000, sigma)
            arrays[f"in_{sigma:g}_{seed}"], arrays[f"out_{sigma:g}_{seed}"] = ins, outs
            for method in METHODS:
                for selection in ("split", "bonferroni"):
                    audit = one_run_epsilon(
                        ins, outs, delta=DELTA, method=method, selection=selection, seed=seed
                    )
                    ours[(sigma, method, selection, seed)] = audit.epsilon
    peer = run_peer(peer_python, arrays, COUNTS)
    print(f"\n### jax_privacy {peer['version']} on the same scores (m = 1e5, δ = 1e-5, 0.05)")
    print(f"mean over seeds 0..{seeds - 1}; jax_privacy guesses positive only\n")
    print(
        "| σ | method | privmon split | privmon Bonferroni | jax_privacy default (Bonferroni "
        "over its threshold hull) | jax_privacy Split (half) | formula sheet's jax figure |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    sheet = {(1.0, "steinke"): 0.57, (1.0, "fdp"): 2.37, (2.0, "steinke"): 0.20, (2.0, "fdp"): 1.13}
    for sigma in (1.0, 2.0):
        for method in METHODS:
            mine = [
                np.mean([ours[(sigma, method, sel, s)] for s in range(seeds)])
                for sel in ("split", "bonferroni")
            ]
            theirs = [
                np.mean(
                    [peer["scores"][f"{sigma:g}_{s} {method} {strategy}"] for s in range(seeds)]
                )
                for strategy in ("bonferroni", "split")
            ]
            print(
                f"| {sigma:g} | {method} | {mine[0]:.2f} | {mine[1]:.2f} | {theirs[0]:.2f} | "
                f"{theirs[1]:.2f} | {sheet[(sigma, method)]} |"
            )
    print("\n### Count-level bounds, δ = 1e-5, 0.05: privmon / jax_privacy\n")
    print("| m | guesses | correct | steinke | fdp |")
    print("|---:|---:|---:|---|---|")
    for (m, r, v), theirs in zip(COUNTS, peer["counts"], strict=True):
        mine = {
            mt: epsilon_from_guesses(n_canaries=m, n_guesses=r, n_correct=v, delta=DELTA, method=mt)
            for mt in METHODS
        }
        cells = [f"{mine[mt]:.4f} / {theirs[mt]:.4f}" for mt in METHODS]
        print(f"| {m} | {r} | {v} | {' | '.join(cells)} |")


def peer_side(npz: str) -> None:
    """Runs in jax_privacy's environment: no privmon, no torch; prints one JSON line with
    jax_privacy's bounds (both methods, its default Bonferroni over the threshold hull and its
    Split) for every pair ``in_<name>`` / ``out_<name>`` of the file, and the count-level bounds
    of its ``counts`` (when present)."""
    from importlib.metadata import version

    from jax_privacy import auditing

    data = np.load(npz)
    scores: dict[str, float] = {}
    for key in data.files:
        if not key.startswith("in_"):
            continue
        name = key[len("in_") :]
        auditor = auditing.CanaryScoreAuditor(data[f"in_{name}"], data[f"out_{name}"])
        seed = int(name.rsplit("_", 1)[1])
        for method, fn in (
            ("steinke", auditor.epsilon_one_run),
            ("fdp", auditor.epsilon_one_run_fdp),
        ):
            for strategy, choice in (
                ("bonferroni", auditing.Bonferroni()),
                ("split", auditing.Split(seed=seed)),
            ):
                scores[f"{name} {method} {strategy}"] = float(
                    fn(LEVEL, DELTA, threshold_strategy=choice)
                )
    counts = [
        {
            "steinke": auditing._epsilon_one_run(0, int(m), int(r), int(v), LEVEL, DELTA),
            "fdp": auditing._epsilon_one_run_fdp(0, int(m), int(r), int(v), LEVEL, DELTA),
        }
        for m, r, v in (data["counts"] if "counts" in data.files else [])
    ]
    print(json.dumps({"version": version("jax-privacy"), "scores": scores, "counts": counts}))


def run_peer(peer_python: str, arrays: dict[str, np.ndarray], counts: Any = None) -> dict:
    """jax_privacy's bounds on ``arrays`` (pairs ``in_<name>_<seed>`` / ``out_<name>_<seed>``),
    computed by :func:`peer_side` in the peer's own environment: only arrays cross over."""
    out = Path(tempfile.mkdtemp(prefix="privmon-one-run-"))
    extra = {} if counts is None else {"counts": np.array(counts)}
    np.savez(out / "scores.npz", **extra, **arrays)
    run = subprocess.run(
        [peer_python, __file__, "--peer-side", str(out / "scores.npz")],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        sys.exit(f"the peer failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def cost_part() -> None:
    import tracemalloc

    from privmon.audit.one_run_math import steinke_p_value

    print("\n### One p-value at m = r = 1e7, v = 6e6, 33 ε (CPU seconds, peak traced memory)\n")
    tracemalloc.start()
    start = time.process_time()
    p = steinke_p_value(10**7, 10**7, 6 * 10**6, np.linspace(0, 1, 33), DELTA)
    seconds = time.process_time() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print("| CPU s | peak MiB | p at ε = 0, 1 |")
    print("|---:|---:|---|")
    print(f"| {seconds:.2f} | {peak / 2**20:.0f} | {p[0]:.3g}, {p[-1]:.3g} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="gaussian,null,timing,cost")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=200, help="null runs per setting")
    parser.add_argument("--null-sizes", default="1000,100000")
    parser.add_argument(
        "--power-sigma", type=float, default=3.0, help="the null table's alternative"
    )
    parser.add_argument("--peer-python", default="/work/venv-jaxprivacy/bin/python")
    parser.add_argument("--peer-side", help=argparse.SUPPRESS)  # the peer's own process
    args = parser.parse_args()
    if args.peer_side:
        peer_side(args.peer_side)
        return
    parts = args.parts.split(",")
    if "gaussian" in parts:
        gaussian_part(args.seeds)
    if "null" in parts:
        null_part(args.runs, [int(m) for m in args.null_sizes.split(",")], args.power_sigma)
    if "timing" in parts:
        timing_part()
    if "cost" in parts:
        cost_part()
    if "jax" in parts:
        jax_part(args.peer_python, args.seeds)


if __name__ == "__main__":
    main()
