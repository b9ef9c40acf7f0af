"""Input canaries for a black-box one-run DP audit of any model (:class:`InputCanaries`):
records that join the training set, scored by a query — much weaker than the gradient canaries
(:mod:`~privmon.audit.canaries`), auditing the whole pipeline rather than the mechanism."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from privmon._shown import shown
from privmon._training_guard import TrainingGuard
from privmon._validation import as_scores, check_int
from privmon.audit.one_run import inclusion_bits
from privmon.audit.opacus_per_sample import PerSampleState

__all__ = ["InputCanaries"]

logger = logging.getLogger("privmon")


def _check_query(query: Any) -> bool:
    """The direction of a query with one score per record (ValueError when unknown)."""
    direction = getattr(query, "higher_is_member", None)
    if direction not in (True, False) or not callable(query):
        raise ValueError(
            "query must be a privmon query with one score per record and a known direction "
            f"(higher_is_member True or False), got {shown(query)} with higher_is_member="
            f"{shown(direction)}"
        )
    return bool(direction)


class InputCanaries:
    """Input canaries for a black-box one-run audit of any model.

    Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run": each canary record is
    included in the training set with probability ½ (seeded, :attr:`included`); after (or during)
    training a query scores every canary and :func:`privmon.audit.one_run_epsilon` turns the
    scores into an ε lower bound. Mislabelled records are the usual canaries: a model that
    memorizes them fits labels no other record supports.

    Args:
        records: the canary records, a map-style dataset (``len`` and integer indexing; a
            ``TensorDataset`` of ``(x, y)``, a list of ``(x, y)`` tuples) whose items the
            training loop and the query both accept after default collation.
        query: the query :meth:`scores` runs when called without one (e.g.
            ``privmon.queries.LossQuery(model)``), so that ``PrivacyMonitor(canaries=...)`` can
            call ``scores()`` at every check.
        seed: seeds the inclusion bits (>= 0); a draw that includes all or none of the records
            is refused.

    Examples:
        >>> import torch
        >>> from privmon.audit import InputCanaries
        >>> from privmon.queries import LossQuery
        >>> gen = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(40, 8, generator=gen), torch.randint(0, 2, (40,), generator=gen)
        >>> canaries = InputCanaries(torch.utils.data.TensorDataset(x, y), seed=0)  # random labels
        >>> len(canaries.training_records)  # the included ones, to add to the training set
        16
        >>> model = torch.nn.Linear(8, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        >>> keep = torch.as_tensor(canaries.included)
        >>> for _ in range(100):  # a model that memorizes its training set
        ...     optimizer.zero_grad()
        ...     torch.nn.functional.cross_entropy(model(x[keep]), y[keep]).backward()
        ...     optimizer.step()
        >>> in_scores, out_scores = canaries.scores(LossQuery(model))  # negated losses
        >>> bool(in_scores.mean() > out_scores.mean())
        True
    """

    def __init__(
        self, records: Dataset[Any] | Sequence[Any], *, query: Any = None, seed: int = 0
    ) -> None:
        if not hasattr(records, "__getitem__") or not hasattr(records, "__len__"):
            raise TypeError(
                "records must be a map-style dataset (len() and integer indexing), got "
                f"{type(records).__name__}"
            )
        n = len(records)
        if n < 2:
            raise ValueError(f"records must hold at least 2 canaries, got {n}")
        self.records = records
        if query is not None:
            _check_query(query)
        self.query = query
        self._seed = check_int(seed, name="seed", minimum=0)
        self._included, _ = inclusion_bits(n, seed=self._seed)  # refused when a side would be empty

    @property
    def included(self) -> np.ndarray:
        """Which canaries are in the training set (bool, shape (len(records),))."""
        return self._included.copy()

    @property
    def training_records(self) -> Subset[Any]:
        """The included canaries, to add to the training set (e.g. ``ConcatDataset([train,
        canaries.training_records])``)."""
        return Subset(cast(Dataset[Any], self.records), np.flatnonzero(self._included).tolist())

    def scores(self, query: Any = None, *, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """(in_scores, out_scores) of the query on every canary, signed so that higher =
        included (negated when ``query.higher_is_member`` is False), float64, in record order.

        The query runs as at a monitor check (``prepare(device)``, one call per batch,
        ``release()``) under the monitor's training guard: modes, buffers, gradients, Opacus
        hooks and every RNG are restored afterwards, so training can go on, and a query that
        writes to the weights is refused (RuntimeError). A ``release()`` that raises is logged
        (logger ``"privmon"``) and costs no score, as at a monitor check. Non-finite
        scores are kept (aligned with the records); ``one_run_epsilon`` drops and counts them.

        Args:
            query: a privmon query (e.g. ``privmon.queries.LossQuery(model)``) with one score
                per record and a known direction (``higher_is_member`` True or False); default
                the one given at construction.
            batch_size: records per query call (>= 1).

        Raises:
            ValueError: the query's direction is unknown, or it returns other than one score
                per record.
        """
        if query is None:
            if self.query is None:
                raise ValueError(
                    "scores() needs a query: pass one here or to InputCanaries(query=)"
                )
            query = self.query
        direction = _check_query(query)
        size = check_int(batch_size, name="batch_size", minimum=1)
        loader = DataLoader(cast(Dataset[Any], self.records), batch_size=size, shuffle=False)
        modules = list(getattr(query, "modules", ()))
        parts = []
        try:
            per_sample = PerSampleState(modules)
            with TrainingGuard(modules, [], per_sample=per_sample) as guard:
                getattr(query, "prepare", lambda device: None)(getattr(query, "device", None))
                for batch in loader:
                    out = query(batch)
                    refused = guard.after_query()
                    if refused:
                        raise RuntimeError(f"the canaries' query {refused}")
                    parts.append(out.detach())
        finally:  # after training's state is restored; a failing release() costs no figure
            try:
                getattr(query, "release", lambda: None)()
            except Exception:
                name = getattr(query, "name", type(query).__name__)
                logger.exception("privmon: release of the canaries' query %r failed", name)
        scores, _ = as_scores(torch.cat(parts), name="query scores", drop=False)
        if scores.shape != (len(self._included), 1):
            raise ValueError(
                f"query must give one score per record: got shape {tuple(scores.shape)} for "
                f"{len(self._included)} records"
            )
        values = scores[:, 0].cpu().numpy() * (1.0 if direction else -1.0)
        return values[self._included], values[~self._included]
