"""RMSNorm: keeps its normalized input ``x * rstd`` compressed plus the fp32 per-row rstd; the
same codes rebuild its output for the next op (an ``rms`` recipe step).

Two forms, told apart by ``form``:

- ``"hf"``: the Hugging Face form (``LlamaRMSNorm`` and its copies in Mistral, Qwen2, ...)::

      h = x.to(float32); h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
      out = weight * h.to(x.dtype)

  computed with those very ops (the fp32 upcast, the cast back, the promotion of an fp32
  weight times a bf16 ``h`` to fp32), so the output is the module's bit for bit.
- ``"torch"``: ``F.rms_norm`` (``torch.nn.RMSNorm``), over any number of trailing dims.

The compressed backward is the analytic gradient of ``x * rstd(x)``,
``rstd * (g - h * mean(g * h))``, with the affine and cast steps before it as autograd would
run them. In the exact (debug) mode the input itself is kept and backward differentiates the
same formula with autograd, so gradients are PyTorch's bit for bit.
"""

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
from mesa_lite.ops.layer_norm import fused_backward, keep_normalized

register_probe("rms_norm", 1, lambda a: F.rms_norm(a, (1,)))


def rms_forward(x, weight, eps, form: str, dims: int):
    """The module's formula: ``(out, rstd)``; ``rstd`` fp32, one per row (a row: the last
    ``dims`` dims)."""
    red = tuple(range(-dims, 0))
    if form == "hf":
        in_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + eps)
        return weight * (h * rstd).to(in_dtype), rstd
    out = F.rms_norm(x, x.shape[-dims:], weight, eps)
    e = torch.finfo(x.dtype).eps if eps is None else eps
    rstd = torch.rsqrt(x.float().pow(2).mean(red, keepdim=True) + e)
    return out, rstd


def _rms_first(p: quant.Packed, step: tuple, aux: list, dtype: torch.dtype) -> torch.Tensor:
    """The RMSNorm's output from its kept normalized input (exact mode: the module's formula
    on the kept input)."""
    _, _, in_dtype, form, eps, dims = step
    (weight,) = aux
    if p.spec.exact:
        return rms_forward(p.codes, weight, eps, form, dims)[0].to(dtype)
    h = quant.stored(p, torch.float32).view(p.shape)
    if form == "hf":
        return (weight * h.to(in_dtype)).to(dtype)
    return (h if weight is None else h * weight.float()).to(dtype)


# ("rms", out dtype, input dtype, form, eps, dims): an RMSNorm's output; always the first step
quant.register_step("rms", quant.RecipeStep(1, _rms_first, None, lambda step: step[1]))


class RMSNormFn(torch.autograd.Function):
    """Keeps the compressed normalized input and the fp32 rstd (exact mode: the input), and
    registers them, with the weight, as the rebuildable copy of the output, so the next
    Linear (q/k/v, gate/up projections) keeps no second copy."""

    @staticmethod
    def forward(ctx, x, weight, eps, form: str, dims: int, spec: QuantSpec, traced: bool = False):
        out, rstd = rms_forward(x, weight, eps, form, dims)
        if spec.exact or not quant.compressible(x):
            p = quant.quantize(x, spec)
        else:
            p = keep_normalized(x, torch.zeros_like(rstd), rstd, spec)
        quant.save(ctx, p, rstd, weight)
        step = ("rms", out.dtype, x.dtype, form, eps, dims)
        ctx.cfg = (eps, form, dims, x.dtype)
        # traced: a block-internal norm, shared under compile too
        return shared_output(out, p.derived(step, out.dtype, aux=(weight,)), traced=traced)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        p, rstd, weight = quant.load(ctx)
        eps, form, dims, x_dtype = ctx.cfg
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if p.spec.exact:
            return (*_autograd_grads(p, weight, grad, eps, form, dims, need_x, need_w),
                    None, None, None, None, None)  # fmt: skip
        row_len = math.prod(p.shape[len(p.shape) - dims :])
        if fused_backward(p, grad, rstd, row_len, x_dtype):
            g_x, g_w, _ = fused.norm_backward(
                p.codes, p.scales, p.spec.group_size, p.spec.bits, grad, rstd, weight, x_dtype,
                row_len, center=False, hf=form == "hf", need_x=need_x,
                need_sums=need_w and weight is not None, use_triton=True,
            )  # fmt: skip
            g_w = None if g_w is None else g_w.view(weight.shape).to(weight.dtype)
            return g_x, g_w, None, None, None, None, None
        h = quant.dequantize(p, torch.float32)
        red = tuple(range(-dims, 0))
        lead = tuple(range(h.dim() - dims))

        def sum_lead(t):  # over the leading dims; an unbatched input has none
            return t.sum(lead) if lead else t

        if form == "hf":
            hd = h.to(x_dtype)
            g_w = sum_lead(grad * hd).to(weight.dtype) if need_w else None
            g_h = (grad * weight).to(x_dtype).float()
        else:
            g = grad.float()
            g_w = None
            if weight is not None and need_w:
                g_w = sum_lead(g * h).to(weight.dtype)
            g_h = g if weight is None else g * weight.float()
        g_x = None
        if need_x:
            g_x = (rstd * (g_h - h * (g_h * h).mean(red, keepdim=True))).to(x_dtype)
        return g_x, g_w, None, None, None, None, None


def _autograd_grads(p, weight, grad, eps, form, dims, need_x, need_w):
    """The gradients of the formula by autograd, from the kept input itself (exact mode, fp64)."""
    x = quant.dequantize(p).detach().requires_grad_(need_x)
    w = None if weight is None else weight.detach().requires_grad_(need_w)
    with torch.enable_grad():
        out, _ = rms_forward(x, w, eps, form, dims)
        inputs = [t for t, n in ((x, need_x), (w, need_w)) if n and t is not None]
        got = iter(torch.autograd.grad(out, inputs, grad))
    g_x = next(got) if need_x else None
    g_w = next(got) if need_w and weight is not None else None
    return g_x, g_w


def rms_norm(x, weight, eps, form: str, dims: int, spec: QuantSpec,
             traced: bool = False) -> torch.Tensor:  # fmt: skip
    """The RMSNorm of ``form`` keeping its normalized input compressed (``RMSNormFn``);
    ``traced`` as ``layer_norm``'s."""
    if plain_under_functorch("RMSNorm"):
        return rms_forward(x, weight, eps, form, dims)[0]
    if form == "torch":  # F.rms_norm is an op autocast may cast; the HF formula casts itself
        dtype = autocast_dtype("rms_norm", x.device)
        x, weight = autocast_cast(x, dtype), autocast_cast(weight, dtype)
    return RMSNormFn.apply(x, weight, eps, form, dims, spec, traced)
