"""Run privmon's shadow audit, save its statistics and scores, and compare them with TensorFlow
Privacy's and ML Privacy Meter's attacks in the peers' own environment.

The peers (TensorFlow among their dependencies) live in a separate virtual environment, never in
privmon's; only arrays cross over. Setting one up (Python 3.11; TensorFlow Privacy 0.9 imports
``tensorflow_estimator``, which TensorFlow 2.16 and later no longer carries, and its
``advanced_mia`` module ships in 0.8.x, later in ``tensorflow-empirical-privacy``)::

    python -m venv /work/venv-peers
    /work/venv-peers/bin/pip install "tensorflow==2.15.1" "tensorflow-privacy==0.8.12" \\
        "tf-models-official==2.15.0" "tensorflow-text==2.15.0" privacy-meter

Then, from the repository root, in privmon's environment::

    python benchmarks/peers_run.py --peer-python /work/venv-peers/bin/python

The audit is ``examples/lira_audit.py``'s: ``--models`` MLPs 64-32-10 trained full batch with
Adam (150 epochs) on random halves of ``--records`` digits with ``--canaries`` mislabelled.
Saved in ``--out`` (default: a temporary directory): ``audit.npz`` with the (k, n) statistic φ,
the membership masks and privmon's leave-one-model-out scores, and ``audit.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from privmon.attacks import calibrated_score, leave_one_out
from privmon.audit import shadow_audit


def privmon_scores(stat: np.ndarray, masks: np.ndarray) -> dict[str, np.ndarray]:
    """privmon's leave-one-model-out scores, (k, n) each, higher = member."""
    scores = {
        "loss": leave_one_out(stat, masks, attack="loss"),
        "lira": leave_one_out(stat, masks, attack="lira", fixed_variance=False),
        "lira fixed": leave_one_out(stat, masks, attack="lira", fixed_variance=True),
        "lira_offline": leave_one_out(stat, masks, attack="lira_offline", fixed_variance=False),
    }
    k = stat.shape[0]
    # the calibrated score on φ itself (leave_one_out's "calibrated" reads φ as a loss)
    scores["calibrated (phi)"] = np.stack(
        [
            calibrated_score(stat[i], stat[np.arange(k) != i], masks[np.arange(k) != i])
            for i in range(k)
        ]
    )
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default="/work/venv-peers/bin/python")
    parser.add_argument("--out", type=Path, default=None, help="where to save the arrays")
    parser.add_argument("--models", type=int, default=64)
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--canaries", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    digits = load_digits()
    rng = np.random.default_rng(args.seed)
    pick = rng.choice(len(digits.target), size=args.records, replace=False)
    x = torch.tensor(digits.data[pick] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[pick])
    canaries = rng.choice(args.records, size=args.canaries, replace=False)
    y[canaries] = (y[canaries] + torch.as_tensor(rng.integers(1, 10, args.canaries))) % 10

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    audit = shadow_audit(
        mlp,
        (x, y),
        n_models=args.models,
        seed=args.seed,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        epochs=150,
        attacks=("loss",),
    )
    stat, masks = np.asarray(audit.statistic), np.asarray(audit.masks)
    scores = privmon_scores(stat, masks)
    out = args.out or Path(tempfile.mkdtemp(prefix="privmon-peers-"))
    out.mkdir(parents=True, exist_ok=True)
    np.savez(
        out / "audit.npz",
        statistic=stat,
        masks=masks,
        **{f"privmon {name}": s for name, s in scores.items()},
    )
    peers = subprocess.run(
        [
            args.peer_python,
            "-c",
            "from importlib.metadata import version as v\n"
            "for p in ('tensorflow', 'tensorflow-privacy', 'privacy-meter'):\n"
            "    try: print(p, v(p), end='; ')\n"
            "    except Exception: print(p, 'absent', end='; ')",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    setup = (
        f"digits: {args.records} records ({args.canaries} mislabelled), {args.models} MLPs "
        "64-32-10 on random halves, Adam 150 full-batch epochs, statistic phi = log(p / (1 - p))"
    )
    (out / "audit.json").write_text(json.dumps({"setup": setup, "peers": peers}))
    print(f"saved {out / 'audit.npz'}", flush=True)
    script = Path(__file__).with_name("peers_lira.py")
    sys.exit(subprocess.run([args.peer_python, str(script), str(out)], check=False).returncode)


if __name__ == "__main__":
    main()
