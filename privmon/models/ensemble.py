"""k trained models of one architecture as one batched ensemble, their parameters stacked along
a leading dimension (``torch.func.stack_module_state``) and run as one stacked forward
(:mod:`privmon.models.linear_stack`)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from privmon._validation import check_int
from privmon.models.linear_stack import StackedForward, stacked_forward

__all__ = ["Ensemble"]


class Ensemble:
    """k trained models of one architecture, their parameters stacked along a leading dimension.

    :func:`privmon.audit.train_ensemble` returns one; any k models of one architecture make one
    through ``torch.func.stack_module_state``. ``ensemble(x)`` runs all k models on the same
    inputs in eval mode under ``no_grad``: an output of shape (k, n, ...).
    ``ensemble.model(i)`` returns model i as an ordinary module.

    Args:
        template: a module of the architecture (copied, never run with its own parameters).
        params, buffers: name -> tensor of shape (k, ...), as ``torch.func.stack_module_state``
            lays them out (kept detached).
        seeds: (k,) the seed of each model (initialisation and batch order).
        masks: (k, n) bool, the records each model trained on.
        trained_by: (k,) int, the rank of the torch.distributed group that trained each model
            (0 in one process, the default), -1 for a model loaded from a checkpoint folder.

    Every argument but ``template`` is kept as the attribute of the same name.

    Examples:
        >>> import numpy as np
        >>> import torch
        >>> from torch import nn
        >>> from privmon.models import Ensemble
        >>> _ = torch.manual_seed(0)
        >>> models = [nn.Linear(4, 3) for _ in range(5)]
        >>> params, buffers = torch.func.stack_module_state(models)
        >>> masks = np.random.default_rng(0).random((5, 10)) < 0.5  # who trained on what
        >>> ensemble = Ensemble(models[0], params, buffers, seeds=np.arange(5), masks=masks)
        >>> len(ensemble), ensemble(torch.randn(8, 4)).shape
        (5, torch.Size([5, 8, 3]))
        >>> ensemble.model(2)
        Linear(in_features=4, out_features=3, bias=True)
    """

    def __init__(
        self,
        template: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        seeds: np.ndarray,
        masks: np.ndarray,
        *,
        trained_by: np.ndarray | None = None,
    ) -> None:
        self._template = template
        self._forward: dict[int, StackedForward] = {}  # by the inputs' number of dimensions
        self.params = {k: v.detach() for k, v in params.items()}
        self.buffers = {k: v.detach() for k, v in buffers.items()}
        self.seeds = seeds
        self.masks = masks
        self.trained_by = np.zeros(len(seeds), dtype=np.int64) if trained_by is None else trained_by

    def __len__(self) -> int:
        return int(self.masks.shape[0])

    def __repr__(self) -> str:
        return f"Ensemble(n_models={len(self)}, model={type(self._template).__name__})"

    @property
    def device(self) -> torch.device:
        """The device of the stacked parameters."""
        return next(iter(self.params.values())).device

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """All k models' outputs on the inputs ``x`` (n, ...): shape (k, n, ...)."""
        x = x.to(self.device)
        forward = self._forward.get(x.ndim)
        if forward is None:
            template = copy.deepcopy(self._template).eval()
            forward = self._forward[x.ndim] = stacked_forward(template, x.ndim, shared=True)
        return forward(self.params, self.buffers, x)

    def model(self, i: int) -> nn.Module:
        """Model ``i`` as an independent module (a copy, in eval mode)."""
        i = check_int(i, name="i", minimum=0)
        if i >= len(self):
            raise ValueError(f"i must be an index in [0, {len(self) - 1}], got {i}")
        m = copy.deepcopy(self._template)
        m.load_state_dict({k: v[i] for k, v in {**self.params, **self.buffers}.items()})
        return m.eval()
