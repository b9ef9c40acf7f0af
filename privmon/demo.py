"""`privmon demo`: a small GAN on scikit-learn's 8x8 handwritten digits, monitored while it trains.

Members are a small training split (MACE §9.1 trains on a small subset so the GAN overfits);
non-members and the reference set are disjoint held-out splits of the same shuffled pool, so
members and non-members are exchangeable. Every few dozen steps a check measures three queries —
the discriminator's logit (MACE eq. 20), the distance to the nearest generated sample (eq. 19)
and both together (eq. 21) — plus the black-box DOMIAS attack on 1,000 generated records
(``log p_G(x) - log p_R(x)``, KDEs in the top 10 principal axes of the reference split; DOMIAS
Eq. 2, App. B.3), and writes TensorBoard event files and ``summary.json``.
With ``dp=True`` the discriminator is trained with Opacus (DP-SGD) and ε, both ceilings and the
measured advantage are shown together.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from privmon._validation import check_int, check_positive
from privmon.callbacks import PrivacyEarlyStopping, PrivacyMonitor
from privmon.queries import DiscriminatorQuery, GeneratorQuery, HybridQuery, NearestGeneratedQuery
from privmon.report import checks_from_reports, tags, verdict
from privmon.sinks import JsonlSink

__all__ = [
    "DemoConfig",
    "MissingDependencyError",
    "check_requirements",
    "digits_splits",
    "gan_step",
    "make_gan",
    "run_demo",
]

LATENT = 16


@dataclass(frozen=True)
class DemoConfig:
    logdir: str = "runs/privmon-demo"
    steps: int = 3000
    dp: bool = False
    seed: int = 0
    every_n_steps: int = 50
    n_members: int = 200
    n_nonmembers: int = 400
    n_reference: int = 400
    batch_size: int = 64
    budget: float | None = None
    target_epsilon: float = 3.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    progress: bool = True
    num_threads: int | None = 1


class MissingDependencyError(ImportError):
    """An optional package the demo needs is not installed; the message says how to install it."""


def check_requirements(*, dp: bool) -> None:
    """Raise :class:`MissingDependencyError` when scikit-learn (the digits) or, for ``dp``,
    Opacus is not installed."""
    needed = [("sklearn", "scikit-learn", "demo", "privmon demo trains on scikit-learn's digits")]
    if dp:
        needed.append(("opacus", "opacus", "dp", "privmon demo --dp trains with Opacus"))
    for module, dist, extra, why in needed:
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(
                f"{why}, which is not installed: pip install 'privmon[{extra}]' "
                f"(or pip install {dist})"
            )


def digits_splits(seed: int, n_members: int, n_nonmembers: int, n_reference: int):
    """Disjoint member / non-member / reference splits of the digits, scaled to [-1, 1]."""
    check_requirements(dp=False)
    from sklearn.datasets import load_digits

    x = load_digits().data.astype(np.float32) / 8.0 - 1.0
    need = n_members + n_nonmembers + n_reference
    if need > len(x):
        raise ValueError(f"the splits need {need} records, the digits have {len(x)}")
    order = np.random.default_rng(seed).permutation(len(x))
    parts = np.split(order[:need], [n_members, n_members + n_nonmembers])
    return tuple(torch.from_numpy(x[p]) for p in parts)


def make_gan(dim: int = 64, latent: int = LATENT) -> tuple[nn.Module, nn.Module]:
    """A small MLP generator (latent -> [-1, 1]^dim) and discriminator (dim -> logit)."""
    generator = nn.Sequential(
        nn.Linear(latent, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, dim),
        nn.Tanh(),
    )
    discriminator = nn.Sequential(
        nn.Linear(dim, 256),
        nn.LeakyReLU(0.2),
        nn.Linear(256, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, 1),
    )
    return generator, discriminator


def gan_step(
    generator: nn.Module,
    discriminator: nn.Module,
    opt_g: torch.optim.Optimizer,
    opt_d: torch.optim.Optimizer,
    real: torch.Tensor,
) -> None:
    """One step of the demo GAN on a batch of real records."""
    bce = nn.BCEWithLogitsLoss()
    fake = generator(torch.randn(real.shape[0], LATENT))
    # Discriminator: one batch of real and fake records (one per-sample-gradient pass).
    logits = discriminator(torch.cat([real, fake.detach()])).squeeze(1)
    labels = torch.cat([torch.ones(real.shape[0]), torch.zeros(real.shape[0])])
    opt_d.zero_grad()
    bce(logits, labels).backward()
    opt_d.step()
    # Generator: non-saturating loss; the discriminator's parameters are frozen meanwhile
    # (and, under Opacus, its per-sample-gradient hooks are off).
    _freeze(discriminator, True)
    opt_g.zero_grad()
    bce(discriminator(fake).squeeze(1), torch.ones(real.shape[0])).backward()
    opt_g.step()
    _freeze(discriminator, False)


def _freeze(discriminator: nn.Module, frozen: bool) -> None:
    for p in discriminator.parameters():
        p.requires_grad_(not frozen)
    if hasattr(discriminator, "disable_hooks"):  # an Opacus GradSampleModule
        toggle: Any = discriminator.disable_hooks if frozen else discriminator.enable_hooks
        toggle()


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Train the GAN under the monitor; returns the summary also written to summary.json.

    The models are tiny MLPs: ``config.num_threads`` (default 1) intra-op threads run them
    faster than many, and far faster on a busy machine where idle OpenMP threads spin (a run
    took 245 s instead of 15 s on a loaded 2-core machine). torch's thread count is restored
    afterwards; ``num_threads=None`` leaves it alone.
    """
    check_requirements(dp=config.dp)
    check_positive(config.target_epsilon, name="target_epsilon")
    check_int(config.seed, name="seed")
    _prepare_logdir(config.logdir)  # before any training: a bad path fails in a moment
    previous = torch.get_num_threads()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    try:
        with warnings.catch_warnings():
            # Opacus' advisories (secure RNG off, full backward hooks on a frozen input) are
            # expected in a demo; the user's own warning filters are left as they were.
            warnings.filterwarnings("ignore", message="Secure RNG turned off")
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            return _run(config)
    finally:
        torch.set_num_threads(previous)


def _prepare_logdir(logdir: str) -> None:
    """Create ``logdir`` and write (and remove) a file there; ValueError naming it if either
    fails (a path under a regular file, a read-only directory, a full disk)."""
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise ValueError(f"logdir {logdir!r} is a file, not a directory")
    try:
        os.makedirs(logdir, exist_ok=True)
        with tempfile.TemporaryFile(dir=logdir) as probe:
            probe.write(b"privmon")
            probe.flush()
    except OSError as err:
        raise ValueError(f"logdir {logdir!r} cannot be written: {err.strerror or err}") from None


def _made_private(config: DemoConfig, discriminator: Any, optimizer: Any, loader: Any) -> Any:
    """(the PrivacyEngine, and the discriminator, its optimizer and the loader made private):
    Opacus picks the noise that spends exactly target_epsilon over the planned steps."""
    from opacus import PrivacyEngine

    engine = PrivacyEngine(accountant="rdp")
    private = engine.make_private_with_epsilon(
        module=discriminator,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=config.target_epsilon,
        target_delta=config.delta,
        epochs=math.ceil(config.steps / len(loader)),
        max_grad_norm=config.max_grad_norm,
    )
    return (engine, *private)


def _batches(loader: Any, steps: int) -> Any:
    """The loader's batches of real records, epoch after epoch, until ``steps`` of them; an
    empty batch (Poisson sampling, under DP, can draw one) is skipped."""
    taken = 0
    while taken < steps:
        for (real,) in loader:
            if real.shape[0] == 0:
                continue
            yield real
            taken += 1
            if taken >= steps:
                return


def _run(config: DemoConfig) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    members, nonmembers, reference = digits_splits(
        config.seed, config.n_members, config.n_nonmembers, config.n_reference
    )
    generator, discriminator = make_gan(members.shape[1])
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    loader = DataLoader(
        TensorDataset(members),
        batch_size=config.batch_size,
        shuffle=True,
        drop_last=not config.dp,  # Opacus replaces the loader with Poisson sampling
    )
    engine = None
    if config.dp:
        engine, discriminator, opt_d, loader = _made_private(config, discriminator, opt_d, loader)
    disc_q = DiscriminatorQuery(discriminator)
    near_q = NearestGeneratedQuery(generator, n_samples=1000, latent_dim=LATENT)
    # DOMIAS: p_G a KDE of the generated records, p_R of the reference split, both in the
    # reference split's top 10 principal axes (fitted once; p_R of each audit record is cached).
    domias_q = GeneratorQuery(
        generator,
        reference,
        attack="domias",
        n_samples=1000,
        latent_dim=LATENT,
        embed="pca",
        name="domias",
    )
    queries = [disc_q, near_q, HybridQuery(disc_q, near_q), domias_q]
    stopping = None
    if config.budget is not None:
        stopping = PrivacyEarlyStopping("disc/histogram", config.budget, use="lower", patience=1)
    monitor = PrivacyMonitor(
        queries,
        [members[i : i + 256] for i in range(0, len(members), 256)],
        [nonmembers[i : i + 256] for i in range(0, len(nonmembers), 256)],
        every_n_steps=config.every_n_steps,
        # the run's length is known: its δ is spent evenly over the checks it will make
        planned_checks=max(1, config.steps // config.every_n_steps),
        writer=config.logdir,
        sinks=[JsonlSink(os.path.join(config.logdir, "checks.jsonl"))],
        accountant=engine,
        delta=config.delta,
        early_stopping=stopping,
    )
    start = time.perf_counter()
    step, stopped_at = 0, None
    # tqdm on stderr; disable=None turns it off when stderr is not a terminal (CI logs, pipes).
    with tqdm(total=config.steps, unit="step", disable=None if config.progress else True) as bar:
        for real in _batches(loader, config.steps):
            step += 1
            gan_step(generator, discriminator, opt_g, opt_d, real)
            report = monitor.last_report
            if monitor.step(step):
                stopped_at = step
            bar.update(1)
            if monitor.last_report is not report and monitor.last_report is not None:
                adv = monitor.last_report.scalars.get(tags.value("disc", "histogram"))
                if adv is not None:
                    bar.set_postfix_str(f"adv(disc)={adv:.3f}", refresh=False)
            if stopped_at is not None:
                break
    if monitor.last_report is None or monitor.last_report.step != step:
        monitor.check(step)
    monitor.close()
    summary = _summary(monitor, config, step, stopped_at, time.perf_counter() - start)
    with open(os.path.join(config.logdir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, allow_nan=False)
    return summary


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _finite_dict(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _finite(v) for k, v in d.items()}


def _summary(
    monitor: PrivacyMonitor, config: DemoConfig, steps: int, stopped_at: int | None, seconds: float
) -> dict[str, Any]:
    last = monitor.history[-1]
    final: dict[str, Any] = {}
    peak: dict[str, dict[str, float]] = {}
    for name, q in last.queries.items():
        for method in q.estimates:
            key = f"{name}/{method}"
            final[key] = {
                f: last.scalars[tags.estimate(name, method, f)] for f in tags.ESTIMATE_FIGURES
            }
            if tags.auc(name) in last.scalars:
                final[key]["auc"] = last.scalars[tags.auc(name)]
            values = np.nan_to_num(monitor.history.column(tags.value(name, method)), nan=-1.0)
            best = int(values.argmax())  # the first check with the largest value
            lowers = np.nan_to_num(monitor.history.column(tags.lower(name, method)), nan=-1.0)
            low = int(lowers.argmax())  # the verdict's figure, when it certifies leakage
            peak[key] = {
                "step": int(monitor.history.steps[best]),
                "value": float(values[best]),
                "lower_step": int(monitor.history.steps[low]),
                "lower": float(lowers[low]),
            }
        final[f"{name}/top_records"] = list(q.top_records)
    es, outcome = monitor.early_stopping, monitor.stopping_outcome
    return {
        "steps": steps,
        "stopped_at": stopped_at,
        "stop_reason": es.reason if es is not None else None,
        # the budget and what it did: the stop, or none and the highest certified figure
        "stopping": None if outcome is None else _finite_dict(outcome.to_json()),
        "wall_seconds": round(seconds, 2),
        "checks": len(monitor.history),
        "failed_checks": monitor.n_failed,
        "final": final,
        "peak": peak,
        "epsilon": _finite(last.epsilon),
        "ceilings": tags.ceilings(last.scalars),
        "dp_violation": any(r.dp_violation for r in monitor.history),
        # the verdict privmon report gives these checks, from the same rules
        "verdict": verdict(checks_from_reports(monitor.history, outcome=outcome)).headline,
        "config": {
            k: v for k, v in config.__dict__.items() if k not in ("progress", "num_threads")
        },
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A short console table of the final figures, each estimate's peak and its certified lower
    bound's peak over the run (the figure the verdict names), then the run's one-line verdict
    (the one ``privmon report`` gives)."""
    rows = [
        f"{'query/method':<20} {'value':>7} {'lower':>7} {'plugin':>7} {'AUC':>6} "
        f"{'peak (step)':>14} {'peak lower (step)':>18}"
    ]
    for key, f in summary["final"].items():
        if key.endswith("top_records"):
            continue
        auc = f.get("auc")
        pk = summary["peak"][key]
        rows.append(
            f"{key:<20} {f['value']:7.3f} {f['lower']:7.3f} {f['plugin']:7.3f} "
            f"{'' if auc is None else format(auc, '.3f'):>6} "
            f"{pk['value']:7.3f} ({pk['step']}) {pk['lower']:11.3f} ({pk['lower_step']})"
        )
    if summary["epsilon"] is not None:
        c = summary["ceilings"]
        rows.append(
            f"epsilon = {summary['epsilon']:.3f} at delta = {summary['config']['delta']}:"
            f" ceiling tanh {c.get('tanh', float('nan')):.3f}, "
            f"(eps, delta) {c.get('eps_delta', float('nan')):.3f}"
        )
    if summary.get("stopping") is not None:  # a budget: what it did, stop or not
        rows.append(summary["stopping"]["sentence"])
    rows.append(
        f"{summary['steps']} steps, {summary['checks']} checks in {summary['wall_seconds']:.1f} s"
    )
    rows.append(f"verdict: {summary['verdict']}")
    return "\n".join(rows)
