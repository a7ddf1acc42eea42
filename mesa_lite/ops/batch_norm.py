"""BatchNorm in training mode: keeps its normalized input ``(x - mean) * invstd`` compressed
(plus the per-channel mean and invstd it computed) instead of its input.

Forward is torch's own ``_batch_norm_impl_index`` (what ``F.batch_norm`` runs: the same output
and the same in-place update of the running statistics). Backward, for a contiguous input with
spatial dimensions (the codes are then rows of the spatial size), computes the gradients from
the codes of ``x_hat`` in two passes that never write the input out
(``kernels/batch_norm_backward.py``: the per-channel sums, then the input's gradient, with
torch's formula); otherwise (a channels-last or (N, C) input, ``FUSED_BACKWARD`` off, or under
torch.compile, which traces the native pair ``native_batch_norm`` and its backward instead) it
rebuilds the input from the codes, ``x_hat / invstd + mean``, and calls
``_batch_norm_impl_index_backward`` as torch's own backward does (its cuDNN, MIOpen or native
form, with the saved statistics and reserve). With ``debug_exact`` the input itself is kept and
torch's backward runs: the gradients are torch's bit for bit.
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
    inverse_perm,
    plain_under_functorch,
    recast,
    register_probe,
)

# backward from x_hat's codes in two passes (kernels/batch_norm_backward.py) where the codes are
# rows of a contiguous input; False: the input rebuilt and torch's backward (debugging, A/B)
FUSED_BACKWARD = True

register_probe(
    "batch_norm", 1, lambda a: F.batch_norm(a, a.new_zeros(1).float(), a.new_ones(1).float())
)
register_probe("instance_norm", 1, lambda a: F.instance_norm(a.expand(1, 1, 2)))


def _stat_shape(shape) -> tuple[int, ...]:
    """Per-channel statistics' shape, broadcasting over an input of ``shape``."""
    return (1, shape[1]) + (1,) * (len(shape) - 2)


def _keep_normalized(x, mean, invstd, spec: QuantSpec) -> quant.Packed:
    """Codes of ``(x - mean) * invstd`` (per channel, fp32): rows of the spatial size through
    the quantize kernel's own normalization for a contiguous input, the torch ops otherwise."""
    n, c = x.shape[0], x.shape[1]
    spatial = x.numel() // max(n * c, 1)
    if x.is_contiguous() and spatial > 1:
        rows = (mean.float().repeat(n), invstd.float().repeat(n))
        return quant.quantize(x, spec, normalize=rows)
    shape = _stat_shape(x.shape)
    x_hat = (x.float() - mean.float().view(shape)) * invstd.float().view(shape)
    return quant.quantize(x_hat, spec)


def _dense(shape, stride) -> bool:
    """Whether ``stride`` lays ``shape`` out without gaps or overlap (a permutation of the
    row-major layout; an expanded tensor's zero strides overlap)."""
    expected = 1
    pairs = sorted((st, size) for size, st in zip(shape, stride, strict=True) if size != 1)
    for st, size in pairs:
        if st != expected:
            return False
        expected *= size
    return True


def _rebuild_input(p: quant.Packed, mean, invstd, dtype, x_shape) -> torch.Tensor:
    """The input from its normalized codes, ``x_hat / invstd + mean`` per channel in fp32 then
    one cast to ``dtype``, in one dequantize pass (rows of the spatial size; no fp32
    temporaries), in row-major order; or the input itself, kept exactly (debug_exact, fp64)."""
    if p.spec.exact:
        return p.codes
    n = x_shape[0] if len(x_shape) > 1 else 1
    rows = (mean.float().repeat(n), invstd.float().repeat(n))
    return quant.unnormalize(p, *rows, dtype).view(x_shape)


class BatchNormFn(torch.autograd.Function):
    """``F.batch_norm`` in training mode. ``cfg``: ``(momentum, eps, dtype)``, ``dtype``
    autocast's cast target for the weight and bias (None: no cast)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, cfg, spec: QuantSpec):
        momentum, eps, dtype = cfg
        w, b = autocast_cast(weight, dtype), autocast_cast(bias, dtype)
        compiling = torch.compiler.is_compiling()
        if compiling:
            out, mean, invstd = torch.ops.aten.native_batch_norm(
                x, w, b, running_mean, running_var, True, momentum, eps
            )
            reserve, impl = None, -1
        else:
            out, mean, invstd, reserve, impl = torch.ops.aten._batch_norm_impl_index(
                x, w, b, running_mean, running_var, True, momentum, eps,
                torch.backends.cudnn.enabled,
            )  # fmt: skip
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        px = None
        ctx.rows = False  # x_hat's codes in row-major order, rows of the spatial size
        if need_x or need_w:
            if spec.exact or not quant.compressible(x):  # debug_exact, fp64: x itself
                px = quant.quantize(x, spec)
            else:
                px = _keep_normalized(x, mean, invstd, spec)
                ctx.rows = x.is_contiguous() and x.numel() > x.shape[0] * x.shape[1]
        quant.save(ctx, px, weight, running_mean, running_var, mean, invstd, reserve)
        ctx.cfg, ctx.impl = cfg, impl
        ctx.x_meta = (x.shape, x.stride(), x.dtype)
        ctx.param_dtypes = dtypes_of(weight, bias)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, weight, running_mean, running_var, mean, invstd, reserve = quant.load(ctx)
        momentum, eps, dtype = ctx.cfg
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_shape, x_stride, x_dtype = ctx.x_meta
        fused = FUSED_BACKWARD and ctx.rows and grad.dtype == x_dtype
        if fused and not torch.compiler.is_compiling():
            # from x_hat's codes, never rebuilding the input (kernels/batch_norm_backward.py)
            w = None if weight is None else recast(weight, dtype)
            gx, sums = quant.batch_norm_backward(px, grad, invstd, w, need_x)
            w_dtype, b_dtype = ctx.param_dtypes
            gw = sums[1].to(w_dtype) if need_w and weight is not None else None
            gb = sums[0].to(b_dtype) if need_b and b_dtype is not None else None
            return gx, gw, gb, None, None, None, None
        if px is not None:
            x = _rebuild_input(px, mean, invstd, x_dtype, x_shape)
            if x.stride() != x_stride:
                # in the input's layout (channels-last): the backward's reductions, so its
                # gradients, follow the layout; not an expanded input's overlapping strides
                if _dense(x_shape, x_stride):
                    x = x.new_empty_strided(x_shape, x_stride).copy_(x)
        else:  # only the bias needs a gradient: the input is not read
            x = grad.new_empty_strided(x_shape, x_stride, dtype=x_dtype)
        w = recast(weight, dtype)
        perm = channels_last_perm(x) if torch.compiler.is_compiling() else None
        if perm is not None:
            # the compiler hands backward a contiguous gradient where eager mode passes the
            # output's channels-last one on; the reductions follow the layout
            grad = grad.permute(perm).contiguous().permute(inverse_perm(perm))
        mask = [need_x, need_w and weight is not None, need_b and ctx.param_dtypes[1] is not None]
        if ctx.impl < 0:
            gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                grad, x, w, running_mean, running_var, mean, invstd, True, eps, mask
            )
        else:
            gx, gw, gb = torch.ops.aten._batch_norm_impl_index_backward(
                ctx.impl, x, grad, w, running_mean, running_var, mean, invstd, True, eps, mask,
                reserve,
            )  # fmt: skip
        w_dtype, b_dtype = ctx.param_dtypes
        gw = None if gw is None or not mask[1] else gw.to(w_dtype)
        gb = None if gb is None or not mask[2] else gb.to(b_dtype)
        return (gx if need_x else None), gw, gb, None, None, None, None


def batch_norm(x, running_mean, running_var, weight, bias, momentum, eps, spec: QuantSpec):
    """``F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)`` keeping
    the normalized input compressed."""
    if plain_under_functorch("BatchNorm"):
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    F._verify_batch_size(x.size())  # F.batch_norm's own check: one value per channel raises
    dtype = autocast_dtype("batch_norm", x.device)
    cfg = (momentum, eps, dtype)
    return BatchNormFn.apply(
        autocast_cast(x, dtype), weight, bias, running_mean, running_var, cfg, spec
    )


def _repeat(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t.repeat(n)


def instance_norm(x, running_mean, running_var, weight, bias, momentum, eps, spec: QuantSpec):
    """``F.instance_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)``
    keeping the normalized input compressed: what ``at::instance_norm`` computes (the
    per-channel parameters and statistics repeated per sample, the input viewed as one sample
    of ``N * C`` channels, ``batch_norm``, the running statistics averaged back over the
    samples), with the BatchNorm that keeps its normalized input."""
    if plain_under_functorch("InstanceNorm") or x.numel() == 0:
        return F.instance_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    F._verify_spatial_size(x.size())  # F.instance_norm's own check
    dtype = autocast_dtype("instance_norm", x.device)
    if dtype is not None:  # autocast casts at instance_norm; the ops inside see no autocast
        x, weight, bias = (autocast_cast(t, dtype) for t in (x, weight, bias))
        with torch.autocast(x.device.type, enabled=False):
            return instance_norm(x, running_mean, running_var, weight, bias, momentum, eps, spec)
    n, c = x.shape[0], x.shape[1]
    # at::instance_norm repeats the running statistics in the input's dtype (bf16 statistics
    # for a bf16 input with fp32 buffers) and averages them back in it
    rm, rv = (None if t is None else t.repeat(n).to(x.dtype) for t in (running_mean, running_var))
    shape = (1, n * c, *x.shape[2:])
    out = batch_norm(
        x.contiguous().view(shape), rm, rv, _repeat(weight, n), _repeat(bias, n), momentum, eps,
        spec,
    )  # fmt: skip
    with torch.no_grad():
        if running_mean is not None:
            running_mean.copy_(rm.view(n, c).mean(0, False))
        if running_var is not None:
            running_var.copy_(rv.view(n, c).mean(0, False))
    return out.view(x.shape)
