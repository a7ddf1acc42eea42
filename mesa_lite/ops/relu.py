"""ReLU and its piecewise-linear family (ReLU6 / Hardtanh, LeakyReLU, Hardsigmoid): each keeps
1 bit per element, which piece of the function the element fell on, instead of its input or
output (Hardsigmoid's gradient is ``grad / 6`` inside (-3, 3), 0 outside).

torch's ReLU keeps its output and its backward is ``threshold_backward(grad, out, 0)``: zero
where ``out <= 0``, ``grad`` elsewhere (a NaN output passes its gradient). The bit kept is that
condition. Hardtanh (ReLU6 is Hardtanh(0, 6)) passes the gradient unless ``x <= min_val`` or
``x >= max_val`` (NaN passes), LeakyReLU scales it by ``negative_slope`` unless ``x > 0``; the
bit is that condition, taken from the input before the op (in place, torch tests the output,
which gives the same bit). Backward selects or scales the gradient with torch's own backward
ops, so the gradients are torch's bit for bit. Hardtanh's bit is taken by torch's own backward
op on a gradient of ones, so it follows that op's comparisons. One exception: torch's CPU
Hardtanh backward treats a NaN input, and in bf16 an input within rounding of the range's ends,
differently in its vectorized and its scalar loop, so the result depends on where the element
falls, which the gradient's layout and the tensor's size move; the bit follows the layout of
the forward. With ``debug_exact`` Hardtanh runs torch's own op, exact by definition. In place
(``inplace=True``, as timm's ResNets build their ReLUs) the input is modified and returned, as
torch's in-place ops do.
"""

from __future__ import annotations

import torch

from mesa_lite.kernels.bits import (
    pack_bits,
    pack_bits_ref,
    pack_positive,
    pack_positive_ref,
    relu_backward,
    unpack_bits,
)
from mesa_lite.ops.common import (
    channels_last_perm,
    first_order_only,
    inverse_perm,
    needs_grad,
    plain_under_functorch,
)

F = torch.nn.functional


def _apply(x: torch.Tensor, op: tuple, inplace: bool) -> torch.Tensor:
    """The forward of ``op``: ``("relu",)``, ``("hardtanh", min_val, max_val)`` or
    ``("leaky", negative_slope)``."""
    if op[0] == "relu":
        return F.relu(x, inplace)
    if op[0] == "hardtanh":
        return F.hardtanh(x, op[1], op[2], inplace)
    if op[0] == "hardsigmoid":
        return F.hardsigmoid(x, inplace)
    return F.leaky_relu(x, op[1], inplace)


def _bits(x: torch.Tensor, op: tuple) -> torch.Tensor:
    """The bool condition of ``op`` on its input (Hardtanh, LeakyReLU)."""
    ones = torch.ones_like(x, memory_format=torch.preserve_format)
    if op[0] == "hardtanh":
        return torch.ops.aten.hardtanh_backward(ones, x, op[1], op[2]).ne_(0).bool()
    if op[0] == "hardsigmoid":
        return torch.ops.aten.hardsigmoid_backward(ones, x).ne_(0).bool()
    return x > 0


class ReLUFn(torch.autograd.Function):
    """``op`` (see ``_apply``) out of place, or in place with ``inplace``, keeping its
    condition packed 8 per byte, in the memory order of the output (channels-last too, so that
    the gradient takes the layout torch's backward gives it)."""

    @staticmethod
    def forward(ctx, x, inplace: bool, op: tuple = ("relu",)):
        compiling = torch.compiler.is_compiling()
        ctx.perm = channels_last_perm(x)
        ctx.op = op
        if op[0] != "relu":  # the condition from the input, before an in-place op changes it
            bits = _bits(x, op)
            src = bits if ctx.perm is None else bits.permute(ctx.perm)
            # the Triton packers are direct launches, which torch.compile cannot trace: there
            # the references' torch ops, which Inductor fuses
            packed = pack_bits_ref(src) if compiling else pack_bits(src)
        out = _apply(x, op, inplace)
        if inplace:
            ctx.mark_dirty(x)
        if op[0] == "relu":  # the bit straight from the output, in one pass
            src = out if ctx.perm is None else out.permute(ctx.perm)
            packed = pack_positive_ref(src) if compiling else pack_positive(src)
        ctx.save_for_backward(packed)
        ctx.shape = src.shape
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        perm, op = ctx.perm, ctx.op
        g = grad if perm is None else grad.permute(perm)
        selects = op[0] in ("relu", "hardtanh")
        if selects and not torch.compiler.is_compiling() and g.is_contiguous():
            # the gradient in the bits' order: one pass, the result in the gradient's layout
            out = relu_backward(g, packed)
            return (out if perm is None else out.permute(inverse_perm(perm))), None, None
        passes = unpack_bits(packed, ctx.shape)
        if perm is not None:
            passes = passes.permute(inverse_perm(perm))
        if op[0] == "leaky":
            # torch's own backward on a stand-in input with the kept sign: its arithmetic
            sign = torch.where(passes, 1.0, -1.0).to(grad.dtype)
            return torch.ops.aten.leaky_relu_backward(grad, sign, op[1], False), None, None
        if op[0] == "hardsigmoid":  # a stand-in inside (0) or outside (4) of (-3, 3)
            stand_in = torch.where(passes, 0.0, 4.0).to(grad.dtype)
            return torch.ops.aten.hardsigmoid_backward(grad, stand_in), None, None
        # where, not masked_fill: masked_fill's result is contiguous whatever the layout
        return torch.where(passes, grad, 0), None, None


def relu(
    x: torch.Tensor, inplace: bool = False, op: tuple = ("relu",), exact: bool = False
) -> torch.Tensor:
    """``F.relu(x, inplace)`` (or the Hardtanh / LeakyReLU ``op``, see ``_apply``) keeping one
    bit per element when ``x`` needs grad (``exact``, debug_exact: Hardtanh runs torch's op,
    see the module's docstring); otherwise (no grad, non-floating input, inside
    torch.func transforms) the torch op itself. In-place LeakyReLU with a negative slope runs
    torch's op, whose backward refuses it as torch does."""
    if (
        not needs_grad(x)
        or plain_under_functorch("ReLU")
        or (inplace and op[0] == "leaky" and op[1] < 0)
        or (exact and op[0] == "hardtanh")
    ):
        return _apply(x, op, inplace)
    if inplace and torch.compiler.is_compiling():
        # Dynamo breaks the graph at a Function that marks its input dirty; the compiler
        # makes the copy in place again
        # makes the copy in place again
        return x.copy_(ReLUFn.apply(x, False, op))
    return ReLUFn.apply(x, inplace, op)
