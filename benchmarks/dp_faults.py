"""Fault injection for the DP alarm (issue #29): does privmon's alarm cover the DP-SGD faults
users hit, and stay silent on correct runs and on consistent changes?

The setup of ``examples/dp_audit.py`` and ``benchmarks/dp_canaries.py``: scikit-learn's digits,
600 training records, an MLP 64-256-10, Opacus 1.6 ``make_private(noise_multiplier=2.5,
max_grad_norm=1.0)``, Poisson batches of 60 (q = 0.1), SGD lr 0.5, 400 steps; the accountant
(Opacus' default, PRV) reports ε = 3.67 at δ = 1e-5. One seeded run attaches canaries (1e3 or
1e5 Dirac ``GradientCanaries``, or record canaries: a hook, not built yet) and hands them to a
``privmon.PrivacyMonitor(LossQuery(model), 200 members, 200 held-out, accountant=engine,
canaries=...)`` that checks three times during training and once at the end, after whatever
the fault does after training. A run returns the accountant's ε, the test accuracy, whether any
check set ``report.dp_violation`` and why (every message, and every scalar under a
``dp_checks`` tag: the mechanism checks of issue #29, once they exist), the audited ε (the
canaries' ``privacy/canaries/<method>/epsilon_lower_bound``) and the CPU time per step.

Each fault is injected as a user would cause it, one at a time, on top of the correct run; its
true ε is the accountant's (the same PRV accountant) on the mechanism that really ran, where it
is defined. Two non-faults (consistent changes) must stay silent.

Parts (``--parts``, comma-separated):

* ``faults``: seeds × faults and non-faults × canary kinds → true ε, accountant ε, test accuracy,
  alarms (runs), the check that fired, the audited ε (median), whether the canaries' scores are
  bit-identical to the correct run's, the mechanism checks' figures;
* ``null``: the false-alarm rate over many correct runs of a cheaper model (nn.Linear(64, 10),
  fewer steps), with its Clopper-Pearson 95 % interval;
* ``timing``: CPU time per step without canaries, with today's ``GradientCanaries`` (mechanism
  checks off, once that option exists) and with the checks on; interleaved repeats, median.

    python benchmarks/dp_faults.py                  # everything: seeds 0-4, 1e3/1e5/record
    python benchmarks/dp_faults.py --quick          # smoke: 1 seed, 100 steps, 10 null runs
    python benchmarks/dp_faults.py --parts faults --kinds 1e3 --seeds 2 --faults correct,clip-10

One thread (torch and BLAS), CPU time (``time.process_time``): the machine may be shared. The
data, model and noise patch are dp_canaries.py's (imported). Full run, 1 CPU: about 6 min per
canary kind for the faults (5 seeds), 2 min for 200 null runs, 1 min for the timing.

What the harness reads from privmon, i.e. what the mechanism checks must provide to show up:

* ``report.dp_violation`` and ``report.messages`` of every check in ``monitor.history``; a
  message names a mechanism check as ``"<check>: <evidence>"`` with ``<check>`` one of
  :data:`CHECK_NAMES` (the canary audit's and the queries' messages are recognised as today);
* scalars whose tag has a ``dp_checks`` segment: ``.../dp_checks/<check>/fired`` (>= 0.5:
  fired) and any ``.../dp_checks/<check>/...p_value...`` (e.g.
  ``privacy/dp_checks/sampling/mean/p_value``), tabulated per check whatever the names;
* ``GradientCanaries(..., checks=())`` switches the checks off (found by its signature); the
  canaries' ``scores()``, ``state_dict()`` / ``load_state_dict()`` (the resume fault).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import logging
import math
import re
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from dp_canaries import (
    BATCH,
    CLIP,
    DELTA,
    LR,
    N_TRAIN,
    SIGMA,
    digits,
    mlp,
    small,
    with_noise_factor,
)
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from threadpoolctl import threadpool_limits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon import PrivacyMonitor, PrivacyViolationWarning
from privmon.audit import GradientCanaries
from privmon.estimators.intervals import clopper_pearson_lower, clopper_pearson_upper
from privmon.queries import LossQuery
from privmon.report import tags

N_AUDIT = 200  # members and held-out records of the loss query
Q = BATCH / N_TRAIN
CHECKS = 4  # per run: three during training, one at the end
NON_DP_STEPS, VIEWS, WRONG_CLIP, UNDERCOUNT, CHANGED_CLIP, GRAD_SCALE = 100, 4, 10.0, 10.0, 0.5, 0.5
# The mechanism checks of issue #29 (DP_FAULTS_DESIGN.md §1): a message names the one that fired
# as "<check>: <evidence>"; their scalars live under a "dp_checks" tag segment.
CHECK_NAMES = ("clipping", "noise", "sampling", "steps", "ledger")
DP_CHECKS_SEGMENT = "dp_checks"
# Opacus' warnings are filtered by dp_canaries (imported above).
warnings.simplefilter("ignore", PrivacyViolationWarning)  # read from the reports instead
logging.getLogger("privmon").setLevel(logging.ERROR)  # the alarms' log lines: idem


def accountant_epsilon(sigma: float, q: float, steps: int) -> float:
    """ε at δ of the subsampled Gaussian mechanism (σ, q, steps) by Opacus' PRV accountant, the
    one ``PrivacyEngine()`` uses: ∞ without noise."""
    if sigma <= 0:
        return math.inf
    accountant = PRVAccountant()
    accountant.history = [(sigma, q, steps)]
    with np.errstate(divide="ignore"):  # log(1 - q) at q = 1
        return float(accountant.get_epsilon(DELTA))


# -- data and models: dp_canaries.py's (digits(seed) -> (train, x_test, y_test), mlp, small) --
Data = tuple[TensorDataset, torch.Tensor, torch.Tensor]


# -- canary kinds ------------------------------------------------------------------------------
def checks_supported() -> bool:
    """Whether ``GradientCanaries`` takes ``checks=`` (the mechanism checks of issue #29)."""
    return "checks" in inspect.signature(GradientCanaries).parameters


@dataclass(frozen=True)
class CanaryKind:
    """How a run's canaries are made: ``wrap`` sets ``run.train`` and returns the model to make
    private (before ``make_private``); ``attach`` returns the canaries for the monitor (after
    ``make_private`` and the fault's patches, so that the canaries pass through them), or None.
    ``run.checks``: None for ``GradientCanaries``' default, () to switch the mechanism checks off
    (only where that option exists). Both run again at the resume fault's rebuild."""

    name: str
    n: int = 0

    def wrap(self, run: Run, model: nn.Module) -> nn.Module:
        run.train = run.data[0]
        return model

    def attach(self, run: Run) -> Any:
        if self.n == 0:
            return None
        options: dict[str, Any] = {} if run.checks is None else {"checks": run.checks}
        return GradientCanaries(run.optimizer, self.n, seed=run.seed, **options)


@dataclass(frozen=True)
class RecordCanaryKind(CanaryKind):
    """Record canaries (issue #29 §2): ``privmon.audit.RecordCanaries(n, seed=run.seed)``, n
    dataset slots after the N training records that the DP loader samples like records, routed
    by the wrapped model to a block of their own (fillers for the excluded half). ``run.train``
    becomes the N + n slots, so the accountant's N and q count them: with the loader's batch
    size ``BATCH`` unchanged, q = BATCH / (N + n) (for 1,000 canaries 60 / 1,600, not 0.1) and
    the accountant's ε is that of the smaller q. The monitor reads ``scores()``; the resume fault
    rebuilds them with the same seed and restores the block (in the model's and the canaries'
    state). The queries, the test accuracy and the head's fine-tuning run on plain tensors or on
    ``run.net``, which the wrapper passes through untouched."""

    def wrap(self, run: Run, model: nn.Module) -> nn.Module:
        from privmon.audit import RecordCanaries

        run.extra["record_canaries"] = canaries = RecordCanaries(self.n, seed=run.seed)
        run.train = canaries.dataset(run.data[0])  # N + n slots, read by the DP loader
        return canaries.model(model)

    def attach(self, run: Run) -> Any:
        return run.extra["record_canaries"]


KINDS: dict[str, CanaryKind] = {
    "none": CanaryKind("none"),
    "1e3": CanaryKind("1e3", 1_000),
    "1e5": CanaryKind("1e5", 100_000),
    "record": RecordCanaryKind("record", 1_000),
}


# -- one run -----------------------------------------------------------------------------------
@dataclass
class Run:
    """A run's state: what the faults' hooks read and change."""

    fault: Fault
    kind: CanaryKind
    seed: int
    steps: int
    data: Data
    model_fn: Callable[[], nn.Module]
    checks: tuple[str, ...] | None = None
    net: nn.Module = field(init=False)  # the user's model, unwrapped
    train: Any = field(init=False)
    engine: PrivacyEngine = field(init=False)
    model: nn.Module = field(init=False)
    optimizer: Any = field(init=False)
    loader: Any = field(init=False)
    canaries: Any = field(init=False)
    monitor: PrivacyMonitor = field(init=False)
    step: int = 0
    step_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def build(run: Run) -> None:
    """The correct setup, with the fault's hooks: model, ``make_private``, canaries, monitor."""
    run.net = run.model_fn()
    model = run.kind.wrap(run, run.net)
    run.engine = PrivacyEngine()
    run.model, run.optimizer, run.loader = run.engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(run.train, batch_size=BATCH, **run.fault.loader_options),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        **run.fault.private_options(run),
    )
    run.fault.after_private(run)
    run.canaries = run.kind.attach(run)
    train, x_test, y_test = run.data
    x, y = train.tensors
    run.monitor = PrivacyMonitor(
        LossQuery(run.model),
        [(x[:N_AUDIT], y[:N_AUDIT])],
        [(x_test[:N_AUDIT], y_test[:N_AUDIT])],
        every_n_steps=max(1, run.steps // CHECKS),
        methods=("histogram",),
        accountant=run.engine,
        canaries=run.canaries,
        planned_checks=CHECKS,
    )


def train(run: Run, until: int) -> None:
    """DP-SGD steps up to global step ``until``; the monitor checks on its schedule before the
    last step (the last check comes after the fault's post-training work)."""
    loss_fn = nn.CrossEntropyLoss()
    while run.step < until:
        run.fault.epoch_start(run)
        for inputs, y in run.loader:
            run.fault.before_step(run)
            start = time.process_time()
            inputs, y = run.fault.rows(inputs, y)
            run.optimizer.zero_grad()
            loss_fn(run.model(inputs), y).backward()
            run.optimizer.step()
            run.step_seconds += time.process_time() - start
            run.step += 1
            if run.step < run.steps:
                run.monitor.step(run.step)
            if run.step >= until:
                break


def resume_losing_accountant(run: Run) -> None:
    """Checkpoint model, optimizer, canaries and monitor; resume in a fresh process's objects (a
    new ``PrivacyEngine``) whose accountant state was not saved: it counts from zero."""
    saved = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "monitor": run.monitor.state_dict(),
        "canaries": None if run.canaries is None else run.canaries.state_dict(),
    }
    build(run)
    run.model.load_state_dict(saved["model"])
    if run.canaries is not None:
        run.canaries.load_state_dict(saved["canaries"])
    run.optimizer.load_state_dict(saved["optimizer"])  # after the canaries: their param group
    run.monitor.load_state_dict(saved["monitor"])


def causes(message: str) -> str:
    """The check a report message names: the canary audit, a query's certificate, or a mechanism
    check's ``<check>:`` evidence; "other" else."""
    if "canary audit" in message:
        return "canaries"
    if "membership advantage" in message:
        return "query"
    for name in CHECK_NAMES:
        if re.search(rf"\b{name}:", message):
            return name
    return "other"


def dp_check_figures(scalars: dict[str, float]) -> dict[str, dict[str, float]]:
    """Every scalar under a ``dp_checks`` tag segment, by check (the segment after it) and the
    rest of the tag (``fired``, ``p_value``, ``mean/p_value`` ...)."""
    out: dict[str, dict[str, float]] = {}
    for tag, v in scalars.items():
        parts = tag.split("/")
        if DP_CHECKS_SEGMENT in parts[:-2]:
            i = parts.index(DP_CHECKS_SEGMENT)
            out.setdefault(parts[i + 1], {})["/".join(parts[i + 2 :])] = float(v)
    return out


def run_once(
    fault: Fault,
    kind: CanaryKind,
    seed: int,
    *,
    steps: int,
    data: Data,
    model_fn: Callable[[], nn.Module] = mlp,
    checks: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """One seeded run with ``fault`` injected: the figures the tables read."""
    cpu = time.process_time()
    torch.manual_seed(seed)
    run = Run(fault, kind, seed, steps, data, model_fn, checks)
    build(run)
    if fault.resumes:
        train(run, steps // 2)
        resume_losing_accountant(run)
    train(run, steps)
    fault.after_training(run)
    check_start = time.process_time()
    run.monitor.check(run.step)
    check_seconds = time.process_time() - check_start
    run.monitor.close()
    run.model.eval()
    _, x_test, y_test = data
    with torch.no_grad():
        accuracy = float((run.model(x_test).argmax(1) == y_test).float().mean())
    reports = run.monitor.history
    last = reports[-1]
    fired: set[str] = set()
    for report in reports:
        for check, figures in dp_check_figures(report.scalars).items():
            if figures.get("fired", 0.0) >= 0.5:
                fired.add(check)
    messages = list(dict.fromkeys(m for r in reports for m in r.messages))
    scores = None if run.canaries is None else run.canaries.scores()
    return {
        "accountant_eps": float(run.engine.get_epsilon(DELTA)),
        "true_eps": fault.true_epsilon(steps),
        "accuracy": accuracy,
        "alarm": any(r.dp_violation for r in reports),
        "alarm_steps": [r.step for r in reports if r.dp_violation],
        "messages": messages,
        "causes": sorted({causes(m) for m in messages} | fired),
        "audited": {
            method: v for tag, v in last.scalars.items() if (method := tags.parse_canary(tag))
        },
        "dp_checks": dp_check_figures(last.scalars),
        "scores_digest": None
        if scores is None
        else hashlib.sha256(scores[0].tobytes() + b"|" + scores[1].tobytes()).hexdigest(),
        "ms_per_step": 1e3 * run.step_seconds / max(run.step, 1),
        "last_check_ms": 1e3 * check_seconds,
        "cpu_seconds": time.process_time() - cpu,
    }


# -- the faults ----------------------------------------------------------------------------------
def _nothing(run: Run) -> None:
    return None


def _no_options(run: Run) -> dict[str, Any]:
    return {}


def _same_rows(inputs: Any, y: torch.Tensor) -> tuple[Any, torch.Tensor]:
    return inputs, y


def _infinite(steps: int) -> float:
    return math.inf


def _as_accounted(steps: int) -> float:
    return accountant_epsilon(SIGMA, Q, steps)


@dataclass(frozen=True)
class Fault:
    """A fault (or non-fault) as hooks into the correct run. ``true_epsilon(steps)``: ε of the
    mechanism that really ran (∞ where none holds, NaN where unknown)."""

    key: str
    title: str
    how: str
    true_epsilon: Callable[[int], float] = _as_accounted
    is_fault: bool = True
    bound: str = ""  # "≤ " where the true ε is an upper bound
    loader_options: dict[str, Any] = field(default_factory=dict)
    private_options: Callable[[Run], dict[str, Any]] = _no_options
    after_private: Callable[[Run], None] = _nothing
    epoch_start: Callable[[Run], None] = _nothing
    before_step: Callable[[Run], None] = _nothing
    rows: Callable[[Any, torch.Tensor], tuple[Any, torch.Tensor]] = _same_rows
    after_training: Callable[[Run], None] = _nothing
    resumes: bool = False


def correct() -> Fault:
    """The correct run: nothing injected."""
    return Fault("correct", "correct run", "-", is_fault=False)


def noise_removed() -> Fault:
    """1. No noise: a custom or patched optimizer whose ``add_noise`` uses another attribute (or
    a σ of 0 from a debugging config) while the accountant reads ``noise_multiplier``."""
    return Fault(
        "noise-removed",
        "noise removed",
        "patched `add_noise` (σ 0, accountant told 2.5)",
        _infinite,
        after_private=lambda run: with_noise_factor(run.optimizer, 0.0),
    )


def noise_half() -> Fault:
    """2. Half the noise: the same patch with σ / 2 (e.g. noise computed from a std that was
    already divided, or σ read from a second config entry)."""
    return Fault(
        "noise-half",
        "noise × 0.5",
        "patched `add_noise` (σ 1.25, accountant told 2.5)",
        lambda steps: accountant_epsilon(SIGMA / 2, Q, steps),
        after_private=lambda run: with_noise_factor(run.optimizer, 0.5),
    )


def _flat_clipped_sum(optimizer: Any, factors: torch.Tensor | None) -> None:
    """Accumulate Σ_i factor_i · g_i into each parameter's ``summed_grad`` (unclipped when
    ``factors`` is None): the accumulation half of Opacus' ``clip_and_accumulate``."""
    for p in optimizer.params:
        samples = optimizer._get_flat_grad_sample(p).to(p.dtype)
        grad = samples.sum(0) if factors is None else torch.einsum("i,i...", factors, samples)
        p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad


class UnclippedDPOptimizer(DPOptimizer):
    """A custom clipping path that never clips: the per-sample gradients are summed as they
    are (e.g. a ``clip_and_accumulate`` override written for speed that forgot the factor)."""

    def clip_and_accumulate(self) -> None:
        _flat_clipped_sum(self, None)


class UndercountingDPOptimizer(DPOptimizer):
    """A clipping path whose per-sample norm of one parameter (the first layer's weight) is 10×
    too small, as a buggy grad sampler or ghost-clipping norm for one layer type gives: the
    clip factor is too large, so a record's contribution can exceed C (up to 10 C)."""

    undercounted = 0  # index in ``params``

    def clip_and_accumulate(self) -> None:
        norms = [g.reshape(len(g), -1).norm(2, dim=-1) for g in self.grad_samples]
        norms[self.undercounted] = norms[self.undercounted] / UNDERCOUNT
        total = torch.stack(norms, dim=1).norm(2, dim=1)
        factors = (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0)
        _flat_clipped_sum(self, factors)


def _as_class(cls: type) -> Callable[[Run], None]:
    def swap(run: Run) -> None:  # the same object, as if constructed as ``cls``
        run.optimizer.__class__ = cls

    return swap


def clipping_skipped() -> Fault:
    """3. Clipping skipped: a DPOptimizer subclass with its own ``clip_and_accumulate`` that sums
    the per-sample gradients unclipped (noise still σ · C): no sensitivity bound, ε = ∞."""
    return Fault(
        "clip-skipped",
        "clipping skipped",
        "custom clipping path (subclass)",
        _infinite,
        after_private=_as_class(UnclippedDPOptimizer),
    )


def around_clipping(body: Callable[[Any, Callable[[], None]], None]) -> Callable[[Run], None]:
    """A patch of the optimizer instance's ``clip_and_accumulate``: ``body(optimizer,
    original)`` runs in its place."""

    def patch(run: Run) -> None:
        optimizer = run.optimizer
        original = optimizer.clip_and_accumulate
        optimizer.clip_and_accumulate = lambda: body(optimizer, original)

    return patch


def _clip_at_wrong_bound(optimizer: Any, original: Callable[[], None]) -> None:
    bound = optimizer.max_grad_norm
    optimizer.max_grad_norm = WRONG_CLIP
    try:
        original()
    finally:
        optimizer.max_grad_norm = bound


def _scale_then_clip(optimizer: Any, original: Callable[[], None]) -> None:
    for p in optimizer.params:
        samples = p.grad_sample
        p.grad_sample = (
            [s * GRAD_SCALE for s in samples] if isinstance(samples, list) else samples * GRAD_SCALE
        )
    original()


def clip_at_ten() -> Fault:
    """4. The bound read from two places: clipping uses the training config's C = 10 (e.g. a
    wrapper re-reading ``cfg.max_grad_norm``) while the noise is calibrated to the C = 1 given to
    ``make_private``: sensitivity 10 C for noise σ C, i.e. σ_eff = σ / 10."""

    return Fault(
        "clip-10",
        "clip at C = 10, noise for C = 1",
        "bound read from two places",
        lambda steps: accountant_epsilon(SIGMA / WRONG_CLIP, Q, steps),
        after_private=around_clipping(_clip_at_wrong_bound),
    )


def norm_undercount() -> Fault:
    """5. One layer's per-sample norm undercounted 10× (``UndercountingDPOptimizer``): a record
    whose gradient lies in that layer contributes up to 10 C, so ε ≤ that of σ / 10."""
    return Fault(
        "norm-undercount",
        "one layer's per-sample norm undercounted 10×",
        "buggy grad sampler / ghost-clipping norm",
        lambda steps: accountant_epsilon(SIGMA / UNDERCOUNT, Q, steps),
        bound="≤ ",
        after_private=_as_class(UndercountingDPOptimizer),
    )


def _views(x: torch.Tensor) -> torch.Tensor:
    """The record and VIEWS - 1 random 1-pixel shifts of the 8×8 digit, stacked as rows."""
    images = x.reshape(-1, 8, 8)
    shifted = [images]
    for _ in range(VIEWS - 1):
        dy, dx = (int(v) for v in torch.randint(-1, 2, (2,)))
        shifted.append(torch.roll(images, shifts=(dy, dx), dims=(1, 2)))
    return torch.cat(shifted).reshape(-1, x.shape[-1])


def _four_views(inputs: Any, y: torch.Tensor) -> tuple[Any, torch.Tensor]:
    if isinstance(inputs, tuple | list):  # (x, slot ...): augment x, repeat the rest
        first, *rest = inputs
        return (_views(first), *(torch.cat([r] * VIEWS) for r in rest)), torch.cat([y] * VIEWS)
    return _views(inputs), torch.cat([y] * VIEWS)


def four_views() -> Fault:
    """6. Data augmentation stacked as rows: each Poisson-sampled record becomes 4 views in the
    batch, each clipped on its own, so a record contributes up to 4 C: σ_eff = σ / 4 at q."""
    return Fault(
        "four-views",
        "4 augmented views per record, each its own row",
        "augmentation stacked as rows",
        lambda steps: accountant_epsilon(SIGMA / VIEWS, Q, steps),
        rows=_four_views,
    )


def own_loader() -> Fault:
    """7. The DP loader replaced: the user iterates their own DataLoader (here the full batch)
    instead of the one ``make_private`` returned; every record is in every step: q = 1."""

    def replace(run: Run) -> None:
        run.loader = DataLoader(run.train, batch_size=len(run.train))

    return Fault(
        "own-loader",
        "the user's own DataLoader (full batch)",
        "DP loader replaced",
        lambda steps: accountant_epsilon(SIGMA, 1.0, steps),
        after_private=replace,
    )


def shuffled_batches() -> Fault:
    """8. ``make_private(poisson_sampling=False)`` on a shuffled DataLoader: fixed-size shuffled
    batches, accounted as Poisson at q = 1 / len(loader) (opacus #80). Shuffling has no
    amplification bound the accountant implements: the true ε is unknown (Chua et al. 2024 show
    it can be far above the Poisson figure)."""
    return Fault(
        "shuffled",
        "shuffled fixed batches accounted as Poisson",
        "`poisson_sampling=False` (opacus #80)",
        lambda steps: math.nan,
        loader_options={"shuffle": True},
        private_options=lambda run: {"poisson_sampling": False},
    )


def lost_accountant() -> Fault:
    """9. Accountant state lost at a resume: after half the steps the script checkpoints model,
    optimizer, canaries and monitor but not ``engine.accountant``; the resumed process makes a
    fresh ``PrivacyEngine``, which counts only the second half (reports 2.52 for 3.67)."""
    return Fault(
        "lost-accountant",
        "accountant state lost at a resume",
        "fresh PrivacyEngine at the resume",
        resumes=True,
    )


def _fine_tune_head(run: Run) -> None:
    layers = list(run.net.children())
    head = layers[-1] if layers else run.net  # the last layer (a bare Linear: itself)
    optimizer = torch.optim.SGD(head.parameters(), lr=LR)
    loader = DataLoader(run.train, batch_size=BATCH, shuffle=True)
    loss_fn = nn.CrossEntropyLoss()
    done = 0
    while done < NON_DP_STEPS:
        for inputs, y in loader:
            run.model.zero_grad()  # also clears Opacus' per-sample gradients
            loss_fn(run.model(inputs), y).backward()
            optimizer.step()
            done += 1
            if done == NON_DP_STEPS:
                break
    run.step += NON_DP_STEPS


def non_dp_head() -> Fault:
    """10. Non-private updates: after DP training, 100 steps of a second, plain optimizer
    fine-tune the head on the training data (e.g. a "calibration" pass). ε = ∞."""
    return Fault(
        "non-dp-head",
        "100 non-DP steps on the head after DP training",
        "a second optimizer",
        _infinite,
        after_training=_fine_tune_head,
    )


def _reseed_global(run: Run) -> None:
    torch.manual_seed(run.seed)


def seed_reset() -> Fault:
    """11. ``torch.manual_seed(seed)`` at the top of every epoch ("for reproducibility"): the
    global RNG drives Opacus' noise and Poisson batches, so both repeat every epoch; differences
    of iterates an epoch apart cancel the noise: ε = ∞ over the iterates."""
    return Fault(
        "seed-reset",
        "`torch.manual_seed` reset every epoch",
        "noise and batches repeat",
        _infinite,
        epoch_start=_reseed_global,
    )


def generator_reseed() -> Fault:
    """12. The noise generator reseeded every step: ``make_private(noise_generator=g)`` and
    ``g.manual_seed(0)`` before each step (a reproducibility helper called in the step): the
    same noise every step; differences of successive iterates are noiseless: ε = ∞."""

    def options(run: Run) -> dict[str, Any]:
        run.extra["generator"] = torch.Generator().manual_seed(0)
        return {"noise_generator": run.extra["generator"]}

    return Fault(
        "generator-reseed",
        "noise generator reseeded every step",
        "`g.manual_seed(0)` before each step",
        _infinite,
        private_options=options,
        before_step=lambda run: run.extra["generator"].manual_seed(0),
    )


def double_rate() -> Fault:
    """13. Batches drawn at twice the accounted rate: after ``make_private`` the script builds
    its own ``DPDataLoader`` from a DataLoader with batch size 120 (q = 0.2) while the
    accountant's hook keeps q = 0.1."""

    def replace(run: Run) -> None:
        run.loader = DPDataLoader.from_data_loader(DataLoader(run.train, batch_size=2 * BATCH))

    return Fault(
        "double-rate",
        "batches at twice the accounted rate",
        "own DPDataLoader at 2q",
        lambda steps: accountant_epsilon(SIGMA, 2 * Q, steps),
        after_private=replace,
    )


def clip_changed() -> Fault:
    """A (not a fault). ``optimizer.max_grad_norm`` lowered to 0.5 halfway (a clipping
    schedule): Opacus' noise reads the same attribute, so σ · C follows C: ε unchanged."""

    def change(run: Run) -> None:
        if run.step == run.steps // 2:
            run.optimizer.max_grad_norm = CHANGED_CLIP

    return Fault(
        "clip-changed",
        "A: `max_grad_norm` changed mid-run",
        "consistent: noise follows C",
        is_fault=False,
        before_step=change,
    )


def scaled_grads() -> Fault:
    """B (not a fault). Every per-sample gradient × 0.5 before clipping (a grad sampler scaled
    consistently in norm and sum, as a loss scaled by 0.5 gives): clipping still bounds every
    row by C, ε unchanged."""

    return Fault(
        "scaled-grads",
        "B: per-sample gradients × 0.5 before clipping",
        "consistent rescaling",
        is_fault=False,
        after_private=around_clipping(_scale_then_clip),
    )


FAULTS: dict[str, Fault] = {
    f.key: f
    for f in (
        correct(),
        noise_removed(),
        noise_half(),
        clipping_skipped(),
        clip_at_ten(),
        norm_undercount(),
        four_views(),
        own_loader(),
        shuffled_batches(),
        lost_accountant(),
        non_dp_head(),
        seed_reset(),
        generator_reseed(),
        double_rate(),
        clip_changed(),
        scaled_grads(),
    )
}


# -- the parts -----------------------------------------------------------------------------------
def _eps(v: float) -> str:
    if math.isnan(v):
        return "unknown"
    if math.isinf(v):
        return "∞"
    return f"{v:.3g}"


def faults_table(seeds: int, steps: int, kinds: list[str], faults: list[str]) -> None:
    """Per canary kind: each fault over ``seeds`` seeds."""
    for name in kinds:
        kind = KINDS[name]
        t0 = time.perf_counter()
        results: dict[str, list[dict[str, Any]]] = {}
        try:
            for seed in range(seeds):
                data = digits(seed)
                for key in ["correct", *[k for k in faults if k != "correct"]]:
                    results.setdefault(key, []).append(
                        run_once(FAULTS[key], kind, seed, steps=steps, data=data)
                    )
        except NotImplementedError as e:
            print(f"\n## Canaries {name}: not run ({e})\n")
            continue
        minutes = (time.perf_counter() - t0) / 60
        print(
            f"\n## Faults, canaries {name}: seeds 0-{seeds - 1}, {steps} steps, checks every "
            f"{max(1, steps // CHECKS)} steps and at the end ({minutes:.1f} min)\n"
        )
        print(
            "| fault | how | true ε | accountant ε | test acc | alarms | fired | audited ε "
            "fdp / steinke (median) | scores ≡ correct | ms / step |"
        )
        print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
        reference = [r["scores_digest"] for r in results["correct"]]
        for key, rs in results.items():
            fault = FAULTS[key]
            fired = Counter(c for r in rs for c in r["causes"])
            audited = " / ".join(
                f"{statistics.median(r['audited'][m] for r in rs):.2f}"
                for m in ("fdp", "steinke")
                if all(m in r["audited"] for r in rs)
            )
            same = sum(
                r["scores_digest"] is not None and r["scores_digest"] == ref
                for r, ref in zip(rs, reference, strict=True)
            )
            print(
                f"| {fault.title} | {fault.how} | {fault.bound}{_eps(rs[0]['true_eps'])} | "
                f"{statistics.median(r['accountant_eps'] for r in rs):.2f} | "
                f"{statistics.mean(r['accuracy'] for r in rs):.2f} | "
                f"{sum(r['alarm'] for r in rs)}/{len(rs)} | "
                f"{', '.join(f'{c} {n}' for c, n in fired.items()) or '-'} | {audited or '-'} | "
                f"{'-' if key == 'correct' else f'{same}/{len(rs)}'} | "
                f"{statistics.median(r['ms_per_step'] for r in rs):.2f} |"
            )
        mechanism_table(results)
        examples = {key: rs[0]["messages"][0] for key, rs in results.items() if rs[0]["messages"]}
        if examples:
            print("\nFirst message, seed 0:\n")
            for key, message in examples.items():
                print(f"- {FAULTS[key].title}: {message[:300]}")


def mechanism_table(results: dict[str, list[dict[str, Any]]]) -> None:
    """The mechanism checks' figures at the last check, per fault: times fired (of the seeds),
    and each p-value's median."""
    checks = sorted({c for rs in results.values() for r in rs for c in r["dp_checks"]})
    if not checks:
        print(f"\nNo `{DP_CHECKS_SEGMENT}` scalars in the reports (the checks do not exist yet).")
        return
    print(f"\nMechanism checks at the last check (fired: runs; p: median): {', '.join(checks)}\n")
    print("| fault | " + " | ".join(checks) + " |")
    print("|---|" + "---|" * len(checks))
    for key, rs in results.items():
        cells = []
        for check in checks:
            figures = [r["dp_checks"].get(check, {}) for r in rs]
            fired = sum(f.get("fired", 0.0) >= 0.5 for f in figures)
            ps = sorted({k for f in figures for k in f if "p_value" in k})
            medians = {k: statistics.median(f[k] for f in figures if k in f) for k in ps}
            p_text = " ".join(
                f"{k.replace('p_value', 'p').strip('/')}={v:.2g}" for k, v in medians.items()
            )
            cells.append(f"{fired}/{len(rs)} {p_text}".strip())
        print(f"| {FAULTS[key].title} | " + " | ".join(cells) + " |")


def null_table(runs: int, steps: int, kind_name: str) -> None:
    """False alarms over ``runs`` correct runs of a linear model (seeds 1000 + i)."""
    t0 = time.perf_counter()
    alarms, causes_seen = 0, Counter[str]()
    for i in range(runs):
        r = run_once(
            FAULTS["correct"],
            KINDS[kind_name],
            1000 + i,
            steps=steps,
            data=digits(1000 + i),
            model_fn=small,
        )
        alarms += r["alarm"]
        causes_seen.update(r["causes"])
    minutes = (time.perf_counter() - t0) / 60
    lo = float(clopper_pearson_lower(alarms, runs, 0.025))
    hi = float(clopper_pearson_upper(alarms, runs, 0.025))
    print(
        f"\n## False alarms over {runs} correct runs (linear 64-10, {steps} steps, canaries "
        f"{kind_name}, {CHECKS} checks, interval_delta 0.05; {minutes:.1f} min)\n"
    )
    print("| runs | alarms | rate | Clopper-Pearson 95 % | fired |")
    print("|---:|---:|---:|---|---|")
    fired = ", ".join(f"{c} {n}" for c, n in causes_seen.items()) or "-"
    print(f"| {runs} | {alarms} | {alarms / runs:.3f} | [{lo:.3f}, {hi:.3f}] | {fired} |")


def timing_table(repeats: int, steps: int) -> None:
    """CPU ms per step (and per final check) of the correct MLP run: no canaries, today's
    canaries with the mechanism checks off, and on; interleaved repeats, median."""
    data = digits(0)
    settings: dict[str, tuple[str, tuple[str, ...] | None] | None] = {"no canaries": ("none", None)}
    for n in ("1e3", "1e5"):
        settings[f"{n}, checks off"] = (n, () if checks_supported() else None)
        settings[f"{n}, checks on"] = (n, None) if checks_supported() else None
    times: dict[str, list[tuple[float, float]]] = {k: [] for k, v in settings.items() if v}
    run_once(FAULTS["correct"], KINDS["1e5"], 0, steps=steps, data=data)  # warm-up, discarded
    for _ in range(repeats):
        for label in times:
            kind, checks = settings[label] or ("none", None)
            r = run_once(FAULTS["correct"], KINDS[kind], 0, steps=steps, data=data, checks=checks)
            times[label].append((r["ms_per_step"], r["last_check_ms"]))
    base = statistics.median(t for t, _ in times["no canaries"])
    print(f"\n## CPU time per step ({repeats} interleaved repeats of {steps} steps, median)\n")
    print("| canaries | ms / step | vs none | vs checks off | ms / final check |")
    print("|---|---:|---:|---:|---:|")
    for label, setting in settings.items():
        if setting is None:
            print(f"| {label} | n/a (no `checks=` option yet) | | | |")
            continue
        ms = statistics.median(t for t, _ in times[label])
        check = statistics.median(c for _, c in times[label])
        off = label.replace("checks on", "checks off")
        vs_off = (
            f"{ms / statistics.median(t for t, _ in times[off]) - 1:+.0%}"
            if label.endswith("on")
            else ""
        )
        print(f"| {label} | {ms:.2f} | {ms / base - 1:+.0%} | {vs_off} | {check:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="faults,null,timing")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kinds", default="1e3,1e5,record", help=f"of {', '.join(KINDS)}")
    parser.add_argument("--faults", default=",".join(FAULTS), help="keys, comma-separated")
    parser.add_argument("--null-runs", type=int, default=200)
    parser.add_argument("--null-steps", type=int, default=100)
    parser.add_argument("--null-kind", default="1e3")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats")
    parser.add_argument("--timing-steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="1 seed, 100 steps, 10 null runs")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.null_runs, args.repeats = 1, 100, 10, 1
        args.null_steps = args.timing_steps = min(args.null_steps, 100)
    kinds, faults = args.kinds.split(","), args.faults.split(",")
    for name in [*kinds, args.null_kind]:
        if name not in KINDS:
            parser.error(f"unknown canary kind {name!r}: one of {', '.join(KINDS)}")
    for key in faults:
        if key not in FAULTS:
            parser.error(f"unknown fault {key!r}: one of {', '.join(FAULTS)}")
    torch.set_num_threads(1)
    threadpool_limits(1)  # numpy / scipy's BLAS too: CPU time counts every thread
    parts = args.parts.split(",")
    if "faults" in parts:
        faults_table(args.seeds, args.steps, kinds, faults)
    if "null" in parts:
        null_table(args.null_runs, args.null_steps, args.null_kind)
    if "timing" in parts:
        timing_table(args.repeats, args.timing_steps)


if __name__ == "__main__":
    main()
