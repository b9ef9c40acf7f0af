"""Every path of privmon timed on CUDA, with the CPU figure beside it, in one command.

Run from the repository root::

    python benchmarks/gpu_suite.py                        # both columns, the issue's sizes
    python benchmarks/gpu_suite.py --json gpu.json        # the table, and the rows as JSON
    python benchmarks/gpu_suite.py --device cpu --scale 0.01   # the CPU column only, small
    python benchmarks/gpu_suite.py --only domias,lira     # the paths whose name holds a word

It prints the machine, then one markdown table (path, size, CPU s, CUDA s, speed-up, notes) on
stdout; progress goes to stderr. Sized for one GPU (an NVIDIA H200, 16 CPU cores): under 8
minutes for both columns at ``--scale 1``, the issue's sizes (1e6 scores, canaries and DOMIAS
records); ``--scale`` multiplies every size (each has a floor), so a small scale is a CPU smoke
run (``tests/test_gpu_suite.py``).

**A path** is one function ``(device, size) -> seconds``: it builds its inputs (untimed), makes
one warm-up call, then times one more call when the warm-up took at least 1 s, else three (up to
25 while they take under 0.3 s in all), and returns the median (per step or per check where the
row says so). On CUDA ``torch.cuda.synchronize()`` runs before and after each timed call. Audit
batches stay on the CPU, as a loader gives them (the query moves them, as in a check); score
arrays are made on the device, where a query leaves them.

**The CPU column** runs with torch's default threads. A row with a CPU size ceiling measures the
CPU at that ceiling and at a quarter of it and extrapolates affinely to the row's size (each such
path costs a fixed part plus one proportional to its size); its notes say "CPU ≈ affine from a
and b". Measured at 1e6, the slowest rows (the KDE plug-in on 16-D scores, DOMIAS, SecMI) would
take minutes of the 8. Below its ceiling a row's CPU figure is measured at the row's size.

**Failures are rows.** A path that needs a missing extra, runs out of memory, raises, or runs
past its cap (``--cap`` seconds per cell, 45 by default) gives a row saying so, and the suite
goes on. The CUDA column runs first, every path, then the CPU column; a cell that would start
with less than 3 s of ``--budget`` left is skipped and says so, and none runs past it: the whole
run takes at most the budget (420 s by default) plus the imports and CUDA's start.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from importlib import metadata
from itertools import count, cycle, islice
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privmon
from privmon.attacks import lira, rmia
from privmon.audit import one_run_epsilon, random_halves, train_ensemble
from privmon.queries import LossQuery

CPU = torch.device("cpu")
# timed calls after the warm-up: one if the warm-up took LONG_S, else REPEATS, or more (up to
# MAX_REPEATS) while they take under SHORT_S in all
REPEATS, MAX_REPEATS, LONG_S, SHORT_S = 3, 25, 1.0, 0.3
MIN_CELL_S = 3.0  # a cell with less of the budget left is skipped
EXTRAS = {"opacus": "dp", "transformers": "transformers", "diffusers": "diffusion"}
for _message in ("Secure RNG", "Optimal order", "Full backward hook", "invalid value"):
    warnings.filterwarnings("ignore", message=_message)  # Opacus' notices, once per engine


# -- timing ----------------------------------------------------------------------------------
def _timed(call: Callable[[], object], *, device: torch.device) -> float:
    """Seconds of one call; on CUDA from a synchronised start to a synchronised end."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def median_seconds(call: Callable[[], object], *, device: torch.device, per: int = 1) -> float:
    """Median seconds of ``call`` (divided by ``per``, the steps one call runs) after one
    untimed warm-up call (the number of timed calls: REPEATS above)."""
    warm = _timed(call, device=device)
    calls = min(MAX_REPEATS, max(REPEATS, math.ceil(SHORT_S / max(warm, 1e-9))))
    times = [_timed(call, device=device) for _ in range(1 if warm >= LONG_S else calls)]
    return statistics.median(times) / per


def generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


# -- estimators and DOMIAS -------------------------------------------------------------------
def estimate_seconds(
    device: torch.device, size: int, *, dim: int, call: Callable[[Any, Any], object]
) -> float:
    """``call(members, nonmembers)`` on size // 2 scores each: N(μ, I) against N(0, I), (n,) or
    (n, dim), μ = 0.1 (1-D) or 0.05 per coordinate."""
    shape, gen = ((size // 2,) if dim == 1 else (size // 2, dim)), generator(device)
    m = torch.randn(shape, generator=gen, device=device) + (0.1 if dim == 1 else 0.05)
    h = torch.randn(shape, generator=gen, device=device)
    return median_seconds(lambda: call(m, h), device=device)


def domias_seconds(device: torch.device, size: int, *, n_fit: int = 10_000) -> float:
    """``privmon.domias_scores`` (KDEs) of ``size`` 8-D records against 10,000 synthetic and
    10,000 reference records (the paper's Sec. 5.1 sizes)."""
    gen = generator(device)
    test = torch.randn(size, 8, generator=gen, device=device)
    synthetic = 0.9 * torch.randn(n_fit, 8, generator=gen, device=device)
    reference = torch.randn(n_fit, 8, generator=gen, device=device)
    return median_seconds(lambda: privmon.domias_scores(test, synthetic, reference), device=device)


# -- ensembles and reference-model attacks ---------------------------------------------------
def _classification(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = generator(device)
    x = torch.randn(n, 64, generator=gen, device=device)
    return x, torch.randint(0, 10, (n,), generator=gen, device=device)


def _mlp(*, layer_norm: bool = False) -> nn.Module:
    """64-32-10; with a LayerNorm the stack runs under vmap instead of batched products."""
    norm: list[nn.Module] = [nn.LayerNorm(32)] if layer_norm else []
    return nn.Sequential(nn.Linear(64, 32), *norm, nn.ReLU(), nn.Linear(32, 10))


def _ensemble(device: torch.device, n: int, *, epochs: int, layer_norm: bool) -> Callable[[], Any]:
    """``train_ensemble`` of 64 MLPs, each on a random half of n records, full-batch Adam."""
    masks, model_fn = random_halves(n, 64, seed=0), partial(_mlp, layer_norm=layer_norm)
    return partial(
        train_ensemble, model_fn, _classification(device, n), masks,
        loss_fn=partial(F.cross_entropy, reduction="none"),
        optimizer=partial(torch.optim.Adam, lr=1e-2), epochs=epochs, seed=0,
    )  # fmt: skip


def train_ensemble_seconds(
    device: torch.device, size: int, *, epochs: int, layer_norm: bool
) -> float:
    """Stacked training: batched products, or vmap with ``layer_norm``."""
    train = _ensemble(device, size, epochs=epochs, layer_norm=layer_norm)
    return median_seconds(train, device=device)


def ensemble_forward_seconds(device: torch.device, size: int) -> float:
    """``Ensemble(x)``: 64 trained MLPs on ``size`` records at once, outputs (64, n, 10)."""
    ensemble = _ensemble(device, 1_000, epochs=1, layer_norm=False)()
    x, _ = _classification(device, size)
    return median_seconds(lambda: ensemble(x), device=device)


def reference_attack_seconds(device: torch.device, size: int, *, attack: str) -> float:
    """``attacks.lira`` (online, per-record variances) or ``attacks.rmia`` (online, half the
    records as population) with 64 reference models."""
    gen = generator(device)
    shadow_in = torch.rand(64, size, generator=gen, device=device) < 0.5
    shadow = torch.randn(64, size, generator=gen, device=device) + shadow_in
    target = torch.randn(size, generator=gen, device=device)
    if attack == "lira":
        return median_seconds(lambda: lira(target, shadow, shadow_in), device=device)
    t, s, pop = target.sigmoid(), shadow.sigmoid(), torch.arange(size, device=device) % 2 == 0
    return median_seconds(lambda: rmia(t, s, shadow_in, population=pop), device=device)


# -- DP-SGD: mechanism checks, canaries, one-run bounds --------------------------------------
Attach = Callable[[Any, int], contextlib.AbstractContextManager[Any]]


def dp_step_seconds(
    device: torch.device, size: int, *, batch: int, attach: Attach, steps: int = 10
) -> float:
    """One Opacus DP-SGD step (MLP 64-256-10, 10 · batch random records, q = 0.1, σ = 1, C = 1,
    SGD) with ``attach(optimizer, size)`` on; ``steps`` Poisson batches drawn beforehand. The
    warm-up's steps cover the mechanism checks' probe at each of the first 10 steps."""
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(10 * batch, 64), torch.randint(0, 10, (10 * batch,)))
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=batch), noise_multiplier=1.0, max_grad_norm=1.0,
    )  # fmt: skip
    batches = [(x.to(device), y.to(device)) for x, y in islice(cycle(loader), steps)]

    def train() -> None:
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    with attach(optimizer, size):
        return median_seconds(train, device=device, per=steps)


ATTACH: dict[str, Attach] = {  # what each DP row attaches to the optimizer
    "bare": lambda optimizer, size: contextlib.nullcontext(),
    "checks": lambda optimizer, size: privmon.audit.MechanismChecks(optimizer),
    "canaries": lambda optimizer, m: privmon.audit.GradientCanaries(optimizer, m, checks=()),
}


def one_run_seconds(device: torch.device, size: int, *, method: str) -> float:
    """``audit.one_run_epsilon`` on ``size`` canary scores (the default split selection)."""
    gen = generator(device)
    included = torch.rand(size, generator=gen, device=device) < 0.5
    scores = torch.randn(size, generator=gen, device=device) + 0.1 * included
    inside, outside = scores[included], scores[~included]
    bound = partial(one_run_epsilon, inside, outside, delta=1e-5, method=method)
    return median_seconds(bound, device=device)


# -- queries of generative models ------------------------------------------------------------
def run_queries(queries: Sequence[Any], batches: Sequence[Any]) -> None:
    """What a check asks of its queries: prepare, every batch through each query, release."""
    for query in queries:
        query.prepare()
    with torch.no_grad():
        for batch in batches:
            for query in queries:
                query(batch)
    for query in queries:
        query.release()


def lm_seconds(device: torch.device, size: int, *, vocab: int, batch: int = 16) -> float:
    """``language_model_queries`` (loss, Min-K%, Min-K%++, one shared forward per batch) on
    ``size`` texts of 128 tokens: a randomly initialised GPT-2 config (2 layers of width 128),
    nothing downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from privmon.queries import language_model_queries

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab, n_positions=128, n_embd=128, n_layer=2, n_head=4, use_cache=False,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).to(device).eval()
    queries = language_model_queries(model, ("loss", "min_k", "min_k_plus_plus"))
    gen, batches = torch.Generator().manual_seed(0), []
    for start in range(0, size, batch):
        ids = torch.randint(0, vocab, (min(batch, size - start), 128), generator=gen)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return median_seconds(lambda: run_queries(queries, batches), device=device)


def diffusion_seconds(
    device: torch.device, size: int, *, statistic: str, batch: int = 256
) -> float:
    """``DiffusionQuery`` at t = 100 on ``size`` 3×32×32 images in batches of 256: a randomly
    initialised diffusers UNet2DModel (channels 32/64/64) and a DDPMScheduler (T = 1000)."""
    from diffusers import DDPMScheduler, UNet2DModel

    from privmon.queries import DiffusionQuery

    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(32, 64, 64),
        layers_per_block=1, norm_num_groups=8, down_block_types=("DownBlock2D",) * 3,
        up_block_types=("UpBlock2D",) * 3,
    ).to(device).eval()  # fmt: skip
    query = DiffusionQuery(model, DDPMScheduler(num_train_timesteps=1000), statistic, timesteps=100)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.rand(min(batch, size - start), 3, 32, 32, generator=gen) * 2 - 1
        for start in range(0, size, batch)
    ]
    return median_seconds(lambda: run_queries([query], batches), device=device)


# -- the monitor beside a training step ------------------------------------------------------
class _Block(nn.Module):
    """A ResNet basic block: two 3×3 convolutions with BatchNorm, plus the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        conv_bn = [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(
            *conv_bn, nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        )
        same = stride == 1 and cin == cout
        self.shortcut = nn.Identity() if same else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def resnet() -> nn.Module:
    """A ResNet-8-like classifier of 3×32×32 images (widths 16/32/64, 10 classes)."""
    stem = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    blocks = [_Block(16, 16, 1), _Block(16, 32, 2), _Block(32, 64, 2)]
    return nn.Sequential(*stem, *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def train_step_seconds(device: torch.device, size: int, *, steps: int = 10) -> float:
    """One training step (forward, backward, SGD with momentum) of the ResNet on a batch."""
    torch.manual_seed(0)
    model = resnet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(size, 3, 32, 32, device=device), torch.randint(0, 10, (size,), device=device)

    def train() -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    return median_seconds(train, device=device, per=steps)


def _monitor(device: torch.device, size: int, *, batch: int = 500) -> privmon.PrivacyMonitor:
    """A monitor of the ResNet's loss: size // 2 members and as many non-members, on the CPU."""
    torch.manual_seed(0)
    model, gen, half = resnet().to(device), torch.Generator().manual_seed(0), size // 2
    x, y = torch.randn(size, 3, 32, 32, generator=gen), torch.randint(0, 10, (size,), generator=gen)

    def side(a: int, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(x[i : min(i + batch, b)], y[i : min(i + batch, b)]) for i in range(a, b, batch)]

    return privmon.PrivacyMonitor(
        LossQuery(model), side(0, half), side(half, 2 * half), strict=True
    )


def check_seconds(device: torch.device, size: int, *, overhead: bool = False) -> float:
    """``PrivacyMonitor.check`` (forward passes, both estimators, ROC, per-record risk); with
    ``overhead``, the part besides the forward passes, from the monitor's own figures
    (``report.seconds − report.query_seconds``; it synchronises CUDA around the queries)."""
    monitor, step = _monitor(device, size), count()
    if not overhead:
        return median_seconds(lambda: monitor.check(next(step)), device=device)
    reports = [monitor.check(next(step)) for _ in range(1 + REPEATS)][1:]  # after a warm-up
    return statistics.median(r.seconds - r.query_seconds for r in reports)


# -- the suite -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Path:
    """One timed path: ``run(device, size) -> seconds`` at ``size`` (counted in ``unit``);
    ``per`` says what one figure is of; above ``cpu_max`` the CPU figure is extrapolated."""

    name: str
    size: int
    unit: str
    run: Callable[[torch.device, int], float]
    per: str = "call"
    cpu_max: int | None = None


Sizer = Callable[[int, int], int]  # (size at scale 1, floor) -> size at the suite's scale


def estimator_paths(n: Sizer) -> list[Path]:
    at = partial(Path, size=n(10**6, 1_000), unit="scores")
    one, many = partial(estimate_seconds, dim=1), partial(estimate_seconds, dim=16)
    hist = partial(privmon.optimal_advantage, method="histogram")
    kde = partial(privmon.optimal_advantage, method="kde")
    return [
        at("`optimal_advantage`, histogram, 1-D", run=partial(one, call=hist)),
        at("`optimal_advantage`, kde, 1-D", run=partial(one, call=kde)),
        at("`analyse`, histogram + kde, 1-D",
           run=partial(one, call=privmon.analyse)),
        at("`optimal_advantage`, learned rule, 16-D",
           run=partial(many, call=hist), cpu_max=250_000),
        at("`analyse`, learned rule + KDE plug-in, 16-D",
           run=partial(many, call=privmon.analyse), cpu_max=25_000),
        at("`domias_scores`, KDE, 8-D", unit="records", run=domias_seconds, cpu_max=100_000),
    ]  # fmt: skip


def ensemble_paths(n: Sizer) -> list[Path]:
    records, epochs, per_record = n(10_000, 100), n(20, 2), n(10**6, 1_000)
    train = partial(train_ensemble_seconds, epochs=epochs)
    attack = partial(Path, size=per_record, unit="records", cpu_max=250_000)
    return [
        Path(f"`train_ensemble`, 64 MLPs, {epochs} epochs, batched products", records, "records",
             partial(train, layer_norm=False), cpu_max=2_500),
        Path(f"`train_ensemble`, 64 MLPs + LayerNorm, {epochs} epochs, vmap", records, "records",
             partial(train, layer_norm=True), cpu_max=2_500),
        Path("`Ensemble(x)`, 64 MLPs", n(200_000, 1_000), "records", ensemble_forward_seconds,
             cpu_max=50_000),
        attack("`attacks.lira`, online, 64 shadow models",
               run=partial(reference_attack_seconds, attack="lira")),
        attack("`attacks.rmia`, online, 64 reference models",
               run=partial(reference_attack_seconds, attack="rmia")),
    ]  # fmt: skip


def dp_paths(n: Sizer) -> list[Path]:
    batch, canaries = n(2_048, 16), n(10**6, 1_000)
    step = partial(dp_step_seconds, batch=batch)
    return [
        Path("Opacus DP-SGD step, nothing attached", batch, "records a step",
             partial(step, attach=ATTACH["bare"]), "step"),
        Path("… + `audit.MechanismChecks` (all checks)", batch, "records a step",
             partial(step, attach=ATTACH["checks"]), "step"),
        Path(f"… + `audit.GradientCanaries` (checks off), batch {batch:,}", canaries, "canaries",
             partial(step, attach=ATTACH["canaries"]), "step"),
        Path("`audit.one_run_epsilon`, fdp", canaries, "canaries",
             partial(one_run_seconds, method="fdp")),
        Path("`audit.one_run_epsilon`, steinke", canaries, "canaries",
             partial(one_run_seconds, method="steinke")),
    ]  # fmt: skip


def generative_paths(n: Sizer) -> list[Path]:
    vocab, images = n(50_257, 1_000), partial(Path, size=n(1_024, 4), unit="images", cpu_max=256)
    return [
        Path(f"`language_model_queries` (loss, min_k, min_k++), GPT-2 V = {vocab:,}", n(256, 2),
             "texts", partial(lm_seconds, vocab=vocab), cpu_max=64),
        images("`DiffusionQuery` loss, UNet2DModel",
               run=partial(diffusion_seconds, statistic="loss")),
        images("`DiffusionQuery` pia", run=partial(diffusion_seconds, statistic="pia")),
        images("`DiffusionQuery` secmi", run=partial(diffusion_seconds, statistic="secmi")),
        images("`DiffusionQuery` sima", run=partial(diffusion_seconds, statistic="sima")),
    ]  # fmt: skip


def monitor_paths(n: Sizer) -> list[Path]:
    records = n(10_000, 20)
    return [
        Path("training step, ResNet-8-like, 3×32×32", n(256, 8), "images a step",
             train_step_seconds, "step"),
        Path("`PrivacyMonitor.check`, `LossQuery` of that ResNet", records, "audit records",
             check_seconds, "check", cpu_max=2_500),
        Path("… of which not the forward passes", records, "audit records",
             partial(check_seconds, overhead=True), "check", cpu_max=2_500),
    ]  # fmt: skip


GROUPS = (estimator_paths, ensemble_paths, dp_paths, generative_paths, monitor_paths)


def suite(*, scale: float) -> list[Path]:
    """Every path at ``scale`` (1: the issue's sizes); each size keeps its floor."""

    def n(full: int, floor: int) -> int:
        return max(floor, round(full * scale))

    return [path for group in GROUPS for path in group(n)]


# -- cells: a figure, or why there is none ---------------------------------------------------
FailureKind = Literal["missing-extra", "out-of-memory", "timeout", "budget", "error"]


@dataclass(frozen=True)
class Measured:
    seconds: float
    estimated_from: tuple[int, int] | None = None  # (small, large) sizes of an extrapolation


@dataclass(frozen=True)
class Failed:
    failed: FailureKind
    reason: str


Cell = Measured | Failed


class CellTimeout(BaseException):
    """A cell ran past its cap (a BaseException: no library's ``except Exception`` keeps it)."""


@contextlib.contextmanager
def time_cap(seconds: float) -> Iterator[None]:
    """Raise CellTimeout in the main thread after ``seconds`` (SIGALRM)."""

    def expire(signum: int, frame: Any) -> None:
        raise CellTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def failure(err: BaseException, *, cap: float) -> Failed:
    if isinstance(err, CellTimeout):
        return Failed("timeout", f"past the cell's {cap:.0f} s cap")
    if isinstance(err, ModuleNotFoundError):
        module = (err.name or "").split(".")[0]
        extra = f" (pip install 'privmon[{EXTRAS[module]}]')" if module in EXTRAS else ""
        return Failed("missing-extra", f"needs {module}{extra}")
    if isinstance(err, torch.cuda.OutOfMemoryError | MemoryError) or "can't allocate" in str(err):
        return Failed("out-of-memory", type(err).__name__)
    first = (str(err).strip().splitlines() or [""])[0][:160]
    return Failed("error", f"{type(err).__name__}: {first}")


def measure(
    path: Path, device: torch.device, sizes: Sequence[int], *, cap: float, deadline: float
) -> tuple[float, ...] | Failed:
    """``path.run`` at each size, all within one cap, or the failure."""
    left = deadline - time.monotonic()
    if left < MIN_CELL_S:
        return Failed("budget", "the suite's time budget was spent before this cell")
    left = min(cap, left)
    try:
        with time_cap(left):
            return tuple(path.run(device, size) for size in sizes)
    except (Exception, CellTimeout) as err:
        return failure(err, cap=left)
    finally:
        gc.collect()
        gc.freeze()  # what survives stays: later collections need not walk it again
        if device.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()


def cell(path: Path, device: torch.device, *, cap: float, deadline: float) -> Cell:
    """The path's figure on ``device``; on the CPU above ``cpu_max``, the affine extrapolation
    from ``cpu_max`` and ``cpu_max // 4``."""
    if device.type != "cpu" or path.cpu_max is None or path.size <= path.cpu_max:
        got = measure(path, device, (path.size,), cap=cap, deadline=deadline)
        return got if isinstance(got, Failed) else Measured(got[0])
    large, small = path.cpu_max, path.cpu_max // 4
    got = measure(path, device, (large, small), cap=cap, deadline=deadline)
    if isinstance(got, Failed):
        return got
    slope = max((got[0] - got[1]) / (large - small), 0.0)
    return Measured(got[0] + slope * (path.size - large), estimated_from=(small, large))


# -- output ----------------------------------------------------------------------------------
Cells = dict[tuple[int, str], Cell]


def cell_text(got: Cell | None) -> str:
    if got is None:
        return "—"
    if isinstance(got, Failed):
        return got.failed
    text = f"{got.seconds:.0f}" if got.seconds >= 100 else f"{got.seconds:.3g}"
    return ("≈ " if got.estimated_from else "") + text


def speedup(cpu: Cell | None, cuda: Cell | None) -> float | None:
    if isinstance(cpu, Measured) and isinstance(cuda, Measured) and cuda.seconds > 0:
        return cpu.seconds / cuda.seconds
    return None


def notes(cpu: Cell | None, cuda: Cell | None) -> str:
    out = []
    if isinstance(cpu, Measured) and cpu.estimated_from:
        out.append("CPU ≈ affine from {:,} and {:,}".format(*cpu.estimated_from))
    out += [f"{label}: {got.reason}" for label, got in (("CUDA", cuda), ("CPU", cpu))
            if isinstance(got, Failed)]  # fmt: skip
    return "; ".join(out)


def table(paths: Sequence[Path], cells: Cells) -> list[str]:
    lines = [
        "| path | size | per | CPU s | CUDA s | speed-up | notes |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for i, path in enumerate(paths):
        cpu, cuda = cells.get((i, "cpu")), cells.get((i, "cuda"))
        ratio = speedup(cpu, cuda)
        lines.append(
            f"| {path.name} | {path.size:,} {path.unit} | {path.per} | {cell_text(cpu)} | "
            f"{cell_text(cuda)} | {'—' if ratio is None else f'{ratio:.1f}×'} | "
            f"{notes(cpu, cuda)} |"
        )
    return lines


def rows_json(paths: Sequence[Path], cells: Cells) -> list[dict[str, Any]]:
    def of(got: Cell | None) -> dict[str, Any] | None:
        return None if got is None else asdict(got)

    return [
        {"path": p.name, "size": p.size, "unit": p.unit, "per": p.per,
         "cpu": of(cells.get((i, "cpu"))), "cuda": of(cells.get((i, "cuda"))),
         "speedup": speedup(cells.get((i, "cpu")), cells.get((i, "cuda")))}
        for i, p in enumerate(paths)
    ]  # fmt: skip


def machine(devices: Sequence[torch.device]) -> dict[str, Any]:
    cpu = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), None)
    found = []
    for package in ("torch", "numpy", "scipy", "opacus", "transformers", "diffusers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{package} {metadata.version(package)}")
    info = {"cpu": cpu or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "versions": ", ".join(found)}  # fmt: skip
    if any(d.type == "cuda" for d in devices):
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return info


# -- main ------------------------------------------------------------------------------------
def run_suite(
    paths: Sequence[Path], devices: Sequence[torch.device], *, cap: float, budget: float
) -> Cells:
    """Every cell: the CUDA column first (the figures only a GPU gives), then the CPU's;
    progress on stderr."""
    deadline = time.monotonic() + budget
    cells: Cells = {}
    for device in sorted(devices, key=lambda d: d.type != "cuda"):
        for i, path in enumerate(paths):
            started = time.perf_counter()
            got = cells[i, device.type] = cell(path, device, cap=cap, deadline=deadline)
            detail = got.reason if isinstance(got, Failed) else notes(got, None)
            print(
                f"[{device.type} {i + 1}/{len(paths)}] {path.name} at {path.size:,}: "
                f"{cell_text(got)} {detail} ({time.perf_counter() - started:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    return cells


def devices_of(choice: str) -> list[torch.device]:
    if choice == "cpu":
        return [CPU]
    if not torch.cuda.is_available():
        if choice == "cuda":
            raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
        print("no CUDA device: only the CPU column runs", file=sys.stderr)
        return [CPU]
    return [torch.device("cuda")] if choice == "cuda" else [torch.device("cuda"), CPU]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "both"), default="both")
    parser.add_argument("--scale", type=float, default=1.0, help="size factor (1: the issue's)")
    parser.add_argument("--cap", type=float, default=45.0, help="seconds per cell at most")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the suite")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--only", help="comma-separated words: the paths whose name holds one")
    args = parser.parse_args(argv)
    if not args.scale > 0 or not args.cap > 0 or not args.budget > 0:
        parser.error("--scale, --cap and --budget must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    devices, paths = devices_of(args.device), suite(scale=args.scale)
    if args.only:
        words = [w.strip().lower() for w in args.only.split(",") if w.strip()]
        paths = [p for p in paths if any(w in p.name.lower() for w in words)]
    started = time.perf_counter()
    if any(d.type == "cuda" for d in devices):  # the context and cuBLAS's handle: not counted
        x = torch.ones(64, 64, device="cuda")
        (x @ x).sum().item()
    init = time.perf_counter() - started
    cells = run_suite(paths, devices, cap=args.cap, budget=args.budget)
    total, info = time.perf_counter() - started, machine(devices)
    print(", ".join(f"{k}: {v}" for k, v in info.items()) + f"; scale {args.scale:g}.\n")
    print("\n".join(table(paths, cells)))
    print(f"\nTotal {total:.0f} s, of which {init:.1f} s before the first cell.")
    if args.json:
        out = {"machine": info, "scale": args.scale, "seconds": total}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**out, "rows": rows_json(paths, cells)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
