"""Everything privmon reads of Opacus' optimizers, in one place, for the gradient canaries and
the mechanism checks: wrappers of a ``DPOptimizer`` instance's methods, which of privmon's
objects an optimizer carries, the Opacus optimizer families some of them cannot run on (by
class), what Opacus' accountant hook closes over (the accountant and its sampling rate), the
rows of a clipping call, ghost clipping's per-sample norms and clipping coefficients; AdaClip's
gradient noise multiplier and its noisy count of unclipped rows; under FSDP2, each rank's shard
of a DTensor, the summed gradients, the model's per-sample norms and each rank's share of the
noise. What a step keeps on the model for the training guard is
:mod:`~privmon.audit.opacus_per_sample`'s.

Checked against Opacus 1.6.0. One read has no public route there: ``make_private`` keeps the
accountant and the sampling rate only in the step hook's closure
(``accountant.get_optimizer_hook_fn(sample_rate=...)``). The LR schedulers bound to an optimizer
(torch's, not Opacus') are :mod:`~privmon.audit.lr_schedulers`'."""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from privmon._validation import check_unit
from privmon.audit.lr_schedulers import bound_schedulers

__all__ = [
    "ADACLIP",
    "CLIPS_IN_BACKWARD",
    "FSDP",
    "GHOST",
    "PER_LAYER",
    "PER_LAYER_DDP",
    "Hook",
    "OpacusFamily",
    "accountant_steps",
    "attached",
    "canary_sample_rate",
    "check_canary_optimizer",
    "check_dp_optimizer",
    "check_ghost_module",
    "claim",
    "ghost_coefficient",
    "ghost_rows",
    "gradient_noise_multiplier",
    "hook_accountant",
    "hook_sample_rate",
    "install",
    "kept_clipping_counts",
    "local",
    "noise_share",
    "noisy_count",
    "nonfinite_norm_row",
    "nonfinite_row",
    "opacus_family",
    "rank_and_world",
    "release",
    "rows_to_clip",
    "runs_with",
    "summed_grad",
    "uninstall",
]


@dataclass(frozen=True)
class OpacusFamily:
    """Opacus optimizer classes (names in ``opacus.optimizers``, most derived first) that one
    reason for a refusal covers, with their subclasses."""

    classes: tuple[str, ...]

    def matched(self, optimizer: Any) -> str | None:
        """The name of the first of the classes ``optimizer`` is an instance of, or None."""
        return _first_base(self.classes, cast(Hashable, type(optimizer)))


@functools.cache
def _first_base(classes: tuple[str, ...], kind: type) -> str | None:
    """The first of the Opacus optimizer ``classes`` that ``kind`` derives from, or None: asked
    several times a step, so kept per class."""
    try:
        from opacus import optimizers
    except ImportError:  # pragma: no cover - opacus is an optional dependency
        return None
    for name in classes:
        cls = getattr(optimizers, name, None)
        if isinstance(cls, type) and issubclass(kind, cls):
            return name
    return None


FSDP = OpacusFamily(("FSDPOptimizerFastGradientClipping",))
PER_LAYER_DDP = OpacusFamily(("SimpleDistributedPerLayerOptimizer",))
GHOST = OpacusFamily(
    ("DistributedDPOptimizerFastGradientClipping", "DPOptimizerFastGradientClipping")
)
PER_LAYER = OpacusFamily(("DPPerLayerOptimizer",))
ADACLIP = OpacusFamily(("AdaClipDPOptimizer",))
CLIPS_IN_BACKWARD = (GHOST, FSDP)
"""The families that clip in the loss's backward pass, in the model (ghost clipping)."""
# most derived first: an optimizer belongs to the first family it matches
_FAMILIES = (FSDP, PER_LAYER_DDP, GHOST, PER_LAYER, ADACLIP)
# How a user gets each family (None: flat clipping, DPOptimizer and DistributedDPOptimizer), in
# the order a refusal's advice lists where the refused part runs.
_HOW = {
    None: (
        "flat clipping (make_private(clipping='flat'), grad_sample_mode 'hooks', 'functorch', "
        "'ew' or 'no_op', on one process or under DDP: DistributedDPOptimizer)"
    ),
    PER_LAYER: "per-layer clipping on one process (clipping='per_layer')",
    ADACLIP: "adaptive clipping (clipping='adaptive')",
    GHOST: "ghost clipping (grad_sample_mode='ghost')",
    PER_LAYER_DDP: "per-layer clipping under DDP",
    FSDP: "FSDP (grad_sample_mode='ghost_fsdp')",
}
# the families whose step the gradient canaries cannot join as a record: why
_NO_CANARIES = {
    PER_LAYER_DDP: "per-layer clipping bounds each parameter separately",
    PER_LAYER: "per-layer clipping bounds each parameter separately",
    FSDP: "ghost clipping keeps no per-sample gradients",
    GHOST: "ghost clipping keeps no per-sample gradients",
    ADACLIP: "adaptive clipping changes the noise multiplier and the bound per step",
}


def runs_with(refused: Callable[[OpacusFamily | None], bool]) -> str:
    """Where a part runs, for a refusal's advice: how a user gets each Opacus family (None:
    flat clipping) that ``refused`` does not refuse, joined by "or"; "no configuration of
    Opacus" when it refuses them all."""
    places = [how for family, how in _HOW.items() if not refused(family)]
    return " or ".join(places) or "no configuration of Opacus"


def opacus_family(optimizer: Any) -> tuple[OpacusFamily, str] | None:
    """The family of ``optimizer`` and the Opacus class it matched, or None (flat clipping)."""
    for family in _FAMILIES:
        name = family.matched(optimizer)
        if name is not None:
            return family, name
    return None


def rows_to_clip(params: list[Any]) -> tuple[int, bool] | None:
    """The rows a clipping call is about to clip (those of the first parameter with per-sample
    gradients, a tensor or one per accumulated batch) and whether its summed gradient restarts
    (``summed_grad`` None); None when no parameter has per-sample gradients."""
    for p in params:
        samples = getattr(p, "grad_sample", None)
        if isinstance(samples, torch.Tensor):
            return len(samples), getattr(p, "summed_grad", None) is None
        if isinstance(samples, list):
            return sum(len(s) for s in samples), getattr(p, "summed_grad", None) is None
    return None


_WIDE = (torch.float32, torch.float64)  # sums in the dtype itself cannot overflow a correct one


def nonfinite_row(params: list[Any]) -> tuple[int | None, str] | None:
    """After a clipping call: None when every parameter's summed gradient is finite (one sum a
    tensor, in at least float32 so that a correct half-precision sum cannot overflow it, and
    one copy to the host); else the first row of the call's per-sample
    gradients (``grad_sample``, a tensor or one per accumulated batch, rows counted across them)
    that is not finite and whether it holds a NaN ("NaN") or only infinities ("inf") — the row
    None when every one is finite (the clipping itself made the sum non-finite)."""
    sums = [s for p in params if isinstance(s := getattr(p, "summed_grad", None), torch.Tensor)]
    if not sums:
        return None
    totals = [s.sum() if s.dtype in _WIDE else s.sum(dtype=torch.float32) for s in sums]
    stacked = torch.stack(totals)
    # a finite sum of the totals means each is finite (fewest operations: this runs at every
    # clipping call); a sum overflowing from finite totals is told apart
    if math.isfinite(float(stacked.sum())) or bool(stacked.isfinite().all()):
        return None
    rows: list[torch.Tensor] = []  # per row of the call: all entries finite, any entry NaN
    nans: list[torch.Tensor] = []
    for p in params:
        samples = getattr(p, "grad_sample", None)
        found = samples if isinstance(samples, list) else [samples]
        parts = [g.reshape(len(g), -1) for g in found if isinstance(g, torch.Tensor)]
        if parts and len(g := torch.cat(parts)) and g.shape[1]:
            rows.append(g.isfinite().all(dim=1))
            nans.append(g.isnan().any(dim=1))
    sizes = {len(r) for r in rows}
    if len(sizes) != 1:
        return None, "not finite"
    bad = torch.nonzero(~torch.stack(rows).all(dim=0)).flatten()
    if len(bad) == 0:
        return None, "not finite"
    slot = int(bad[0])
    return slot, "NaN" if bool(torch.stack(nans)[:, slot].any()) else "inf"


# Which of privmon's objects each optimizer carries: {"canaries": ..., "checks": ...}.
_CARRIED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


class Hook:
    """A wrapper that replaces one method of an Opacus optimizer instance: ``body(original,
    *args, **kwargs)`` runs in its place (recognisable, so that detaching can tell whether
    someone wrapped the method again since)."""

    def __init__(self, optimizer: Any, name: str, body: Callable[..., Any]) -> None:
        self.name = name
        self.previous = optimizer.__dict__.get(name)  # an instance-level wrapper, or None
        self.original = getattr(optimizer, name)
        self.body = body

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.body(self.original, *args, **kwargs)


def install(optimizer: Any, bodies: dict[str, Callable[..., Any]]) -> list[Hook]:
    """Wrap each named method of the optimizer instance with its body, in order."""
    hooks = [Hook(optimizer, name, body) for name, body in bodies.items()]
    for hook in hooks:
        setattr(optimizer, hook.name, hook)
    return hooks


def uninstall(optimizer: Any, hooks: list[Hook], owner: str) -> None:
    """Put back what :func:`install` replaced (RuntimeError, changing nothing, when one of the
    methods was wrapped again by someone else since)."""
    for hook in hooks:
        if optimizer.__dict__.get(hook.name) is not hook:
            raise RuntimeError(
                f"optimizer.{hook.name} was replaced after the {owner} were attached; restore "
                f"it before detaching the {owner}"
            )
    for hook in reversed(hooks):
        if hook.previous is None:
            delattr(optimizer, hook.name)
        else:
            setattr(optimizer, hook.name, hook.previous)


def attached(optimizer: Any, role: str) -> Any:
    """The object of this role ("canaries", "checks") the optimizer carries, or None."""
    return _CARRIED.get(optimizer, {}).get(role)


def claim(optimizer: Any, role: str, owner: Any) -> None:
    """Record that ``owner`` is the optimizer's object of this role."""
    _CARRIED.setdefault(optimizer, {})[role] = owner


def release(optimizer: Any, role: str) -> None:
    """Forget the optimizer's object of this role."""
    _CARRIED.get(optimizer, {}).pop(role, None)


def check_dp_optimizer(optimizer: Any, *, who: str) -> Any:
    """``optimizer`` if it is an Opacus ``DPOptimizer`` (TypeError otherwise; ``who`` needs
    it) whose parameters hold values (ValueError for one on the meta device: ``who`` reads
    the gradients, the noise and the weights of every step)."""
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError:  # pragma: no cover - opacus is an optional dependency
        raise TypeError(
            f"optimizer must be an Opacus DPOptimizer for {who}, and opacus is not installed "
            "(pip install 'privmon[dp]')"
        ) from None
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            "optimizer must be an Opacus DPOptimizer (the optimizer PrivacyEngine.make_private "
            f"returns), got {type(optimizer).__name__}"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        if p.is_meta:
            raise ValueError(
                f"optimizer's parameter {i} (shape {tuple(p.shape)}) is on the meta device, which "
                f"holds no values for {who} to read (each step's gradients, noise and weights). "
                "Give the model real weights before make_private (e.g. "
                "model.to_empty(device='cpu'), then load_state_dict)"
            )
    return optimizer


def _free_variable(optimizer: Any, name: str) -> Any:
    """The value of a free variable of the optimizer's step hook (Opacus' ``make_private``
    attaches ``accountant.get_optimizer_hook_fn(sample_rate=...)``, a closure over the
    accountant ``self`` and ``sample_rate``), or None."""
    hook = getattr(optimizer, "step_hook", None)
    code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None)
    if code is None or not cells or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def hook_sample_rate(optimizer: Any) -> float | None:
    """The sampling rate Opacus' accountant hook was built with, or None when the optimizer
    carries no such hook."""
    rate = _free_variable(optimizer, "sample_rate")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= 1:
        return None
    return float(rate)


def hook_accountant(optimizer: Any) -> Any:
    """The accountant the optimizer's step hook counts steps with (an Opacus accountant: it has
    a ``history``), or None."""
    owner = _free_variable(optimizer, "self")
    return owner if accountant_steps(owner) is not None else None


def accountant_steps(accountant: Any) -> int | None:
    """Steps an Opacus accountant (or a ``PrivacyEngine``'s) counted: the sum of ``num_steps``
    over its ``history`` of ``(noise_multiplier, sample_rate, num_steps)``; None when
    ``accountant`` is neither."""
    accountant = getattr(accountant, "accountant", accountant)  # a PrivacyEngine's
    history = getattr(accountant, "history", None)
    if not isinstance(history, list):
        return None
    try:
        return int(sum(int(entry[2]) for entry in history))
    except (TypeError, IndexError, ValueError):
        return None


def rank_and_world(optimizer: Any) -> tuple[int, int]:
    """(rank, world size) of a distributed Opacus optimizer (it adds the noise on rank 0 and
    sums over the ranks); (0, 1) for one process."""
    rank, world = getattr(optimizer, "rank", 0), getattr(optimizer, "world_size", 1)
    if not isinstance(rank, int) or not isinstance(world, int) or world < 1:
        return 0, 1
    return rank, world


def local(tensor: Any) -> Any:
    """This rank's shard of a DTensor (FSDP2's parameters and gradients: ``to_local``, no copy,
    no collective); anything else as it is (no DTensor exists before its module is loaded)."""
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def summed_grad(optimizer: Any, p: Any) -> torch.Tensor | None:
    """This rank's part of the summed (clipped) gradient of ``p``: Opacus keeps it in
    ``p.summed_grad``, FSDP's optimizer in ``grad_state[p]["summed_grad"]`` (a DTensor); None
    while the sum is empty."""
    if FSDP.matched(optimizer) is not None:
        summed = optimizer.grad_state[p]["summed_grad"]
    else:
        summed = getattr(p, "summed_grad", None)
    return None if summed is None else local(summed)


def noise_share(optimizer: Any) -> float:
    """The share of σ C in the noise ``add_noise`` puts on each entry of the summed gradient:
    1 / world size under FSDP with mean reduction (each rank noises its shard of the average
    over the ranks), else 1."""
    if FSDP.matched(optimizer) is None or optimizer.loss_reduction != "mean":
        return 1.0
    return 1.0 / rank_and_world(optimizer)[1]


def check_canary_optimizer(
    optimizer: Any, checks: tuple[str, ...], *, runnable: tuple[str, ...]
) -> Any:
    """``optimizer`` if GradientCanaries (with mechanism ``checks``) can join it: an Opacus
    flat-clipping ``DPOptimizer`` carrying no canaries, no other checks and no LR scheduler.
    ``runnable``: the mechanism checks that run on it, which a refusal names."""
    check_dp_optimizer(optimizer, who="GradientCanaries")
    found = opacus_family(optimizer)
    if found is not None and found[0] in _NO_CANARIES:
        family, name = found
        here = "No mechanism check runs on it either"
        if runnable:
            here = f"On it MechanismChecks(optimizer, checks={runnable!r}) runs"
        raise ValueError(
            f"optimizer is an Opacus {name}, which GradientCanaries do not support: "
            f"{_NO_CANARIES[family]}. GradientCanaries run with "
            f"{runs_with(lambda f: f in _NO_CANARIES)}. {here}."
        )
    if attached(optimizer, "canaries") is not None:
        raise ValueError(
            "optimizer already carries GradientCanaries: detach() them before attaching others"
        )
    if checks and attached(optimizer, "checks") is not None:
        raise ValueError(
            "optimizer already carries mechanism checks (a MechanismChecks): detach() them, or "
            "pass checks=() to these canaries"
        )
    schedulers = bound_schedulers(optimizer)
    if schedulers:
        raise ValueError(
            f"optimizer already has an LR scheduler ({', '.join(schedulers)}): a scheduler made "
            "before the GradientCanaries does not know the canary block's param group (it "
            "fails at its first step, or schedules the block wrongly); create the "
            "GradientCanaries before the scheduler"
        )
    return optimizer


def canary_sample_rate(sample_rate: Any, optimizer: Any) -> float:
    """The canaries' sampling rate: ``sample_rate`` in (0, 1], or the accountant hook's (which
    a given rate must equal)."""
    hooked = hook_sample_rate(optimizer)
    if sample_rate is None:
        if hooked is None:
            raise ValueError(
                "sample_rate: the optimizer carries no Opacus accountant hook to read its "
                "sampling rate from (it was not made by PrivacyEngine.make_private); pass "
                "sample_rate=, the probability that a record is in a batch, in (0, 1]"
            )
        return hooked
    rate = check_unit(sample_rate, name="sample_rate")
    if rate == 0:
        raise ValueError("sample_rate must be in the interval (0, 1], got 0")
    if hooked is not None and not np.isclose(rate, hooked, rtol=1e-9, atol=0):
        raise ValueError(
            f"sample_rate={rate!r} differs from the rate the optimizer's accountant uses "
            f"({hooked!r}): canaries must be sampled like records; leave sample_rate=None"
        )
    return rate


def check_ghost_module(module: Any, optimizer: Any) -> Any:
    """``module`` if it is the model whose backward pass clips for the ghost-clipping
    ``optimizer``: the ``GradSampleModuleFastGradientClipping`` (``...FSDP`` under FSDP) that
    ``make_private`` returns with ``grad_sample_mode="ghost"`` (``"ghost_fsdp"``), whose
    trainable parameters the optimizer steps."""
    from opacus import grad_sample  # the optimizer's

    fsdp = FSDP.matched(optimizer) is not None
    kind = grad_sample.GradSampleModuleFastGradientClipping.__name__ + ("FSDP" if fsdp else "")
    if not isinstance(module, getattr(grad_sample, kind)):
        raise TypeError(
            f"module must be the {kind} that make_private returned with grad_sample_mode="
            f"{'ghost_fsdp' if fsdp else 'ghost'!r}, got {type(module).__name__}"
        )
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not all(id(p) in stepped for p in module.trainable_parameters):
        raise ValueError(
            "module's trainable parameters are not all the optimizer's: pass the model "
            "make_private returned together with this optimizer"
        )
    return module


def _norm_owners(module: Any) -> list[Any]:
    """Under FSDP, the submodules that keep per-sample gradient norms (``norm_sample``, one per
    trainable parameter, of the whole parameter and this rank's batch), as the model's
    ``get_norm_sample`` reads them; [] for any other model (or None)."""
    walk, inner = getattr(module, "iterate_submodules", None), getattr(module, "_module", None)
    found = walk(inner) if callable(walk) and inner is not None else ()
    return [m for m in found if isinstance(getattr(m, "norm_sample", None), list)]


def _norms(params: list[Any], module: Any) -> list[torch.Tensor]:
    """The last backward pass's per-sample gradient norms: each parameter's ``_norm_sample``
    (ghost clipping), or those of ``module``'s submodules (FSDP)."""
    found = [n for p in params if isinstance(n := getattr(p, "_norm_sample", None), torch.Tensor)]
    return found or [n for m in _norm_owners(module) for n in m.norm_sample]


def ghost_rows(optimizer: Any, params: list[Any], module: Any) -> tuple[int, bool] | None:
    """Under ghost clipping: the rows whose per-sample gradient norms the step's backward pass
    computed (of ``module``'s submodules under FSDP) and whether the summed gradient restarts
    (it is None); None when there are no norms."""
    norms = _norms(params, module)
    if not norms or not params:
        return None
    return len(norms[0]), summed_grad(optimizer, params[0]) is None


def nonfinite_norm_row(
    optimizer: Any, params: list[Any], module: Any
) -> tuple[int | None, str] | None:
    """Under ghost clipping (which keeps per-sample norms, no per-sample gradients): None when
    every summed gradient (this rank's shard of it under FSDP) is finite; else the first row of
    the batch whose per-sample gradient norm is not finite and whether it is NaN or inf — the
    row None when every norm is finite (the clipping, or under FSDP another rank's record, made
    the sum so)."""
    sums = [s for p in params if (s := summed_grad(optimizer, p)) is not None and s.numel()]
    totals = [s.sum(dtype=torch.promote_types(s.dtype, torch.float32)) for s in sums]
    if not sums or bool(torch.stack(totals).isfinite().all()):
        return None
    norms = [n.reshape(len(n), -1) for n in _norms(params, module)]
    rows = torch.cat(norms, dim=1) if norms and len({len(n) for n in norms}) == 1 else None
    bad = [] if rows is None else torch.nonzero(~rows.isfinite().all(dim=1)).flatten().tolist()
    if rows is None or not bad:
        return None, "not finite"
    return bad[0], "NaN" if bool(rows[bad[0]].isnan().any()) else "inf"


@contextlib.contextmanager
def _probe_norms(module: Any, share: float) -> Iterator[None]:
    """Within the block one row of per-sample gradient norm ``share`` on each trainable
    parameter is the model's last backward pass (each parameter's ``_norm_sample``, or under
    FSDP its submodules' ``norm_sample``); what was there is put back after."""
    owners = _norm_owners(module)
    params = [] if owners else list(module.trainable_parameters)
    kept = [(m, m.norm_sample) for m in owners]
    saved = [(p, p.__dict__.get("_norm_sample", _ABSENT)) for p in params]
    norms = module.__dict__.get("_per_sample_gradient_norms")
    try:
        for m, slots in kept:
            m.norm_sample = [torch.full((1,), share, dtype=n.dtype, device=n.device) for n in slots]
        for p in params:
            p._norm_sample = torch.full((1,), share, dtype=p.dtype, device=p.device)
        yield
    finally:
        for m, slots in kept:
            m.norm_sample = slots
        for p, value in saved:
            if value is _ABSENT:
                p.__dict__.pop("_norm_sample", None)
            else:
                p._norm_sample = value
        module._per_sample_gradient_norms = norms


def ghost_coefficient(module: Any, share: float) -> float:
    """The clipping coefficient ghost clipping's ``module.get_clipping_coef()`` gives one row
    whose per-sample gradient norm on each trainable parameter is ``share`` (the norms put back
    after). Under FSDP it reads this rank's norms alone: no collective."""
    with _probe_norms(module, share):
        return float(module.get_clipping_coef().reshape(-1)[0])


_ABSENT = object()


def gradient_noise_multiplier(optimizer: Any) -> float:
    """The multiplier of C in the standard deviation of the noise the optimizer adds to the
    summed gradient: ``noise_multiplier``, or under AdaClip the part the noisy count leaves,
    σ_g = (σ⁻² − (2 σ_u)⁻²)^(−1/2) (Andrew et al., "Differentially Private Learning with
    Adaptive Clipping", Theorem 1: what ``AdaClipDPOptimizer.add_noise`` adds)."""
    sigma = float(optimizer.noise_multiplier)
    if ADACLIP.matched(optimizer) is None or sigma <= 0:
        return sigma
    return float((sigma**-2 - (2 * float(optimizer.unclipped_num_std)) ** -2) ** -0.5)


def noisy_count(optimizer: Any) -> tuple[float, float] | None:
    """Under AdaClip: (the count of unclipped rows as it stands, the standard deviation σ_u of
    the noise ``add_noise`` adds to it); None for other optimizers."""
    if ADACLIP.matched(optimizer) is None:
        return None
    return float(optimizer.unclipped_num), float(optimizer.unclipped_num_std)


@contextlib.contextmanager
def kept_clipping_counts(optimizer: Any) -> Iterator[None]:
    """Within the block AdaClip's counts of clipped rows (``sample_size``, ``unclipped_num``,
    which its ``clip_and_accumulate`` advances, a tensor in place) may change: they are put
    back after, so a probe of that call leaves the next bound as training would have it."""
    saved = {
        name: value.clone() if isinstance(value, torch.Tensor) else value
        for name, value in optimizer.__dict__.items()
        if name in ("sample_size", "unclipped_num")
    }
    try:
        yield
    finally:
        optimizer.__dict__.update(saved)
