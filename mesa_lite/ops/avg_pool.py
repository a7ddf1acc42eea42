"""Average pooling that keeps nothing for backward.

torch's ``avg_pool2d`` and ``adaptive_avg_pool2d`` (other than to one output per channel,
which torch computes as a mean) keep their whole input for backward, where their backward ops
read only its shape and layout. Here backward passes those ops a tensor of that shape and
layout whose values are never read, so the gradients are torch's bit for bit and nothing of
the input is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite.ops.common import first_order_only, needs_grad, plain_under_functorch
from mesa_lite.ops.max_pool import _pair


class AvgPoolFn(torch.autograd.Function):
    """``F.avg_pool2d(x, *args)`` (``adaptive`` False) or ``F.adaptive_avg_pool2d(x,
    *args)``; ``args`` as the functional takes them."""

    @staticmethod
    def forward(ctx, x, adaptive: bool, args: tuple):
        out = F.adaptive_avg_pool2d(x, *args) if adaptive else F.avg_pool2d(x, *args)
        ctx.adaptive, ctx.args = adaptive, args
        ctx.x_meta = (x.shape, x.stride(), x.dtype)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        shape, stride, dtype = ctx.x_meta
        x = grad.new_empty_strided(shape, stride, dtype=dtype)  # only its shape is read
        if ctx.adaptive:
            return torch.ops.aten._adaptive_avg_pool2d_backward(grad, x), None, None
        kernel, stride_, padding, ceil_mode, count_include_pad, divisor = ctx.args
        gx = torch.ops.aten.avg_pool2d_backward(
            grad, x, kernel, stride_, padding, ceil_mode, count_include_pad, divisor
        )
        return gx, None, None


def avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """``F.avg_pool2d`` keeping nothing for backward (batched 4-D input; otherwise, without
    grad or inside torch.func transforms, the functional itself)."""
    args = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    if x.dim() != 4 or not needs_grad(x) or plain_under_functorch("AvgPool2d"):
        return F.avg_pool2d(x, *args)
    stride = kernel_size if stride is None or stride == [] else stride
    args = (_pair(kernel_size), _pair(stride), _pair(padding), ceil_mode, count_include_pad,
            divisor_override)  # fmt: skip
    return AvgPoolFn.apply(x, False, args)


def adaptive_avg_pool2d(x, output_size):
    """``F.adaptive_avg_pool2d`` keeping nothing for backward (a batched 4-D input to more
    than one output per channel: torch's mean path for one output keeps nothing already)."""
    if (
        x.dim() != 4
        or not needs_grad(x)
        or plain_under_functorch("AdaptiveAvgPool2d")
        or output_size in (1, (1, 1), [1, 1])
        or (isinstance(output_size, (tuple, list)) and None in output_size)
    ):
        return F.adaptive_avg_pool2d(x, output_size)
    return AvgPoolFn.apply(x, True, (output_size,))
