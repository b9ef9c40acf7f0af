"""What watching a synthesizer's fit costs: CTGAN and TVAE on CPS1988, with and without checks.

Run from the repository root::

    OMP_WAIT_POLICY=PASSIVE nice -n 10 python benchmarks/synthetic_cost.py

(1) Paired fits. For each synthesizer and |D_mem| (``--members``, 100 and 500), the same seeded
fit of ``--epochs`` epochs runs without a monitor, with the example's monitor watching DOMIAS
alone, and with the example's five attacks (DOMIAS, DCR, Eq. 1, GAN-Leaks, GAN-Leaks CAL), a
check every ``--every`` (10) epochs drawing 10,000 synthetic records (one draw a check, which
the queries share), 1,000 held-out
and 10,000 reference records (``examples/synthetic_census.py``'s sets of seed 0); the three run
in rotation, ``--repeats`` rounds, one torch thread. An epoch is (fit − preprocessing) / epochs,
the preprocessing being ctgan's ``DataTransformer`` fit and transform, timed apart; a check is
(monitored fit − plain fit) / checks; the overhead is (monitored − plain) / plain. Medians
over the rounds.

(2) One check, broken down (the five attacks, TVAE and CTGAN after ``--epochs`` epochs on 100
members, median of ``--checks`` checks, the generator's weights nudged between checks as a
training step would): the synthesizer's ``sample()`` (through privmon's state-preserving
wrapper; the first query draws, the others reuse its table), ``TableEncoder.encode`` (the
synthetic records and the audit batches), the attack itself (fitting p_G or the distances,
scoring), the monitor's analysis (``analyse_check``: estimators, certificate, ROC, per-record
risk) and the rest (building the report, bookkeeping), timed by wrapping those functions in
this process (privmon unchanged).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from synthetic_census import (  # noqa: E402
    CATEGORICAL,
    DEFAULT_ATTACKS,
    census,
    make_queries,
    make_synthesizer,
    splits,
)

import privmon  # noqa: E402
import privmon.callbacks.monitor as monitor_module  # noqa: E402
import privmon.queries.generator as generator_module  # noqa: E402
from privmon.attacks.tables import TableEncoder  # noqa: E402
from privmon.integrations.synthesizers import attach  # noqa: E402
from privmon.queries.synthesizers import CtganModel, synthesizer_model  # noqa: E402

SETTINGS = {"plain": None, "domias": ("domias",), "five attacks": DEFAULT_ATTACKS}


def sets(table, n: int, seed: int = 0):
    ref, held, mem, _ = splits(table, seed, n_reference=10_000, n_heldout=1000, n_members=n)
    return mem, held, ref


def timed_fit(kind, mem, held, ref, *, epochs, every, attacks, seed=0) -> float:
    synthesizer = make_synthesizer(kind, epochs, seed)
    if attacks is None:
        start = time.perf_counter()
        synthesizer.fit(mem, discrete_columns=CATEGORICAL)
        return time.perf_counter() - start
    queries = make_queries(synthesizer, ref, attacks, 10_000)
    monitor = privmon.PrivacyMonitor(queries, [mem], [held], every_n_steps=every)
    start = time.perf_counter()
    with attach(synthesizer, monitor):
        synthesizer.fit(mem, discrete_columns=CATEGORICAL)
    seconds = time.perf_counter() - start
    assert len(monitor.history) == epochs // every and monitor.n_failed == 0
    return seconds


def preprocessing(mem, repeats: int) -> float:
    from ctgan.data_transformer import DataTransformer

    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        transformer = DataTransformer()
        transformer.fit(mem, CATEGORICAL)
        transformer.transform(mem)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def paired(table, args) -> None:
    print(
        f"(1) fits of {args.epochs} epochs, a check every {args.every} epochs "
        f"({args.epochs // args.every} checks, one draw of 10,000 synthetic records a check), "
        f"medians of {args.repeats} rounds, 1 thread"
    )
    print()
    print(
        "| synthesizer | D_mem | monitor | fit s | preprocessing s | epoch s | monitored fit s | "
        "check s | check / epoch | overhead |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    checks = args.epochs // args.every
    for kind in args.synthesizers:
        for n in args.members:
            mem, held, ref = sets(table, n)
            prep = preprocessing(mem, args.repeats)
            timed_fit(kind, mem, held, ref, epochs=2, every=1, attacks=None)  # warm-up
            times = defaultdict(list)
            for r in range(args.repeats):
                names = list(SETTINGS)
                names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
                for name in names:
                    times[name].append(
                        timed_fit(
                            kind,
                            mem,
                            held,
                            ref,
                            epochs=args.epochs,
                            every=args.every,
                            attacks=SETTINGS[name],
                        )
                    )
            plain = statistics.median(times["plain"])
            epoch = (plain - prep) / args.epochs
            for name in ("domias", "five attacks"):
                diffs = [w - p for w, p in zip(times[name], times["plain"], strict=True)]
                check = statistics.median(diffs) / checks
                overhead = statistics.median(diffs) / plain
                print(
                    f"| {kind.upper()} | {n} | {name} | {plain:.1f} | {prep:.2f} | {epoch:.4f} | "
                    f"{statistics.median(times[name]):.1f} | {check:.3f} | {check / epoch:.0f}x | "
                    f"{100 * overhead:.0f}% |",
                    flush=True,
                )


class Stopwatch:
    """Wraps functions and sums their time per (query, part) while a check runs."""

    def __init__(self):
        self.parts = defaultdict(float)
        self.query = "-"

    def wrap(self, owner, name: str, part: str | None, *, sets_query=False):
        original = getattr(owner, name)

        def wrapper(*a, **kw):
            if sets_query:
                previous, self.query = self.query, a[0].name
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                if part is not None:
                    self.parts[self.query, part] += time.perf_counter() - start
                if sets_query:
                    self.query = previous

        setattr(owner, name, wrapper)


def breakdown(table, args) -> None:
    watch = Stopwatch()
    q = generator_module.GeneratorQuery
    watch.wrap(q, "prepare", None, sets_query=True)
    watch.wrap(q, "__call__", None, sets_query=True)
    watch.wrap(CtganModel, "sample", "sample()")
    watch.wrap(TableEncoder, "encode", "encoding")
    for fn in ("fit_synthetic", "attack_scores", "reference_values"):
        watch.wrap(generator_module, fn, "attack")
    watch.wrap(monitor_module, "analyse_check", "analysis")
    print()
    print(
        f"(2) one check of the five attacks after {args.epochs} epochs on 100 members, 1,100 "
        f"audit and one draw of 10,000 synthetic records a check, median of {args.checks} "
        "checks (s)"
    )
    print()
    parts = ("sample()", "encoding", "attack")
    print("| synthesizer | query | " + " | ".join(parts) + " | query total |")
    print("|---|---|" + "---:|" * (len(parts) + 1))
    mem, held, ref = sets(table, 100)
    for kind in args.synthesizers:
        synthesizer = make_synthesizer(kind, args.epochs, 0)
        synthesizer.fit(mem, discrete_columns=CATEGORICAL)
        queries = make_queries(synthesizer, ref, DEFAULT_ATTACKS, 10_000)
        monitor = privmon.PrivacyMonitor(
            queries, [mem], [held], every_n_steps=1, planned_checks=args.checks + 1
        )
        monitor.check(0)  # the caches' first fill
        generator = synthesizer_model(synthesizer).modules()[0]
        per_check, totals = [], []
        for k in range(1, args.checks + 1):
            with torch.no_grad():  # as a training step would: the next check draws anew
                next(generator.parameters()).add_(1e-6)
            watch.parts.clear()
            start = time.perf_counter()
            monitor.check(k)
            totals.append(time.perf_counter() - start)
            per_check.append(dict(watch.parts))
        med = {
            key: statistics.median(c.get(key, 0.0) for c in per_check)
            for key in {k for c in per_check for k in c}
        }
        for a in DEFAULT_ATTACKS:
            cells = [med.get((a, p), 0.0) for p in parts]
            print(
                f"| {kind.upper()} | {a} | "
                + " | ".join(f"{c:.3f}" for c in cells)
                + f" | {sum(cells):.3f} |"
            )
        total = statistics.median(totals)
        by_part = {p: sum(med.get((a, p), 0.0) for a in DEFAULT_ATTACKS) for p in parts}
        analysis = med.get(("-", "analysis"), 0.0)
        rest = total - sum(by_part.values()) - analysis
        cells = " | ".join(f"{by_part[p]:.3f} ({100 * by_part[p] / total:.0f}%)" for p in parts)
        print(f"| {kind.upper()} | all five | {cells} | {total - analysis - rest:.3f} |")
        print(
            f"| {kind.upper()} | whole check {total:.3f} s | analysis {analysis:.3f} s "
            f"({100 * analysis / total:.0f}%) | rest {rest:.3f} s ({100 * rest / total:.0f}%) "
            "| | |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthesizers", nargs="+", default=["ctgan", "tvae"])
    p.add_argument("--members", nargs="+", type=int, default=[100, 500])
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checks", type=int, default=10)
    p.add_argument("--section", choices=("all", "paired", "breakdown"), default="all")
    args = p.parse_args()
    torch.set_num_threads(1)
    table = census()
    if args.section in ("all", "paired"):
        paired(table, args)
    if args.section in ("all", "breakdown"):
        breakdown(table, args)


if __name__ == "__main__":
    main()
