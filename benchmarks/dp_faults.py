"""Fault injection for the DP alarm (issue #29): does privmon's alarm cover the DP-SGD faults
users hit, and stay silent on correct runs and on consistent changes?

The setup of ``examples/dp_audit.py`` and ``benchmarks/dp_canaries.py``: scikit-learn's digits,
600 training records, an MLP 64-256-10, Opacus 1.6 ``make_private(noise_multiplier=2.5,
max_grad_norm=1.0)``, Poisson batches at q = 0.1, SGD lr 0.5, 400 steps; the accountant
(Opacus' default, PRV) reports ε = 3.67 at δ = 1e-5. One seeded run hands its canaries to a
``privmon.PrivacyMonitor(LossQuery(model), 200 members, 200 held-out, accountant=engine,
canaries=...)`` that checks three times during training and once at the end, after whatever
the fault does after training. The canary kinds (``--kinds``):

* ``1e3``, ``1e5``: Dirac ``GradientCanaries(optimizer, n)``, the mechanism checks on (their
  default);
* ``record``: ``[RecordCanaries(1000), MechanismChecks(optimizer)]``, the monitor's
  ``canaries=`` taking both: 1,000 dataset slots that the DP loader samples like records, so
  the loader reads N + m = 1,600 items; the batch is round(q (N + m)) = 160 and the SGD lr
  × (N + m) / N, so that q stays 0.1, the accountant's ε 3.67 and the model's training as
  without canaries (in distribution);
* ``none``: no canaries (timing only).

A run returns the accountant's ε, the test accuracy, whether any check set
``report.dp_violation`` and why (``report.dp_causes``: ``"<check>: <evidence>"`` for a
mechanism check, ``"canaries/<method>: …"`` for the one-run audit; the
``privacy/dp_checks/<check>/fired`` scalars; a query's certificate by its message), the audited
ε (``privacy/canaries/<method>/epsilon_lower_bound``), the mechanism checks' p-values and the
CPU time per step. The faults (``dp_fault_cases.py``) are injected as users cause them, one at a
time, on top of the correct run; a fault's true ε is the PRV accountant's on the mechanism that
really ran, where one is defined.

Parts (``--parts``, comma-separated):

* ``faults``: seeds × faults and non-faults × canary kinds → true ε, accountant ε, test accuracy,
  alarms (runs), the checks that fired, the audited ε (median), whether the canaries' scores are
  bit-identical to the correct run's, the mechanism checks' figures at the last check;
* ``null``: the false-alarm rate over many correct runs (1,000 by default) of a cheaper model
  (nn.Linear(64, 10), 100 steps, about 1.5 s of CPU a run), at the monitor's default
  ``dp_alarm_delta``, with its Clopper-Pearson 95 % interval, how often each p-value is < 0.05
  and the smallest p / level any statistical test reached at any check (below 1: it fired);
* ``timing``: CPU time per step of the correct MLP run with today's ``GradientCanaries``
  (``checks=()``) and with the checks on, at 1e3 and 1e5 canaries (and without canaries);
  per repeat the five runs stepped in turn, one step each (in a new random order at every
  step), each run's mean step (stalls left out); median and quartiles over the repeats, and
  the checks' cost as the paired ratio on / off of each repeat.

    python benchmarks/dp_faults.py                  # everything: seeds 0-4, 1e3/1e5/record
    python benchmarks/dp_faults.py --quick          # smoke: 1 seed, 100 steps, 10 null runs
    python benchmarks/dp_faults.py --parts faults --kinds 1e3 --seeds 2 --faults correct,clip-10

One thread (torch and BLAS), CPU time (``time.process_time``): the machine may be shared. The
data, model and noise patch are dp_canaries.py's (imported).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import logging
import math
import random
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from dp_canaries import CLIP, DELTA, LR, N_TRAIN, SIGMA, digits, mlp, small
from dp_fault_cases import FAULTS, Fault, Q
from opacus import PrivacyEngine
from threadpoolctl import threadpool_limits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privmon import PrivacyMonitor, PrivacyViolationWarning
from privmon.audit import MECHANISM_CHECKS, GradientCanaries, MechanismChecks, RecordCanaries
from privmon.estimators.intervals import clopper_pearson_lower, clopper_pearson_upper
from privmon.queries import LossQuery
from privmon.report import tags

N_AUDIT = 200  # members and held-out records of the loss query
CHECKS = 4  # per run: three during training, one at the end
DP_ALARM_DELTA = inspect.signature(PrivacyMonitor).parameters["dp_alarm_delta"].default
# Opacus' warnings are filtered by dp_canaries (imported above).
warnings.simplefilter("ignore", PrivacyViolationWarning)  # read from the reports instead
logging.getLogger("privmon").setLevel(logging.ERROR)  # the alarms' log lines: idem

# -- data and models: dp_canaries.py's (digits(seed) -> (train, x_test, y_test), mlp, small) --
Data = tuple[TensorDataset, torch.Tensor, torch.Tensor]


# -- canary kinds ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CanaryKind:
    """How a run's canaries are made: ``wrap`` sets ``run.train``, ``run.batch`` and ``run.lr``
    and returns the model to make private (before ``make_private``); ``attach`` returns what
    the monitor's ``canaries=`` gets (after ``make_private`` and the fault's patches, so that
    the canaries and checks pass through them), or None. ``run.checks``: None for the
    mechanism checks' default (all), () for none (today's canaries). Both run again at the
    resume fault's rebuild."""

    name: str
    n: int = 0

    def wrap(self, run: Run, model: nn.Module) -> nn.Module:
        run.train, run.batch, run.lr = run.data[0], round(Q * N_TRAIN), LR
        return model

    def attach(self, run: Run) -> Any:
        if self.n == 0:
            return None
        options: dict[str, Any] = {} if run.checks is None else {"checks": run.checks}
        return GradientCanaries(run.optimizer, self.n, seed=run.seed, **options)


@dataclass(frozen=True)
class RecordCanaryKind(CanaryKind):
    """``[RecordCanaries(n, seed=run.seed), MechanismChecks(optimizer)]``: n dataset slots after
    the N records (``run.train``: N + n items), routed by the wrapped model to a block of their
    own; the batch round(q (N + n)) and the lr × (N + n) / N keep q and the model's training
    (under Opacus' ``loss_reduction="mean"``, which divides by the expected batch). The resume
    fault rebuilds both with the same seed and restores their state (the block is also in the
    model's). The queries, the test accuracy and the head's fine-tuning call the wrapper on
    plain tensors: the model itself."""

    def wrap(self, run: Run, model: nn.Module) -> nn.Module:
        run.extra["records"] = records = RecordCanaries(self.n, seed=run.seed)
        run.train = records.dataset(run.data[0])  # N + n slots, read by the DP loader
        run.batch = round(Q * len(run.train))
        run.lr = LR * len(run.train) / N_TRAIN
        return records.model(model)

    def attach(self, run: Run) -> Any:
        if run.checks == ():
            return run.extra["records"]
        checks = MechanismChecks(
            run.optimizer, **({} if run.checks is None else {"checks": run.checks})
        )
        return [run.extra["records"], checks]


KINDS: dict[str, CanaryKind] = {
    "none": CanaryKind("none"),
    "1e3": CanaryKind("1e3", 1_000),
    "1e5": CanaryKind("1e5", 100_000),
    "record": RecordCanaryKind("record", 1_000),
}


def _objects(canaries: Any) -> list[Any]:
    """What the monitor's ``canaries=`` got, as a list."""
    if canaries is None:
        return []
    return list(canaries) if isinstance(canaries, list) else [canaries]


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
    train: Any = field(init=False)  # what the DP loader reads
    batch: int = field(init=False)  # the loader's batch size (q = batch / len(train))
    lr: float = field(init=False)
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
        optimizer=torch.optim.SGD(model.parameters(), lr=run.lr),
        data_loader=DataLoader(run.train, batch_size=run.batch, **run.fault.loader_options),
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


def step_once(run: Run, inputs: torch.Tensor, y: torch.Tensor) -> float:
    """One DP-SGD step on a batch (the fault's rows), then the monitor on its schedule before
    the run's last step (the last check comes after the fault's post-training work); the CPU
    seconds of the step alone."""
    start = time.process_time()
    inputs, y = run.fault.rows(inputs, y)
    run.optimizer.zero_grad()
    nn.functional.cross_entropy(run.model(inputs), y).backward()
    run.optimizer.step()
    seconds = time.process_time() - start
    run.step += 1
    if run.step < run.steps:
        run.monitor.step(run.step)
    return seconds


def train(run: Run, until: int) -> None:
    """DP-SGD steps up to global step ``until``."""
    while run.step < until:
        run.fault.epoch_start(run)
        for inputs, y in run.loader:
            run.fault.before_step(run)
            run.step_seconds += step_once(run, inputs, y)
            if run.step >= until:
                break


def resume_losing_accountant(run: Run) -> None:
    """Checkpoint model, optimizer, canaries (and checks) and monitor; resume in a fresh
    process's objects (a new ``PrivacyEngine``) whose accountant state was not saved: it counts
    from zero."""
    saved = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "monitor": run.monitor.state_dict(),
        "canaries": [c.state_dict() for c in _objects(run.canaries)],
    }
    build(run)
    run.model.load_state_dict(saved["model"])
    for canaries, state in zip(_objects(run.canaries), saved["canaries"], strict=True):
        canaries.load_state_dict(state)
    run.optimizer.load_state_dict(saved["optimizer"])  # after the canaries: their param group
    run.monitor.load_state_dict(saved["monitor"])


def cause_of(cause: str) -> str:
    """The check a ``report.dp_causes`` entry names: a mechanism check (``"<check>: …"``) or
    the one-run audit (``"canaries/<method>: …"`` → ``canaries``)."""
    check = cause.split(":", 1)[0]
    return "canaries" if check.startswith("canaries/") else check


def dp_check_figures(scalars: dict[str, float]) -> dict[str, dict[str, float]]:
    """The mechanism checks' scalars, by check: ``fired`` and ``<test>/p_value``."""
    out: dict[str, dict[str, float]] = {}
    for tag, v in scalars.items():
        parsed = tags.parse_dp_check(tag)
        if parsed:
            check, test = parsed
            out.setdefault(check, {})["fired" if test is None else f"{test}/p_value"] = float(v)
    return out


def closest_to_alarm(scalars: dict[str, float]) -> float:
    """The smallest p / level of the statistical tests of a check (``inf`` without one): below
    1, the test fired."""
    level = scalars.get(tags.DP_ALARM_DELTA)
    ratios = [
        v / level
        for checks in dp_check_figures(scalars).values()
        for k, v in checks.items()
        if level and k.endswith("/p_value") and not math.isnan(v)
    ]
    return min(ratios, default=math.inf)


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
    fired = {cause_of(c) for r in reports for c in r.dp_causes}
    for report in reports:
        fired |= {c for c, f in dp_check_figures(report.scalars).items() if f.get("fired") == 1.0}
        if any("membership advantage" in m for m in report.messages):
            fired.add("query")
    scored = [c for c in _objects(run.canaries) if hasattr(c, "scores")]
    scores = scored[0].scores() if scored else None
    return {
        "accountant_eps": float(run.engine.get_epsilon(DELTA)),
        "true_eps": fault.true_epsilon(steps),
        "accuracy": accuracy,
        "alarm": any(r.dp_violation for r in reports),
        "alarm_steps": [r.step for r in reports if r.dp_violation],
        "causes": list(dict.fromkeys(c for r in reports for c in r.dp_causes)),
        "fired": sorted(fired),
        "audited": {
            method: v for tag, v in last.scalars.items() if (method := tags.parse_canary(tag))
        },
        "dp_checks": dp_check_figures(last.scalars),
        "closest": min((closest_to_alarm(r.scalars) for r in reports), default=math.inf),
        "scores_digest": None
        if scores is None
        else hashlib.sha256(scores[0].tobytes() + b"|" + scores[1].tobytes()).hexdigest(),
        "ms_per_step": 1e3 * run.step_seconds / max(run.step, 1),
        "last_check_ms": 1e3 * check_seconds,
        "cpu_seconds": time.process_time() - cpu,
    }


# -- the parts -----------------------------------------------------------------------------------
def _eps(v: float) -> str:
    if math.isnan(v):
        return "unknown"
    if math.isinf(v):
        return "∞"
    return f"{v:.3g}"


def faults_table(
    seeds: int, steps: int, kinds: list[str], faults: list[str], checks: tuple[str, ...] | None
) -> None:
    """Per canary kind: each fault over ``seeds`` seeds; ``checks``: the mechanism checks run
    (None: the default, all; (): none, the canaries alone as before issue #29)."""
    for name in kinds:
        kind = KINDS[name]
        t0 = time.perf_counter()
        results: dict[str, list[dict[str, Any]]] = {}
        for seed in range(seeds):
            data = digits(seed)
            for key in ["correct", *[k for k in faults if k != "correct"]]:
                r = run_once(FAULTS[key], kind, seed, steps=steps, data=data, checks=checks)
                results.setdefault(key, []).append(r)
                print(  # progress, so that a run cut short still says what it measured
                    f"faults {name} seed {seed} {key}: alarm steps {r['alarm_steps']}, "
                    f"fired {r['fired']}",
                    file=sys.stderr,
                )
        minutes = (time.perf_counter() - t0) / 60
        which = (
            "all mechanism checks"
            if checks is None
            else "mechanism checks: " + (", ".join(checks) or "none")
        )
        print(
            f"\n## Faults, canaries {name}, {which}: "
            f"seeds 0-{seeds - 1}, {steps} steps, checks every {max(1, steps // CHECKS)} steps "
            f"and at the end ({minutes:.1f} min)\n"
        )
        print(
            "| fault | how | true ε | accountant ε | test acc | alarms | fired (runs) | first "
            "alarm (median step) | audited ε fdp / steinke (median) | scores ≡ correct | "
            "ms / step |"
        )
        print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        reference = [r["scores_digest"] for r in results["correct"]]
        for key, rs in results.items():
            fault = FAULTS[key]
            fired = Counter(c for r in rs for c in r["fired"])
            audited = " / ".join(
                f"{statistics.median(r['audited'][m] for r in rs):.2f}"
                for m in ("fdp", "steinke")
                if all(m in r["audited"] for r in rs)
            )
            same = sum(
                r["scores_digest"] is not None and r["scores_digest"] == ref
                for r, ref in zip(rs, reference, strict=True)
            )
            first = [r["alarm_steps"][0] for r in rs if r["alarm_steps"]]
            print(
                f"| {fault.title} | {fault.how} | {fault.bound}{_eps(rs[0]['true_eps'])} | "
                f"{statistics.median(r['accountant_eps'] for r in rs):.2f} | "
                f"{statistics.mean(r['accuracy'] for r in rs):.2f} | "
                f"{sum(r['alarm'] for r in rs)}/{len(rs)} | "
                f"{', '.join(f'{c} {n}' for c, n in sorted(fired.items())) or '-'} | "
                f"{statistics.median(first) if first else '-'} | {audited or '-'} | "
                f"{'-' if key == 'correct' else f'{same}/{len(rs)}'} | "
                f"{statistics.median(r['ms_per_step'] for r in rs):.2f} |"
            )
        mechanism_table(results)
        examples = {key: rs[0]["causes"][0] for key, rs in results.items() if rs[0]["causes"]}
        if examples:
            print("\nFirst cause, seed 0:\n")
            for key, cause in examples.items():
                print(f"- {FAULTS[key].title}: {cause[:300]}")


def mechanism_table(results: dict[str, list[dict[str, Any]]]) -> None:
    """The mechanism checks' figures at the last check, per fault: times fired (of the seeds),
    and each p-value's median."""
    checks = list(MECHANISM_CHECKS)
    print("\nMechanism checks at the last check (fired: runs; p: median)\n")
    print("| fault | " + " | ".join(checks) + " |")
    print("|---|" + "---|" * len(checks))
    for key, rs in results.items():
        cells = []
        for check in checks:
            figures = [r["dp_checks"].get(check, {}) for r in rs]
            fired = sum(f.get("fired", 0.0) == 1.0 for f in figures)
            ps = sorted({k for f in figures for k in f if k.endswith("/p_value")})
            medians = {k: statistics.median(f[k] for f in figures if k in f) for k in ps}
            p_text = " ".join(f"{k.removesuffix('/p_value')} p={v:.2g}" for k, v in medians.items())
            cells.append(f"{fired}/{len(rs)} {p_text}".strip())
        print(f"| {FAULTS[key].title} | " + " | ".join(cells) + " |")


def null_table(runs: int, steps: int, kind_names: list[str]) -> None:
    """False alarms over ``runs`` correct runs of a linear model (seeds 1000 + i), per kind; how
    often each statistical test's p-value at the last check is below 0.05, and the smallest
    ratio p / level any test reached at any check (below 1: an alarm). Progress every 100 runs
    on stderr, so that a run cut short still says its exact count."""
    for kind_name in kind_names:
        t0 = time.perf_counter()
        alarms, fired, low = 0, Counter[str](), Counter[str]()
        closest = math.inf
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
            fired.update(r["fired"])
            closest = min(closest, r["closest"])
            for check, figures in r["dp_checks"].items():
                low.update(
                    f"{check}/{k.removesuffix('/p_value')}"
                    for k, p in figures.items()
                    if k.endswith("/p_value") and p < 0.05
                )
            if (i + 1) % 100 == 0:
                print(f"null {kind_name}: {i + 1} runs, {alarms} alarms", file=sys.stderr)
        minutes = (time.perf_counter() - t0) / 60
        lo = float(clopper_pearson_lower(alarms, runs, 0.025))
        hi = float(clopper_pearson_upper(alarms, runs, 0.025))
        print(
            f"\n## False alarms over {runs} correct runs (linear 64-10, {steps} steps, canaries "
            f"{kind_name}, {CHECKS} checks, interval_delta 0.05, dp_alarm_delta "
            f"{DP_ALARM_DELTA:g}; {minutes:.1f} min)\n"
        )
        print(
            "| runs | alarms | rate | Clopper-Pearson 95 % | fired | p < 0.05 at the last check "
            "| smallest p / level |"
        )
        print("|---:|---:|---:|---|---|---|---:|")
        said = ", ".join(f"{c} {n}" for c, n in sorted(fired.items())) or "-"
        tests = ("noise/variance", "sampling/mean", "sampling/dispersion")
        share = ", ".join(f"{t} {low[t]}" for t in tests)
        print(
            f"| {runs} | {alarms} | {alarms / runs:.4f} | [{lo:.4f}, {hi:.4f}] | {said} | {share} "
            f"| {closest:.3g} |"
        )


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = np.percentile(xs, [25, 50, 75])
    return float(q1), float(q2), float(q3)


def _batches(run: Run) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The run's Poisson batches, epoch after epoch."""
    while True:
        yield from run.loader


def _interleaved(settings: dict[str, tuple[str, tuple[str, ...] | None]], steps: int, data: Data):
    """One repeat: a correct run per setting, all built first, then stepped in turn (one step
    each, in a new random order at every step, the monitors checking on their schedule outside
    the timing): per setting the mean CPU ms of its steps after the first 10 (the clipping
    probe's), leaving out those above 3× the median (the machine's stalls; a step that probes
    takes about 1.2×), and the ms of its final check. Stepping in turn pairs each step with the
    others' over the same moment, so a busy machine's drift cancels in the ratios."""
    runs = {}
    for label, (kind, checks) in settings.items():
        torch.manual_seed(0)
        runs[label] = run = Run(FAULTS["correct"], KINDS[kind], 0, steps, data, mlp, checks)
        build(run)
    batches = {label: _batches(run) for label, run in runs.items()}
    times: dict[str, list[float]] = {label: [] for label in runs}
    order, shuffle = list(runs), random.Random(0).shuffle
    for i in range(steps):
        shuffle(order)  # each run after each other equally often: no neighbour's cache bias
        for label in order:
            seconds = step_once(runs[label], *next(batches[label]))
            if i >= 10:
                times[label].append(seconds)
    out = {}
    for label, run in runs.items():
        start = time.process_time()
        run.monitor.check(run.step)
        middle = statistics.median(times[label])
        kept = [t for t in times[label] if t <= 3 * middle]
        out[label] = (1e3 * statistics.fmean(kept), 1e3 * (time.process_time() - start))
        run.monitor.close()
    return out


def timing_table(repeats: int, steps: int, checks: tuple[str, ...] | None = None) -> None:
    """CPU ms per step (and per final check) of the correct MLP run: no canaries, and 1e3 / 1e5
    canaries with the mechanism checks off (``checks=()``, today's canaries) and on; per
    repeat the runs stepped in turn (:func:`_interleaved`); median [quartiles] over the repeats,
    and the checks' cost as the per-repeat ratio on / off of the mean step. ``checks``: the
    mechanism checks "on" runs (default all)."""
    data = digits(0)
    settings: dict[str, tuple[str, tuple[str, ...] | None]] = {"no canaries": ("none", None)}
    for n in ("1e3", "1e5"):
        settings[f"{n}, checks off"] = (n, ())
        settings[f"{n}, checks on"] = (n, checks)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in settings}
    t0 = time.perf_counter()
    _interleaved(settings, 20, data)  # warm-up, discarded
    for _ in range(repeats):
        for label, figures in _interleaved(settings, steps, data).items():
            times[label].append(figures)
    minutes = (time.perf_counter() - t0) / 60
    print(
        f"\n## CPU time per step ({repeats} repeats of {steps} steps, the runs stepped in turn; "
        f"checks on: {'all' if checks is None else ', '.join(checks)}; median [quartiles]; "
        f"{minutes:.1f} min)\n"
    )
    print("| canaries | ms / step | checks on / off, paired | ms / final check |")
    print("|---|---:|---:|---:|")
    for label in settings:
        q1, q2, q3 = _quartiles([t for t, _ in times[label]])
        check = statistics.median(c for _, c in times[label])
        paired = ""
        if label.endswith("on"):
            off = times[label.replace("checks on", "checks off")]
            ratios = [on / o - 1 for (on, _), (o, _) in zip(times[label], off, strict=True)]
            r1, r2, r3 = _quartiles(ratios)
            paired = f"{r2:+.1%} [{r1:+.1%}, {r3:+.1%}]"
        print(f"| {label} | {q2:.2f} [{q1:.2f}, {q3:.2f}] | {paired} | {check:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="faults,null,timing")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kinds", default="1e3,1e5,record", help=f"of {', '.join(KINDS)}")
    parser.add_argument("--faults", default=",".join(FAULTS), help="keys, comma-separated")
    parser.add_argument(
        "--checks",
        default="all",
        help="the mechanism checks the faults part runs: all, none (the canaries alone, as "
        "before issue #29) or names, comma-separated",
    )
    parser.add_argument("--null-runs", type=int, default=1000)
    parser.add_argument("--null-steps", type=int, default=100)
    parser.add_argument("--null-kinds", default="1e3", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=11, help="timing repeats")
    parser.add_argument("--timing-steps", type=int, default=200)
    parser.add_argument(
        "--timing-checks", default=None, help="the checks timed, comma-separated (default all)"
    )
    parser.add_argument("--quick", action="store_true", help="1 seed, 100 steps, 10 null runs")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.null_runs, args.repeats = 1, 100, 10, 2
        args.null_steps = args.timing_steps = min(args.null_steps, 100)
    kinds, faults = args.kinds.split(","), args.faults.split(",")
    null_kinds = args.null_kinds.split(",")
    for name in [*kinds, *null_kinds]:
        if name not in KINDS:
            parser.error(f"unknown canary kind {name!r}: one of {', '.join(KINDS)}")
    for key in faults:
        if key not in FAULTS:
            parser.error(f"unknown fault {key!r}: one of {', '.join(FAULTS)}")
    named = {"all": None, "none": ()}
    checks = named[args.checks] if args.checks in named else tuple(args.checks.split(","))
    unknown_checks = set(checks or ()) - set(MECHANISM_CHECKS)
    if unknown_checks:
        parser.error(f"unknown check(s) {sorted(unknown_checks)}: of {', '.join(MECHANISM_CHECKS)}")
    torch.set_num_threads(1)
    threadpool_limits(1)  # numpy / scipy's BLAS too: CPU time counts every thread
    parts = args.parts.split(",")
    if "faults" in parts:
        faults_table(args.seeds, args.steps, kinds, faults, checks)
    if "null" in parts:
        null_table(args.null_runs, args.null_steps, null_kinds)
    if "timing" in parts:
        only = None if args.timing_checks is None else tuple(args.timing_checks.split(","))
        timing_table(args.repeats, args.timing_steps, only)


if __name__ == "__main__":
    main()
