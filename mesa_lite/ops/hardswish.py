"""Hardswish: keeps its input in int8 plus 2 bits per element, which of its three pieces the
input fell on (``x < -3``, ``-3 <= x <= 3``, ``x > 3``, as torch's ``hardswish_backward``
branches).

Its gradient jumps at -3 and 3 (0 / -0.5, 1.5 / 1), so a rebuilt input rounded across them
would take the wrong piece; with the pieces kept, backward runs torch's own
``hardswish_backward`` on a stand-in input: the rebuilt input (held inside [-3, 3]) where the
input was in the middle piece, -4 or 4 where it was not. The outer pieces' gradients (0 and
the gradient itself) are then exact, the middle one's ``grad * (x / 3 + 0.5)`` is off by the
rounding of ``x``. A NaN input takes the right-hand piece, as in torch. With ``debug_exact``
torch's own op runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.kernels.bits import pack_bits, pack_bits_ref, unpack_bits
from mesa_lite.ops.common import first_order_only, needs_grad, plain_under_functorch


class HardswishFn(torch.autograd.Function):
    """``F.hardswish(x)`` (in place with ``inplace``) keeping int8 ``x`` and its pieces."""

    @staticmethod
    def forward(ctx, x, inplace: bool, spec: QuantSpec):
        compiling = torch.compiler.is_compiling()
        pack = pack_bits_ref if compiling else pack_bits
        left = x < -3
        middle = (x >= -3).logical_and_(x <= 3)
        p = quant.quantize(x, spec)  # row-major order, as the bits
        packed = pack(torch.stack((left, middle)).reshape(2, -1))
        out = F.hardswish(x, inplace)
        if inplace:
            ctx.mark_dirty(x)
        quant.save(ctx, p, packed)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        p, packed = quant.load(ctx)
        x = quant.dequantize(p, ctx.x_dtype)
        left, middle = unpack_bits(packed, (2, *p.shape)).unbind(0)
        outer = torch.where(left, -4.0, 4.0).to(x.dtype)
        stand_in = torch.where(middle, x.clamp(-3, 3), outer)
        return torch.ops.aten.hardswish_backward(grad, stand_in), None, None


def hardswish(x: torch.Tensor, inplace: bool, spec: QuantSpec) -> torch.Tensor:
    """``F.hardswish(x, inplace)`` keeping int8 ``x`` and 2 bits per element; torch's own op
    without grad, with ``debug_exact``, for inputs that are not fp32/fp16/bf16, and inside
    torch.func transforms."""
    if (
        not needs_grad(x)
        or spec.exact
        or not quant.compressible(x)
        or plain_under_functorch("Hardswish")
    ):
        return F.hardswish(x, inplace)
    if inplace and torch.compiler.is_compiling():
        # Dynamo breaks the graph at a Function that marks its input dirty
        return x.copy_(HardswishFn.apply(x, False, spec))
    return HardswishFn.apply(x, inplace, spec)
