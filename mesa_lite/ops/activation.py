"""Elementwise activations written as formulas (Hugging Face's ``NewGELUActivation``,
``FastGELUActivation``, ``QuickGELUActivation``, ``GELUTanh``, ``GELUActivation``, SiLU, ...):
one compressed copy of the input; the output rebuilt from it for the next op (an ``act``
recipe step).

The forward runs the module's own formula, so the output is the module's bit for bit, under
autocast too (autocast still acts inside: ``torch.pow`` in the GELU formulas runs in fp32 on
CUDA). Backward rebuilds the input and differentiates the same formula with autograd under the
forward's autocast state: the exact derivative of the formula, evaluated at the rebuilt input.
Where the formula is a single torch op with its own backward op (SiLU), that op is called
directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import first_order_only, keep, plain_under_functorch, shared_output
from mesa_lite.ops.gelu import gelu_input_grad


def autocast_state(device: torch.device) -> tuple:
    """``(device type, enabled, dtype)`` of autocast on ``device``, to run a recompute in."""
    dev = device.type
    if dev not in ("cpu", "cuda", "xpu", "mps"):
        return (dev, False, None)
    return (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))


def _run(fn, x: torch.Tensor, state: tuple) -> torch.Tensor:
    dev, enabled, dtype = state
    if dtype is None:
        return fn(x)
    with torch.autocast(dev, dtype=dtype, enabled=enabled):
        return fn(x)


def _act_first(p: quant.Packed, step: tuple, aux: list, dtype: torch.dtype) -> torch.Tensor:
    """The activation's output from the codes of its input (exact mode: the kept input)."""
    _, x_dtype, fn, state = step
    x = quant.stored(p, x_dtype).view(p.shape)
    return _run(fn, x, state).to(dtype)


def _act_then(h: torch.Tensor, step: tuple, aux: list) -> torch.Tensor:
    _, x_dtype, fn, state = step
    return _run(fn, h.to(x_dtype), state)


# ("act", input dtype, formula, autocast state): an activation's output from its input
quant.register_step("act", quant.RecipeStep(0, _act_first, _act_then, lambda step: step[1]))


def silu_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward(grad, x)


def _silu_first(p: quant.Packed, step: tuple, aux: list, dtype: torch.dtype) -> torch.Tensor:
    """SiLU's output from the codes of its input, inside the dequantize kernel (exact mode:
    torch's SiLU on the kept input)."""
    x_dtype = step[1]
    if p.spec.exact:
        return F.silu(p.codes.to(x_dtype).view(p.shape)).to(dtype)
    return quant.stored(p, dtype, ("silu", x_dtype)).view(p.shape)


def _silu_then(h: torch.Tensor, step: tuple, aux: list) -> torch.Tensor:
    return F.silu(h.to(step[1]))


# ("silu", input dtype): a SiLU's output (``F.silu``, whose dtype is its input's)
quant.register_step("silu", quant.RecipeStep(0, _silu_first, _silu_then, lambda step: step[1]))


def silu_input_grad(px: quant.Packed, grad: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """SiLU's input gradient from the kept input ``px`` (rebuilt in ``x_dtype``), as
    ``gelu_input_grad``: one kernel from codes with no recipe, else the rebuilt input."""
    if not px.recipe and not px.spec.exact:  # one kernel: x is rebuilt in registers
        return quant.silu_backward(px, grad, x_dtype)
    return silu_grad(grad, quant.dequantize(px, x_dtype))


class ActivationFn(torch.autograd.Function):
    """``fn(x)`` for an elementwise formula ``fn``, keeping ``x`` compressed (or the codes a
    producer registered for it, its recipe extended) and registering them as the rebuildable
    copy of the output, so the next Linear keeps no second copy.

    ``grad_fn``: ``(grad, x) -> grad of x`` when the formula has its own backward op; a GELU
    formula's ``approximate`` (``"none"``: the erf form, ``"tanh"``: the tanh form, however
    its ops are spelled) when it is GELU's; None differentiates ``fn`` with autograd.

    A GELU formula, compressed, takes GELU's kernels: backward in one pass from the codes, and
    the next op rebuilds the output as GELU of the rebuilt input (a ``gelu`` recipe step) in
    the dequantize kernel. SiLU (``grad_fn`` ``silu_grad``) likewise (a ``silu`` step; its
    backward in one pass from codes with no recipe). In the exact (debug) mode every formula
    is differentiated with autograd, so gradients are the formula's own bit for bit.
    """

    @staticmethod
    def forward(ctx, x, fn, grad_fn, spec: QuantSpec, inplace_fn=None, shared=None,
                traced: bool = False):  # fmt: skip
        state = autocast_state(x.device)
        out_shared = True
        if inplace_fn is None:
            out = fn(x)
            p = keep(x, spec, max_steps=quant.MAX_RECIPE_STEPS - 1)
        else:
            # in place (``nn.SiLU(inplace=True)``, as timm's EfficientNets build it): the input
            # is kept before the op overwrites it; kept exactly, a copy of it
            exact = spec.exact or not quant.compressible(x)
            if exact:
                p = quant.quantize(x.clone(), spec)
            else:
                p = keep(x, spec, max_steps=quant.MAX_RECIPE_STEPS - 1)
            out = inplace_fn(x)
            ctx.mark_dirty(x)
            if exact:
                # no registered codes: the registry holds exact ones weakly, and a copy that
                # only this ctx holds can die (non-reentrant checkpoint) while a recompute
                # would find it alive; the next op keeps the output itself
                out_shared = False
        quant.save(ctx, p)
        grad_fn = backward_for(grad_fn, spec)
        if isinstance(grad_fn, str):
            step = ("gelu", x.dtype, grad_fn)
        elif grad_fn is silu_grad:  # fn is F.silu (no autocast cast: it runs in x's dtype)
            step = ("silu", x.dtype)
        else:
            step = ("act", x.dtype, fn, state)
        ctx.fn, ctx.grad_fn, ctx.state, ctx.x_dtype = fn, grad_fn, state, x.dtype
        if out.shape == x.shape and out_shared:
            if shared is None:  # traced: a block-internal output, shared under compile too
                return shared_output(out, p.derived(step, out.dtype), traced=traced)
            # in place: registered by the caller (apply bumps a dirty output's version on return)
            shared.append(p.derived(step, out.dtype))
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (px,) = quant.load(ctx)
        if isinstance(ctx.grad_fn, str):  # GELU's fused backward from the codes
            gx = gelu_input_grad(px, grad.to(ctx.x_dtype), ctx.grad_fn, ctx.x_dtype)
            return gx, None, None, None, None, None, None
        if ctx.grad_fn is silu_grad:  # SiLU's likewise
            gx = silu_input_grad(px, grad.to(ctx.x_dtype), ctx.x_dtype)
            return gx, None, None, None, None, None, None
        x = quant.dequantize(px, ctx.x_dtype)
        grad_x = activation_grad(ctx.fn, ctx.grad_fn, ctx.state, x, grad)
        return grad_x, None, None, None, None, None, None


def backward_for(grad_fn, spec: QuantSpec):
    """The backward an activation takes under ``spec``: a GELU form's fused kernel only
    compressed; in the exact (debug) mode autograd on the formula (None), so that gradients
    are the formula's own bit for bit."""
    return None if isinstance(grad_fn, str) and spec.exact else grad_fn


def run_activation(fn, x: torch.Tensor, state: tuple) -> torch.Tensor:
    """``fn(x)`` under the autocast ``state`` of its forward (``autocast_state``)."""
    return _run(fn, x, state)


def activation_grad(fn, grad_fn, state: tuple, x: torch.Tensor, grad: torch.Tensor):
    """The input gradient of ``fn`` at ``x``: ``grad_fn(grad, x)``, or (None) ``fn``
    differentiated by autograd under the forward's autocast ``state``."""
    if isinstance(grad_fn, str):
        return torch.ops.aten.gelu_backward(grad, x, approximate=grad_fn)
    if grad_fn is not None:
        return grad_fn(grad, x)
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        y = _run(fn, x, state)
        (gx,) = torch.autograd.grad(y, x, grad)
    return gx


def activation(x: torch.Tensor, fn, spec: QuantSpec, grad_fn=None, name: str = "activation",
               inplace_fn=None, traced: bool = False):  # fmt: skip
    """``fn(x)`` keeping ``x`` compressed for backward (``ActivationFn``); with ``inplace_fn``
    (``fn``'s in-place form) ``x`` is overwritten and returned, as the in-place op does;
    ``traced`` (not in place): the output's codes serve its consumer under torch.compile too
    (a block-internal output, ``ops.common.shared_output``)."""
    if plain_under_functorch(name):
        return fn(x) if inplace_fn is None else inplace_fn(x)
    if inplace_fn is not None and torch.compiler.is_compiling():
        # Dynamo breaks the graph at a Function that marks its input dirty; the compiler
        # makes the copy in place again (kept exactly, the input is a copy: copy_ overwrites x)
        src = x.clone() if spec.exact or not quant.compressible(x) else x
        return x.copy_(ActivationFn.apply(src, fn, grad_fn, spec))
    if inplace_fn is None:
        return ActivationFn.apply(x, fn, grad_fn, spec, None, None, traced)
    shared: list = []
    out = ActivationFn.apply(x, fn, grad_fn, spec, inplace_fn, shared)
    for p in shared:
        quant.share(out, p)
    return out


def _silu_(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x, inplace=True)


def silu(x: torch.Tensor, spec: QuantSpec, inplace: bool = False) -> torch.Tensor:
    """``F.silu(x, inplace)`` keeping ``x`` compressed."""
    return activation(x, torch.nn.functional.silu, spec, silu_grad, "SiLU",
                      _silu_ if inplace else None)  # fmt: skip
