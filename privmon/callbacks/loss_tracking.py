"""A monitor's per-record loss traces (:class:`LossTracing`): the training loop's per-sample
losses (:meth:`~privmon.PrivacyMonitor.record_losses`, no extra forward) and the member set's
losses at each check, kept in bounded memory (:class:`~privmon.attacks.LossTraces`); at each
check, the most vulnerable records by LT-IQR and LOSS TNR's estimates of LiRA's TPR at low FPR
(:mod:`~privmon.attacks.loss_traces`, :mod:`~privmon.attacks.loss_tail`). Under
torch.distributed each rank keeps the losses of its own batches, which travel to rank 0 inside
the check's one score exchange and are merged there; the member set's traces live on rank 0,
where the check is analysed."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from privmon._failure import Failure
from privmon._validation import check_flag, check_fprs, check_int
from privmon.attacks.loss_tail import DEFAULT_FPRS, loss_tnr
from privmon.attacks.loss_traces import LossTraces, checked_batch, lt_iqr
from privmon.report import Vulnerable, tags
from privmon.report.build import TraceFigures

__all__ = ["FLUSH_BATCHES", "FLUSH_LOSSES", "LOSS_TRACES", "LossTracing", "TracesSent"]

logger = logging.getLogger("privmon")

LOSS_TRACES = "loss_traces"
"""The loss traces' entry among a check's failures."""

FLUSH_LOSSES = 1 << 16
"""How many recorded losses are kept (12 bytes each: the loss and its index) before they are
added to the traces together: the update's fixed cost is then spread over many batches."""

FLUSH_BATCHES = 1024
"""How many recorded batches are kept at most before they are added (small batches)."""

TracesSent = tuple[int, int, int, int]
"""What a rank sends of its loop traces: stride, steps, dropped losses, bytes."""


def _traces_state(template: LossTraces, sent: TracesSent, data: torch.Tensor) -> LossTraces:
    """A rank's loop traces rebuilt from its bytes (``template``: this rank's, same setup)."""
    state = template.state_dict()
    cut = state["sums"].numel() * 4
    state["sums"] = data[:cut].clone().view(torch.float32).reshape(state["sums"].shape)
    state["counts"] = data[cut:].clone().view(torch.int32).reshape(state["counts"].shape)
    state["stride"], state["steps"], state["dropped"] = (torch.tensor(v) for v in sent[:3])
    out = LossTraces(n_records=template.n_records, slots=template.slots, records=_subset(template))
    out.load_state_dict(state)
    return out


def _subset(traces: LossTraces) -> torch.Tensor | None:
    records = traces.state_dict()["records"]
    return records if records.numel() else None


class LossTracing:
    """Per-record loss traces a :class:`~privmon.PrivacyMonitor` keeps (its ``loss_traces``),
    and what each check reports of them: per source, the ``top_k`` records of highest LT-IQR
    (Pollock et al., "Free Record-Level Privacy Risk Evaluation Through Artifact-Based
    Methods": Q3 − Q1 of the record's loss trace over the whole run so far), in
    ``report.vulnerable``; and, for each query whose scores are per-record losses
    (``per_record_loss``, e.g. :class:`~privmon.queries.LossQuery`), LOSS TNR (Dodd et al.,
    "The Tail Tells All") at each FPR of ``fpr``: an estimate of LiRA's TPR there, not a bound.

    Memory: :attr:`bytes_per_record` (8 bytes a slot: 256 at the default 32 slots) per traced
    record, plus 4 bytes per training record when ``records`` is a subset; constant in the
    steps and checks.

    Args:
        n_records: the training set's size: :meth:`~privmon.PrivacyMonitor.record_losses`
            takes indices into it; None: no traces from the training loop.
        records: the training records to trace (indices); None: all of them.
        slots: slots per traced record, an even integer >= 4.
        checks: also trace the member set's losses at each check (per loss query).
        top_k: most vulnerable records reported per source.
        fpr: the FPRs LOSS TNR estimates LiRA's TPR at (default 0.1 % and 1 %).

    Examples:
        >>> from privmon.callbacks import LossTracing
        >>> tracing = LossTracing(60_000)  # every record of a 60,000-record training set
        >>> tracing.bytes_per_record, tracing.nbytes  # 32 slots of 8 bytes each
        (256, 15360000)
    """

    def __init__(
        self,
        n_records: int | None = None,
        *,
        records: Any = None,
        slots: int = 32,
        checks: bool = True,
        top_k: int = 10,
        fpr: Any = DEFAULT_FPRS,
    ) -> None:
        if n_records is None and records is not None:
            raise ValueError("records needs n_records: the training set's size")
        self._loop = (
            None
            if n_records is None
            else LossTraces(n_records=n_records, slots=slots, records=records)
        )
        self._pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._kept = 0  # losses in the batches pending
        self.slots = LossTraces(n_records=1, slots=slots).slots
        self.checks = check_flag(checks, name="checks")
        self.top_k = check_int(top_k, name="top_k", minimum=1)
        self.fpr = tuple(check_fprs(fpr))
        self.at_checks: dict[str, LossTraces] = {}  # per loss query: its members' traces

    @property
    def loop(self) -> LossTraces | None:
        """The training loop's traces, every recorded batch in (None: the loop is not traced)."""
        self._flush()
        return self._loop

    @property
    def bytes_per_record(self) -> int:
        """Bytes of state per traced record."""
        return LossTraces(n_records=1, slots=self.slots).bytes_per_record

    @property
    def nbytes(self) -> int:
        """Bytes the loop's traces take (the subset's index table included)."""
        if self.loop is None:
            return 0
        table = 0 if _subset(self.loop) is None else 4 * self.loop.n_records
        return self.loop.records.numel() * self.bytes_per_record + table

    def setup(self) -> tuple[Any, ...]:
        """What the ranks must share: the loop's size and subset (a digest), the slots and what
        is reported."""
        loop = None
        if self.loop is not None:
            subset = self.loop.records.cpu().numpy().tobytes()
            loop = (self.loop.n_records, hashlib.sha256(subset).hexdigest())
        return loop, self.slots, self.checks, self.top_k, self.fpr

    def record(self, indices: Any, losses: Any, *, step: int) -> None:
        """One batch of the loop (:meth:`~privmon.PrivacyMonitor.record_losses`): checked at
        once where that computes nothing (shapes, dtypes), kept (the losses copied, detached)
        and added with the batches kept since, once they hold :data:`FLUSH_LOSSES` losses or
        :data:`FLUSH_BATCHES` batches (and before a check reads the traces), in one vectorised
        update, where the indices' range is checked (a ValueError names the step of the batch
        out of range)."""
        if self._loop is None:
            raise ValueError(
                "record_losses needs LossTracing(n_records=...): the monitor's loss_traces "
                "trace no training-loop losses"
            )
        step = check_int(step, name="step")
        idx, loss = checked_batch(indices, losses)
        self._pending.append((idx, loss.detach().clone(), step))
        self._kept += idx.numel()
        if self._kept >= FLUSH_LOSSES or len(self._pending) >= FLUSH_BATCHES:
            self._flush()

    def _flush(self) -> None:
        """The batches kept, added to the loop's traces in one update (dropped if it fails)."""
        if not self._pending or self._loop is None:
            return
        pending, self._pending, self._kept = self._pending, [], 0
        device = pending[0][1].device
        idx = torch.cat([i if i.device == device else i.to(device) for i, _, _ in pending])
        loss = torch.cat([v if v.device == device else v.to(device) for _, v, _ in pending])
        sizes = torch.tensor([v.numel() for _, v, _ in pending], device=device)
        steps = torch.tensor([s for _, _, s in pending], device=device).repeat_interleave(sizes)
        try:
            self._loop.update(idx, loss, step=steps)
        except ValueError:
            n = self._loop.n_records
            out = (
                s for i, _, s in pending if i.numel() and (int(i.min()) < 0 or int(i.max()) >= n)
            )
            bad = next(out, None)
            if bad is None:
                raise
            raise ValueError(
                f"record_losses: the indices of the batch at step {bad} must lie in "
                f"[0, {n - 1}] (n_records = {n}); its batch and the {len(pending) - 1} kept "
                "with it were left out"
            ) from None

    def outgoing(self) -> tuple[TracesSent | None, torch.Tensor | None]:
        """What this rank sends of its loop traces, and its bytes (sums, then counts)."""
        if self.loop is None:
            return None, None
        state = self.loop.state_dict()
        data = torch.cat([state["sums"].view(-1).view(torch.uint8),
                          state["counts"].view(-1).view(torch.uint8)])  # fmt: skip
        sent = (self.loop.stride, self.loop.steps, int(state["dropped"]), data.numel())
        return sent, data

    def merged(
        self, sent: Sequence[TracesSent | None], data: Sequence[torch.Tensor]
    ) -> LossTraces | None:
        """Every rank's loop traces merged (``sent``/``data``: per rank, from the exchange;
        empty: this process's own)."""
        if self.loop is None or not data:
            return self.loop
        ranks = [_traces_state(self.loop, s, d) for s, d in zip(sent, data, strict=True) if s]
        merged = ranks[0]
        for other in ranks[1:]:
            merged = merged.merge(other)
        return merged

    def figures(
        self, scores: Mapping[str, tuple[torch.Tensor, torch.Tensor]], queries: Sequence[Any],
        *, sent: Sequence[TracesSent | None], data: Sequence[torch.Tensor], strict: bool,
    ) -> TraceFigures:  # fmt: skip
        """One check's figures: each loss query's LOSS TNR (its members' losses traced when
        ``checks``), and the most vulnerable records of each source (the loop's traces merged
        over the ranks: :meth:`merged`). A failure is logged and left out (``strict``:
        raised)."""
        try:
            loop = self.merged(sent, data)
            scalars: dict[str, float] = {}
            vulnerable: dict[str, Vulnerable] = {}
            for q in queries:
                if getattr(q, "per_record_loss", False) and q.name in scores:
                    scalars.update(self._checked(q.name, *scores[q.name]))
            if loop is not None and loop.steps:
                vulnerable[tags.TRAINING_LOOP] = self._vulnerable(loop)
            for name, traces in self.at_checks.items():
                vulnerable[name] = self._vulnerable(traces)
            return TraceFigures(scalars=scalars, vulnerable=vulnerable)
        except Exception as err:
            if strict:
                raise
            logger.exception("privmon: the loss traces' figures failed")
            return TraceFigures(failures={LOSS_TRACES: Failure.of(err).reason})

    def _checked(
        self, name: str, members: torch.Tensor, nonmembers: torch.Tensor
    ) -> dict[str, float]:
        """LOSS TNR of one loss query, its members' losses added to their traces."""
        members, nonmembers = (
            members.reshape(members.shape[0], -1),
            nonmembers.reshape(nonmembers.shape[0], -1),
        )
        if members.shape[1] != 1 or not members.shape[0] or not nonmembers.shape[0]:
            return {}
        if self.checks:
            traces = self.at_checks.get(name)
            if traces is None or traces.n_records != members.shape[0]:  # the set changed
                traces = self.at_checks[name] = LossTraces(
                    n_records=members.shape[0], slots=self.slots
                )
            rows = torch.arange(members.shape[0], device=members.device)
            traces.update(rows, members[:, 0].float(), step=traces.steps)
        est = loss_tnr(members[:, 0], nonmembers[:, 0], fpr=self.fpr)
        return {tags.loss_tnr(name, a): v for a, v in zip(est.fpr, est.estimate, strict=True)}

    def _vulnerable(self, traces: LossTraces) -> Vulnerable:
        risk = lt_iqr(traces)
        top = risk.most_vulnerable(self.top_k)
        scores = risk.scores[torch.searchsorted(risk.records, top)]
        return Vulnerable(
            records=tuple(top.tolist()),
            scores=tuple(scores.tolist()),
            n_scored=int((~torch.isnan(risk.scores)).sum()),
            steps=traces.steps,
        )

    def state_dict(self) -> dict[str, Any]:
        """The loop's traces (None without) and each loss query's member traces."""
        return {
            "loop": None if self.loop is None else self.loop.state_dict(),
            "checks": {name: t.state_dict() for name, t in self.at_checks.items()},
        }

    def load_state_dict(self, state: Any) -> None:
        """Resume from :meth:`state_dict` of the same setup; ValueError naming what differs."""
        if not isinstance(state, dict) or set(state) != {"loop", "checks"}:
            raise ValueError("state loss_traces must be a LossTracing.state_dict()")
        if (state["loop"] is None) != (self._loop is None):
            raise ValueError("state loss_traces and monitor disagree on tracing the loop")
        checks = {}
        for name, saved in dict(state["checks"]).items():
            n = check_int(int(saved["n_records"]), name="state loss_traces n_records", minimum=1)
            checks[name] = LossTraces(n_records=n, slots=self.slots)
            checks[name].load_state_dict(saved)
        if self._loop is not None:
            self._pending, self._kept = [], 0  # the state replaces every loss recorded
            self._loop.load_state_dict(state["loop"])
        self.at_checks = checks
