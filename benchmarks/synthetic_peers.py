"""privmon's table attacks against the packages the synthetic-data community uses, on CPS1988.

Run from the repository root (the ``domias`` side runs in its own virtual environment, since
``domias`` 0.0.5 pins its own dependencies; give its python with ``--domias-python``)::

    python3 -m venv /tmp/venv-dom && /tmp/venv-dom/bin/pip install torch==2.13.0 \\
        && /tmp/venv-dom/bin/pip install domias==0.0.5
    OMP_WAIT_POLICY=PASSIVE python benchmarks/synthetic_peers.py \\
        --domias-python /tmp/venv-dom/bin/python

The data: the example's split of seed 0 (``examples/synthetic_census.py``: duplicates dropped,
10,000 reference, 1,000 held-out, 100 members) and 10,000 records sampled from a TVAE fitted
on the members for ``--epochs`` epochs (seeded).

(a) DOMIAS. ``privmon.domias_scores`` on DataFrames against ``domias.baselines.kde_baseline``
(scipy ``gaussian_kde`` of the synthetic and the reference arrays; it returns
``p_G / (p_R + 1e-20)``) on the same records: the numeric columns only (where scipy's KDE has a
non-singular covariance), and the whole table one-hot encoded (where it may not). Spearman
between the scores, the largest difference of the log scores, the members' AUC, and the time of
one call of each (median of ``--repeats``; the package's in its own process, import excluded).

(b) DCR. ``privmon.attacks.dcr`` against ``sdmetrics.single_table.privacy.dcr_utils.
calculate_dcr`` (Gower distance of each audit record to its closest synthetic record).
sdmetrics takes each numeric column's range from the table the distances are measured to (its
``reference_dataset``, here the synthetic table), so privmon's encoder is fitted on that table
too (``dcr(audit, synthetic)``; a category of the audit records the release lacks is its
column's "other" code, one difference as in Gower's); the monitor's DCR query fits it on the
population reference set instead, which changes the ranges, not the method.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from synthetic_census import CATEGORICAL, census, make_synthesizer, splits  # noqa: E402

import privmon  # noqa: E402
from privmon.attacks import dcr  # noqa: E402

NUMERIC = ["wage", "education", "experience"]

PACKAGE_SIDE = """
import json, sys, time, warnings
import numpy as np
from domias.baselines import kde_baseline
data = np.load(sys.argv[1])
out, times = {}, {}
for name in json.loads(sys.argv[2]):
    x, g, r = data[name + "_test"], data[name + "_syn"], data[name + "_ref"]
    runs = []
    try:
        for _ in range(int(sys.argv[4])):
            t = time.perf_counter()
            _, ratio = kde_baseline(x, g, r)
            runs.append(time.perf_counter() - t)
        out[name] = ratio
        times[name] = runs
    except Exception as err:  # e.g. numpy.linalg.LinAlgError: a singular covariance
        times[name] = type(err).__name__ + ": " + str(err)[:60] + "..."
np.savez(sys.argv[3], **out)
print(json.dumps(times))
"""


def median_time(fn, repeats: int) -> tuple[float, object]:
    runs, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), out


def one_hot(table: pd.DataFrame, like: pd.DataFrame) -> np.ndarray:
    """The table as numbers: the numeric columns, then one 0/1 column per category of ``like``."""
    parts = [table[NUMERIC].to_numpy(dtype=np.float64)]
    for c in CATEGORICAL:
        for level in sorted(like[c].unique()):
            parts.append((table[c] == level).to_numpy(dtype=np.float64)[:, None])
    return np.hstack(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--domias-python", default="/tmp/venv-dom/bin/python")
    p.add_argument("--epochs", type=int, default=300, help="TVAE epochs before sampling")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    table = census()
    ref, held, mem, _ = splits(table, args.seed, n_reference=10_000, n_heldout=1000, n_members=100)
    tvae = make_synthesizer("tvae", args.epochs, args.seed)
    tvae.fit(mem, discrete_columns=CATEGORICAL)
    syn = tvae.sample(10_000)
    audit = pd.concat([mem, held], ignore_index=True)
    is_member = np.r_[np.ones(len(mem), bool), np.zeros(len(held), bool)]
    print(
        f"CPS1988 seed {args.seed}: {len(mem)} members + {len(held)} held-out audit records, "
        f"{len(syn)} TVAE ({args.epochs} epochs) and {len(ref)} reference records; "
        f"torch threads 1, {args.repeats} repeats"
    )

    # (a) DOMIAS: privmon on DataFrames, the package on the same records as arrays
    settings = {
        "numeric": (audit[NUMERIC], syn[NUMERIC], ref[NUMERIC]),
        "one_hot": (audit, syn, ref),
    }
    arrays = {}
    for name, (x, g, r) in settings.items():
        if name == "numeric":
            arrays.update({f"{name}_test": x.to_numpy(float), f"{name}_syn": g.to_numpy(float)})
            arrays[f"{name}_ref"] = r.to_numpy(float)
        else:
            arrays.update({f"{name}_test": one_hot(x, r), f"{name}_syn": one_hot(g, r)})
            arrays[f"{name}_ref"] = one_hot(r, r)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        np.savez(src, **arrays)
        proc = subprocess.run(
            [
                args.domias_python,
                "-c",
                PACKAGE_SIDE,
                src,
                json.dumps(list(settings)),
                dst,
                str(args.repeats),
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        package_times = json.loads(proc.stdout.strip().splitlines()[-1])
        package = dict(np.load(dst))
    print()
    print("(a) DOMIAS: privmon.domias_scores (DataFrames) vs domias 0.0.5 kde_baseline (arrays)")
    print()
    print(
        "| table | privmon s | domias s | Spearman | max abs diff of log scores (records where "
        "domias' ratio is 0) | AUC privmon | "
        "AUC domias |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (x, g, r) in settings.items():
        sec, ours = median_time(lambda x=x, g=g, r=r: privmon.domias_scores(x, g, r), args.repeats)
        auc_ours = privmon.auc(ours[is_member], ours[~is_member])
        theirs = package_times[name]
        if isinstance(theirs, str):
            print(f"| {name} | {sec:.3f} | fails: {theirs} | — | — | {auc_ours:.3f} | — |")
            continue
        ratio = package[name]
        rho = spearmanr(ours, ratio).statistic
        ok = ratio > 0  # where scipy's p_G (evaluated in linear space) did not underflow to 0
        diff = np.abs(ours[ok] - np.log(ratio[ok])).max()
        auc_theirs = privmon.auc(ratio[is_member], ratio[~is_member])
        print(
            f"| {name} | {sec:.3f} | {statistics.median(theirs):.3f} | {rho:.6f} | "
            f"{diff:.1e} ({int((~ok).sum())} at 0) | {auc_ours:.3f} | {auc_theirs:.3f} |"
        )

    # (b) DCR: privmon against sdmetrics, ranges of the synthetic table (distances measured to)
    from sdmetrics.single_table.privacy.dcr_utils import calculate_dcr

    metadata = {
        "columns": {
            **{c: {"sdtype": "numerical"} for c in NUMERIC},
            **{c: {"sdtype": "categorical"} for c in CATEGORICAL},
        }
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the categories the release lacks: "other"
        sec_ours, ours = median_time(lambda: -dcr(audit, syn), args.repeats)
    sec_sdm, theirs = median_time(
        lambda: calculate_dcr(audit, syn, metadata).to_numpy(np.float64), args.repeats
    )
    print()
    print(
        "(b) DCR: privmon.attacks.dcr vs sdmetrics calculate_dcr (Gower, ranges of the "
        "synthetic table)"
    )
    print()
    print("| audit x synthetic | privmon s | sdmetrics s | speedup | max abs diff | AUC (-DCR) |")
    print("|---|---:|---:|---:|---:|---:|")
    auc = privmon.auc(-ours[is_member], -ours[~is_member])
    lacking = sum(len(set(audit[c]) - set(syn[c])) for c in CATEGORICAL)
    print(
        f"| {len(audit)} x {len(syn)} ({lacking} categories the release lacks) | {sec_ours:.3f} | "
        f"{sec_sdm:.2f} | "
        f"{sec_sdm / sec_ours:.0f}x | {np.abs(ours - theirs).max():.1e} | {auc:.3f} |"
    )


if __name__ == "__main__":
    main()
