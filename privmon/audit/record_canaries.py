"""Record canaries: an end-to-end one-run audit of DP-SGD whose canaries are dataset slots that
ride the real DP data loader, the real per-sample clipping, the real noise and the real update.
:class:`RecordCanaries` makes the slots (:meth:`RecordCanaries.dataset`), the model wrapper that
routes each slot to its own coordinate of a dedicated block (:meth:`RecordCanaries.model`), and
scores the block (higher = included) for :func:`privmon.audit.one_run_epsilon`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from privmon._digest import check_sealed, sealed
from privmon._validation import check_int, check_module
from privmon.audit.one_run import inclusion_bits

__all__ = ["RecordCanaries", "RecordCanaryDataset", "RecordCanaryModel"]

GRADIENT_NORM = 1e6
"""The norm of an included canary's per-sample gradient under ``loss_reduction="sum"`` (times the
batch size under ``"mean"``, as Opacus scales it): far above any clipping bound, so that clipping
bounds it to C."""


_SILENT = (
    "record canaries: a canary row's loss has zero gradient at the slot rows' zero output, so a "
    "second backward (ghost clipping's) cannot tell its clip factor: it contributes nothing. "
    "Pass RecordCanaries.dataset(template=...) a target whose loss gradient at 0 is not zero"
)


class _Push(torch.autograd.Function):
    """The block's output for slot rows: zeros forward (the output does not depend on the block or
    the model); backward, a fixed gradient ``push`` per row, whatever the loss. A second backward
    through the same graph scales each row's push by how much that row's upstream gradient
    scaled since the first (ghost clipping's second pass reweights each row's loss by its clip
    factor: the canary is then clipped like a record)."""

    @staticmethod
    def forward(ctx: Any, routed: torch.Tensor, push: torch.Tensor, shape: Any, dtype: Any) -> Any:
        ctx.save_for_backward(push)
        return routed.new_zeros(shape, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (push,) = ctx.saved_tensors
        size = grad.reshape(len(grad), math.prod(grad.shape[1:])).norm(dim=1).to(push.dtype)
        first = getattr(ctx, "first", None)
        if first is None:
            ctx.first = size
            return push[:, None], None, None, None
        if bool(((first == 0) & (push != 0)).any()):
            warnings.warn(_SILENT, RuntimeWarning, stacklevel=2)
        ratio = torch.where(first > 0, size / first, 0.0)
        return (push * ratio)[:, None], None, None, None


def _zero(value: Any) -> Any:
    """A zero of ``value``'s type and shape (tensors, arrays, numbers); other values as they are."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, np.ndarray):
        return np.zeros_like(value)
    if isinstance(value, bool | int | float | np.number):
        return type(value)(0)
    return value


def _record(item: Any, index: int) -> tuple[Any, ...]:
    if not isinstance(item, tuple | list) or len(item) < 2:
        raise TypeError(
            "records must yield (input, target, ...) tuples: the input is what the model takes, "
            f"the rest is what the loss takes; record {index} is a {type(item).__name__}"
        )
    return tuple(item)


class RecordCanaryDataset(Dataset[tuple[Any, ...]]):
    """The training records followed by the canary slots (made by
    :meth:`RecordCanaries.dataset`). Record i yields ``((x_i, -1), *rest_i)``; slot j yields
    ``((x_template, j), *rest_template)``; the slot numbers are int64 scalars, so the default
    collation gives the model ``(x, slots)`` with ``slots`` an int64 vector (-1 for a record)."""

    def __init__(self, records: Any, n_canaries: int, template: Any) -> None:
        self.records = records
        self.n_records = len(records)
        self.n_canaries = n_canaries
        first, *rest = _record(template, 0)
        self._template = (first, tuple(rest))

    def __len__(self) -> int:
        return self.n_records + self.n_canaries

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} slots")
        if index < self.n_records:
            first, *rest = _record(self.records[index], index)
            return ((first, torch.tensor(-1)), *rest)
        template, others = self._template
        return ((template, torch.tensor(index - self.n_records)), *others)


def _slotted(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, torch.Tensor] | None:
    """(inputs, slots) when the call is one ``(inputs, slots)`` pair with ``slots`` a 1-d int64
    tensor (a batch of :class:`RecordCanaryDataset` items), else None."""
    if len(args) != 1 or kwargs or not isinstance(args[0], tuple | list) or len(args[0]) != 2:
        return None
    inputs, slots = args[0]
    if isinstance(slots, torch.Tensor) and slots.dtype == torch.int64 and slots.ndim == 1:
        return inputs, slots
    return None


class RecordCanaryModel(nn.Module):
    """The model with the canaries' block (made by :meth:`RecordCanaries.model`).

    On a batch ``(x, slots)`` of :class:`RecordCanaryDataset` items it returns the model's output
    on the records' rows (``slots == -1``) and, on slot rows, zeros that depend on neither the
    model nor the block (``torch.where``: the model's per-sample gradient of a slot row is exactly
    0); the block, ``nn.Linear(n_canaries, 1, bias=False)`` applied to the one-hot of the slot,
    receives through a custom autograd function a fixed gradient of :data:`GRADIENT_NORM` on an
    included canary's row and 0 on a filler's, whatever the loss (a second backward through the
    same graph, ghost clipping's, scales each row's by how much its loss gradient was scaled).
    Any other call is the model's own (``wrapper(x)`` equals ``model(x)`` bit for bit), so
    queries on the wrapper keep working.

    Attributes:
        model: the user's model.
        block: the canaries' block; its weight (1, n_canaries) starts at zero."""

    def __init__(self, model: nn.Module, push: torch.Tensor, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.block = nn.Linear(len(push), 1, bias=False, device=device, dtype=torch.float32)
        nn.init.zeros_(self.block.weight)
        self.register_buffer("push", push.to(device), persistent=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output; on a batch of slots, zeros on the slot rows (see the class)."""
        slotted = _slotted(args, kwargs)
        if slotted is None:
            return self.model(*args, **kwargs)
        inputs, slots = slotted
        out = self.model(inputs)
        if not isinstance(out, torch.Tensor) or out.ndim == 0 or len(out) != len(slots):
            raise ValueError(
                "record canaries need a model whose output is one tensor with a row per input "
                f"row: got {type(out).__name__} for {len(slots)} rows"
            )
        weight = self.block.weight
        slots = slots.to(weight.device)
        canary = slots >= 0
        onehot = (slots[:, None] == torch.arange(weight.shape[1], device=weight.device)).to(
            weight.dtype
        )
        push = torch.where(canary, cast(torch.Tensor, self.push)[slots.clamp(min=0)], 0.0)
        zeros = _Push.apply(self.block(onehot), push, out.shape, out.dtype).to(out.device)
        rows = canary.to(out.device).reshape((len(slots),) + (1,) * (out.ndim - 1))
        return torch.where(rows, zeros, out)


class RecordCanaries:
    """Record canaries: a one-run audit of DP-SGD end to end, through the real DP loader.

    Each canary is a slot of the training dataset (:meth:`dataset`: the N records, then m slots)
    that the DP data loader samples like a record, so the accountant's N and q count the slots:
    the dataset has N + m items and ``make_private`` sets q = 1 / len(loader) ≈ batch / (N + m).
    To keep the q of N records take the batch size q · (N + m), and under
    ``loss_reduction="mean"`` (Opacus divides by the expected batch, now q · (N + m)) the SGD
    learning rate × (N + m) / N: the model then trains as without canaries, in distribution.

    The wrapper of :meth:`model` routes slot j to coordinate j of a dedicated block: an included
    canary's per-sample gradient is :data:`GRADIENT_NORM` on that coordinate (× B under
    ``"mean"``, as Opacus scales it) and exactly zero on the model's weights, so the optimizer's
    own clipping bounds it to C; the excluded half (seeded fair coins, :attr:`included`, the same
    bits as :class:`~privmon.audit.GradientCanaries` with the same seed) are fillers, zero
    everywhere, so N and the sampling do not depend on which canaries are included. The canaries
    pass through the loader's sampling, the clipping, the noise and the update rule a record
    does; :meth:`scores` gives each coordinate's total update θ_0 − θ_T (higher = included) for
    :func:`privmon.audit.one_run_epsilon`. An audited ε above the accountant's means the
    mechanism that ran is not the one accounted: noise missing, clipping skipped or at a larger
    bound, a record stacked as several rows, the DP loader replaced.

    Cost: the block's per-sample gradients are B × m entries per step (B rows in the batch), its
    one-hot activations as many: 1e3 canaries at B = 160 are 1.3 MB, 1e5 are 128 MB. What they
    cannot see: they ride the loader, so a sampling fault (a wrong rate, fixed batches) shows
    only through the ε it costs; a fault in a model layer's per-sample norm (their gradient lies
    in the block), updates outside the DP optimizer, lost accountant steps and repeated noise
    are the mechanism checks'. Supported: Opacus ``make_private`` with flat clipping,
    ``grad_sample_mode`` ``"hooks"``, ``"functorch"`` or ``"ghost"`` (ghost clipping clips in a
    second, reweighted backward: a slot row's loss must have a non-zero gradient at its zero
    output, as cross-entropy always has; a warning says when not), ``loss_reduction`` ``"mean"``
    or ``"sum"``, records ``(input, target, ...)``, a model with one output tensor. Opacus 1.6
    fails on an empty *first* Poisson batch of nested records (probability (1 − q)^(N + m));
    later empty batches are fine. The wrapper reads a call ``wrapper((x, s))`` with ``s`` a 1-d
    int64 tensor as a batch of slots.

    Args:
        n_canaries: number of canary slots m (>= 2).
        seed: seeds the inclusion bits (>= 0); a draw that includes all or none of the
            canaries (probability 2^(1-m)) is refused: take another seed or more canaries.

    Examples:
        >>> import torch
        >>> from opacus import PrivacyEngine
        >>> from privmon.audit import RecordCanaries, one_run_epsilon
        >>> _ = torch.manual_seed(0)
        >>> data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        >>> canaries = RecordCanaries(200, seed=0)
        >>> train = canaries.dataset(data)  # 64 records, then 200 canary slots
        >>> net = torch.nn.Linear(4, 2)
        >>> model = canaries.model(net)
        >>> engine = PrivacyEngine()
        >>> model, optimizer, loader = engine.make_private(
        ...     module=model,
        ...     optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ...     data_loader=torch.utils.data.DataLoader(train, batch_size=66),  # q = 66 / 264
        ...     noise_multiplier=1.0,
        ...     max_grad_norm=1.0,
        ... )
        >>> for inputs, y in loader:  # one epoch: 4 steps; inputs = (x, slots)
        ...     optimizer.zero_grad()
        ...     torch.nn.functional.cross_entropy(model(inputs), y).backward()
        ...     optimizer.step()
        >>> in_scores, out_scores = canaries.scores()
        >>> len(train), len(in_scores) + len(out_scores)
        (264, 200)
        >>> audit = one_run_epsilon(in_scores, out_scores, delta=1e-5)
        >>> bool(audit.epsilon <= engine.get_epsilon(delta=1e-5))  # the accountant's ε holds
        True
        >>> x = data.tensors[0]
        >>> torch.equal(model(x), net(x))  # on a plain input, the model itself
        True
    """

    def __init__(self, n_canaries: int, *, seed: int = 0) -> None:
        self._n = check_int(n_canaries, name="n_canaries", minimum=2)
        self._seed = check_int(seed, name="seed", minimum=0)
        self._included, _ = inclusion_bits(self._n, seed=self._seed)  # no side empty
        self._wrapper: RecordCanaryModel | None = None
        self._pending: torch.Tensor | None = None  # values loaded before model()

    def dataset(
        self, records: Dataset[Any] | Sequence[Any], *, template: Any = None
    ) -> RecordCanaryDataset:
        """The training records followed by the m canary slots (N + m items), for the DP loader.

        Args:
            records: a map-style dataset (``len`` and integer indexing) of ``(input, target,
                ...)`` items.
            template: the item whose values every slot carries (the model runs on its input,
                the output is discarded); default zeros shaped like record 0's values.

        Raises:
            TypeError: ``records`` is not map-style, or its items are not ``(input, target,
                ...)`` tuples.
        """
        if not hasattr(records, "__getitem__") or not hasattr(records, "__len__"):
            raise TypeError(
                "records must be a map-style dataset (len() and integer indexing), got "
                f"{type(records).__name__}"
            )
        if template is None:
            if len(records) == 0:
                raise ValueError("records is empty: pass template= for the slots' values")
            template = tuple(_zero(v) for v in _record(records[0], 0))
        return RecordCanaryDataset(records, self._n, template)

    def model(self, model: nn.Module) -> RecordCanaryModel:
        """The model wrapped with the canaries' block (on the model's device), to make private in
        its place; the optimizer must take the wrapper's parameters. A later call wraps anew and
        :meth:`scores` reads the newest block."""
        check_module(model, name="model")
        tensors = [*model.parameters(), *model.buffers()]
        device = tensors[0].device if tensors else torch.device("cpu")
        push = torch.from_numpy(self._included.astype(np.float32)) * GRADIENT_NORM
        self._wrapper = RecordCanaryModel(model, push, device)
        if self._pending is not None:
            with torch.no_grad():
                self._wrapper.block.weight[0].copy_(self._pending)
            self._pending = None
        return self._wrapper

    def _values(self) -> torch.Tensor:
        """The block now, float64 on the CPU."""
        if self._wrapper is None:
            if self._pending is not None:
                return self._pending.clone()
            raise RuntimeError("the canaries have no block yet: call model() first")
        return self._wrapper.block.weight.detach()[0].to("cpu", torch.float64).clone()

    def scores(self) -> tuple[np.ndarray, np.ndarray]:
        """(in_scores, out_scores): θ_0 − θ_T along each canary's coordinate of the block (higher
        = included), for the included and the excluded canaries, each in canary order, float64.

        Raises:
            RuntimeError: :meth:`model` was never called.
        """
        score = -self._values().numpy()  # θ_0 = 0
        return score[self._included], score[~self._included]

    @property
    def included(self) -> np.ndarray:
        """Which canaries are included (bool, shape (n_canaries,); fair coins drawn from the
        seed); the others' slots are fillers."""
        return self._included.copy()

    @property
    def n_canaries(self) -> int:
        """Number of canary slots m."""
        return self._n

    def state_dict(self) -> dict[str, Any]:
        """The configuration (n, seed, inclusion bits) and the block's values (also in the
        model's own ``state_dict``), CPU tensors, sealed with the digest of all of it."""
        return sealed(
            {
                "n_canaries": self._n,
                "seed": self._seed,
                "included": torch.from_numpy(self._included.copy()),
                "values": self._values(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the block's values (kept until :meth:`model` when no
        block exists yet).

        Raises:
            ValueError: ``state`` is damaged (its content no longer matches its digest) or
                carries no digest, lacks a field, or was saved by canaries of another
                configuration (the message names the first field that differs).
        """
        check_sealed(state, what="RecordCanaries state")
        fields = ("n_canaries", "seed", "included", "values")
        missing = [k for k in fields if k not in state]
        if missing:
            raise ValueError(f"state is not a RecordCanaries state_dict: it lacks {missing}")
        for key, mine in (("n_canaries", self._n), ("seed", self._seed)):
            if state[key] != mine:
                raise ValueError(
                    f"state was saved by canaries with {key}={state[key]!r}; these have "
                    f"{key}={mine!r}"
                )
        if not np.array_equal(np.asarray(state["included"]), self._included):
            raise ValueError("state's included bits differ from these canaries'")
        values = torch.as_tensor(state["values"]).to(torch.float64)
        if values.shape != (self._n,):
            raise ValueError(f"state's values must have shape ({self._n},)")
        if self._wrapper is None:
            self._pending = values.clone()
            return
        with torch.no_grad():
            self._wrapper.block.weight[0].copy_(values)
