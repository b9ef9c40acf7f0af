"""The specific-setup audit on a statistic that carries no membership signal: per-target AUC.

Run from the repository root::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/specific_null.py

``privmon.audit.specific`` on 300 targets whose "model" ignores its training data: the score
of target j in model i is a per-target offset (sd 2) plus fresh N(0, 1) noise, drawn from the
global RNG the audit seeds per model. Whatever the attack, each target's AUC over the models
(in against out) should average 0.5. The threshold attack reads the score itself; offline
LiRA (``"lira_offline"``) scores each model against all the other models, online LiRA
(``"lira"``) against the other fold of a split of each target's members and non-members
(leaving only the scored model out, as session 7 measured before the split, gave 0.437 /
0.441 / 0.446 at 16 / 64 / 128 models). The table shows the mean per-target AUC and the
targets read as strongly exposed (AUC >= 0.8) or strongly protected (AUC <= 0.2).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from privmon.audit import specific


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, nargs="+", default=[16, 64, 128])
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, n_targets = 400, 300
    x, y = torch.randn(n, 3), torch.zeros(n, dtype=torch.long)
    reference = (torch.randn(n_targets, 3), torch.zeros(n_targets, dtype=torch.long))
    offset = 2.0 * torch.randn(n_targets, generator=torch.Generator().manual_seed(0))

    def score_fn(model, xt, yt):  # no membership signal: the model is ignored
        return offset + torch.randn(len(xt))

    print("| models | attack | mean per-target AUC | AUC >= 0.8 | AUC <= 0.2 |")
    print("|---:|---|---:|---:|---:|")
    for k in args.models:
        for attack in ("threshold", "lira", "lira_offline"):
            r = specific(
                lambda xk, yk, seed: None,
                (x, y),
                np.arange(n_targets),
                reference=reference,
                n_models=k,
                seed=0,
                score_fn=score_fn,
                attack=attack,
            )
            print(
                f"| {k} | {attack} | {np.nanmean(r.auc):.3f} | {int((r.auc >= 0.8).sum())} | "
                f"{int((r.auc <= 0.2).sum())} |"
            )


if __name__ == "__main__":
    main()
