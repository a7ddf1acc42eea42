"""ReLU: keeps 1 bit per element (where the gradient passes) instead of its output.

torch's ReLU keeps its output and its backward is ``threshold_backward(grad, out, 0)``: zero
where ``out <= 0``, ``grad`` elsewhere (a NaN output passes its gradient). The bit kept is that
condition, so the gradients are torch's bit for bit. In place (``nn.ReLU(inplace=True)``, as
timm's ResNets build it) the input is modified and returned, as ``relu_`` does.
"""

from __future__ import annotations

import torch

from mesa_lite.kernels.bits import pack_bits, pack_bits_ref, unpack_bits
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
        passes = out.le(0).logical_not_()
        # kept in the output's memory order (channels-last too), so that the gradient takes
        # the layout torch's backward gives it
        ctx.perm = channels_last_perm(passes)
        if ctx.perm is not None:
            passes = passes.permute(ctx.perm)
        # the Triton packer is a direct launch, which torch.compile cannot trace: there the
        # reference's torch ops, which Inductor fuses
        packed = pack_bits_ref(passes) if torch.compiler.is_compiling() else pack_bits(passes)
        ctx.save_for_backward(packed)
        ctx.shape = passes.shape
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        passes = unpack_bits(packed, ctx.shape)
        if ctx.perm is not None:
            passes = passes.permute(inverse_perm(ctx.perm))
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
