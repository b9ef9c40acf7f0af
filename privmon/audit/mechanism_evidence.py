"""The mechanism checks' findings from their statistics: each test's outcome (deterministic) or
p-value (statistical) and the sentence that says what the run did against what the accountant
assumes (:class:`~privmon.audit.MechanismChecks` collects the statistics)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privmon.audit.mechanism import MechanismFinding
from privmon.audit.mechanism_math import (
    CLIP_TOLERANCE,
    RowCounts,
    binomial_population,
    dispersion_p_value,
    mean_p_value,
    noise_p_value,
)

__all__ = [
    "PROBE_NORM",
    "TESTS",
    "clipping",
    "finite_gradients",
    "kinds_of",
    "ledger",
    "noise_repeat",
    "noise_variance",
    "sampling",
    "step_count",
]

PROBE_NORM = 100.0  # the clipping probe's norm, in units of C
# (check, test, kind) in the order the findings come.
TESTS = (
    ("clipping", "probe", "deterministic"),
    ("clipping", "finite", "deterministic"),
    ("noise", "variance", "statistical"),
    ("noise", "repeat", "deterministic"),
    ("sampling", "mean", "statistical"),
    ("sampling", "dispersion", "statistical"),
    ("steps", "count", "deterministic"),
    ("ledger", "weights", "deterministic"),
)
_KIND = {(check, test): kind for check, test, kind in TESTS}


def kinds_of(check: str) -> tuple[tuple[str, Any], ...]:
    """The (test, kind) pairs of one of the mechanism checks, in the order of :data:`TESTS`."""
    return tuple((test, kind) for c, test, kind in TESTS if c == check)


def _num(x: float) -> str:
    """A figure for a sentence: 5 significant digits, as Python writes a float (100.0, 1.0)."""
    return repr(float(f"{x:.5g}")) if math.isfinite(x) else str(x)


def _finding(name: str, fired: bool, p_value: float | None, evidence: str) -> MechanismFinding:
    check, test = name.split("/")
    return MechanismFinding(check, test, _KIND[check, test], fired, p_value, evidence)  # type: ignore[arg-type]


def clipping(
    worst: tuple[float, float, int] | None,
    probes: int,
    over: int,
    steps: int,
    bound: float,
    error: str | None,
    unclipped: tuple[int, int] = (0, 0),
) -> MechanismFinding:
    """The probe's worst contribution (ratio to C, that C, its step) against C; ``over``: the
    probes whose contribution exceeded C by more than their precision's rounding allows;
    ``unclipped``: (the private steps whose backward pass computed no ghost clipping
    coefficients, the first of them)."""
    if unclipped[0]:
        count, first = unclipped
        return _finding(
            "clipping/probe",
            True,
            None,
            (
                f"clipping: step {first} was not clipped: its backward pass computed no ghost "
                f"clipping coefficients ({count} of {steps} steps); the loss must be that of "
                "the criterion make_private returned"
            ),
        )
    if worst is None:
        why = f"the probe could not run ({error})" if error else "no private step yet"
        return _finding("clipping/probe", False, None, f"clipping: not tested: {why}")
    ratio, worst_bound, step = worst
    if over:
        row = f"a row of norm {PROBE_NORM * worst_bound:g}"
        return _finding(
            "clipping/probe",
            True,
            None,
            (
                f"clipping: {row} contributed {_num(ratio * worst_bound)}, above C = "
                f"{_num(worst_bound)} (step {step}; {over} of {probes} probes)"
            ),
        )
    most = (
        "C" if ratio <= 1 + CLIP_TOLERANCE else f"{_num(ratio)} C, within its precision's rounding,"
    )
    return _finding(
        "clipping/probe",
        False,
        None,
        (
            f"clipping: a row of norm {PROBE_NORM:g} C contributed at most {most} in {probes} "
            f"probes over {steps} steps (the last C = {_num(bound)})"
        ),
    )


def finite_gradients(
    first: tuple[int, int | None, str] | None, hits: int, steps: int, *, sharded: bool = False
) -> MechanismFinding:
    """Whether a non-finite per-sample gradient reached a noised update: ``hits`` private steps
    of ``steps`` did, the first (step, the row of its batch or None, "NaN" or "inf");
    ``sharded``: FSDP, where the row is told by its per-sample norm and this rank's shard of
    the sum, which another rank's record reaches too."""
    if first is None:
        said = (
            f"every per-sample gradient that reached the noise was finite ({steps} steps)"
            if steps
            else "no private step yet"
        )
        return _finding("clipping/finite", False, None, f"clipping: {said}")
    step, slot, kind = first
    count = f"({hits} of {steps} steps noised a non-finite clipped sum)"
    said = (
        f"a per-sample gradient of record slot {slot} was {kind} at step {step}: it passed "
        f"clipping unbounded {count}"
        if slot is not None
        else f"the clipped sum was not finite at step {step}, though every per-sample gradient "
        f"of the call was: the clipping made it so {count}"
        if not sharded
        else f"this rank's shard of the clipped sum was not finite at step {step}, though every "
        f"per-sample gradient norm of its batch was: another rank's record or the clipping "
        f"made it so {count}"
    )
    return _finding("clipping/finite", True, None, f"clipping: {said}")


_OTHER_RANK = "Opacus adds the noise on rank 0, which tests it"


def noise_variance(
    squares: float,
    values: int,
    steps: int,
    scale: float,
    rank: int = 0,
    left_out: tuple[int, int] = (0, 0),
    *,
    count: tuple[float, int] = (0.0, 0),
    shards: int = 0,
    share: float = 1.0,
) -> MechanismFinding:
    """S = Σ z² / (share · σ C)² over ``values`` noise values of ``steps`` steps (σ C: the
    last); ``left_out``: the (values, steps) read where the noised gradient was not finite,
    which the test leaves out (a non-finite value has no χ² term); under AdaClip ``count``:
    (Σ (count noise / σ_u)², steps), its p-value Bonferroni-combined with the gradient's,
    min(1, 2 min(p_g, p_c)); ``shards``: under FSDP the world size (0: not sharded), each
    rank's shard noised at ``share`` · σ C (1 / world size under mean reduction)."""
    if rank:
        return _finding(
            "noise/variance", False, 1.0, f"noise: not tested on rank {rank}: {_OTHER_RANK}"
        )
    bad, bad_steps = left_out
    out = (
        f"; {bad:,} values of {bad_steps} steps left out: the noised gradient was not finite"
        if bad
        else ""
    )
    if values == 0:
        why = "every value read was not finite" if bad else "no noised step with σ·C > 0 yet"
        return _finding("noise/variance", False, 1.0, f"noise: not tested: {why}{out}")
    ratio = math.sqrt(squares / values)
    p = noise_p_value(squares, values)
    assumed = f"σ·C = {_num(scale)}"
    if shards:
        part = f"σ·C/{round(1 / share)} = {_num(share * scale)}" if share != 1 else assumed
        assumed = f"{part}, on this rank's shard, 1 of {shards}"
    said = (
        f"noise: the noise added has {_num(ratio)} × the standard deviation the accountant "
        f"assumes ({assumed}; {values:,} values over {steps} steps{out})"
    )
    count_squares, count_steps = count
    if count_steps:
        p = min(1.0, 2 * min(p, noise_p_value(count_squares, count_steps)))
        count_ratio = _num(math.sqrt(count_squares / count_steps))
        said += f"; the noisy count of unclipped rows has {count_ratio} × its σ_u"
    return _finding("noise/variance", False, p, said)


def noise_repeat(digests: bytes, rank: int = 0) -> MechanismFinding:
    """Whether a step's noise digest (8 bytes a step, in step order) repeats an earlier one."""
    if rank:
        return _finding(
            "noise/repeat", False, None, f"noise: not tested on rank {rank}: {_OTHER_RANK}"
        )
    codes = np.frombuffer(digests, dtype=np.uint64)
    if len(codes) == 0:
        return _finding("noise/repeat", False, None, "noise: no noised step yet")
    _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    repeats = np.flatnonzero(first[inverse] != np.arange(len(codes)))
    if len(repeats) == 0:
        return _finding(
            "noise/repeat",
            False,
            None,
            f"noise: no step repeats another's noise ({len(codes)} steps)",
        )
    i = int(repeats[0])
    return _finding(
        "noise/repeat",
        True,
        None,
        (
            f"noise: step {i + 1} repeats the noise of step {int(first[inverse[i]]) + 1} "
            f"({len(repeats)} of {len(codes)} steps repeat an earlier step's noise)"
        ),
    )


def sampling(
    test: str, counts: RowCounts, rate: float | None, expected: Any, world: int = 1
) -> MechanismFinding:
    """The rows per step against Binomial(N, q_t), N from ``expected`` (the optimizer's
    ``expected_batch_size``) and the accountant's ``rate``; ``test``: "mean" or
    "dispersion". On ``world`` > 1 ranks (Opacus' expected batch size is then per rank), N is
    this rank's shard: the dataset split in ``world`` parts of sizes differing by at most 1."""
    name = f"sampling/{test}"
    if rate is None:
        return _finding(
            name,
            False,
            1.0,
            (
                "sampling: not tested: the optimizer's step hook is no Opacus accountant's, so the "
                "sampling rate the accountant uses is unknown"
            ),
        )
    if isinstance(expected, bool) or not isinstance(expected, int | float) or expected <= 0:
        return _finding(
            name,
            False,
            1.0,
            (
                "sampling: not tested: the optimizer has no expected_batch_size to tell the "
                "dataset size N from"
            ),
        )
    if counts.steps == 0:
        return _finding(name, False, 1.0, "sampling: not tested: no private step with q < 1 yet")
    total = round(expected * world)  # int(N q): Opacus divides it by the world size
    n_low, n_high = binomial_population(total, rate)
    population = math.ceil(total / rate - 1e-6)  # the smallest N, as the sentence shows it
    if world > 1:
        n_low, n_high = math.floor(n_low / world), math.ceil(n_high / world)
        population = math.floor(total / rate / world + 1e-6)
    p_value = (mean_p_value if test == "mean" else dispersion_p_value)(counts, n_low, n_high)
    q = counts.q_sum / counts.steps
    shard = " on this rank's shard" if world > 1 else ""
    assumed = f"the accountant assumes Binomial({population}, {_num(q)}){shard}"
    if counts.k_min == counts.k_max:
        said = f"{int(counts.k_min)} rows in each of {counts.steps} steps, {assumed}"
    else:
        mean = counts.rows / counts.steps
        variance = max(counts.k_sq / counts.steps - mean * mean, 0.0)
        said = (
            f"{_num(mean)} rows per step (variance {_num(variance)}) over {counts.steps} steps, "
            f"{assumed} (mean {_num(population * q)}, variance {_num(population * q * (1 - q))})"
        )
    return _finding(name, False, p_value, f"sampling: {said}")


def step_count(counted: int | None, taken: int) -> MechanismFinding:
    """The accountant's count of noised steps against the steps taken."""
    if counted is None:
        return _finding(
            "steps/count",
            False,
            None,
            (
                "steps: not tested: no Opacus accountant to compare with (the optimizer's step "
                "hook is not an accountant's; give the monitor accountant=)"
            ),
        )
    return _finding(
        "steps/count",
        counted != taken,
        None,
        f"steps: the accountant counted {counted} noised steps, {taken} were taken",
    )


def ledger(
    unnoised: int,
    first: int,
    changed: bool | None,
    last: int,
    *,
    written: tuple[int, int] = (0, 0),
) -> MechanismFinding:
    """``unnoised`` optimizer steps without noise (the first after private step ``first``);
    ``written``: how many private steps started from weights written since the private step
    before by no step of the optimizer, and that step of the first; whether the weights
    ``changed`` since the last private step ``last`` (None: none yet)."""
    said = []
    if unnoised:
        said.append(
            f"the optimizer stepped {unnoised} times without noise (first after private step "
            f"{first})"
        )
    if written[0]:
        said.append(
            f"the weights were written outside the optimizer's steps before {written[0]} "
            f"private steps (first after private step {written[1]})"
        )
    if changed:
        said.append(f"the weights changed after the last private step (step {last})")
    if said:
        return _finding(
            "ledger/weights", True, None, f"ledger: {'; '.join(said)}: a non-private update"
        )
    if changed is None:
        return _finding("ledger/weights", False, None, "ledger: no private step yet")
    return _finding(
        "ledger/weights",
        False,
        None,
        f"ledger: the weights are those of the last private step (step {last})",
    )
