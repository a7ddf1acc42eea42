"""GroupNorm: keeps its normalized input ``(x - mean) * rstd`` compressed (plus the fp32
per-(sample, group) mean and rstd it computed) instead of its input.

Forward is what ``F.group_norm`` runs (``at::group_norm``: the input made contiguous in its
suggested memory format on the CPU, row-major elsewhere, then ``native_group_norm``), so the
output is torch's bit for bit; backward rebuilds that input from the codes, ``x_hat / rstd +
mean``, and calls ``native_group_norm_backward`` as torch's own backward does, so with
``debug_exact`` the gradients are torch's bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import (
    autocast_cast,
    autocast_dtype,
    channels_last_perm,
    dtypes_of,
    first_order_only,
    plain_under_functorch,
    recast,
    register_probe,
)

register_probe("group_norm", 1, lambda a: F.group_norm(a.expand(1, 1, 2), 1))


def _keep_normalized(x, mean, rstd, groups: int, spec: QuantSpec) -> quant.Packed:
    """Codes of the normalized input in row-major order: rows of one (sample, group), through
    the quantize kernel's own normalization for a row-major input, torch ops otherwise."""
    rows = (mean.reshape(-1), rstd.reshape(-1))
    if x.is_contiguous():
        return quant.quantize(x, spec, normalize=rows)
    n = x.shape[0]
    stat = (n, groups, 1)
    x_hat = (x.float().reshape(n, groups, -1) - mean.float().view(stat)) * rstd.float().view(stat)
    return quant.quantize(x_hat.view(x.shape), spec)


def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    """``suggest_memory_format()`` of ATen for a dense ``x``: channels-last when ``x`` is laid
    out so (and not also row-major), else row-major."""
    if x.dim() not in (4, 5) or channels_last_perm(x) is None:
        return torch.contiguous_format
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


class GroupNormFn(torch.autograd.Function):
    """``F.group_norm``. ``cfg``: ``(groups, eps, dtype)``, ``dtype`` autocast's cast target
    for the input, weight and bias (None: no cast)."""

    @staticmethod
    def forward(ctx, x, weight, bias, cfg, spec: QuantSpec):
        groups, eps, dtype = cfg
        n, c = x.shape[0], x.shape[1]
        hxw = x.numel() // max(n * c, 1)
        # at::group_norm: the CPU keeps the suggested memory format, other devices row-major
        if x.device.type == "cpu":
            x = x.contiguous(memory_format=_suggested_format(x))
        else:
            x = x.contiguous()
        w = None if weight is None else autocast_cast(weight, dtype).contiguous()
        b = None if bias is None else autocast_cast(bias, dtype).contiguous()
        out, mean, rstd = torch.ops.aten.native_group_norm(x, w, b, n, c, hxw, groups, eps)
        if spec.exact or not quant.compressible(x):  # debug_exact, fp64: x itself
            px = quant.quantize(x, spec)
        else:
            px = _keep_normalized(x, mean, rstd, groups, spec)
        quant.save(ctx, px, weight, mean, rstd)
        ctx.cfg, ctx.dims = cfg, (n, c, hxw)
        ctx.x_meta = (x.shape, x.stride(), x.dtype)
        ctx.param_dtypes = dtypes_of(weight, bias)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, weight, mean, rstd = quant.load(ctx)
        groups, eps, dtype = ctx.cfg
        n, c, hxw = ctx.dims
        x_shape, x_stride, x_dtype = ctx.x_meta
        if px.spec.exact:
            x = px.codes
        else:
            x = quant.unnormalize(px, mean.reshape(-1), rstd.reshape(-1), x_dtype).view(x_shape)
            if x.stride() != x_stride:  # channels-last on the CPU: the input's own layout
                x = x.new_empty_strided(x_shape, x_stride).copy_(x)
        w = None if weight is None else recast(weight, dtype).contiguous()
        w_dtype, b_dtype = ctx.param_dtypes
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1] and w_dtype is not None,
                ctx.needs_input_grad[2] and b_dtype is not None]  # fmt: skip
        # as torch's derivative formula: the gradient in the input's memory format on the CPU
        if grad.device.type == "cpu":
            grad = grad.contiguous(memory_format=_suggested_format(x))
        else:
            grad = grad.contiguous()
        gx, gw, gb = torch.ops.aten.native_group_norm_backward(
            grad, x, mean, rstd, w, n, c, hxw, groups, mask
        )
        gw = gw.to(w_dtype) if mask[1] else None
        gb = gb.to(b_dtype) if mask[2] else None
        return (gx if mask[0] else None), gw, gb, None, None


def group_norm(x, groups: int, weight, bias, eps: float, spec: QuantSpec) -> torch.Tensor:
    """``F.group_norm(x, groups, weight, bias, eps)`` keeping the normalized input
    compressed."""
    bad = x.dim() < 2 or x.numel() == 0 or x.shape[1] % groups
    if plain_under_functorch("GroupNorm") or bad:
        return F.group_norm(x, groups, weight, bias, eps)  # torch's own errors for bad input
    dtype = autocast_dtype("group_norm", x.device)
    return GroupNormFn.apply(autocast_cast(x, dtype), weight, bias, (groups, eps, dtype), spec)
