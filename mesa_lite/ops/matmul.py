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


# ---- the ops torch.matmul runs ------------------------------------------------------------
# torch.matmul (``_matmul_impl`` in ATen's LinearAlgebra.cpp) runs one mm or one bmm, chosen
# from the operands' dims, strides and whether they require grad; its gradients are those of
# that mm or bmm. MatMulFn runs the same op and differentiates it with the same formulas, so
# that the exact (debug) mode's gradients are PyTorch's bit for bit.


def _path(a: torch.Tensor, b: torch.Tensor, need_a: bool, need_b: bool) -> str:
    """The op torch.matmul runs for ``a @ b`` (both of 2 or more dims; ``need_a``/``need_b``
    whether they require grad): ``"mm"`` (both 2-D), ``"fold"`` (``a``'s batch folded into the
    rows of one mm with the 2-D ``b``), ``"fold_t"`` (the same for ``b.mT`` against ``a.t()``,
    output transposed back) or ``"bmm"`` (both expanded to the broadcast batch)."""
    da, db = a.dim(), b.dim()
    if da == 2 and db == 2:
        return "mm"
    if da == 3 and db == 3 and a.shape[0] != b.shape[0]:
        # a batch of one broadcast against more is squeezed when it requires grad: its gradient
        # is then one mm, not a bmm summed over the batch (a Perceiver's latents)
        if a.shape[0] == 1 and need_a:
            da = 2
        elif b.shape[0] == 1 and need_b:
            db = 2
    # torch's should_fold: the 2-D operand requires grad, or (``a`` the batched one) ``a``'s
    # batch folds into its rows without a copy
    if da >= 3 and db == 2 and (need_b or _folds(a)):
        return "fold"
    if da == 2 and db >= 3 and need_a:
        return "fold_t"
    return "bmm"


def _folds(t: torch.Tensor) -> bool:
    """Whether ``t``'s leading dims fold into its rows as a view (torch's should_fold test)."""
    if t.numel() == 0:
        return True
    return all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(t.dim() - 2))


def _mat1(path: str, t: torch.Tensor) -> torch.Tensor:
    """The mm's first operand: ``a`` (``"mm"``), ``a`` folded (``"fold"``) or ``b.mT`` folded
    (``"fold_t"``), ``t`` that operand (a copy where the fold is not a view, as in torch)."""
    if path == "fold_t":
        t = t.mT
    elif path == "mm":
        return t
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # (not -1: ambiguous when empty)


def _mat2(path: str, t: torch.Tensor) -> torch.Tensor:
    """The mm's second operand: ``b`` (``"mm"``, ``"fold"``) or ``a.t()`` (``"fold_t"``), ``t``
    that operand (a squeezed batch of one, if any, dropped)."""
    m = t if t.dim() == 2 else t.squeeze(0)
    return m.t() if path == "fold_t" else m


def _col_major(m: torch.Tensor) -> bool:
    """Whether the 2-D ``m`` is column-major, as torch's mm backward tests its operands: it
    computes a column-major operand's gradient transposed (``mm_mat1_backward``,
    ``mm_mat2_backward``), which sums in another order."""
    return m.stride(0) == 1 and m.stride(1) == m.shape[0]


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
    Runs the mm or bmm torch.matmul runs (``_path``) and differentiates it as torch does, the
    choices that depend on the operands' layouts taken from the forward's operands.

    ``shares``: a tuple ``(a0, b0)`` of the tensors whose existing codes may be reused (the
    operands before the autocast cast; see ``quant.lookup_shared``). A tuple, so that autograd
    does not take them for inputs.
    """

    @staticmethod
    def forward(ctx, a, b, spec: QuantSpec, shares=(None, None)):
        need_a, need_b = ctx.needs_input_grad[:2]
        path = _path(a, b, need_a, need_b)
        if path == "bmm":
            out = torch.matmul(a, b)
            cols = (False, False)
        else:  # torch.matmul's own mm, spelled out to keep its operands' layouts
            m1 = _mat1(path, b if path == "fold_t" else a)
            m2 = _mat2(path, a if path == "fold_t" else b)
            out = m1.mm(m2)
            cols = (_col_major(m1), _col_major(m2))
            if path == "fold":
                out = out.view(*a.shape[:-1], m2.shape[1])
            elif path == "fold_t":
                out = out.view(*b.shape[:-2], b.shape[-1], m2.shape[1]).mT.contiguous()
            del m1, m2
        pa = _keep_operand(a, shares[0], spec) if need_b else None
        pb = _keep_operand(b, shares[1], spec) if need_a else None
        quant.save(ctx, pa, pb)
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.shapes = (a.shape, b.shape)
        ctx.path = (path, *cols)  # (and whether the mm's operands were column-major)
        return fresh(out)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        pa, pb = quant.load(ctx)
        need_a, need_b = ctx.needs_input_grad[:2]
        path = ctx.path[0]
        if path == "bmm":
            grad_a, grad_b = _bmm_backward(ctx, grad, pa, pb, need_a, need_b)
        else:
            grad_a, grad_b = _mm_backward(ctx, grad, pa, pb, need_a, need_b)
        return grad_a, grad_b, None, None


def _mm_backward(ctx, grad, pa, pb, need_a, need_b):
    """The gradients of the mm ``m1.mm(m2)`` with mm's own formulas, taken back through the
    fold. Each operand is rebuilt only for the other's gradient, and freed before the next."""
    path, col1, col2 = ctx.path
    a_shape, b_shape = ctx.shapes
    kept, needs = (pa, pb), (need_a, need_b)
    # which of a (0) and b (1) m1 and m2 are made from; the mm's output and its gradient g
    i1, i2 = (1, 0) if path == "fold_t" else (0, 1)
    if path == "fold_t":  # the mm's output was transposed back
        g = grad.mT.reshape(math.prod(grad.shape[:-2]) * grad.shape[-1], grad.shape[-2])
    else:
        g = grad.reshape(math.prod(grad.shape[:-1]), grad.shape[-1])
    g1 = g2 = None
    if needs[i1]:  # mm_mat1_backward
        m2 = _mat2(path, _operand(kept[i2], ctx.dtypes[i2]))
        g1 = m2.mm(g.t()).t() if col1 else g.mm(m2.t())
        del m2
    if needs[i2]:  # mm_mat2_backward
        m1 = _mat1(path, _operand(kept[i1], ctx.dtypes[i1]))
        g2 = g.t().mm(m1).t() if col2 else m1.t().mm(g)
        del m1
    if path != "fold_t":  # (reshape: a view, or the shape it has)
        return (None if g1 is None else g1.reshape(a_shape),
                None if g2 is None else g2.reshape(b_shape))  # fmt: skip
    grad_b = None if g1 is None else g1.reshape(*b_shape[:-2], b_shape[-1], b_shape[-2]).mT
    grad_a = None if g2 is None else g2.t().reshape(a_shape)
    return grad_a, grad_b


def _bmm_backward(ctx, grad, pa, pb, need_a, need_b):
    """The gradients of torch.matmul's bmm of the expanded, reshaped operands (a reshape that
    copies a strided view, such as timm's k of its qkv output, gives the bmm the layout
    PyTorch's backward uses), summed over the broadcast dims as expand's backward sums."""
    a_shape, b_shape = ctx.shapes
    batch = torch.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    n = math.prod(batch)  # (not -1: ambiguous for an empty tensor)
    g3 = grad.reshape(n, *grad.shape[-2:])
    grad_a = grad_b = None
    if need_a:
        b = _operand(pb, ctx.dtypes[1])
        b3 = b.expand(*batch, *b_shape[-2:]).reshape(n, *b_shape[-2:])
        del b
        grad_a = _sum_to(g3.bmm(b3.transpose(1, 2)).view(*batch, *a_shape[-2:]), a_shape)
        del b3
    if need_b:
        a = _operand(pa, ctx.dtypes[0])
        a3 = a.expand(*batch, *a_shape[-2:]).reshape(n, *a_shape[-2:])
        del a
        grad_b = _sum_to(a3.transpose(1, 2).bmm(g3).view(*batch, *b_shape[-2:]), b_shape)
    return grad_a, grad_b


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
