"""Convolution: ``F.conv1d/2d/3d`` keeping its (autocast-cast) input compressed; the weight is
kept as the Parameter itself (as in ``ops/linear.py``).

A channels-last input is kept in its memory order (the codes of ``x.permute(0, 2, ..., 1)``)
and rebuilt as a channels-last tensor, so backward runs on the layout torch's own backward
sees, with no copy. The gradients are ``aten.convolution_backward``'s, called as torch's
``ConvolutionBackward0`` calls it: bit for bit torch's with ``debug_exact``. A frozen
convolution keeps no input, where torch keeps it whenever the op records a backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import (
    autocast_cast,
    autocast_dtype,
    cast,
    channels_last_perm,
    claim,
    first_order_only,
    fresh,
    inverse_perm,
    keep,
    offerable,
    plain_under_functorch,
    recast,
    register_probe,
)

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
for _nd in (1, 2, 3):
    for _name, _fn in ((f"conv{_nd}d", _CONV[_nd]), (f"conv_transpose{_nd}d", _CONV_T[_nd])):
        register_probe(
            _name,
            2,
            lambda a, b, fn=_fn, nd=_nd: fn(a.view((1,) * (nd + 2)), b.view((1,) * (nd + 2))),
        )


class ConvFn(torch.autograd.Function):
    """``F.convNd`` (or ``F.conv_transposeNd``) keeping the compressed input. ``cfg``: ``(nd,
    stride, padding, dilation, groups, dtype, output_padding)``, ``padding`` as ints, ``dtype``
    autocast's cast target for the weight and bias (None: no cast), ``output_padding`` None
    for a convolution, a transposed convolution's otherwise. The input is kept only when the
    weight needs grad, the weight only when the input does."""

    @staticmethod
    def forward(ctx, x, weight, bias, cfg, spec: QuantSpec, shares=(None,)):
        nd, stride, padding, dilation, groups, dtype, output_padding = cfg
        w, b = autocast_cast(weight, dtype), autocast_cast(bias, dtype)
        if output_padding is None:
            out = _CONV[nd](x, w, b, stride, padding, dilation, groups)
        else:
            out = _CONV_T[nd](x, w, b, stride, padding, output_padding, groups, dilation)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        px = None
        ctx.perm = None
        if need_w:
            ctx.perm = channels_last_perm(x)
            # codes quantized here are offered to the other consumers of x (a ResNet's first
            # block reads its input with two convolutions)
            if ctx.perm is None:
                px = keep(x, spec, share_key=shares[0], offer=True)
            else:  # codes in memory order: a ReLU's shared ones, or quantized here
                xp = x.permute(ctx.perm)
                fresh_codes = quant.lookup_shared(xp, spec) is None
                px = keep(xp, spec)
                claim(x, spec, memory_order=True)
                if fresh_codes and offerable(x):
                    quant.share(x, px, memory_order=True)
        quant.save(ctx, px, weight if need_x else None)
        ctx.cfg = cfg
        ctx.x_meta = (x.shape, x.stride(), x.dtype)
        ctx.w_meta = (weight.shape, weight.stride(), weight.dtype)
        ctx.b_meta = None if bias is None else (bias.shape[0], bias.dtype)
        return fresh(out)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, weight = quant.load(ctx)
        nd, stride, padding, dilation, groups, dtype, output_padding = ctx.cfg
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_shape, x_stride, x_dtype = ctx.x_meta
        w_shape, w_stride, w_dtype = ctx.w_meta
        if need_w:
            x = quant.dequantize(px, x_dtype)
            if ctx.perm is not None:
                x = x.permute(inverse_perm(ctx.perm))
        else:  # only its shape and layout are read
            x = grad.new_empty_strided(x_shape, x_stride, dtype=x_dtype)
        if need_x:
            w = recast(weight, dtype)
        else:
            w = grad.new_empty_strided(w_shape, w_stride, dtype=dtype or w_dtype)
        bias_sizes = None if ctx.b_meta is None else [ctx.b_meta[0]]
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad, x, w, bias_sizes, list(stride), list(padding), list(dilation),
            output_padding is not None, list(output_padding or (0,) * nd), groups,
            [need_x, need_w, bool(need_b and ctx.b_meta is not None)],
        )  # fmt: skip
        gw = None if gw is None else cast(gw, w_dtype)
        gb = None if gb is None else cast(gb, ctx.b_meta[1])
        return gx, gw, gb, None, None, None


def same_padding(kernel_size, dilation) -> tuple[int, ...] | None:
    """``padding="same"`` as ints when it is symmetric in every dim (torch then runs the int
    form); None when torch pads one side more (the plain op runs)."""
    out = []
    for k, d in zip(kernel_size, dilation, strict=True):
        total = d * (k - 1)
        if total % 2:
            return None
        out.append(total // 2)
    return tuple(out)


def conv(x, weight, bias, nd: int, stride, padding, dilation, groups: int, spec: QuantSpec,
         output_padding=None):  # fmt: skip
    """``F.conv{nd}d(x, weight, bias, stride, padding, dilation, groups)`` (int padding), or
    with ``output_padding`` ``F.conv_transpose{nd}d(x, weight, bias, stride, padding,
    output_padding, groups, dilation)``, keeping the input compressed for the weight's
    gradient."""
    if plain_under_functorch("Conv"):
        if output_padding is None:
            return _CONV[nd](x, weight, bias, stride, padding, dilation, groups)
        return _CONV_T[nd](x, weight, bias, stride, padding, output_padding, groups, dilation)
    op = f"conv{nd}d" if output_padding is None else f"conv_transpose{nd}d"
    dtype = autocast_dtype(op, x.device)
    output_padding = None if output_padding is None else tuple(output_padding)
    cfg = (nd, tuple(stride), tuple(padding), tuple(dilation), groups, dtype, output_padding)
    return ConvFn.apply(autocast_cast(x, dtype), weight, bias, cfg, spec, (x,))
