"""Linear: ``F.linear`` keeping its (autocast-cast) input compressed; the weight is kept as the
Parameter itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import (
    autocast_cast,
    autocast_dtype,
    cast,
    first_order_only,
    fresh,
    keep,
    kept_cast,
    plain_under_functorch,
    recast,
    register_probe,
    weight_cast,
)

register_probe("linear", 2, lambda a, b: F.linear(a, b))


def _folded_col_major(x: torch.Tensor) -> bool:
    """Whether the 2-D matrix torch's linear multiplies for ``x`` (``x`` itself, or a contiguous
    ``x`` folded to (-1, in_features)) is column-major, as torch's mm backward tests it."""
    if x.dim() == 2:
        s0, s1, rows = x.stride(0), x.stride(1), x.shape[0]
    elif x.dim() > 2 and x.is_contiguous():
        s0, s1, rows = x.shape[-1], 1, x.numel() // max(x.shape[-1], 1)
    else:
        return False
    return s0 == 1 and s1 == rows


class LinearFn(torch.autograd.Function):
    """``F.linear`` keeping the compressed input; the weight is kept as the Parameter itself and
    cast again in backward, so no low-precision copy of it outlives the forward.

    ``dtype``: autocast's cast target for the weight and bias (None: no cast). ``shares``:
    ``(x0,)``, the input before the autocast cast, whose registered codes (a LayerNorm's or
    GELU's output) are reused instead of a second copy. The input is kept only when the
    weight needs grad, the weight only when the input does.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dtype: torch.dtype | None, spec: QuantSpec, shares=(None,)):
        wc = weight_cast(weight, dtype)
        out = F.linear(x, wc, autocast_cast(bias, dtype))
        need_x, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[0]
        px = keep(x, spec, share_key=shares[0]) if need_x else None
        kept = kept_cast(weight, wc, spec) if need_w else None
        quant.save(ctx, px, weight if need_w else None, kept)
        ctx.dtype = dtype
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        ctx.x_col_major = _folded_col_major(x)
        return fresh(out)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, weight, kept = quant.load(ctx)
        needs = ctx.needs_input_grad[:3]
        grads = linear_backward(
            grad, lambda: quant.dequantize(px, ctx.x_dtype), weight, ctx.dtype,
            ctx.x_col_major, needs, ctx.w_dtype, ctx.b_dtype, kept,
        )  # fmt: skip
        return *grads, None, None, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` folded to 2-D, (rows, features)."""
    return x.reshape(-1, x.shape[-1])


def linear_backward(grad, rebuild_x, weight, dtype, x_col_major: bool, needs, w_dtype, b_dtype,
                    w_cast=None):  # fmt: skip
    """``F.linear``'s gradients (input, weight, bias; None where ``needs`` is False), as
    torch's own backward computes them.

    Args:
        grad: the output's gradient.
        rebuild_x: returns the input (called only for the weight's gradient).
        weight: the weight before its autocast cast to ``dtype`` (None: no cast).
        x_col_major: ``_folded_col_major`` of the forward input.
        needs: needs-grad flags of input, weight and bias.
        w_dtype, b_dtype: the dtypes of weight and bias before any cast (``b_dtype`` None:
            no bias), which their gradients take.
        w_cast: the forward's cast of the weight, where kept (``kept_cast``; None: cast again).
    """
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_w = grad_b = None
    # the weight's gradient first: the rebuilt input is freed before the input's gradient,
    # of the same size, is allocated
    if needs[1]:
        grad_w = cast(g2.t() @ _rows(rebuild_x()), w_dtype)
    if needs[0]:
        w = recast(weight, dtype, w_cast)
        # as torch's mm backward: a column-major input gets its gradient computed transposed
        gx = (w.t() @ g2.t()).t() if x_col_major else g2 @ w
        grad_x = gx.reshape(*grad.shape[:-1], w.shape[1])
    if b_dtype is not None and needs[2]:
        grad_b = cast(g2.sum(0), b_dtype)
    return grad_x, grad_w, grad_b


def linear(x, weight, bias, spec: QuantSpec) -> torch.Tensor:
    if plain_under_functorch("Linear"):
        return F.linear(x, weight, bias)
    dtype = autocast_dtype("linear", x.device)
    return LinearFn.apply(autocast_cast(x, dtype), weight, bias, dtype, spec, (x,))


register_probe("addmm", 3, lambda a, b, c: torch.addmm(a, b, c))


def addmm_forward(x, weight, bias, dtype: torch.dtype | None) -> torch.Tensor:
    """Hugging Face ``Conv1D``'s forward, ``torch.addmm(bias, x.view(-1, in), weight)`` viewed
    as ``(*x.shape[:-1], out)``, with autocast's casts to ``dtype`` (None: no cast)."""
    x2 = x.view(-1, x.shape[-1])
    out = torch.addmm(autocast_cast(bias, dtype), x2, autocast_cast(weight, dtype))
    return out.view(*x.shape[:-1], out.shape[-1])


def addmm_col_major(x: torch.Tensor, weight: torch.Tensor) -> tuple[bool, bool]:
    """Whether the matrix addmm multiplies for ``x`` (folded to 2-D) and the (in, out) weight
    are column-major, as addmm's backward tests them."""
    w_col = weight.stride(0) == 1 and weight.stride(1) == weight.shape[0]
    return _folded_col_major(x.view(-1, x.shape[-1])), w_col


def addmm_backward(grad, rebuild_x, weight, dtype, x_col_major: bool, w_col_major: bool, needs,
                   w_dtype, b_dtype, w_cast=None):  # fmt: skip
    """``addmm_forward``'s gradients (input, weight, bias; None where ``needs`` is False) with
    addmm's own backward formulas; the arguments as ``linear_backward``'s, ``w_col_major``
    whether the weight (in, out) is column-major (its gradient is then too)."""
    g2 = grad.reshape(-1, grad.shape[-1])
    gx = gw = gb = None
    if needs[1]:  # mm_mat2_backward, first as in linear_backward
        x2 = _rows(rebuild_x())
        gw = cast(g2.t().mm(x2).t() if w_col_major else x2.t().mm(g2), w_dtype)
        del x2
    if needs[0]:  # mm_mat1_backward
        w = recast(weight, dtype, w_cast)
        gx = (w.mm(g2.t())).t() if x_col_major else g2.mm(w.t())
        gx = gx.reshape(*grad.shape[:-1], w.shape[0])
    if b_dtype is not None and needs[2]:
        gb = cast(g2.sum(0), b_dtype)
    return gx, gw, gb


class AddmmFn(torch.autograd.Function):
    """``addmm_forward``: Hugging Face's ``Conv1D`` (GPT-2), whose weight is stored (in, out);
    keeps the compressed input as ``LinearFn`` does, and computes the gradients with addmm's
    own backward formulas."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype: torch.dtype | None, spec: QuantSpec, shares=(None,)):
        wc = autocast_cast(weight, dtype)
        out = addmm_forward(x, wc, bias, dtype)
        need_x, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[0]
        px = keep(x, spec, share_key=shares[0]) if need_x else None
        kept = kept_cast(weight, wc, spec) if need_w else None
        quant.save(ctx, px, weight if need_w else None, kept)
        ctx.dtype, ctx.x_dtype, ctx.w_dtype = dtype, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        ctx.col_major = addmm_col_major(x, weight)
        return fresh(out)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, weight, kept = quant.load(ctx)
        grads = addmm_backward(
            grad, lambda: quant.dequantize(px, ctx.x_dtype), weight, ctx.dtype, *ctx.col_major,
            ctx.needs_input_grad[:3], ctx.w_dtype, ctx.b_dtype, kept,
        )  # fmt: skip
        return *grads, None, None, None


def addmm(x, weight, bias, spec: QuantSpec) -> torch.Tensor:
    """Hugging Face ``Conv1D``'s forward keeping its (autocast-cast) input compressed."""
    if plain_under_functorch("Conv1D"):
        x2 = torch.addmm(bias, x.view(-1, x.shape[-1]), weight)
        return x2.view(*x.shape[:-1], weight.shape[1])
    dtype = autocast_dtype("addmm", x.device)
    return AddmmFn.apply(autocast_cast(x, dtype), weight, bias, dtype, spec, (x,))
