"""TensorBoard sink: privacy scalars, per-record risk histograms, a PR curve of the membership
classifier, and a custom-scalar layout that puts the advantage, its certified lower bound and the
DP ceilings on one chart."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from privmon._validation import check_writable_dir
from privmon.report import Report

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Write reports to TensorBoard. ``writer``: a SummaryWriter or a log directory path."""

    def __init__(self, writer: Any) -> None:
        if isinstance(writer, (str, os.PathLike)):
            self._logdir: str | None = check_writable_dir(os.fspath(writer), name="writer")
            writer = None  # opened at the first report: ranks that never write leave no file
        elif callable(getattr(writer, "add_scalar", None)):
            self._logdir = None
        else:
            raise ValueError("writer must be a SummaryWriter or a log directory path")
        self._owned = self._logdir is not None
        self._writer = writer
        self._layout_written = False

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self._logdir)
        return self._writer

    def _layout(self, report: Report) -> None:
        charts: dict[str, list[Any]] = {}
        ceilings = [
            t for t in ("privacy/ceiling/tanh", "privacy/ceiling/eps_delta") if t in report.scalars
        ]
        for qname, q in report.queries.items():
            for method in q.estimates:
                base = f"privacy/{qname}/{method}"
                # figures whose meaning holds: the estimate, the run-level certified bound and
                # the ceilings (the plug-in figures are biased up and bound nothing)
                tags = [f"{base}/value", f"{base}/lower", *ceilings]
                charts[f"{qname} {method}: advantage vs DP ceiling"] = ["Multiline", tags]
        if "privacy/epsilon" in report.scalars:
            charts["epsilon: accountant vs measured lower bounds"] = [
                "Multiline",
                ["privacy/epsilon"]
                + [t for t in report.scalars if t.endswith("epsilon_lower_bound")],
            ]
        self.writer.add_custom_scalars({"privacy": charts})
        self._layout_written = True

    def write(self, report: Report) -> None:
        if not self._layout_written:
            self._layout(report)
        w, step = self.writer, report.step
        for tag, value in report.scalars.items():
            w.add_scalar(tag, value, step)
        for qname, q in report.queries.items():
            if q.member_risk is not None and np.isfinite(q.member_risk).any():
                risk = q.member_risk[np.isfinite(q.member_risk)]
                w.add_histogram(f"privacy/{qname}/member_risk", risk, step)
            if q.member_posterior is not None and q.nonmember_posterior is not None:
                post = np.concatenate([q.member_posterior, q.nonmember_posterior])
                labels = np.concatenate(
                    [np.ones(len(q.member_posterior)), np.zeros(len(q.nonmember_posterior))]
                )
                keep = np.isfinite(post)
                w.add_pr_curve(f"privacy/{qname}/membership_pr", labels[keep], post[keep], step)
        w.flush()

    def close(self) -> None:
        if self._writer is None:
            return
        if self._owned:
            self._writer.close()
        else:
            self._writer.flush()
