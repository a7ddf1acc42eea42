"""GELU: keeps its input compressed; the same codes rebuild its output for the next op (a
``gelu`` recipe step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import (
    autocast_cast,
    autocast_dtype,
    first_order_only,
    keep,
    plain_under_functorch,
    register_probe,
)

register_probe("gelu", 1, lambda a: F.gelu(a))


def _gelu_first(p: quant.Packed, step: tuple, aux: list, dtype: torch.dtype) -> torch.Tensor:
    """GELU's output from the codes of its input, inside the dequantize kernel (exact mode:
    torch's GELU on the kept input)."""
    _, step_dtype, approximate = step
    if p.spec.exact:
        return F.gelu(p.codes.to(step_dtype), approximate=approximate)
    return quant.stored(p, dtype, ("gelu", approximate, step_dtype)).view(p.shape)


def _gelu_then(h: torch.Tensor, step: tuple, aux: list) -> torch.Tensor:
    """GELU on a previous step's result, in the dtype the forward's GELU ran in."""
    return F.gelu(h.to(step[1]), approximate=step[2])


# ("gelu", dtype, approximate): a GELU's output, in the dtype its forward ran in
quant.register_step("gelu", quant.RecipeStep(0, _gelu_first, _gelu_then, lambda step: step[1]))


class GELUFn(torch.autograd.Function):
    """Keeps the compressed input; registers it as the (rebuildable) copy of its output, so
    the next Linear (timm's fc2) keeps no second copy. An input that is itself a registered
    output (a LayerNorm's, another GELU's) is kept as those codes, its recipe extended by one
    step."""

    @staticmethod
    def forward(ctx, x, approximate: str, spec: QuantSpec, shares=(None,)):
        out = F.gelu(x, approximate=approximate)
        p = keep(x, spec, share_key=shares[0], max_steps=quant.MAX_RECIPE_STEPS - 1)
        quant.save(ctx, p)
        quant.share(out, p.derived(("gelu", x.dtype, approximate), out.dtype))
        ctx.approximate = approximate
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (px,) = quant.load(ctx)
        return gelu_input_grad(px, grad, ctx.approximate, ctx.x_dtype), None, None, None


def gelu_input_grad(px: quant.Packed, grad, approximate: str, x_dtype: torch.dtype):
    """GELU's input gradient from the kept input ``px`` (rebuilt in ``x_dtype``)."""
    if not px.recipe and not px.spec.exact:  # one kernel: x is rebuilt in registers
        return quant.gelu_backward(px, grad, approximate, x_dtype)
    x = quant.dequantize(px, x_dtype)
    return torch.ops.aten.gelu_backward(grad, x, approximate=approximate)


def gelu(x, approximate: str, spec: QuantSpec) -> torch.Tensor:
    if plain_under_functorch("GELU"):
        return F.gelu(x, approximate=approximate)
    xc = autocast_cast(x, autocast_dtype("gelu", x.device))
    return GELUFn.apply(xc, approximate, spec, (x,))
