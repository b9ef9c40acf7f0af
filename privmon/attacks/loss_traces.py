"""Per-record loss traces kept while a model trains, in bounded memory, and LT-IQR.

Pollock, Shilov, Dodd and de Montjoye, "Free Record-Level Privacy Risk Evaluation Through
Artifact-Based Methods" (LT-IQR): the interquartile range Q3 − Q1 of a record's per-sample
training losses over the training run ranks the records most vulnerable to LiRA (the ones it
identifies confidently and correctly at FPR 1e-3) without any reference model. The losses are
those the training loop already computes for the records of each batch: :class:`LossTraces`
takes them (no extra forward), :func:`lt_iqr` scores the records from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from privmon._shown import shown
from privmon._validation import as_tensor, check_fraction, check_int, check_unit

__all__ = ["LossTraces", "LtIqr", "checked_batch", "lt_iqr"]

_VERSION = 1
_KEYS = ("version", "n_records", "records", "stride", "steps", "dropped", "sums", "counts")
_QUANTILE_LIMIT = 1 << 24  # torch.quantile's largest input


def _check_slots(slots: Any) -> int:
    """An even number of slots >= 4 (the thinning merges neighbouring pairs); kept here, the
    one check of its kind."""
    s = check_int(slots, name="slots", minimum=4)
    if s % 2:
        raise ValueError(f"slots must be an even integer >= 4, got {s}")
    return s


def _tracked(records: Any, n_records: int) -> torch.Tensor | None:
    """The tracked records as distinct sorted int64 indices, None for all of them."""
    if records is None:
        return None
    r = as_tensor(records, name="records", what="a 1-D sequence of record indices")
    if r.ndim != 1 or r.numel() == 0 or r.is_floating_point() or r.dtype == torch.bool:
        raise ValueError(
            f"records must be a non-empty 1-D sequence of integer indices, got shape "
            f"{tuple(r.shape)} and dtype {r.dtype}"
        )
    r = r.to("cpu", torch.int64)
    if bool(((r < 0) | (r >= n_records)).any()):
        raise ValueError(f"records must be indices in [0, {n_records - 1}]")
    if torch.unique(r).numel() != r.numel():
        raise ValueError("records must not repeat an index")
    return torch.sort(r).values


def checked_batch(indices: Any, losses: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``indices`` and ``losses`` as tensors (of their own dtype and device) after the checks
    that compute nothing: 1-D, integer indices, float losses, one loss per index. The indices'
    range is checked when they are added (:meth:`LossTraces.update`).

    Raises:
        ValueError naming the argument.

    Examples:
        >>> import torch
        >>> from privmon.attacks.loss_traces import checked_batch
        >>> idx, loss = checked_batch([3, 1], torch.tensor([0.5, 2.0]))
        >>> idx.tolist(), loss.dtype
        ([3, 1], torch.float32)
    """
    loss = (
        losses
        if isinstance(losses, torch.Tensor)
        else as_tensor(losses, name="losses", what="a 1-D array of per-sample losses")
    )
    idx = (
        indices
        if isinstance(indices, torch.Tensor)
        else as_tensor(indices, name="indices", what="a 1-D array of record indices")
    )
    if loss.ndim != 1 or not loss.is_floating_point():
        raise ValueError(
            f"losses must be a 1-D float array of per-sample losses, got shape "
            f"{tuple(loss.shape)} and dtype {loss.dtype}"
        )
    if idx.ndim != 1 or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise ValueError(
            f"indices must be a 1-D integer array, got shape {tuple(idx.shape)} and dtype "
            f"{idx.dtype}"
        )
    if idx.shape != loss.shape:
        raise ValueError(
            f"indices and losses must have the same length, got {idx.shape[0]} and {loss.shape[0]}"
        )
    return idx, loss


def _coarsened(values: torch.Tensor) -> torch.Tensor:
    """``values`` (m, slots) with neighbouring slots summed into the first half, the second
    half zero: the same trace at twice the stride."""
    halved = values[:, 0::2] + values[:, 1::2]  # strided adds: a sum over pairs is slower
    return torch.cat([halved, torch.zeros_like(halved)], dim=1)


class LossTraces:
    """Every tracked record's loss trace over training, in a fixed number of slots.

    Slot b holds the sum and the count of the record's losses at steps [b·stride, (b+1)·stride);
    the stride starts at 1 and doubles (neighbouring slots merged) whenever a step falls past
    the last slot, so the slots always cover the whole run seen so far at between half and all
    of their resolution: a thinned history that needs no planned step count. With at least
    twice as many slots as epochs a slot spans less than an epoch, so it holds one epoch's loss
    of its record (rarely two): the paper's per-epoch trace. Memory: 8 bytes per slot per
    tracked record (float32 sum, int32 count), 256 bytes at the default 32 slots, plus 4 bytes
    per record of the data set when a subset is tracked; nothing grows with the steps.

    Args:
        n_records: the data set's size; ``update`` takes indices into it.
        slots: slots per record, an even integer >= 4 (default 32).
        records: the indices to track (a subset); None (default): every record.

    Examples:
        >>> import torch
        >>> from privmon.attacks import LossTraces
        >>> traces = LossTraces(n_records=4, slots=4)
        >>> for step in range(6):  # the batch's indices and the losses the loop computed
        ...     losses = torch.tensor([1.0, 2.0]) / (step + 1)
        ...     traces.update(torch.tensor([0, 1]), losses, step=step)
        >>> traces.stride, traces.steps
        (2, 6)
        >>> traces.means()[1]
        tensor([1.5000, 0.5833, 0.3667,    nan], dtype=torch.float64)
    """

    def __init__(self, *, n_records: int, slots: int = 32, records: Any = None) -> None:
        self._n = check_int(n_records, name="n_records", minimum=1)
        self._slots = _check_slots(slots)
        self._records = _tracked(records, self._n)
        m = self._n if self._records is None else self._records.numel()
        self._row: torch.Tensor | None = None
        if self._records is not None:  # data set index -> row, -1 when not tracked
            self._row = torch.full((self._n,), -1, dtype=torch.int32)
            self._row[self._records] = torch.arange(m, dtype=torch.int32)
        self._sums = torch.zeros(m, self._slots, dtype=torch.float32)
        self._counts = torch.zeros(m, self._slots, dtype=torch.int32)
        self._dropped = torch.zeros((), dtype=torch.int64)
        self._stride = 1
        self._steps = 0  # one past the last step seen
        self._fed = False

    @property
    def n_records(self) -> int:
        """The data set's size."""
        return self._n

    @property
    def slots(self) -> int:
        """Slots per tracked record."""
        return self._slots

    @property
    def stride(self) -> int:
        """Training steps per slot (a power of two)."""
        return self._stride

    @property
    def steps(self) -> int:
        """One past the largest step seen (0 before any update)."""
        return self._steps

    @property
    def dropped(self) -> int:
        """Losses of tracked records left out because they were NaN or infinite."""
        return int(self._dropped)

    @property
    def records(self) -> torch.Tensor:
        """The tracked records' indices (m,), in the rows' order (increasing)."""
        if self._records is None:
            return torch.arange(self._n, device=self._sums.device)
        return self._records.to(self._sums.device)

    @property
    def bytes_per_record(self) -> int:
        """The state's bytes per tracked record (the subset's index table aside)."""
        return self._slots * (self._sums.element_size() + self._counts.element_size())

    def update(self, indices: Any, losses: Any, *, step: Any) -> None:
        """Add one batch: ``losses[i]`` is record ``indices[i]``'s loss at training ``step``
        (or at ``step[i]``: several batches at once, as one).

        Args:
            indices: (b,) integer indices into the data set (repeats allowed: each counts;
                records outside the tracked subset are ignored).
            losses: (b,) the per-sample losses the loop computed (detached here; any float
                dtype and device: the state moves to the first batch's device).
            step: the training step, an integer >= 0; or (b,) integer steps, one per loss.

        Raises:
            ValueError naming the argument: shapes that differ or are not 1-D, non-integer or
                out-of-range indices, a negative step.
        """
        idx, loss = self._batch(indices, losses)
        steps, last = self._steps_of(step, idx)
        while last >= self._slots * self._stride:
            self._sums, self._counts = _coarsened(self._sums), _coarsened(self._counts)
            self._stride *= 2
        keep = torch.isfinite(loss)
        if self._row is None:
            rows = idx
            self._dropped += keep.numel() - keep.sum()
        else:
            rows = self._row[idx].to(torch.int64)
            tracked = rows >= 0
            self._dropped += (tracked & ~keep).sum()
            keep &= tracked
        flat = torch.where(keep, rows * self._slots + steps // self._stride, 0)
        self._sums.view(-1).index_add_(0, flat, torch.where(keep, loss, 0.0))
        self._counts.view(-1).index_add_(0, flat, keep.to(torch.int32))
        self._steps = max(self._steps, last + 1)
        self._fed = True

    def _steps_of(self, step: Any, idx: torch.Tensor) -> tuple[Any, int]:
        """The step (an int) or the per-loss steps (an int64 tensor on the state's device), and
        the last one."""
        if not isinstance(step, torch.Tensor):
            step = check_int(step, name="step")
            return step, step
        if step.shape != idx.shape or step.is_floating_point() or step.dtype == torch.bool:
            raise ValueError(
                f"step must be an integer >= 0 or 1-D integers, one per loss; got shape "
                f"{tuple(step.shape)} and dtype {step.dtype}"
            )
        steps = step.to(self._sums.device, torch.int64)
        first, last = torch.aminmax(steps) if steps.numel() else (steps.new_zeros(()),) * 2
        if int(first) < 0:
            raise ValueError("step must be integers >= 0")
        return steps, int(last)

    def _batch(self, indices: Any, losses: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked (b,) int64 indices and float32 losses on the state's device."""
        idx, loss = checked_batch(indices, losses)
        if not self._fed and loss.device != self._sums.device:
            self._move(loss.device)
        idx = idx.to(self._sums.device, torch.int64)
        low, high = torch.aminmax(idx) if idx.numel() else (idx.new_zeros(()),) * 2
        if int(low) < 0 or int(high) >= self._n:
            raise ValueError(f"indices must lie in [0, {self._n - 1}] (n_records = {self._n})")
        return idx, loss.to(self._sums.device, torch.float32)

    def _move(self, device: torch.device) -> None:
        self._sums, self._counts = self._sums.to(device), self._counts.to(device)
        self._dropped = self._dropped.to(device)
        self._row = None if self._row is None else self._row.to(device)

    def means(self) -> torch.Tensor:
        """The trace: each slot's mean loss, (m, slots) float64, NaN where a slot holds none;
        slot b starts at step b · :attr:`stride`.

        Examples:
            >>> import torch
            >>> from privmon.attacks import LossTraces
            >>> traces = LossTraces(n_records=2, slots=4)
            >>> traces.update(torch.tensor([1, 1]), torch.tensor([1.0, 3.0]), step=2)
            >>> traces.means()[1].tolist()
            [nan, nan, 2.0, nan]
        """
        counts = self._counts.to(torch.float64)
        return torch.where(counts > 0, self._sums.to(torch.float64) / counts, torch.nan)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state as plain tensors (CPU), readable by ``torch.load(weights_only=True)``.

        Examples:
            >>> from privmon.attacks import LossTraces
            >>> sorted(LossTraces(n_records=3, slots=4).state_dict())[:3]
            ['counts', 'dropped', 'n_records']
        """
        records = self.records.cpu()
        return {
            "version": torch.tensor(_VERSION),
            "n_records": torch.tensor(self._n),
            "records": records if self._records is not None else records[:0],
            "stride": torch.tensor(self._stride),
            "steps": torch.tensor(self._steps),
            "dropped": self._dropped.detach().cpu().clone(),
            "sums": self._sums.cpu().clone(),
            "counts": self._counts.cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace this state's traces by those of ``state`` (from :meth:`state_dict` of a
        state with the same ``n_records``, ``slots`` and ``records``); ``state`` is not changed.

        Raises:
            ValueError naming what differs: missing keys, another version, size, slot count or
                tracked subset, a stride that is not a power of two.

        Examples:
            >>> import torch
            >>> from privmon.attacks import LossTraces
            >>> a = LossTraces(n_records=3, slots=4)
            >>> a.update(torch.tensor([2]), torch.tensor([0.5]), step=9)
            >>> b = LossTraces(n_records=3, slots=4)
            >>> b.load_state_dict(a.state_dict())
            >>> b.steps, b.stride
            (10, 4)
        """
        missing = [k for k in _KEYS if k not in state]
        if missing:
            raise ValueError(f"state must hold {list(_KEYS)}: missing {missing}")
        mine = self.state_dict()
        if int(state["version"]) != _VERSION:
            raise ValueError(f"state has version {int(state['version'])}, expected {_VERSION}")
        for key in ("n_records", "records"):
            if not torch.equal(state[key].cpu(), mine[key]):
                raise ValueError(f"state tracks other records: its {key} differs from this one's")
        shape = tuple(self._sums.shape)
        for key in ("sums", "counts"):
            if tuple(state[key].shape) != shape or state[key].dtype != mine[key].dtype:
                raise ValueError(
                    f"state[{key!r}] must be {mine[key].dtype} of shape {shape} (slots = "
                    f"{self._slots}), got {state[key].dtype} of shape {tuple(state[key].shape)}"
                )
        stride = int(state["stride"])
        if stride < 1 or stride & (stride - 1):
            raise ValueError(f"state['stride'] must be a power of two, got {shown(stride)}")
        device = self._sums.device
        self._sums = state["sums"].to(device).clone()
        self._counts = state["counts"].to(device).clone()
        self._dropped = state["dropped"].to(device, torch.int64).clone()
        self._stride, self._steps = stride, int(state["steps"])
        self._fed = self._fed or self._steps > 0

    def merge(self, other: LossTraces) -> LossTraces:
        """A new state holding both states' losses (per-rank states of one run: each rank fed
        its own batches); neither is changed. The finer one is thinned to the coarser stride.

        Raises:
            ValueError: ``other`` tracks other records or has another slot count.

        Examples:
            >>> import torch
            >>> from privmon.attacks import LossTraces
            >>> rank0, rank1 = LossTraces(n_records=4, slots=4), LossTraces(n_records=4, slots=4)
            >>> rank0.update(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]), step=0)
            >>> rank1.update(torch.tensor([2, 3]), torch.tensor([3.0, 4.0]), step=0)
            >>> rank0.merge(rank1).means()[:, 0].tolist()
            [1.0, 2.0, 3.0, 4.0]
        """
        if not isinstance(other, LossTraces):
            raise TypeError(f"other must be a LossTraces, got {type(other).__name__}")
        if other.slots != self._slots:
            raise ValueError(f"other must have slots = {self._slots}, got {other.slots}")
        mine, theirs = self.state_dict(), other.state_dict()
        if other.n_records != self._n or not torch.equal(mine["records"], theirs["records"]):
            raise ValueError("other must track the same records (n_records and records)")
        stride = max(self._stride, other.stride)
        for s in (mine, theirs):
            while int(s["stride"]) < stride:
                s["sums"], s["counts"] = _coarsened(s["sums"]), _coarsened(s["counts"])
                s["stride"] = s["stride"] * 2
        mine["sums"] = mine["sums"] + theirs["sums"]
        mine["counts"] = mine["counts"] + theirs["counts"]
        mine["dropped"] = mine["dropped"] + theirs["dropped"]
        mine["steps"] = torch.maximum(mine["steps"], theirs["steps"])
        out = LossTraces(n_records=self._n, slots=self._slots, records=self._records)
        out._move(self._sums.device)
        out.load_state_dict(mine)
        return out


@dataclass(frozen=True)
class LtIqr:
    """LT-IQR scores: ``scores[i]`` is record ``records[i]``'s interquartile range of its loss
    trace (float64, NaN for a record with no loss in the window), ``values[i]`` the number of
    trace slots it was computed from; higher = more vulnerable.

    Examples:
        >>> import torch
        >>> from privmon.attacks import LtIqr
        >>> risk = LtIqr(records=torch.tensor([4, 7, 9]), scores=torch.tensor([0.1, 2.0, 0.5]),
        ...              values=torch.tensor([8, 8, 8]))
        >>> risk.most_vulnerable(2).tolist()
        [7, 9]
    """

    records: torch.Tensor
    scores: torch.Tensor
    values: torch.Tensor

    def most_vulnerable(self, k: int) -> torch.Tensor:
        """The ``k`` records (indices) of highest score, highest first (ties: the lower index
        first); fewer when fewer have a score.

        Examples:
            >>> import torch
            >>> from privmon.attacks import LtIqr
            >>> LtIqr(records=torch.tensor([0, 1]), scores=torch.tensor([float("nan"), 1.0]),
            ...       values=torch.tensor([0, 3])).most_vulnerable(2).tolist()
            [1]
        """
        k = check_int(k, name="k", minimum=1)
        scored = torch.nonzero(~torch.isnan(self.scores)).flatten()
        order = torch.sort(self.scores[scored], descending=True, stable=True).indices
        return self.records[scored[order[:k]]]


def _window(traces: LossTraces, start: float, stop: float) -> torch.Tensor:
    """The slots (indices) whose first step lies in [start, stop) · the steps seen."""
    first = torch.arange(traces.slots, dtype=torch.float64) * traces.stride
    inside = (first >= start * traces.steps) & (first < stop * traces.steps)
    return torch.nonzero(inside).flatten()


def lt_iqr(traces: LossTraces, *, start: float = 0.0, stop: float = 1.0) -> LtIqr:
    """Per-record LT-IQR (Pollock et al., "Free Record-Level Privacy Risk Evaluation Through
    Artifact-Based Methods"): Q3 − Q1 of each record's loss trace, the 0.75 and 0.25 quantiles
    interpolated linearly (``numpy.percentile``'s default) over the trace's slots, by default
    the whole training run seen (the paper's choice).

    Args:
        traces: the state the training loop fed.
        start, stop: the part of training the trace covers, as fractions of the steps seen
            (the slots whose first step lies in [start, stop) · steps); ``stop=0.25`` reads the
            score the run had a quarter of the way in, to the slots' resolution.

    Returns:
        :class:`LtIqr` aligned with ``traces.records``; NaN for a record with no finite loss
        in the window (0 for a record with one).

    Raises:
        ValueError naming the argument: ``start`` outside [0, 1), ``stop`` outside (0, 1] or
            not above ``start``. TypeError: ``traces`` is no :class:`LossTraces`.

    Examples:
        >>> import torch
        >>> from privmon.attacks import LossTraces, lt_iqr
        >>> traces = LossTraces(n_records=2, slots=8)
        >>> for step in range(8):  # record 0 learnt at once, record 1 late (an outlier)
        ...     traces.update(torch.tensor([0, 1]), torch.tensor([0.1, 3.0 if step < 5 else 0.0]),
        ...                   step=step)
        >>> risk = lt_iqr(traces)
        >>> [round(v, 2) for v in risk.scores.tolist()], risk.most_vulnerable(1).tolist()
        ([0.0, 3.0], [1])
    """
    if not isinstance(traces, LossTraces):
        raise TypeError(f"traces must be a LossTraces, got {type(traces).__name__}")
    start = check_unit(start, name="start")
    stop = check_fraction(stop, name="stop")
    if start >= 1.0 or stop <= start:
        raise ValueError(f"start must lie in [0, stop) and stop in (0, 1], got {start}, {stop}")
    means = traces.means()
    vals = means[:, _window(traces, start, stop).to(means.device)]
    q = torch.tensor([0.25, 0.75], dtype=torch.float64, device=means.device)
    rows = max(1, _QUANTILE_LIMIT // max(1, vals.shape[1]))
    scores = torch.full((vals.shape[0],), torch.nan, dtype=torch.float64, device=means.device)
    if vals.shape[1]:
        parts = [torch.nanquantile(c, q, dim=1) for c in vals.split(rows)]
        quartiles = torch.cat(parts, dim=1)
        scores = quartiles[1] - quartiles[0]
    values = (~torch.isnan(vals)).sum(dim=1)
    return LtIqr(records=traces.records, scores=scores, values=values)
