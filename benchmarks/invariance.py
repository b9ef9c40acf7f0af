"""1-D figures under monotone transforms of the score: one table.

The optimal advantage of a 1-D query does not change under a strictly increasing transform of
the score (loss, log-loss, confidence and logit-confidence of one model carry the same
information). Here: skewed loss-like scores s = exp(0.4·1[member] + N(0, 1)), 1,000 + 1,000
records, truth 2Φ(0.2) − 1 = 0.159, read as s, log s, s³ and −1/s, plus s with one member score
replaced by 1e6. Each row: ``optimal_advantage`` value and certified lower bound per method and
the plug-in U_N, mean over ``--seeds`` seeded sets. The ``privmon`` on the path is measured, so
an older checkout gives the "before" table::

    python benchmarks/invariance.py
    PYTHONPATH=/path/to/old/checkout python benchmarks/invariance.py
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import torch

import privmon

TRANSFORMS = {
    "s": lambda s: s,
    "log s": np.log,
    "s³": lambda s: s**3,
    "−1/s": lambda s: -1 / s,
    "s, one member at 1e6": None,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"privmon {privmon.__file__}")
    print("| score | histogram value | histogram lower | kde value | kde lower | kde plug-in |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, transform in TRANSFORMS.items():
        rows = []
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            s_m, s_h = np.exp(rng.normal(0.4, 1.0, 1000)), np.exp(rng.normal(0.0, 1.0, 1000))
            if transform is None:
                s_m[0] = 1e6
                m, h = s_m, s_h
            else:
                m, h = transform(s_m), transform(s_h)
            hist = privmon.optimal_advantage(m, h, method="histogram")
            kde = privmon.optimal_advantage(m, h, method="kde")
            rows.append((hist.value, hist.lower, kde.value, kde.lower, kde.plugin))
        mean = np.nanmean(rows, axis=0)
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in mean) + " |")


if __name__ == "__main__":
    main()
