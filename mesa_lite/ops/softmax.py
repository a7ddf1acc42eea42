"""Softmax: keeps only its output, as unsigned codes."""

from __future__ import annotations

import torch

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import (
    autocast_cast,
    autocast_dtype,
    first_order_only,
    needs_grad,
    plain_under_functorch,
    register_probe,
)

register_probe("softmax", 1, lambda a: torch.softmax(a, -1))


class SoftmaxFn(torch.autograd.Function):
    """Keeps only the output, as unsigned codes (softmax outputs lie in [0, 1])."""

    @staticmethod
    def forward(ctx, x, dim: int, spec: QuantSpec):
        out = torch._softmax(x, dim, False)
        p = quant.quantize(out, spec, signed=False)
        quant.save(ctx, p)
        quant.share(out, p)
        ctx.dim = dim
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (py,) = quant.load(ctx)
        gx = quant.softmax_backward(py, grad, ctx.dim)  # one pass from the codes
        if gx is not None:
            return gx, None, None
        y = quant.dequantize(py)
        return torch._softmax_backward_data(grad, y, ctx.dim, y.dtype), None, None


def softmax(x: torch.Tensor, dim: int, spec: QuantSpec | None) -> torch.Tensor:
    """``torch.softmax(x, dim)`` keeping only the output, as uint8 codes (when x needs grad)."""
    if spec is None or not needs_grad(x) or plain_under_functorch("softmax"):
        return torch.softmax(x, dim)
    return SoftmaxFn.apply(autocast_cast(x, autocast_dtype("softmax", x.device)), dim, spec)
