"""The DP-SGD faults of ``benchmarks/dp_faults.py`` (issue #29): 13 faults users cause and 2
consistent changes that are no fault, each as hooks into the correct run (``dp_faults.Run``),
with the true ε of the mechanism that really ran (Opacus' PRV accountant, the one
``PrivacyEngine()`` uses; ∞ where none holds, NaN where unknown). ``FAULTS`` maps each key
(``--faults``) to its :class:`Fault`; a fault's docstring says how a user causes it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from dp_canaries import BATCH, DELTA, LR, N_TRAIN, SIGMA, with_noise_factor
from opacus.accountants import PRVAccountant
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from dp_faults import Run

Q = BATCH / N_TRAIN  # the sampling rate the accountant uses, for every canary kind
NON_DP_STEPS, VIEWS, WRONG_CLIP, UNDERCOUNT, CHANGED_CLIP, GRAD_SCALE = 100, 4, 10.0, 10.0, 0.5, 0.5


def accountant_epsilon(sigma: float, q: float, steps: int) -> float:
    """ε at δ of the subsampled Gaussian mechanism (σ, q, steps) by Opacus' PRV accountant, the
    one ``PrivacyEngine()`` uses: ∞ without noise."""
    if sigma <= 0:
        return math.inf
    accountant = PRVAccountant()
    accountant.history = [(sigma, q, steps)]
    with np.errstate(divide="ignore"):  # log(1 - q) at q = 1
        return float(accountant.get_epsilon(DELTA))


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
    loader = DataLoader(run.data[0], batch_size=BATCH, shuffle=True)  # the records, no slots
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
    its own ``DPDataLoader`` from a DataLoader with twice the batch size (120 of 600 records,
    q = 0.2) while the accountant's hook keeps q = 0.1."""

    def replace(run: Run) -> None:
        run.loader = DPDataLoader.from_data_loader(DataLoader(run.train, batch_size=2 * run.batch))

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
