"""MaxPool2d: keeps one byte per output (where in its window the maximum was) instead of
torch's input and int64 indices.

torch's ``max_pool2d_with_indices`` keeps its whole input (read only for its shape in
backward) and an int64 index per output. Here the index is kept as its offset in the
pooling window, ``row * kernel_w + col`` (a byte for windows up to 256 elements), and
backward rebuilds the int64 indices from it and runs torch's own
``max_pool2d_with_indices_backward``: the gradients are torch's bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite.ops.common import first_order_only, needs_grad, plain_under_functorch


def _grid(out_shape, cfg, device):
    """Top-left input row and column of each output's window, ``(rows[:, None], cols)``."""
    (_, _), (sh, sw), (ph, pw), _, _ = cfg
    oh, ow = out_shape[-2], out_shape[-1]
    rows = torch.arange(oh, device=device) * sh - ph
    cols = torch.arange(ow, device=device) * sw - pw
    return rows[:, None], cols[None, :]


def _compact(indices: torch.Tensor, width: int, cfg) -> torch.Tensor:
    """int64 flat indices (``row * width + col``) as uint8 window offsets."""
    (_, kw), _, _, (dh, dw), _ = cfg
    top, left = _grid(indices.shape, cfg, indices.device)
    r = torch.div(indices, width, rounding_mode="floor") - top
    c = indices.remainder(width) - left
    return (
        torch.div(r, dh, rounding_mode="floor") * kw + torch.div(c, dw, rounding_mode="floor")
    ).to(torch.uint8)


def _expand(offsets: torch.Tensor, width: int, cfg) -> torch.Tensor:
    """The int64 flat indices of ``_compact``'s offsets."""
    (_, kw), _, _, (dh, dw), _ = cfg
    top, left = _grid(offsets.shape, cfg, offsets.device)
    off = offsets.long()
    r = top + torch.div(off, kw, rounding_mode="floor") * dh
    c = left + off.remainder(kw) * dw
    return r * width + c


class MaxPool2dFn(torch.autograd.Function):
    """``F.max_pool2d`` keeping a byte per output. ``cfg``: ``(kernel, stride, padding,
    dilation, ceil_mode)``, each a pair but ``ceil_mode``."""

    @staticmethod
    def forward(ctx, x, cfg):
        kernel, stride, padding, dilation, ceil_mode = cfg
        out, indices = torch.ops.aten.max_pool2d_with_indices(
            x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode
        )
        ctx.save_for_backward(_compact(indices, x.shape[-1], cfg))
        ctx.cfg = cfg
        ctx.x_meta = (x.shape, x.stride(), x.dtype)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = ctx.cfg
        x_shape, x_stride, x_dtype = ctx.x_meta
        indices = _expand(offsets, x_shape[-1], ctx.cfg)
        x = grad.new_empty_strided(x_shape, x_stride, dtype=x_dtype)  # read for its shape
        gx = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode,
            indices,
        )  # fmt: skip
        return gx, None


def _pair(v) -> tuple[int, int]:
    """An int or a sequence of one or two ints, as torch's max_pool2d reads them."""
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else v


def max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode):
    """``F.max_pool2d`` (no indices returned) keeping a byte per output when ``x`` needs grad
    and the window has at most 256 elements; otherwise ``F.max_pool2d`` itself."""
    kernel = _pair(kernel_size)
    empty = stride is None or (not isinstance(stride, int) and len(stride) == 0)
    stride = kernel if empty else _pair(stride)
    cfg = (kernel, stride, _pair(padding), _pair(dilation), ceil_mode)
    if (
        not needs_grad(x)
        or x.dim() not in (3, 4)
        or kernel[0] * kernel[1] > 256
        or plain_under_functorch("MaxPool2d")
    ):
        return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)
    return MaxPool2dFn.apply(x, cfg)
