"""DOMIAS against a tabular VAE: attack AUC against training epochs and training-set size.

In the spirit of Fig. 3 of the DOMIAS paper (van Breugel et al., "Membership Inference Attacks
against Synthetic Data through Overfitting Detection"): a small generative model is trained on
a member set D_mem; an attacker who holds only its synthetic data and a reference set D_ref drawn
from the same population scores test records (half members, half non-members), and the AUC of
each attack shows how much the synthetic data leaks. Fewer training records and longer training
both promote overfitting, so the AUC rises.

- Data: a tabular data set that scikit-learn ships (no download): ``digits`` (1,797 records x 64
  integer features, the default), ``breast_cancer`` (569 x 30), ``diabetes`` (442 x 10) or
  ``wine`` (178 x 13); standardized, then shuffled and split per seed into members, as many
  non-members, and a reference set.
- Generator: a VAE written in torch (MLP encoder and decoder, Gaussian decoder with a learned
  per-feature scale, so samples are ``decoder(z) + sigma * noise``).
- Attacks (all on the same synthetic sample, in the reference set's top ``--embed-dim``
  principal axes, the embedding of DOMIAS App. B.3): DOMIAS (``log p_G - log p_R``, Gaussian
  KDEs), its ablation Eq. 1 (``log p_G``), GAN-Leaks, calibrated GAN-Leaks, MC and LOGAN-D1
  (``--no-logan`` skips the latter, which trains a classifier per point).
- Figures: AUC (mean ± standard deviation over ``--seeds`` seeds) per attack, (a) against the
  training-set size at ``--fixed-epochs`` epochs and (b) against the training epochs at
  ``--fixed-size`` members (one VAE per seed, evaluated at each listed epoch). Then DOMIAS §5.3:
  AUC and top-10 % precision per subgroup (the data set's class label) at the most overfitted
  point of (b), where a global AUC can hide a group at higher risk.

    python examples/domias_tabular.py                        # about a minute on 2 CPU cores
    python examples/domias_tabular.py --plot domias_fig3.png # also save the two panels
    python examples/domias_tabular.py --dataset breast_cancer   # sizes 20-160, 200 reference
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
from torch import nn

import privmon
from privmon.attacks.baselines import eq1, gan_leaks, gan_leaks_cal, logan_d1, monte_carlo
from privmon.attacks.domias import domias_scores
from privmon.attacks.subgroups import subgroup_risk

DATASETS = ("digits", "breast_cancer", "diabetes", "wine")
# per data set: (--sizes, --fixed-size, --n-reference) defaults that fit its number of records
DEFAULTS = {
    "digits": ([25, 50, 100, 200, 400], 100, 600),
    "breast_cancer": ([20, 40, 80, 160], 80, 200),
    "diabetes": ([20, 40, 80, 160], 80, 120),
    "wine": ([10, 20, 40], 20, 90),
}


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=DATASETS, default="digits")
    p.add_argument(
        "--sizes",
        type=int_list,
        help="training-set sizes of panel (a) (default per data set; digits: 25,50,100,200,400)",
    )
    p.add_argument(
        "--fixed-epochs", type=positive_int, default=300, help="training epochs in panel (a)"
    )
    p.add_argument(
        "--epochs",
        type=int_list,
        default=[10, 30, 100, 300, 1000],
        help="epochs at which panel (b) evaluates the VAE",
    )
    p.add_argument(
        "--fixed-size", type=positive_int, help="training-set size in panel (b) (digits: 100)"
    )
    p.add_argument("--n-reference", type=positive_int, help="reference records (digits: 600)")
    p.add_argument("--n-synthetic", type=positive_int, default=2000)
    p.add_argument(
        "--embed-dim",
        type=positive_int,
        default=10,
        help="principal axes of the reference set the attacks work in",
    )
    p.add_argument("--seeds", type=positive_int, default=5)
    p.add_argument("--latent", type=positive_int, default=8, help="VAE latent dimension")
    p.add_argument("--hidden", type=positive_int, default=128, help="VAE hidden width")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--no-logan", action="store_true", help="skip LOGAN-D1 (trains a classifier)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    p.add_argument("--plot", metavar="PATH", help="save both panels as a PNG (matplotlib)")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    sizes, fixed, n_ref = DEFAULTS[args.dataset]
    args.sizes = sizes if args.sizes is None else args.sizes
    args.fixed_size = fixed if args.fixed_size is None else args.fixed_size
    args.n_reference = n_ref if args.n_reference is None else args.n_reference
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"--lr: must be a positive number, got {args.lr}")
    args.epochs = sorted(set(args.epochs))
    args.sizes = sorted(set(args.sizes))
    return args


# --- data ----------------------------------------------------------------------------------------


def load(name: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Features (standardized) and a subgroup label per record (its class, or sex for diabetes)."""
    from sklearn import datasets

    if name == "diabetes":
        raw = datasets.load_diabetes(scaled=False)
        x, groups, group_name = raw.data, raw.data[:, 1].astype(int), "sex"
    else:
        raw = getattr(datasets, f"load_{name}")()
        x, groups, group_name = raw.data, raw.target, "class"
    x = np.asarray(x, dtype=np.float64)
    sd = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
    return x.astype(np.float32), np.asarray(groups), group_name


def split(n_total: int, n_mem: int, n_ref: int, seed: int):
    """Disjoint members, as many non-members, and a reference set of one shuffled pool."""
    order = np.random.default_rng(seed).permutation(n_total)
    return order[:n_mem], order[n_mem : 2 * n_mem], order[2 * n_mem : 2 * n_mem + n_ref]


# --- the generator: a small VAE ------------------------------------------------------------------


class VAE(nn.Module):
    def __init__(self, d: int, latent: int, hidden: int):
        super().__init__()
        self.latent = latent
        self.encoder = nn.Sequential(
            nn.Linear(d, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 2 * latent),
        )
        self.decoder = nn.Sequential(
            nn.Linear(latent, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, d),
        )
        self.log_sigma = nn.Parameter(torch.zeros(d))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """Negative ELBO per record: Gaussian reconstruction NLL + KL(q(z|x) || N(0, I))."""
        mu, log_var = self.encoder(x).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * (0.5 * log_var).exp()
        rec = self.decoder(z)
        nll = 0.5 * ((x - rec) / self.log_sigma.exp()).square() + self.log_sigma
        kl = 0.5 * (mu.square() + log_var.exp() - 1.0 - log_var)
        return nll.sum(dim=1).mean() + kl.sum(dim=1).mean()

    @torch.no_grad()
    def sample(self, n: int, gen: torch.Generator) -> torch.Tensor:
        z = torch.randn(n, self.latent, generator=gen)
        noise = torch.randn(n, self.log_sigma.shape[0], generator=gen)
        return self.decoder(z) + noise * self.log_sigma.exp()


def train(members: torch.Tensor, epochs: list[int], args, seed: int):
    """Train one VAE; yield (epoch, synthetic sample) at each epoch in ``epochs``."""
    torch.manual_seed(seed)
    vae = VAE(members.shape[1], args.latent, args.hidden)
    opt = torch.optim.Adam(vae.parameters(), lr=args.lr)
    n = members.shape[0]
    bs = min(args.batch_size, n)
    for epoch in range(1, epochs[-1] + 1):
        order = torch.randperm(n)
        for s in range(0, n, bs):
            loss = vae.loss(members[order[s : s + bs]])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if epoch in epochs:
            vae.eval()
            syn = vae.sample(args.n_synthetic, torch.Generator().manual_seed(10_000 + seed))
            vae.train()
            yield epoch, syn


# --- attacks -------------------------------------------------------------------------------------


def attack_names(args) -> list[str]:
    names = ["DOMIAS", "Eq. 1", "GAN-Leaks", "GAN-Leaks CAL", "MC"]
    return names if args.no_logan else [*names, "LOGAN-D1"]


def pca(reference: np.ndarray, k: int):
    """Top-k principal axes of the reference set (the embedding of App. B.3)."""
    mean = reference.mean(axis=0)
    _, vecs = np.linalg.eigh(np.cov(reference - mean, rowvar=False))
    axes = vecs[:, ::-1][:, :k]
    return lambda x: (np.asarray(x, dtype=np.float64) - mean) @ axes


def scores(test, syn, ref, args) -> dict[str, np.ndarray]:
    """Every attack's scores (higher = member) on the same embedded sets."""
    out = {
        "DOMIAS": domias_scores(test, syn, ref),
        "Eq. 1": eq1(test, syn),
        "GAN-Leaks": gan_leaks(test, syn),
        "GAN-Leaks CAL": gan_leaks_cal(test, syn, ref),
        "MC": monte_carlo(test, syn),
    }
    if not args.no_logan:
        out["LOGAN-D1"] = logan_d1(test, syn, ref, seed=0)
    return out


def evaluate(syn, idx_mem, idx_non, embed, x, ref_e, args):
    test = embed(np.r_[x[idx_mem], x[idx_non]])
    s = scores(test, embed(syn.numpy()), ref_e, args)
    n = len(idx_mem)
    return {k: privmon.auc(v[:n], v[n:]) for k, v in s.items()}, s


# --- output --------------------------------------------------------------------------------------


def nanmean(values) -> float:
    """Mean of the non-NaN values (NaN when there are none), without numpy's warning."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(v.mean()) if v.size else math.nan


def table(title: str, xname: str, xs: list[int], results: dict, names: list[str]) -> str:
    rows = [title, "", f"| {xname} | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for x in xs:
        cells = []
        for k in names:
            v = np.array(results[x][k])
            cells.append(f"{v.mean():.3f} ± {v.std():.3f}" if len(v) > 1 else f"{v[0]:.3f}")
        rows.append(f"| {x} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(path, args, sizes, by_size, epochs, by_epoch, names):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, xs, res, xlabel in (
        (axes[0], sizes, by_size, f"training-set size |D_mem| ({args.fixed_epochs} epochs)"),
        (axes[1], epochs, by_epoch, f"training epochs (|D_mem| = {args.fixed_size})"),
    ):
        for k in names:
            m = np.array([np.mean(res[x][k]) for x in xs])
            s = np.array([np.std(res[x][k]) for x in xs])
            style = {"lw": 2.5, "color": "k", "zorder": 3} if k == "DOMIAS" else {"lw": 1.2}
            (line,) = ax.plot(xs, m, marker="o", label=k, **style)
            ax.fill_between(xs, m - s, m + s, alpha=0.12, color=line.get_color())
        ax.set_xscale("log")
        ax.set_xticks(xs, [str(v) for v in xs])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("attack AUC")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"DOMIAS vs baselines, VAE on {args.dataset} (mean ± sd over {args.seeds} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    x, groups, group_name = load(args.dataset)
    need = 2 * max(max(args.sizes), args.fixed_size) + args.n_reference
    if need > len(x):
        sys.exit(
            f"error: {args.dataset} has {len(x)} records; the largest training set "
            f"({max(max(args.sizes), args.fixed_size)}) twice (members and non-members) plus "
            f"--n-reference {args.n_reference} needs {need}: lower --sizes / --fixed-size / "
            "--n-reference"
        )
    k = min(args.embed_dim, x.shape[1])
    if args.n_reference <= k:
        sys.exit(f"error: --n-reference must exceed the embedding dimension {k}")
    names = attack_names(args)
    print(
        f"DOMIAS vs baselines on {args.dataset} ({len(x)} records x {x.shape[1]} features), "
        f"VAE generator, {args.n_synthetic} synthetic and {args.n_reference} reference records, "
        f"attacks in {k} principal axes of the reference set, {args.seeds} seed(s)"
    )
    by_size = {n: {a: [] for a in names} for n in args.sizes}
    by_epoch = {e: {a: [] for a in names} for e in args.epochs}
    last_scores = []  # (scores, member groups, non-member groups) at the last epoch, per seed
    for seed in range(args.seeds):
        # (a) training-set size
        for n in args.sizes:
            i_mem, i_non, i_ref = split(len(x), n, args.n_reference, seed)
            embed = pca(x[i_ref], k)
            ref_e = embed(x[i_ref])
            for _, syn in train(torch.from_numpy(x[i_mem]), [args.fixed_epochs], args, seed):
                aucs, _ = evaluate(syn, i_mem, i_non, embed, x, ref_e, args)
                for a in names:
                    by_size[n][a].append(aucs[a])
        # (b) training epochs: one VAE, evaluated along the way
        i_mem, i_non, i_ref = split(len(x), args.fixed_size, args.n_reference, seed)
        embed = pca(x[i_ref], k)
        ref_e = embed(x[i_ref])
        for epoch, syn in train(torch.from_numpy(x[i_mem]), args.epochs, args, seed):
            aucs, s = evaluate(syn, i_mem, i_non, embed, x, ref_e, args)
            for a in names:
                by_epoch[epoch][a].append(aucs[a])
            if epoch == args.epochs[-1]:
                last_scores.append((s, groups[i_mem], groups[i_non]))
        print(f"  seed {seed} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    print()
    print(
        table(
            f"(a) AUC against the training-set size |D_mem| ({args.fixed_epochs} epochs)",
            "|D_mem|",
            args.sizes,
            by_size,
            names,
        )
    )
    print()
    print(
        table(
            f"(b) AUC against training epochs (|D_mem| = {args.fixed_size})",
            "epochs",
            args.epochs,
            by_epoch,
            names,
        )
    )
    # DOMIAS §5.3: the same attacks per subgroup, at the most overfitted point of (b)
    shown = [a for a in ("DOMIAS", "Eq. 1", "GAN-Leaks", "GAN-Leaks CAL") if a in names]
    per_group: dict = {}
    for s, g_mem, g_non in last_scores:
        n = len(g_mem)
        for a in shown:
            for g, r in subgroup_risk(s[a][:n], s[a][n:], g_mem, g_non, q=0.1).items():
                cell = per_group.setdefault(g, {"n": [], "frac": [], "top": []})
                cell.setdefault(a, []).append(r["auc"])
                if a == "DOMIAS":
                    cell["n"].append(r["n_members"] + r["n_nonmembers"])
                    cell["frac"].append(r["member_fraction"])
                    cell["top"].append(r["top_q_precision"][0.1])
    print()
    print(
        f"(c) AUC per subgroup ({group_name}) after {args.epochs[-1]} epochs, "
        f"|D_mem| = {args.fixed_size} (DOMIAS §5.3), mean over seeds. Read the top-10 % "
        "precision against the group's member fraction (random guessing); nan = a group without "
        "members or without non-members in the test set."
    )
    print()
    print(
        f"| {group_name} | test records | member fraction | "
        + " | ".join(f"{a} AUC" for a in shown)
        + " | DOMIAS top-10 % precision |"
    )
    print("|---:|---:|---:|" + "---:|" * (len(shown) + 1))
    last = by_epoch[args.epochs[-1]]
    cells = [f"{nanmean(last[a]):.3f}" for a in shown]
    n_test = 2 * args.fixed_size
    print(f"| all | {n_test} | 0.500 | " + " | ".join(cells) + " | |")
    for g in sorted(per_group):
        cell = per_group[g]
        cells = [f"{nanmean(cell[a]):.3f}" for a in shown]
        print(
            f"| {g} | {np.mean(cell['n']):.1f} | {nanmean(cell['frac']):.3f} | "
            + " | ".join(cells)
            + f" | {nanmean(cell['top']):.3f} |"
        )
    if args.plot:
        plot(args.plot, args, args.sizes, by_size, args.epochs, by_epoch, names)
        print(f"\nplot: {args.plot}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
