"""ReLU: keeps 1 bit per element (where the gradient passes) instead of its output.

torch's ReLU keeps its output and its backward is ``threshold_backward(grad, out, 0)``: zero
where ``out <= 0``, ``grad`` elsewhere (a NaN output passes its gradient). The bit kept is that
condition, so the gradients are torch's bit for bit. In place (``nn.ReLU(inplace=True)``, as
timm's ResNets build it) the input is modified and returned, as ``relu_`` does.
"""

from __future__ import annotations

import torch

from mesa_lite.kernels.bits import pack_positive, pack_positive_ref, relu_backward, unpack_bits
from mesa_lite.ops.common import (
    channels_last_perm,
    first_order_only,
    inverse_perm,
    needs_grad,
    plain_under_functorch,
)


class ReLUFn(torch.autograd.Function):
    """``torch.relu`` (or ``relu_`` with ``inplace``) keeping ``out > 0 or NaN`` packed 8 per
    byte."""

    @staticmethod
    def forward(ctx, x, inplace: bool):
        if inplace:
            out = torch.relu_(x)
            ctx.mark_dirty(x)
        else:
            out = torch.relu(x)
        # kept in the output's memory order (channels-last too), so that the gradient takes
        # the layout torch's backward gives it
        ctx.perm = channels_last_perm(out)
        src = out if ctx.perm is None else out.permute(ctx.perm)
        # the Triton packer (one pass over the output) is a direct launch, which torch.compile
        # cannot trace: there the reference's torch ops, which Inductor fuses
        compiling = torch.compiler.is_compiling()
        packed = pack_positive_ref(src) if compiling else pack_positive(src)
        ctx.save_for_backward(packed)
        ctx.shape = src.shape
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        perm = ctx.perm
        g = grad if perm is None else grad.permute(perm)
        if not torch.compiler.is_compiling() and g.is_contiguous():
            # the gradient in the bits' order: one pass, the result in the gradient's layout
            out = relu_backward(g, packed)
            return (out if perm is None else out.permute(inverse_perm(perm))), None
        passes = unpack_bits(packed, ctx.shape)
        if perm is not None:
            passes = passes.permute(inverse_perm(perm))
        # where, not masked_fill: masked_fill's result is contiguous whatever the layout
        return torch.where(passes, grad, 0), None


def relu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu(x, inplace)`` keeping one bit per element when ``x`` needs grad; otherwise (no
    grad, non-floating input, inside torch.func transforms) ``F.relu`` itself."""
    if not needs_grad(x) or plain_under_functorch("ReLU"):
        return torch.nn.functional.relu(x, inplace)
    if inplace and torch.compiler.is_compiling():
        # Dynamo breaks the graph at a Function that marks its input dirty; the compiler
        # makes the copy in place again
        return x.copy_(ReLUFn.apply(x, False))
    return ReLUFn.apply(x, inplace)
