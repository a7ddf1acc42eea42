"""Dropout: keeps its mask as 1 bit per element instead of PyTorch's byte (CUDA) or full-width
(CPU) mask; the gradients are PyTorch's bit for bit, since the mask is exact.

The forward draws the mask exactly as ``F.dropout`` does on each device, so the same RNG state
gives the same output: on CUDA (and other devices with a fused kernel) ``torch.native_dropout``,
elsewhere ``empty_like(x).bernoulli_(1 - p)`` scaled by ``1 / (1 - p)`` and multiplied in.
"""

from __future__ import annotations

import torch

from mesa_lite.kernels import bits
from mesa_lite.kernels.bits import pack_bits, unpack_bits
from mesa_lite.ops.common import first_order_only, plain_under_functorch


def _fused(x: torch.Tensor, p: float) -> bool:
    """Whether ``F.dropout`` runs the fused ``native_dropout`` kernel on ``x`` (ATen's
    ``is_fused_kernel_acceptable``)."""
    return x.device.type not in ("cpu", "mps", "meta") and 0 < p < 1 and x.numel() > 0


def dropout_forward(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``F.dropout(x, p, training=True)`` (0 < p < 1): ``(out, packed mask, info)``, the mask
    as ``pack_bits`` packs it and ``info`` what ``dropout_backward`` needs besides."""
    fused = _fused(x, p)
    if fused:
        out, mask = torch.native_dropout(x, p, True)
        scale = 1.0 / (1.0 - p)
    else:
        noise = torch.empty_like(x).bernoulli_(1 - p)
        noise.div_(1 - p)
        out = x * noise
        mask = noise.ne(0)
        # the scale as the kept noise holds it, rounded to x's dtype
        scale = noise.new_ones(()).div_(1 - p)
    return out, pack_bits(mask), (fused, scale, x.shape)


def dropout_backward(grad: torch.Tensor, packed: torch.Tensor, info: tuple) -> torch.Tensor:
    """The input gradient of ``dropout_forward`` from its packed mask and info."""
    fused, scale, shape = info
    if fused:  # one pass from the bits on the GPU
        return bits.dropout_backward(grad, packed, scale)
    mask = unpack_bits(packed, shape)
    noise = torch.zeros(shape, dtype=scale.dtype, device=grad.device)
    noise.masked_fill_(mask, scale)
    return grad * noise


class DropoutFn(torch.autograd.Function):
    """``F.dropout(x, p, training=True)`` keeping the mask as packed bits."""

    @staticmethod
    def forward(ctx, x, p: float):
        out, packed, ctx.info = dropout_forward(x, p)
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        return dropout_backward(grad, packed, ctx.info), None


def dropout(x: torch.Tensor, p: float, training: bool = True, inplace: bool = False):
    """``F.dropout`` keeping its mask as 1 bit per element when ``x`` needs grad; anything else
    (p 0 or 1, eval, no grad, an in-place call, non-floating input) is ``F.dropout`` itself."""
    plain = (
        not training
        or inplace
        or not 0 < p < 1
        or x.numel() == 0
        or not x.is_floating_point()
        or not (torch.is_grad_enabled() and x.requires_grad)
        or plain_under_functorch("Dropout")
    )
    if plain:
        return torch.nn.functional.dropout(x, p, training, inplace)
    return DropoutFn.apply(x, p)
