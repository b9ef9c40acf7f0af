"""k models of one architecture run as one stacked forward. When the model is an
``nn.Sequential`` of ``nn.Linear`` layers and parameter-free elementwise activations on 2-D
inputs, the k models' layers run as batched matrix products (``torch.baddbmm``, and one autograd
node for the whole stack whose backward is written out by the same products), which computes
the same functions with less per-step overhead than ``vmap``; any other model runs
``torch.func.functional_call`` under ``torch.vmap``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["StackedForward", "stacked_forward"]

# Parameter-free modules that act elementwise: on a stacked (k, b, h) tensor they compute what
# they compute on each model's (b, h) slice.
_ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.Hardtanh,
    nn.Identity,
)
StackedForward = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor], Any]


def _linear_stack(template: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The layers of ``template`` when it is a plain ``nn.Sequential`` of ``nn.Linear`` layers
    and :data:`_ELEMENTWISE` activations (exact types, no hooks, no buffers), else None."""
    if type(template) is not nn.Sequential or next(template.buffers(), None) is not None:
        return None
    layers = list(template.named_children())
    n_linear = 0
    for _, layer in layers:
        if layer._forward_hooks or layer._forward_pre_hooks:
            return None
        if type(layer) is nn.Linear:  # a parametrized Linear is a subclass: not taken
            n_linear += 1
        elif type(layer) not in _ELEMENTWISE:
            return None
    if n_linear == 0 or template._forward_hooks or template._forward_pre_hooks:
        return None
    return layers


_NARROW = 16  # output features below which a stacked CPU layer computes (weight @ hᵀ)ᵀ


def _stacked_linear(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """k linear layers at once: ``h`` (k, b, in), ``weight`` (k, out, in), ``bias`` (k, out) or
    None -> bias + h @ weightᵀ, (k, b, out)."""
    if h.device.type == "cpu" and weight.shape[1] < _NARROW:
        # batched CPU GEMMs (MKL) with so few output columns run 1.3-3x slower than the
        # transposed product, (weight @ hᵀ)ᵀ, with the batch as columns
        out = (
            torch.bmm(weight, h.mT)
            if bias is None
            else torch.baddbmm(bias[..., None], weight, h.mT)
        )
        return out.mT
    if bias is None:
        return torch.bmm(h, weight.mT)
    return torch.baddbmm(bias.unsqueeze(1), h, weight.mT)


class _LinearStack:
    """k plain ``nn.Sequential`` MLPs (:func:`_linear_stack`) as batched matrix products, with
    their backward written out.

    ``stack(params, buffers, x)`` is a :data:`StackedForward`. Under autograd (parameters that
    require grad) the whole stack is one node, :class:`_LinearStackFunction`: its forward runs
    the layers as plain tensor operations and keeps what each layer's backward reads, and its
    backward turns the gradient of the outputs into each parameter's, per linear layer
    ``grad_W = gradᵀ h``, ``grad_b = Σ_rows grad`` and ``grad_h = grad @ W``. ReLU runs in
    place on the hidden activations privmon made (its backward keeps the units whose output is
    positive); other activations are differentiated by autograd one layer at a time: fewer
    autograd nodes than one per layer and activation (Theory page: *Stacked ensemble forward*).
    """

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self.layers = layers

    def __call__(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        if torch.is_grad_enabled() and any(p.requires_grad for p in params.values()):
            return _LinearStackFunction.apply(self, x, tuple(params), *params.values())
        with torch.no_grad():
            return self._run(params, x, None)

    def _run(self, params: dict[str, torch.Tensor], x: torch.Tensor, saved: list[Any] | None):
        h, owned = x, False  # owned: h is a hidden activation privmon made, free to overwrite
        for name, layer in self.layers:
            if type(layer) is nn.Linear:
                w = params[f"{name}.weight"]
                if h.ndim == 2:  # shared inputs, before the first linear layer
                    h = h.expand(w.shape[0], *h.shape)
                if saved is not None:
                    saved.append(h)
                h, owned = _stacked_linear(h, w, params.get(f"{name}.bias")), True
            elif type(layer) is nn.ReLU:
                h = h.clamp_min_(0) if owned else h.clamp_min(0)
                owned = True
                if saved is not None:
                    saved.append(h)  # the output: positive exactly where the input was
            elif type(layer) is nn.Identity:
                if saved is not None:
                    saved.append(None)
            elif saved is None:
                h, owned = layer(h), True
            else:
                with torch.enable_grad():
                    h_in = h.detach().requires_grad_(True)
                    h_out = layer(h_in)
                saved.append((h_in, h_out))
                h, owned = h_out.detach(), False  # its backward may read the output
        return h.contiguous()

    def backward(
        self, params: dict[str, torch.Tensor], saved: list[Any], grad: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Each parameter's gradient, given ``grad``, the gradient of the outputs (k, b, ...)."""
        grads: dict[str, torch.Tensor] = {}
        first = next(i for i, (_, layer) in enumerate(self.layers) if type(layer) is nn.Linear)
        owned = False  # grad is one privmon computed (autograd's may be shared or expanded)
        for i in range(len(self.layers) - 1, first - 1, -1):
            name, layer = self.layers[i]
            kept = saved[i]
            if type(layer) is nn.Linear:
                w = params[f"{name}.weight"]
                grads[f"{name}.weight"] = torch.bmm(grad.mT, kept)
                if f"{name}.bias" in params:
                    grads[f"{name}.bias"] = grad.sum(dim=1)
                if i > first:
                    grad, owned = torch.bmm(grad, w), True
            elif type(layer) is nn.ReLU:
                threshold = torch.ops.aten.threshold_backward
                grad = (
                    threshold.grad_input(grad, kept, 0, grad_input=grad)
                    if owned
                    else threshold(grad, kept, 0)
                )
                owned = True
            elif type(layer) is not nn.Identity:
                h_in, h_out = kept
                (grad,) = torch.autograd.grad(h_out, h_in, grad)
                owned = True
        return grads


class _LinearStackFunction(torch.autograd.Function):
    """A :class:`_LinearStack` as one autograd node; inputs ``(stack, x, names, *params)``."""

    @staticmethod
    def forward(
        ctx: Any, stack: _LinearStack, x: torch.Tensor, names: tuple[str, ...], *tensors: Any
    ) -> torch.Tensor:
        params = dict(zip(names, tensors, strict=True))
        saved: list[Any] = []
        out = stack._run(params, x, saved)  # autograd.Function runs forward without a graph
        ctx.stack, ctx.params, ctx.kept = stack, params, saved
        kept_storages = {
            t.untyped_storage().data_ptr()
            for item in saved
            for t in (item if isinstance(item, tuple) else (item,))
            if t is not None
        }
        if out.untyped_storage().data_ptr() in kept_storages:
            # an output the backward reads (a trailing ReLU's): saved, so that autograd refuses
            # a loss that modifies it in place, as it would for the model alone
            ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _ = ctx.saved_tensors  # raises if the loss modified a saved output in place
        grads = ctx.stack.backward(ctx.params, ctx.kept, grad)
        ctx.kept = None
        return (None, None, None, *(grads.get(name) for name in ctx.params))


def stacked_forward(template: nn.Module, x_ndim: int, *, shared: bool) -> StackedForward:
    """``forward(params, buffers, x)``: the k stacked models in ``template``'s mode on inputs of
    ``x_ndim`` dimensions per model, (b, ...) for all models when ``shared``, else (k, b, ...)
    (model i's own); output (k, b, ...). A :class:`_LinearStack` for a linear stack on 2-D
    inputs (:func:`_linear_stack`), ``vmap`` over ``functional_call`` otherwise."""
    layers = _linear_stack(template) if x_ndim == 2 else None
    if layers is not None:
        return _LinearStack(layers)
    base = copy.deepcopy(template).to("meta")

    def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], xb: torch.Tensor):
        return functional_call(base, (p, b), (xb,))

    return torch.vmap(one, in_dims=(0, 0, None if shared else 0))
