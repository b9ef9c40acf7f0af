"""PrivacyMonitor: audit a model's membership leakage while it trains.

One check (DESIGN.md, "the flow of one check"): save every RNG and the train/eval mode of every
module involved; run the member and non-member batches through each query under
``torch.no_grad()`` with the modules in eval mode; restore everything; estimate the optimal
advantage per query and method, AUC and TPR at low FPR, per-record risk; read ε from the Opacus
accountant and compare with the ceilings; hand one immutable :class:`~privmon.report.Report` to
the sinks and to early stopping.
"""

from __future__ import annotations

import logging
import math
import random
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from privmon._validation import check_open_unit, to_numpy
from privmon.bounds import epsilon_from_opacus, epsilon_lower_bound, tanh_bound
from privmon.callbacks.distributed import any_rank, gather_rows, rank_and_world
from privmon.callbacks.early_stopping import PrivacyEarlyStopping
from privmon.callbacks.records import RecordTracker
from privmon.estimators.advantage import (
    METHODS,
    default_bins,
    estimates_from_selections,
    fold_selections,
    kde_grid_too_coarse,
    optimal_advantage,
)
from privmon.estimators.risk import cell_signed_risk, histogram_risk
from privmon.estimators.roc import _DEFAULT_FPR, _sort_descending, _summary, roc_summary
from privmon.estimators.streaming import BinnedScores, column_quantiles, robust_range
from privmon.report import QueryResult, Report

__all__ = ["PrivacyMonitor", "PrivacyViolationWarning", "Sink"]

logger = logging.getLogger("privmon")

RISK_LEVELS = (0.5, 0.8, 0.9)
QUANTILES = (0.5, 0.9, 0.99)


class PrivacyViolationWarning(UserWarning):
    """A certified lower bound on the measured advantage exceeds the DP ceiling."""


class Sink(Protocol):
    def write(self, report: Report) -> None: ...
    def close(self) -> None: ...


def _save_rng() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 (the global RNG is what we protect)
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _most_exposed(risk: np.ndarray, k: int) -> tuple[int, ...]:
    """Indices of the k highest risks (NaN last), ties by index: the first k of a stable sort,
    without sorting every record."""
    if k == 0:
        return ()
    key = -(risk if np.isfinite(risk).all() else np.nan_to_num(risk, nan=-1.0))
    candidates = np.arange(key.size)
    if k < key.size:  # the records at or above the k-th highest, in index order
        candidates = np.flatnonzero(key <= np.partition(key, k - 1)[k - 1])
    order = candidates[np.argsort(key[candidates], kind="stable")]
    return tuple(order[:k].tolist())


def _violation_message(step: int, tag: str, lower: float, ceiling: float, eps: float) -> str:
    return (
        f"privmon: at step {step} the certified lower bound on the membership advantage "
        f"({tag}: {lower:.4f}) exceeds the ceiling {ceiling:.4f} that (ε={eps:.3f}, δ)-DP allows. "
        "Something the DP claim rests on is false: either the DP implementation or its "
        "accounting is broken (e.g. less noise than the accountant was told), or the members "
        "and non-members are not drawn from the same distribution — the ceiling assumes they are "
        "exchangeable, and a shifted held-out set looks like leakage."
    )


class PrivacyMonitor:
    """Watch a model's membership leakage during training.

    Args:
        query: a :mod:`privmon.queries` query, or a sequence of them (names must differ).
        members: iterable of batches of training records (the audit member set; keep its order
            fixed — per-record indices refer to the order it yields).
        nonmembers: iterable of batches of held-out records, drawn from the same distribution.
        every_n_steps: ``step(global_step)`` runs a check when global_step is a multiple of it.
        prior: P(member) of the membership experiment, in (0, 1).
        methods: estimators per query, from ("histogram", "kde"); KDE is skipped for discrete
            queries.
        modules: modules the check must protect besides those the queries declare.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` or a log directory.
        sinks: further sinks (e.g. :class:`privmon.sinks.JsonlSink`).
        accountant: an Opacus PrivacyEngine or accountant; ε at ``delta`` is read every check.
        delta: the DP δ at which ε is read, in (0, 1).
        interval_delta: 1 − confidence level of the advantage intervals, in (0, 1).
        early_stopping: a :class:`PrivacyEarlyStopping`.
        max_batches: audit at most this many batches of each set per check.
        top_k: how many most-exposed member indices to report per query.
        strict: re-raise exceptions from a check instead of logging and skipping it.
    """

    def __init__(
        self,
        query: Any,
        members: Iterable[Any],
        nonmembers: Iterable[Any],
        *,
        every_n_steps: int = 100,
        prior: float = 0.5,
        methods: Sequence[str] = ("histogram", "kde"),
        modules: Sequence[nn.Module] | None = None,
        writer: Any = None,
        sinks: Sequence[Sink] = (),
        accountant: Any = None,
        delta: float = 1e-5,
        interval_delta: float = 0.05,
        early_stopping: PrivacyEarlyStopping | None = None,
        max_batches: int | None = None,
        top_k: int = 10,
        strict: bool = False,
    ) -> None:
        queries = list(query) if isinstance(query, (list, tuple)) else [query]
        if not queries:
            raise ValueError("query must be a query or a non-empty sequence of queries")
        for q in queries:
            if not callable(q) or not isinstance(getattr(q, "name", None), str):
                raise ValueError(f"query {q!r} must be callable and have a string name")
        names = [q.name for q in queries]
        if len(set(names)) != len(names):
            raise ValueError(f"query names must be unique, got {names}")
        for obj, name in ((members, "members"), (nonmembers, "nonmembers")):
            if not isinstance(obj, Iterable):
                raise ValueError(f"{name} must be an iterable of batches (a DataLoader, a list)")
        if (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 1
        ):
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        methods = tuple(methods)
        if not methods or any(m not in METHODS for m in methods):
            raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {methods!r}")
        if max_batches is not None and (
            isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
        ):
            raise ValueError(f"max_batches must be None or an integer >= 1, got {max_batches!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
        if early_stopping is not None and not isinstance(early_stopping, PrivacyEarlyStopping):
            raise ValueError("early_stopping must be a PrivacyEarlyStopping or None")
        if accountant is not None and not callable(getattr(accountant, "get_epsilon", None)):
            raise ValueError(
                "accountant must be an Opacus PrivacyEngine or accountant "
                "(an object with get_epsilon(delta))"
            )
        self.queries = queries
        self.members, self.nonmembers = members, nonmembers
        self.every_n_steps = every_n_steps
        self.prior = check_open_unit(prior, name="prior")
        self.methods = methods
        self.modules = tuple(modules or ())
        self.sinks: list[Sink] = list(sinks)
        if writer is not None:
            from privmon.sinks.tensorboard import TensorBoardSink

            self.sinks.insert(0, TensorBoardSink(writer))
        self.accountant = accountant
        self.delta = check_open_unit(delta, name="delta")
        self.interval_delta = check_open_unit(interval_delta, name="interval_delta")
        self.early_stopping = early_stopping
        self.max_batches = max_batches
        self.top_k = top_k
        self.strict = strict
        self.history: list[Report] = []
        self.records = RecordTracker()
        self.n_failed = 0
        self._last_step: int | None = None
        self._stop = False

    # -- training-loop API ------------------------------------------------------------------
    def step(self, global_step: int) -> bool:
        """Run a check when one is due; True when training should stop."""
        if global_step % self.every_n_steps == 0 and global_step != self._last_step:
            self.check(global_step)
        return self._stop

    @property
    def should_stop(self) -> bool:
        return self._stop

    @property
    def last_report(self) -> Report | None:
        return self.history[-1] if self.history else None

    def check(self, global_step: int) -> Report | None:
        """Run one check now. Returns its report, or None when it failed (logged, skipped)."""
        self._last_step = global_step
        try:
            report = self._check(int(global_step))
        except Exception:
            self.n_failed += 1
            if self.strict:
                raise
            logger.exception(
                "privmon: the privacy check at step %s failed and was skipped", global_step
            )
            return None
        if self.history:  # keep arrays for the latest report only: memory flat over checks
            self.history[-1] = self.history[-1].without_arrays()
        self.history.append(report)
        rank, world = rank_and_world()
        if rank == 0:  # every rank holds the same report; one writes it
            for sink in self.sinks:
                self._guarded(sink.write, report, what=f"sink {sink!r}", step=global_step)
        stop = self.early_stopping is not None and bool(
            self._guarded(
                self.early_stopping.update,
                global_step,
                report.scalars,
                what="early stopping",
                step=global_step,
            )
        )
        if world > 1:  # all ranks stop together when any says stop
            stop = any_rank(stop)
        if stop:
            if not self._stop:
                reason = getattr(self.early_stopping, "reason", None) or "another rank said stop"
                logger.warning("privmon: early stopping at step %s — %s", global_step, reason)
            self._stop = True
        return report

    def _guarded(self, fn: Any, *args: Any, what: str, step: int) -> Any:
        """Run a sink or the stopping rule; a failure is logged (re-raised when strict)."""
        try:
            return fn(*args)
        except Exception:
            if self.strict:
                raise
            logger.exception("privmon: %s failed at step %s", what, step)
            return None

    def top_records(
        self, k: int = 10, *, query: str | None = None, by: str = "max"
    ) -> list[tuple[int, float]]:
        """The k most exposed member records across checks: (index, risk), highest first.

        ``by``: "max" (highest risk any check measured), "last" or "mean". ``query`` may be
        omitted when one query is monitored. Indices refer to the members' iteration order.
        """
        return self.records.top(k, query=query, by=by)

    def export_records(self, path: Any, *, query: str | None = None) -> str:
        """CSV of every member record's index and risks (never the record itself)."""
        return self.records.to_csv(path, query=query)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    # -- one check ----------------------------------------------------------------------------
    def _modules(self) -> list[nn.Module]:
        mods: list[nn.Module] = []
        for q in self.queries:
            mods.extend(getattr(q, "modules", ()))
        mods.extend(self.modules)
        return mods

    def _device(self) -> torch.device:
        for root in self._modules():
            for t in list(root.parameters()) + list(root.buffers()):
                return t.device
        return torch.device("cpu")

    def _collect(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
        """Scores of every query on members and non-members, the training state untouched, and
        the seconds spent in the queries themselves (the forward passes)."""
        device = self._device()
        rng = _save_rng()
        modes = {m: m.training for root in self._modules() for m in root.modules()}
        try:
            with torch.no_grad():
                for root in self._modules():
                    root.eval()
                for q in self.queries:
                    getattr(q, "prepare", lambda device: None)(device)
                out, forward = {}, 0.0
                scores: dict[str, list[list[torch.Tensor]]] = {
                    q.name: [[], []] for q in self.queries
                }
                for side, data in enumerate((self.members, self.nonmembers)):
                    for i, batch in enumerate(data):
                        if self.max_batches is not None and i >= self.max_batches:
                            break
                        t = time.perf_counter()
                        for q in self.queries:
                            scores[q.name][side].append(q(batch).detach())
                        forward += time.perf_counter() - t
                for name, (mem, non) in scores.items():
                    if not mem or not non:
                        raise ValueError(
                            "members and nonmembers must each yield at least one batch"
                        )
                    out[name] = (torch.cat(mem), torch.cat(non))
                if device.type == "cuda":  # queued kernels belong to the forward passes
                    t = time.perf_counter()
                    torch.cuda.synchronize(device)
                    forward += time.perf_counter() - t
                return out, forward
        finally:
            for q in self.queries:
                getattr(q, "release", lambda: None)()
            for m, training in modes.items():
                m.training = training
            _restore_rng(rng)

    def _gathered_scores(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
        """This process's scores (and its forward-pass seconds, see :meth:`_collect`); under
        torch.distributed every rank's scores, in rank order.

        Ranks first agree that every one of them collected its shard, so one rank's failure
        makes all of them skip the check instead of leaving the others waiting in a collective.
        """
        _, world = rank_and_world()
        if world == 1:
            return self._collect()
        local, forward, error = None, 0.0, None
        try:
            local, forward = self._collect()
        except Exception as err:
            error = err
        if any_rank(error is not None):
            raise error or RuntimeError("privmon: the check failed on another rank")
        gathered = {name: (gather_rows(m), gather_rows(n)) for name, (m, n) in local.items()}
        return gathered, forward

    def _check(self, step: int) -> Report:
        t0 = time.perf_counter()
        scores, t_query = self._gathered_scores()
        scalars: dict[str, float] = {}
        results: dict[str, QueryResult] = {}
        eps = None
        ceilings: dict[str, float] = {}
        if self.accountant is not None:
            eps = float(epsilon_from_opacus(self.accountant, delta=self.delta))
            if not math.isnan(eps):  # ε = inf gives the trivial ceiling 1
                ceilings["tanh"] = float(tanh_bound(eps, prior=self.prior))
                ceilings["eps_delta"] = float(tanh_bound(eps, prior=self.prior, delta=self.delta))
            scalars["privacy/epsilon"] = eps
            for k, v in ceilings.items():
                scalars[f"privacy/ceiling/{k}"] = v
        messages: list[str] = []
        violation = False
        for q in self.queries:
            mem, non = scores[q.name]
            with torch.inference_mode():  # no autograd bookkeeping on ~hundreds of small ops
                results[q.name] = self._analyse(q, mem, non, scalars)
            if results[q.name].member_risk is not None:
                self.records.update(q.name, step, results[q.name].member_risk)
            for method, est in results[q.name].estimates.items():
                tag = f"{q.name}/{method}"
                if "eps_delta" in ceilings and est.lower > ceilings["eps_delta"] + 1e-12:
                    violation = True
                    msg = _violation_message(step, tag, est.lower, ceilings["eps_delta"], eps)
                    messages.append(msg)
                    logger.warning(msg)
                    warnings.warn(msg, PrivacyViolationWarning, stacklevel=3)
        if eps is not None:
            scalars["privacy/dp_violation"] = float(violation)
        return Report(
            step=step,
            scalars=scalars,
            queries=results,
            epsilon=eps,
            dp_violation=violation,
            messages=tuple(messages),
            seconds=time.perf_counter() - t0,
            query_seconds=t_query,
        )

    @staticmethod
    def _too_coarse(ns: torch.Tensor, covs: torch.Tensor, pooled: torch.Tensor, bins: int) -> bool:
        """optimal_advantage's test for its exact KDE path, from the classes' record counts and
        covariances over all folds."""
        width = (pooled.amax(dim=0) - pooled.amin(dim=0)) / bins
        return kde_grid_too_coarse(ns, covs, width, "scott")

    def _analyse(
        self, q: Any, mem: torch.Tensor, non: torch.Tensor, scalars: dict[str, float]
    ) -> QueryResult:
        name = q.name
        n_mem = mem.shape[0]
        # float64 once, here: every estimator below works in it
        both = torch.cat([mem.reshape(n_mem, -1), non.reshape(non.shape[0], -1)]).to(torch.float64)
        mem2, non2 = both[:n_mem], both[n_mem:]  # rows aligned with the records: the risk
        d = both.shape[1]
        # the usual case, checked once: the estimators below then skip their own checks
        finite = bool(torch.isfinite(both).all())
        discrete = getattr(q, "discrete", False)
        # 1-2 dimensions: one binning pass serves the W_N estimate, the per-record risk and, in
        # 1-D, the KDE (the same grids and counts optimal_advantage would build: the histogram's
        # 100 bins are sums of 20 cells of the KDE's 2000-cell grid, and so are its fold
        # selections).
        grid = lo = hi = None
        selections: dict[str, tuple[BinnedScores, Any]] = {}  # grid estimates: state, folds
        if d <= 2:
            pooled = both if finite else both[torch.isfinite(both).all(dim=1)]
            if d == 1 and finite:  # one sort serves the ROC and the grid's range
                orientation = getattr(q, "higher_is_member", None)
                ranked = -both[:, 0] if orientation is False else both[:, 0]  # as the ROC reads
                ranking = _sort_descending(ranked)
                ascending = -ranking[0] if orientation is False else ranking[0].flip(0)
                lo, hi = robust_range(ascending[:, None], presorted=True)
            elif pooled.shape[0] > 0:  # else the estimators raise their own clear error
                lo, hi = robust_range(pooled)  # one grid range for every estimator
            hist_bins = default_bins("histogram", d)
            shared = d == 1 and "kde" in self.methods and not discrete
            fine = BinnedScores(
                bins=default_bins("kde", d) if shared else hist_bins,
                margin=0.0,
                low=lo,
                high=hi,
                device=both.device,
            )
            if finite:
                cell, inside = fine._add(both, (n_mem, both.shape[0] - n_mem))
            else:
                fine.update(mem2, non2)
            if shared:
                factor = fine.bins[0] // hist_bins
                grid = fine.coarsen(factor)
                if finite:  # the histogram cells the records were counted in
                    cell = torch.div(cell, factor, rounding_mode="floor")
                counts, ns, covs = fine_folds = fold_selections(fine)
                if "histogram" in self.methods:
                    coarse = counts.reshape(*counts.shape[:2], hist_bins, factor).sum(dim=-1)
                    selections["histogram"] = (grid, (coarse, ns, covs))
                if not self._too_coarse(ns[:, 0], covs[:, 0], pooled, fine.bins[0]):
                    selections["kde"] = (fine, fine_folds)
            else:
                grid = fine
                if "histogram" in self.methods:
                    selections["histogram"] = (grid, fold_selections(grid))
        joint = {}
        if selections:  # every grid estimate in one pass (one device transfer)
            joint = estimates_from_selections(
                selections,
                prior=self.prior,
                delta=self.interval_delta,
                bandwidth="scott",
                n_dropped=0,
            )
        estimates = {}
        for method in self.methods:
            if method == "kde" and discrete:
                continue
            if method in joint:
                est = joint[method]
            else:
                est = optimal_advantage(
                    mem2,
                    non2,
                    prior=self.prior,
                    method=method,
                    delta=self.interval_delta,
                    low=lo,
                    high=hi,
                )
            estimates[method] = est
            base = f"privacy/{name}/{method}"
            for field in ("value", "lower", "plugin", "upper"):
                scalars[f"{base}/{field}"] = getattr(est, field)
        # ε implied by each certified lower bound, in one call
        eps_bounds = epsilon_lower_bound(
            np.array([est.lower for est in estimates.values()]), prior=self.prior
        )
        for method, eps_bound in zip(estimates, eps_bounds.tolist(), strict=True):
            scalars[f"privacy/{name}/{method}/epsilon_lower_bound"] = eps_bound
        n_dropped = next(iter(estimates.values())).n_dropped
        if d == 1:
            orientation = getattr(q, "higher_is_member", None)
            if finite:
                summary = _summary(*ranking, n_mem, list(_DEFAULT_FPR), orientation)
            else:
                summary = roc_summary(mem2[:, 0], non2[:, 0], higher_is_member=orientation)
            for key, v in summary.items():
                scalars[f"privacy/{name}/{key}"] = float(v)
        risk = post_m = post_n = None
        top: tuple[int, ...] = ()
        if grid is not None:
            if finite:  # f_p per cell, read off through the cells the records were binned in
                index = to_numpy(torch.where(inside, cell, grid.counts.shape[2]))
                signed = cell_signed_risk(grid, prior=self.prior)[index]
                risk, posterior = np.abs(signed[:n_mem]), (1 + signed) / 2
            else:
                r = histogram_risk(grid, both, prior=self.prior, delta=self.interval_delta)
                risk, posterior = r.value[:n_mem], r.posterior
            post_m, post_n = posterior[:n_mem], posterior[n_mem:]
            scored = np.isfinite(risk)
            if scored.any():
                rf = risk[scored]
                qs, top_risk = column_quantiles(
                    torch.from_numpy(rf)[:, None], QUANTILES, extra=(rf.size - 1,)
                )
                *values, top_value = torch.cat([qs[:, 0], top_risk[:, 0]]).tolist()
                for qtl, value in zip(QUANTILES, values, strict=True):
                    scalars[f"privacy/{name}/risk/q{round(qtl * 100)}"] = value
                scalars[f"privacy/{name}/risk/max"] = top_value
                for level in RISK_LEVELS:
                    scalars[f"privacy/{name}/risk/n_above_{level}"] = float((rf > level).sum())
            top = _most_exposed(risk, self.top_k)
        scalars[f"privacy/{name}/n_dropped"] = float(n_dropped)
        return QueryResult(
            name=name,
            estimates=estimates,
            dim=d,
            n_dropped=n_dropped,
            member_risk=risk,
            member_posterior=post_m,
            nonmember_posterior=post_n,
            top_records=top,
        )

    # -- persistence --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [
                {
                    "step": r.step,
                    "scalars": dict(r.scalars),
                    "epsilon": r.epsilon,
                    "dp_violation": r.dp_violation,
                }
                for r in self.history
            ],
            "last_step": self._last_step,
            "stop": self._stop,
            "n_failed": self.n_failed,
            "early_stopping": None
            if self.early_stopping is None
            else self.early_stopping.state_dict(),
            "records": self.records.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        es = state.get("early_stopping")
        if (es is None) != (self.early_stopping is None):
            raise ValueError("state_dict and monitor disagree on whether early stopping is set")
        if es is not None:
            self.early_stopping.load_state_dict(es)
        self.history = [
            Report(
                step=int(h["step"]),
                scalars=dict(h["scalars"]),
                epsilon=h["epsilon"],
                dp_violation=bool(h["dp_violation"]),
            )
            for h in state["history"]
        ]
        self._last_step = state["last_step"]
        self._stop = bool(state["stop"])
        self.n_failed = int(state["n_failed"])
        self.records.load_state_dict(state.get("records", {}))
