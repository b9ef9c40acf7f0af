"""Reference-model attacks (LiRA, RMIA, difficulty calibration) on a classifier as a monitor
query."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from privmon._validation import (
    as_mask,
    check_flag,
    check_module,
    check_pair,
    check_positive,
    check_unit,
)
from privmon.attacks.metric import logit_confidence_from_logits
from privmon.attacks.reference import (
    fit_variance,
    gaussian_fit,
    lira_offline_score,
    log_normal,
    pooled_variance,
    rmia_marginal,
    rmia_score,
)
from privmon.models import Ensemble
from privmon.queries.batches import (
    Batch,
    Transform,
    call_module,
    first_tensor,
    module_device,
    record_digests,
    records_on_cpu,
    split_batch,
    tensor_digest,
    to_device,
    unique_modules,
)
from privmon.queries.classifier import ClassifierQuery

logger = logging.getLogger("privmon")

__all__ = ["ReferenceModelQuery"]

_REFERENCE_ATTACKS = ("lira", "rmia", "calibrated")


def _reference_modules(references: Any) -> tuple[tuple[nn.Module, ...], int]:
    """The reference modules (none for an Ensemble, which holds its own) and their number;
    an iterator passed as references is read once, here."""
    if isinstance(references, Ensemble):
        return (), len(references)
    if isinstance(references, nn.Module) and not isinstance(references, nn.ModuleList):
        raise ValueError(
            "references must be a sequence of modules or an Ensemble, got one "
            f"{type(references).__name__}: pass a single reference as [reference]"
        )
    refs = tuple(check_module(m, name="references") for m in references)
    if not refs:
        raise ValueError("references must hold at least one reference model")
    return refs, len(refs)


class ReferenceModelQuery(ClassifierQuery):
    """A reference-model attack on a classifier as a monitor query, shape (n,), higher = member.

    ``references`` are classifiers of the same task as ``model``, trained by the user. Each
    attack is the functional one of :mod:`privmon.attacks.reference` on φ, the logit-scaled
    confidence (:class:`~privmon.queries.LogitConfidenceQuery`), with the references trained
    on a record known from ``reference_data`` and ``reference_in`` (records matched by content:
    input bytes and label); without ``reference_data`` every reference counts as trained
    without every record (references trained on a held-out pool):

    - ``"lira"``: LiRA (Carlini et al., "Membership Inference Attacks From First Principles"),
      offline by default: how far φ rises above the Gaussian of the references trained without
      the record; ``online=True`` also fits the in-Gaussian, and needs references trained on
      the audit records, each record in about half of them;
    - ``"rmia"``: RMIA (Zarifzadeh et al., "Low-Cost High-Power Membership Inference Attacks"),
      comparing each record's likelihood ratio with those of ``population`` records;
    - ``"calibrated"``: the difficulty-calibrated loss (Watson et al., "On the Importance of
      Difficulty Calibration in Membership Inference Attacks").

    The formulas are on the Theory page (*Reference-model queries*). A record lacking the
    references its attack needs scores NaN, which the monitor drops and counts. A check costs
    one forward of ``model`` per batch (and, for RMIA, on the population): the references'
    per-record values are cached across checks by batch content, as in
    :class:`~privmon.queries.GeneratorQuery` (tensor inputs only), and ``release()`` keeps only
    the entries the check used.

    Args:
        model: the classifier being trained.
        references: a sequence of reference classifiers (listed in ``modules`` so the monitor
            puts them in eval mode) or a :class:`privmon.audit.Ensemble`; outputs are logits as
            for every classifier query.
        attack: ``"lira"`` (default), ``"rmia"`` or ``"calibrated"``.
        online: LiRA's and RMIA's online form (above); needs ``reference_data``.
        reference_data: the records ``(x, y)`` the references were trained on (their union, as
            the model takes them, after ``transform``), tensors with one row per record.
        reference_in: (k, m) bool, reference i trained on record j of ``reference_data``;
            default: the :class:`~privmon.audit.Ensemble`'s ``masks`` (``reference_data`` is
            then the data it was trained on). Identical records are merged (a reference
            trained on any copy trained on the record).
        population: records ``(x, y)`` that neither ``model`` nor the references trained on;
            required for ``"rmia"`` and for offline ``fixed_variance``.
        fixed_variance: LiRA with one variance per side for all records (offline: pooled over
            ``population``, online: over ``reference_data``). False by default (per-record
            variances, at least two references a side), unlike :func:`privmon.attacks.lira`;
            Carlini et al. advise it below about 64 references.
        a: RMIA's offline slope, in [0, 1].
        gamma: RMIA's likelihood-ratio threshold, > 0.
        cache: cache the references' per-record values across checks.
        name: defaults to ``attack`` (``"lira_online"`` / ``"rmia_online"`` when online).
        transform: ``batch -> (x, y)`` adapter.

    Attributes:
        n_reference_evaluations: records run through the references.
        cache_hits, cache_misses: batches found in / missing from the cache.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from privmon.queries import ReferenceModelQuery
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(4, 3)
        >>> references = [nn.Linear(4, 3) for _ in range(4)]  # trained on held-out records
        >>> query = ReferenceModelQuery(model, references, attack="lira")
        >>> x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
        >>> query.prepare()  # the monitor calls prepare / release around each check
        >>> scores = query((x, y))
        >>> query.release()
        >>> query.name, scores.shape
        ('lira', torch.Size([5]))
    """

    higher_is_member = True

    def __init__(
        self,
        model: nn.Module,
        references: Sequence[nn.Module] | Ensemble,
        *,
        attack: str = "lira",
        online: bool = False,
        reference_data: tuple[Any, Any] | None = None,
        reference_in: Any = None,
        population: tuple[Any, Any] | None = None,
        fixed_variance: bool = False,
        a: float = 0.3,
        gamma: float = 1.0,
        cache: bool = True,
        name: str | None = None,
        transform: Transform | None = None,
    ) -> None:
        if attack not in _REFERENCE_ATTACKS:
            raise ValueError(f"attack must be one of {_REFERENCE_ATTACKS}, got {attack!r}")
        refs, n_refs = _reference_modules(references)
        # the modules themselves: an iterator passed as references is read once, here
        self.references: tuple[nn.Module, ...] | Ensemble = (
            references if isinstance(references, Ensemble) else refs
        )
        self.attack = attack
        self.online = check_flag(online, name="online")
        if self.online and attack == "calibrated":
            raise ValueError(
                "online must be False for attack='calibrated': the calibrated loss compares "
                "with the references trained without the record"
            )
        if self.online and reference_data is None:
            raise ValueError(
                "online=True needs reference_data: the records (x, y) the references trained "
                "on (and reference_in, which reference trained on which, unless references is "
                "an Ensemble)"
            )
        self.fixed_variance = check_flag(fixed_variance, name="fixed_variance")
        self.a = check_unit(a, name="a")
        self.gamma = check_positive(gamma, name="gamma")
        self.cache = check_flag(cache, name="cache")
        offline_fixed = attack == "lira" and self.fixed_variance and not self.online
        if population is None and (attack == "rmia" or offline_fixed):
            raise ValueError(
                "population (x, y) is required for attack='rmia' and for offline "
                "fixed_variance: records neither the model nor the references trained on"
            )
        self.population = records_on_cpu(check_pair(population, name="population"), "population")
        self.reference_data = records_on_cpu(
            check_pair(reference_data, name="reference_data"), "reference_data"
        )
        self._reference_in = self._check_reference_in(reference_in, n_refs)
        default = f"{attack}_online" if self.online else attack
        super().__init__(model, name=default if name is None else name, transform=transform)
        self._check_reference_counts(n_refs)
        self.modules = unique_modules((model, *refs))
        self._population_values: torch.Tensor | None = None  # Pr(z) or the pooled σ²_out
        self._pooled_variances: torch.Tensor | None = None  # online fixed: σ²_in, σ²_out
        self._population_ratio: torch.Tensor | None = None  # r(z) of the current check
        self._columns: dict[bytes, int] | None = None  # record digest -> reference_in column
        self._cache: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()
        self.n_reference_evaluations = 0
        self.cache_hits = 0
        self.cache_misses = 0

    def _check_reference_in(self, reference_in: Any, n_refs: int) -> torch.Tensor | None:
        if self.reference_data is None:
            if reference_in is not None:
                raise ValueError("reference_in needs reference_data, the records it refers to")
            return None
        m = self.reference_data[0].shape[0]
        if reference_in is None:
            if not isinstance(self.references, Ensemble):
                raise ValueError(
                    "reference_in is required with reference_data unless references is an "
                    f"Ensemble: a boolean array of shape ({n_refs}, {m})"
                )
            reference_in = self.references.masks
        if not isinstance(reference_in, torch.Tensor):
            reference_in = np.asarray(reference_in)
        return as_mask(
            reference_in, name="reference_in", shape=(n_refs, m), device=torch.device("cpu")
        )

    def _check_reference_counts(self, n_refs: int) -> None:
        """Fail when no record can have the references its attack needs on each side (LiRA's
        per-record variances need two scores a side, a fixed variance one; the offline attacks
        need out-references); warn when only some records can (the others score NaN)."""
        if self.attack == "lira":
            per_side = 1 if self.fixed_variance else 2
            need_in, need_out = (per_side if self.online else 0), per_side
        else:  # RMIA's Pr(x), the calibrated loss: means over the references
            need_in, need_out = 0, (0 if self.online else 1)
        if self._reference_in is None:
            ins = torch.zeros(1, dtype=torch.long)  # every reference trained without every record
            outs = torch.full((1,), n_refs)
        else:
            ins = self._reference_in.sum(dim=0)
            outs = n_refs - ins
        usable = (ins >= need_in) & (outs >= need_out)
        form = "online" if self.online else "offline"
        needs = (
            f"{form} {self.attack} needs {need_in} references trained on a record and "
            f"{need_out} trained without it"
        )
        if not bool(usable.any()):
            where = "" if self._reference_in is None else " for any record of reference_data"
            raise ValueError(
                f"references: {needs}, which {n_refs} references do not give{where}; train "
                "more references" + (" or pass fixed_variance=True" if need_out == 2 else "")
            )
        if not bool(usable.all()):
            warnings.warn(
                f"{self.name}: {int((~usable).sum())} of {usable.numel()} records of "
                f"reference_data will score NaN (dropped and counted): {needs}",
                UserWarning,
                stacklevel=3,
            )

    def _reference_phi(self, x: Any, y: torch.Tensor, n_classes: int | None) -> torch.Tensor:
        """φ of every record under every reference, (k, n) float64 on y's device; the
        references' logits checked for ``n_classes`` classes (the model's; None: only that the
        references agree and the labels fit them)."""
        self.n_reference_evaluations += y.shape[0]
        try:
            if isinstance(self.references, Ensemble):
                outs = list(first_tensor(self.references(x), "references").unbind(0))
            else:
                outs = [call_module(m, to_device(x, module_device((m,)))) for m in self.references]
            logits = [self._logits(o).to(y.device, torch.float64) for o in outs]
        except (RuntimeError, TypeError, ValueError) as err:
            raise ValueError(
                f"{self.name}: the references failed on records the model takes ({err}); "
                "references must take the model's inputs (dtype, shape) and return its logits"
            ) from err
        widths = sorted({z.shape[1] for z in logits})
        if len(widths) > 1 or (n_classes is not None and widths[0] != n_classes):
            model = "" if n_classes is None else f", the model over {n_classes}"
            raise ValueError(
                f"references must return logits over the model's classes: they return "
                f"{' / '.join(map(str, widths))} classes{model}"
            )
        labels = self._labels(y, logits[0])
        return logit_confidence_from_logits(torch.stack(logits), labels.expand(len(outs), -1))

    def _shadow_in(self, x: Any, y: torch.Tensor) -> torch.Tensor | None:
        """(k, n) bool: reference i trained on record j of the batch (matched by content in
        ``reference_data``); None without ``reference_data``."""
        if self._reference_in is None or self.reference_data is None:
            return None
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{self.name}: reference_data matches tensor inputs only")
        if self._columns is None:
            rx, ry = self.reference_data
            keys = record_digests(rx.to(x.dtype), ry.long())
            columns: dict[bytes, int] = {}
            merged = self._reference_in.clone()
            for j, key in enumerate(keys):
                first = columns.setdefault(key, j)
                merged[:, first] |= self._reference_in[:, j]
            self._columns, self._reference_in = columns, merged
        cols = torch.tensor([self._columns.get(k, -1) for k in record_digests(x, y)])
        found = cols >= 0
        if self.online and not bool(found.any()):
            raise ValueError(
                f"{self.name}: none of the batch's {cols.shape[0]} records is in reference_data "
                "(records are matched by input bytes and label, after transform); the online "
                "attacks need references trained on the audit records"
            )
        m = torch.zeros(self._reference_in.shape[0], cols.shape[0], dtype=torch.bool)
        m[:, found] = self._reference_in[:, cols[found]]
        return m.to(y.device)

    def _reference_values(
        self, x: Any, y: torch.Tensor, n_classes: int | None, *, population: bool = False
    ) -> torch.Tensor:
        """The per-record reference values: (6, n) μ, σ², count of the in and the out side
        (LiRA), (n,) Pr(x) (RMIA) or the out-references' mean loss (calibrated). For the
        ``population`` records online RMIA looks up no membership: its Pr(z) is the mean over
        every reference, and the population is by definition outside ``reference_data``."""
        phi = self._reference_phi(x, y, n_classes)
        online_rmia = self.attack == "rmia" and self.online
        m = None if population and online_rmia else self._shadow_in(x, y)
        out = None if m is None else ~m
        if self.attack == "lira":
            mu_out, var_out, n_out = gaussian_fit(phi, out)
            if m is None:
                mu_in, var_in, n_in = torch.full((3, phi.shape[1]), math.nan, dtype=phi.dtype)
            else:
                mu_in, var_in, n_in = gaussian_fit(phi, m)
            counts = (n_in.to(phi.dtype), n_out.to(phi.dtype))
            return torch.stack([mu_in, var_in, counts[0], mu_out, var_out, counts[1]])
        if self.attack == "rmia":
            return rmia_marginal(torch.sigmoid(phi), m, online=self.online, a=self.a)
        return gaussian_fit(F.softplus(-phi), out)[0]

    def _lookup(self, x: Any, y: torch.Tensor, n_classes: int) -> torch.Tensor:
        if not (self.cache and isinstance(x, torch.Tensor)):
            return self._reference_values(x, y, n_classes)
        key = (tensor_digest(x), tensor_digest(y))
        self._used.add(key)
        hit = self._cache.get(key)
        if hit is not None:
            self.cache_hits += 1
            return hit.to(y.device)
        self.cache_misses += 1
        values = self._reference_values(x, y, n_classes)
        self._cache[key] = values
        return values

    def _records(self, pair: tuple[Any, Any] | None, what: str) -> tuple[Any, torch.Tensor]:
        if pair is None:
            raise ValueError(f"{self.name}: this attack needs {what}")
        x, y = split_batch(tuple(pair), self.device)
        if y is None:
            raise ValueError(f"{what} must be a pair (x, y) of inputs and labels")
        return x, y.long()

    @torch.no_grad()
    def prepare(self, device: Any = None) -> None:
        """RMIA: r(z) of the population under the current model; LiRA with a fixed variance:
        the references' pooled variances (computed once)."""
        pooled = self._pooled_variances if self.online else self._population_values
        if self.attack == "lira" and self.fixed_variance and pooled is None:
            if self.online:
                x, y = self._records(self.reference_data, "reference_data")
                v = self._reference_values(x, y, None)
                self._pooled_variances = torch.stack(
                    [pooled_variance(v[1], v[2]), pooled_variance(v[4], v[5])]
                )
            else:
                x, y, logits = self._population()
                v = self._reference_values(x, y, logits.shape[1])
                self._population_values = pooled_variance(v[4], v[5])
        if self.attack != "rmia":
            return
        x, y, logits = self._population()
        if self._population_values is None:
            self._population_values = self._reference_values(x, y, logits.shape[1], population=True)
        p = torch.sigmoid(logit_confidence_from_logits(logits.double(), y))
        ratio = p / self._population_values.to(p.device)
        finite = ~torch.isnan(ratio)
        self._population_ratio = ratio[finite]
        if self._population_ratio.numel() == 0:
            raise ValueError(
                f"{self.name}: no population record has a finite probability ratio (non-finite "
                "inputs or outputs of the model or the references)"
            )
        if not bool(finite.all()):
            logger.warning(
                "privmon: %s: %d of %d population records have no finite probability ratio "
                "and are left out of the comparison",
                self.name,
                int((~finite).sum()),
                finite.numel(),
            )

    def _population(self) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The population's inputs, its labels checked against the model's logits, the logits."""
        x, y = self._records(self.population, "population")
        logits = self._logits(call_module(self.model, x))
        try:
            return x, self._labels(y, logits), logits
        except ValueError as err:
            raise ValueError(f"population: {err}") from None

    def _variance(self, var: torch.Tensor, count: torch.Tensor, side: int) -> torch.Tensor:
        """Per-record (two scores or more) or the fixed variance (one or more) of one side
        (0: in, 1: out), floored as :func:`privmon.attacks.reference.fit_variance`."""
        if not self.fixed_variance:
            return fit_variance(var, count, fixed=False)
        pooled = self._pooled_variances if self.online else self._population_values
        if pooled is None:
            raise RuntimeError(f"{type(self).__name__}.prepare() must run before scoring")
        pooled = pooled.reshape(-1)[side if self.online else 0].to(var.device)
        return fit_variance(var, count, fixed=True, pooled=pooled)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        x, logits, y = self._forward_labelled(batch)
        phi = logit_confidence_from_logits(logits.to(torch.float64), y)
        values = self._lookup(x, y, logits.shape[1])
        if self.attack == "lira":
            mu_in, var_in, n_in, mu_out, var_out, n_out = values
            var_out = self._variance(var_out, n_out, 1)
            if not self.online:
                return lira_offline_score(phi, mu_out, var_out)
            var_in = self._variance(var_in, n_in, 0)
            score = log_normal(phi, mu_in, var_in) - log_normal(phi, mu_out, var_out)
            return torch.where(torch.isfinite(phi), score, math.nan)
        if self.attack == "rmia":
            if self._population_ratio is None:
                raise RuntimeError(f"{type(self).__name__}.prepare() must run before scoring")
            ratio = torch.where(torch.isfinite(phi), torch.sigmoid(phi) / values, math.nan)
            return rmia_score(ratio, self._population_ratio.to(phi.device), self.gamma)
        return torch.where(torch.isfinite(phi), values - F.softplus(-phi), math.nan)

    def release(self) -> None:
        """Drop the check's population ratios; keep only the cache entries this check used."""
        self._population_ratio = None
        self._cache = {k: v for k, v in self._cache.items() if k in self._used}
        self._used = set()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, attack={self.attack!r}, "
            f"online={self.online})"
        )
