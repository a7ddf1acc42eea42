"""LayerNorm: keeps its normalized input compressed plus fp32 mean and rstd; the same codes
rebuild its output for the next op (an ``affine`` recipe step)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.kernels import norm_backward as fused
from mesa_lite.ops.common import (
    autocast_cast,
    autocast_dtype,
    first_order_only,
    plain_under_functorch,
    register_probe,
    shared_output,
)

register_probe("layer_norm", 1, lambda a: F.layer_norm(a, (1,)))

# LayerNorm's and RMSNorm's compressed backward as one kernel launch that reads the codes
# (kernels/norm_backward.py) for CUDA tensors in eager mode, instead of a dequantize and then
# PyTorch's backward (LayerNorm) or a dozen torch ops (RMSNorm). Off until a GPU run has
# measured it against the unfused path (benchmarks/overhead.py, its "fused norm" column).
FUSED_BACKWARD = False


def fused_backward(p: quant.Packed | None, grad: torch.Tensor, rstd, row_len: int, x_dtype) -> bool:
    """Whether a norm's backward from ``p`` (its kept normalized input) takes the one-launch
    kernel: switched on, compressed with signed codes, on the Triton path, rows and dtypes
    it takes (an fp32 ``rstd``: PyTorch's CPU LayerNorm gives it in the input's dtype)."""
    return (FUSED_BACKWARD and p is not None and not p.spec.exact and p.signed
            and rstd.dtype == torch.float32 and quant.use_triton(grad)
            and fused.fits(row_len, grad.dtype, x_dtype))  # fmt: skip


def _affine_first(p: quant.Packed, step: tuple, aux: list, dtype: torch.dtype) -> torch.Tensor:
    """A LayerNorm's output from what it kept: the affine step on its normalized input inside
    the dequantize kernel, or (exact mode: the input itself) the LayerNorm again."""
    _, _, normalized_shape, eps = step
    weight, bias = aux
    if p.spec.exact:
        return F.layer_norm(p.codes, normalized_shape, weight, bias, eps)
    epilogue = None if weight is None and bias is None else ("affine", weight, bias)
    return quant.stored(p, dtype, epilogue).view(p.shape)


# ("affine", dtype, normalized_shape, eps): the output of a LayerNorm, in fp32 between steps
quant.register_step("affine", quant.RecipeStep(2, _affine_first, None, lambda step: torch.float32))


class LayerNormFn(torch.autograd.Function):
    """Keeps the compressed normalized input ``(x - mean) * rstd`` and the fp32 per-row mean
    and rstd; registers it, with the affine parameters, as the (rebuildable) copy of its
    output, so the next Linear (timm's qkv, fc1) keeps no second copy. The normalized input
    is better conditioned for absmax groups than ``x`` itself (no per-row offset).
    In the exact (debug) mode it keeps ``x`` itself. When only the bias needs grad it keeps
    nothing of ``x``."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps: float, spec: QuantSpec,
                traced: bool = False):  # fmt: skip
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.normalized_shape = normalized_shape
        ctx.x_dtype = x.dtype
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[2]):
            quant.save(ctx, None, None, None, weight, bias)
            ctx.x_shape = x.shape
            return out
        p = keep_normalized(x, mean, rstd, spec)
        quant.save(ctx, p, mean, rstd, weight, bias)
        step = ("affine", out.dtype, normalized_shape, eps)
        # traced: a block-internal norm, shared under compile too
        return shared_output(out, p.derived(step, out.dtype, aux=(weight, bias)), traced=traced)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, mean, rstd, weight, bias = quant.load(ctx)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]]
        shape = ctx.x_shape if px is None else px.shape
        gx, gw, gb = layer_norm_backward(
            grad, px, mean, rstd, weight, bias, ctx.normalized_shape, shape, ctx.x_dtype, mask
        )
        return gx, None, gw, gb, None, None, None


def keep_normalized(x, mean, rstd, spec: QuantSpec) -> quant.Packed:
    """What a LayerNorm keeps of its input ``x``: the normalized input ``(x - mean) * rstd``
    compressed, or ``x`` itself in the exact (debug) mode and for fp64."""
    if spec.exact or not quant.compressible(x):
        return quant.quantize(x, spec)  # x itself (fp64 stays exact)
    return quant.quantize(x, spec, normalize=(mean, rstd))  # (x - mean) * rstd, in fp32


def layer_norm_backward(grad, px, mean, rstd, weight, bias, normalized_shape, x_shape, x_dtype,
                        mask):  # fmt: skip
    """``native_layer_norm_backward`` from what ``keep_normalized`` kept (``px`` None, with
    ``mean`` and ``rstd`` None too, when only the bias needs its gradient)."""
    row_len = math.prod(normalized_shape)
    if fused_backward(px, grad, rstd, row_len, x_dtype):
        gx, gw, gb = fused.norm_backward(
            px.codes, px.scales, px.spec.group_size, px.spec.bits, grad, rstd, weight,
            x_dtype, row_len, center=True, need_x=mask[0], need_sums=mask[1] or mask[2],
            use_triton=True,
        )  # fmt: skip
        gw = gw.view(weight.shape).to(weight.dtype) if mask[1] else None
        gb = gb.view(bias.shape).to(bias.dtype) if mask[2] else None
        return gx, gw, gb
    if px is None:  # only the bias: its gradient reads no x, mean or rstd
        x = grad.new_zeros(()).expand(x_shape)
        stats = x_shape[: len(x_shape) - len(normalized_shape)]
        stats = (*stats, *([1] * len(normalized_shape)))
        mean = rstd = grad.new_zeros((), dtype=torch.float32).expand(stats)
    elif px.spec.exact:
        x = quant.dequantize(px)
    else:  # x = x_hat / rstd + mean
        # rstd is 0 where the variance overflowed (|x| ~ 1e19 in fp32): torch's gradient
        # is 0 there whatever x is, and 0 / 0 must not turn it into NaN (mean is taken)
        x = quant.unnormalize(px, mean, rstd, x_dtype)
    return torch.ops.aten.native_layer_norm_backward(
        grad.contiguous(), x, normalized_shape, mean, rstd, weight, bias, mask
    )


def layer_norm(x, shape: tuple, weight, bias, eps: float, spec: QuantSpec,
               traced: bool = False) -> torch.Tensor:  # fmt: skip
    """``F.layer_norm`` keeping its normalized input compressed; ``traced``: its output's codes
    serve its consumer under torch.compile too (a block-internal norm, ``shared_output``)."""
    if plain_under_functorch("LayerNorm"):
        return F.layer_norm(x, shape, weight, bias, eps)
    dtype = autocast_dtype("layer_norm", x.device)
    w, b = autocast_cast(weight, dtype), autocast_cast(bias, dtype)
    return LayerNormFn.apply(autocast_cast(x, dtype), shape, w, b, eps, spec, traced)
