"""Stage 3 of the estimators on the grid: the rule and its certificate. The Bayes rule
sign(p·P̂ − (1−p)·Q̂) of each fold selection's smoothed densities (stage 2), its held-out true /
false positives (the cross-fitted ``value``), and the certificate rule's, certified by
:mod:`~privmon.estimators.certificate`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from privmon.estimators.certificate import certify
from privmon.estimators.estimates import AdvantageEstimate, make_estimate
from privmon.estimators.selections import GridSelections
from privmon.estimators.tensors import small_tensor

__all__ = ["RuleDensities", "bayes_rule", "grid_estimates"]


def bayes_rule(diff: torch.Tensor, tie: torch.Tensor, tol: float | torch.Tensor) -> torch.Tensor:
    """Bayes rule sign(p·P̂ − (1−p)·Q̂) as 1 (member) / 0 / ``tie`` where the two agree (to
    ``tol``); ``tie`` a tensor of diff's dtype (broadcast)."""
    return torch.where(diff.abs() <= tol, tie, diff > 0)


@functools.lru_cache(maxsize=8)
def _ties(k: int, c: int, prior: float, device: torch.device) -> torch.Tensor:
    """Tie values (K + C, 1) of the K cross-fitted rules and the C certificates' (cached)."""
    return small_tensor([[0.5]] * k + [[float(prior > 0.5)]] * c, np.float64, device)


@dataclass(frozen=True)
class RuleDensities:
    """The cross-fitted rules' smoothed densities of one grid method: ``mass`` (2, K, cells) the
    per-record probability mass per cell of members (0) and non-members (1) learned without
    fold k; ``n_train`` (2, K) the records they were learned from. Record i of fold k is scored
    by row k only: out of sample."""

    mass: torch.Tensor
    n_train: torch.Tensor


def grid_estimates(
    grids: dict[str, GridSelections],
    masses: dict[str, torch.Tensor],
    plugins: dict[str, torch.Tensor],
    *,
    prior: float,
    delta: float,
    n_dropped: int,
    certify_delta: float | None,
) -> tuple[dict[str, AdvantageEstimate], dict[str, RuleDensities]]:
    """Each grid method's estimate and its :class:`RuleDensities`, from its grid's fold
    selections, the rules' smoothed densities ``masses`` (2, K + C, cells) and its plug-in (a
    0-d tensor). Every figure of every method comes back in one device transfer, and the
    certificates share one set of Clopper–Pearson calls."""
    first = next(iter(grids.values()))
    ns = first.selected[1]
    n1, n2 = ns[:, 0].tolist()
    k, c = first.folds, len(first.certificates)
    parts, densities = [], {}
    for method, grid in grids.items():
        mass = masses[method]
        parts.append(_rule_figures(grid, mass, plugins[method], prior=prior))
        densities[method] = RuleDensities(mass[:, :k], grid.selected[1][:, 1 : k + 1])
    # the records of each certificate's folds, (C, 2)
    n_certified = torch.stack([cells.selected[1][:, 0] for cells in first.certificates])
    dropped = first.n_dropped.sum().reshape(1).to(n_certified.dtype)
    *values, extra = torch.cat([*parts, n_certified.flatten(), dropped]).tolist()
    figures = np.asarray(values[: -2 * c]).reshape(len(grids), 3 + 2 * c)
    held_out = np.asarray(values[-2 * c :]).reshape(c, 2)
    plugin, tp, fp = figures[:, :3].T
    lower_delta = delta if certify_delta is None else certify_delta
    certs, certs_check = certify(
        figures[:, 3::2], held_out[:, 0], figures[:, 4::2], held_out[:, 1], prior,
        (lower_delta, delta),
    )  # fmt: skip
    estimates = {
        method: make_estimate(
            plugin=plugin[i],
            tp=tp[i],
            fp=fp[i],
            n1=n1,
            n2=n2,
            cert=certs[i],
            cert_check=certs_check[i],
            prior=prior,
            delta=delta,
            lower_delta=lower_delta,
            method=method,
            n_dropped=n_dropped + int(extra),
        )
        for i, method in enumerate(grids)
    }
    return estimates, densities


def _rule_figures(
    grid: GridSelections,
    mass: torch.Tensor,
    plugin: torch.Tensor,
    *,
    prior: float,
) -> torch.Tensor:
    """The plug-in, the held-out true / false positives of the cross-fitted rules, then those
    of each certificate's rule, as a (3 + 2C,) tensor on the state's device (no sync)."""
    k, c = grid.folds, len(grid.certificates)
    diff = prior * mass[0] - (1 - prior) * mass[1]  # (train sets, cells)
    # the cross-fitted rules break ties with 1/2, the certificates' rules with the prior's side;
    # each reads ties to the scale of its own densities (the value does not depend on the
    # certificates' rules)
    peak = mass.amax(dim=(0, 2))
    tol = 1e-9 * torch.cat([peak[:k].amax().expand(k), peak[k:]]).unsqueeze(1)
    rules = bayes_rule(diff, _ties(k, c, prior, diff.device), tol)
    # each certificate's folds, on its own cells: (C, 2, cells) @ (C, cells, 1)
    held_out = torch.stack([cells.selected[0][:, 0] for cells in grid.certificates])
    return torch.cat(
        [
            plugin.reshape(1),
            (rules[:k] * grid.counts).sum(dim=(1, 2)),  # held-out true / false positives
            (held_out @ rules[k:].unsqueeze(2)).flatten(),
        ]
    )
