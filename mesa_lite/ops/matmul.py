"""MatMul: ``a @ b`` keeping both operands compressed."""

from __future__ import annotations

import math

import torch

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import (
    autocast_cast,
    autocast_dtype,
    first_order_only,
    fresh,
    keep,
    needs_grad,
    plain_under_functorch,
    register_probe,
)

register_probe("matmul", 2, lambda a, b: torch.matmul(a, b))


def _sum_to(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return g if g.shape == shape else g.sum_to_size(shape)


def _keep_operand(t: torch.Tensor, t0: torch.Tensor | None, spec: QuantSpec):
    """A matmul operand to keep: a Parameter (``t0``, before any autocast cast) as itself, as
    a Linear keeps its weight (it lives anyway; cast again in backward); else compressed."""
    if isinstance(t0, torch.nn.Parameter):
        return t0
    return keep(t, spec, share_key=t0)


def _operand(kept, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(kept, quant.Packed):
        return quant.dequantize(kept, dtype)
    return kept.to(dtype)


class MatMulFn(torch.autograd.Function):
    """``a @ b`` for operands of 2 or more dims (batch dims broadcast), keeping both compressed
    (``a`` only when ``b`` needs grad, ``b`` only when ``a`` does; a Parameter as itself).

    ``shares``: a tuple ``(a0, b0)`` of the tensors whose existing codes may be reused (the
    operands before the autocast cast; see ``quant.lookup_shared``). A tuple, so that autograd
    does not take them for inputs.
    """

    @staticmethod
    def forward(ctx, a, b, spec: QuantSpec, shares=(None, None)):
        out = torch.matmul(a, b)
        pa = _keep_operand(a, shares[0], spec) if ctx.needs_input_grad[1] else None
        pb = _keep_operand(b, shares[1], spec) if ctx.needs_input_grad[0] else None
        quant.save(ctx, pa, pb)
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.shapes = (a.shape, b.shape)
        # a 2-D ``a`` row-major: torch.matmul's folded mm has ``a.mT`` column-major as its
        # second operand, whose gradient mm's backward computes as (grad^T @ mat1)^T
        ctx.a_rows = a.dim() == 2 and a.stride(1) == 1 and a.stride(0) == a.shape[1]
        return fresh(out)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        pa, pb = quant.load(ctx)
        a_shape, b_shape = ctx.shapes
        a_dims, b_dims = len(a_shape), len(b_shape)
        grad_a = grad_b = None
        # Mirror torch.matmul's own folding into one mm when one operand is 2-D, and into one
        # bmm of the expanded, reshaped operands when both have batch dims (a reshape that
        # copies a strided view, such as timm's k of its qkv output, gives the bmm the layout
        # PyTorch's backward uses), so that the gradients of the exact (debug) mode equal
        # PyTorch's bit for bit.
        batched = a_dims >= 3 and b_dims >= 3
        if batched:
            batch = torch.broadcast_shapes(a_shape[:-2], b_shape[:-2])
            n = math.prod(batch)  # (not -1: ambiguous for an empty tensor)
            g3 = grad.reshape(n, *grad.shape[-2:])
        if ctx.needs_input_grad[0]:
            b = _operand(pb, ctx.dtypes[1])
            if a_dims == 2 and b_dims >= 3:
                rows = math.prod(b.shape[:-2]) * b.shape[-1]
                bt = b.transpose(-2, -1).reshape(rows, b.shape[-2])
                gt = grad.transpose(-2, -1).reshape(rows, grad.shape[-2])
                grad_a = gt.t() @ bt if ctx.a_rows else (bt.t() @ gt).t()
            elif batched:
                b3 = b.expand(*batch, *b_shape[-2:]).reshape(n, *b_shape[-2:])
                grad_a = g3.bmm(b3.transpose(1, 2)).view(*batch, *a_shape[-2:])
                grad_a = _sum_to(grad_a, a_shape)
            else:
                grad_a = _sum_to(torch.matmul(grad, b.transpose(-2, -1)), a_shape)
        if ctx.needs_input_grad[1]:
            a = _operand(pa, ctx.dtypes[0])
            if b_dims == 2 and a_dims >= 3:
                rows = math.prod(a.shape[:-1])
                grad_b = a.reshape(rows, a.shape[-1]).t() @ grad.reshape(rows, grad.shape[-1])
            elif batched:
                a3 = a.expand(*batch, *a_shape[-2:]).reshape(n, *a_shape[-2:])
                grad_b = a3.transpose(1, 2).bmm(g3).view(*batch, *b_shape[-2:])
                grad_b = _sum_to(grad_b, b_shape)
            else:
                grad_b = _sum_to(torch.matmul(a.transpose(-2, -1), grad), b_shape)
        return grad_a, grad_b, None, None


def matmul(a: torch.Tensor, b: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """``torch.matmul(a, b)`` keeping both operands compressed (when they need grad).

    Operands of fewer than 2 dims run the plain op, exact.
    """
    if spec is None or a.dim() < 2 or b.dim() < 2 or not needs_grad(a, b):
        return torch.matmul(a, b)
    if plain_under_functorch("matmul"):
        return torch.matmul(a, b)
    dtype = autocast_dtype("matmul", a.device)
    bc = autocast_cast(b, dtype)  # b first, as autocast casts (see scaled_dot_product_attention)
    return MatMulFn.apply(autocast_cast(a, dtype), bc, spec, (a, b))
