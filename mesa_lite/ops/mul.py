"""The squeeze-excitation multiply ``x * gate``, ``gate`` one value per channel (broadcast over
the spatial dims): keeps ``x`` compressed (or the codes its producer registered: the SiLU or
ReLU before it) and the small gate itself, instead of both in full.

Backward is torch's own for ``mul``: ``grad * gate`` for ``x`` and ``grad * x`` summed to the
gate's shape (``sum_to_size``, the reduction autograd applies to a broadcast input) for the
gate, so with ``debug_exact`` the gradients are torch's bit for bit.
"""

from __future__ import annotations

import torch

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import first_order_only, keep, plain_under_functorch


class ScaleMulFn(torch.autograd.Function):
    """``x * gate``, ``gate`` broadcasting over ``x`` (no larger than it). ``x`` is kept only
    when the gate needs grad, the gate only when ``x`` does."""

    @staticmethod
    def forward(ctx, x, gate, spec: QuantSpec):
        out = x * gate
        need_x, need_g = ctx.needs_input_grad[:2]
        px = keep(x, spec) if need_g else None
        quant.save(ctx, px, gate if need_x else None)
        ctx.x_dtype, ctx.g_shape = x.dtype, gate.shape
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, gate = quant.load(ctx)
        gx = gg = None
        if ctx.needs_input_grad[0]:
            gx = grad * gate
        if ctx.needs_input_grad[1]:
            x = quant.dequantize(px, ctx.x_dtype)
            gg = (grad * x).sum_to_size(ctx.g_shape)
        return gx, gg, None


def scale_mul(x: torch.Tensor, gate: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x * gate`` keeping ``x`` compressed; the plain product where the gate is as large as
    ``x`` (nothing to save) or inside torch.func transforms."""
    if (
        gate.dim() > x.dim()
        or gate.numel() >= x.numel()
        or torch.broadcast_shapes(x.shape, gate.shape) != x.shape
        or plain_under_functorch("squeeze-excitation multiply")
    ):
        return x * gate
    return ScaleMulFn.apply(x, gate, spec)
