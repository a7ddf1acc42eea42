"""Autograd Functions that compute the plain torch op and keep compressed inputs for backward.

Autocast: the modules cast the inputs exactly as autocast itself would cast them for each op
(``autocast_dtype`` gives the op's cast target, ``autocast_cast`` casts one tensor as autocast's
``cached_cast`` does, without its per-region cache of leaf casts), outside the Function (so
autograd casts the gradients back as autocast's own casts would), and the Functions run the
same aten op on the cast inputs (autocast, still on, then has nothing left to cast). Outside
autocast nothing is cast: mixed dtypes reach the aten op as they came, so it accepts what torch
accepts (an fp32 LayerNorm on bf16 input) and raises torch's own error for what torch rejects.
Forward outputs are therefore bit-identical to PyTorch's, with and without autocast, on any
device.

Each Function keeps only what the gradients asked for need (``ctx.needs_input_grad``): a
frozen Linear whose input needs grad keeps no copy of that input, as in torch.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec

# ---- the dtype autocast gives an op ---------------------------------------------------------

_PROBES = {
    "linear": (2, lambda a, b: F.linear(a, b)),
    "matmul": (2, lambda a, b: torch.matmul(a, b)),
    "softmax": (1, lambda a: torch.softmax(a, -1)),
    "gelu": (1, lambda a: F.gelu(a)),
    "layer_norm": (1, lambda a: F.layer_norm(a, (1,))),
    "sdpa": (1, lambda a: F.scaled_dot_product_attention(*[a[None, None]] * 3)),
}
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def _probe(op: str, device: str, autocast_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    arity, fn = _PROBES[op]
    args = [torch.zeros(1, 1, dtype=dtype, device=device) for _ in range(arity)]
    with torch.no_grad(), torch.autocast(device_type=device, dtype=autocast_dtype):
        return fn(*args).dtype


@functools.cache
def _autocast_policy(op: str, device: str, autocast_dtype: torch.dtype) -> torch.dtype | None:
    """Autocast's cast target for ``op``: its dtype for lower-precision ops, fp32 for fp32 ops,
    None for ops it leaves alone. Found by running the op on 1-element tensors under autocast,
    so it follows PyTorch's own lists on every device and version."""
    if _probe(op, device, autocast_dtype, torch.float32) == autocast_dtype:
        return autocast_dtype
    if _probe(op, device, autocast_dtype, autocast_dtype) == torch.float32:
        return torch.float32
    return None


def autocast_dtype(op: str, device: torch.device) -> torch.dtype | None:
    """The dtype the current autocast state casts ``op``'s floating inputs on ``device`` to, or
    None when autocast is off there or leaves ``op`` alone."""
    dev = device.type
    if dev not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(dev):
        return None
    return _autocast_policy_constant(op, dev, torch.get_autocast_dtype(dev))


@torch.compiler.assume_constant_result
def _autocast_policy_constant(op: str, device: str, autocast_dtype: torch.dtype):
    # torch.compile calls this once while tracing (no probe ops in the graph)
    return _autocast_policy(op, device, autocast_dtype)


def autocast_cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` cast to ``dtype`` where autocast would cast it (a floating tensor other than fp64;
    ``dtype`` None: no cast), else ``t`` itself."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    if not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def _fresh(out: torch.Tensor) -> torch.Tensor:
    """A Function's output that is a view of a tensor made inside it (``F.linear`` on 3-D input,
    a folded matmul, an attention backend's transposed output), as a non-view alias of the same
    memory: autograd forbids in-place ops on views made inside a custom Function, while torch's
    own ops allow them on their outputs."""
    if torch.compiler.is_compiling():  # views and in-place ops are the compiler's business
        return out
    return out.detach() if out._base is not None else out


def _keep(
    x: torch.Tensor, spec: QuantSpec, signed: bool = True, share_key=None, max_steps=None
) -> quant.Packed:
    """Reuses the codes a producer registered for ``x`` (or for ``share_key``, the tensor before
    the autocast cast that made ``x``), else quantizes ``x``.

    ``max_steps``: reuse only codes whose recipe has at most this many steps (a producer that
    extends the recipe passes ``MAX_RECIPE_STEPS - 1``).
    """
    shared = quant.lookup_shared(x, spec, key=share_key)
    if shared is not None and (max_steps is None or len(shared.recipe) <= max_steps):
        return shared
    return quant.quantize(x, spec, signed)


def _first_order_only(backward):
    """Backward from compressed copies is not differentiable again: with ``create_graph=True``
    (double backward) it would silently give wrong second-order gradients, so it raises."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "mesa_lite: double backward (create_graph=True) through compressed activations "
                "is not supported; unwrap the model (mesa_lite.unwrap) or disable the layer "
                "with Config(overrides={name: {'enabled': False}})"
            )
        return backward(ctx, *grads)

    return wrapper


# ---- Linear -----------------------------------------------------------------------------------


def _folded_col_major(x: torch.Tensor) -> bool:
    """Whether the 2-D matrix torch's linear multiplies for ``x`` (``x`` itself, or a contiguous
    ``x`` folded to (-1, in_features)) is column-major, as torch's mm backward tests it."""
    if x.dim() == 2:
        s0, s1, rows = x.stride(0), x.stride(1), x.shape[0]
    elif x.dim() > 2 and x.is_contiguous():
        s0, s1, rows = x.shape[-1], 1, x.numel() // max(x.shape[-1], 1)
    else:
        return False
    return s0 == 1 and s1 == rows


class LinearFn(torch.autograd.Function):
    """``F.linear`` keeping the compressed input; the weight is kept as the Parameter itself and
    cast again in backward, so no low-precision copy of it outlives the forward.

    ``dtype``: autocast's cast target for the weight and bias (None: no cast). ``shares``:
    ``(x0,)``, the input before the autocast cast, whose registered codes (a LayerNorm's or
    GELU's output) are reused instead of a second copy. The input is kept only when the
    weight needs grad, the weight only when the input does.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dtype: torch.dtype | None, spec: QuantSpec, shares=(None,)):
        out = F.linear(x, autocast_cast(weight, dtype), autocast_cast(bias, dtype))
        need_x, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[0]
        px = _keep(x, spec, share_key=shares[0]) if need_x else None
        quant.save(ctx, px, weight if need_w else None)
        ctx.dtype = dtype
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        ctx.x_col_major = _folded_col_major(x)
        return _fresh(out)

    @staticmethod
    @_first_order_only
    def backward(ctx, grad):
        px, weight = quant.load(ctx)
        needs = ctx.needs_input_grad[:3]
        grads = linear_backward(
            grad, lambda: quant.dequantize(px, ctx.x_dtype), weight, ctx.dtype,
            ctx.x_col_major, needs, ctx.w_dtype, ctx.b_dtype,
        )  # fmt: skip
        return *grads, None, None, None


def linear_backward(grad, rebuild_x, weight, dtype, x_col_major: bool, needs, w_dtype, b_dtype):
    """``F.linear``'s gradients (input, weight, bias; None where ``needs`` is False), as
    torch's own backward computes them.

    Args:
        grad: the output's gradient.
        rebuild_x: returns the input (called only for the weight's gradient).
        weight: the weight before its autocast cast to ``dtype`` (None: no cast).
        x_col_major: ``_folded_col_major`` of the forward input.
        needs: needs-grad flags of input, weight and bias.
        w_dtype, b_dtype: the dtypes of weight and bias before any cast (``b_dtype`` None:
            no bias), which their gradients take.
    """
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_w = grad_b = None
    if needs[0]:
        w = autocast_cast(weight, dtype)
        # as torch's mm backward: a column-major input gets its gradient computed transposed
        gx = (w.t() @ g2.t()).t() if x_col_major else g2 @ w
        grad_x = gx.reshape(*grad.shape[:-1], w.shape[1])
    if needs[1]:
        x = rebuild_x()
        grad_w = (g2.t() @ x.reshape(-1, x.shape[-1])).to(w_dtype)
    if b_dtype is not None and needs[2]:
        grad_b = g2.sum(0).to(b_dtype)
    return grad_x, grad_w, grad_b


# ---- GELU -------------------------------------------------------------------------------------


class GELUFn(torch.autograd.Function):
    """Keeps the compressed input; registers it as the (rebuildable) copy of its output, so
    the next Linear (timm's fc2) keeps no second copy. An input that is itself a registered
    output (a LayerNorm's, another GELU's) is kept as those codes, its recipe extended by one
    step."""

    @staticmethod
    def forward(ctx, x, approximate: str, spec: QuantSpec, shares=(None,)):
        out = F.gelu(x, approximate=approximate)
        p = _keep(x, spec, share_key=shares[0], max_steps=quant.MAX_RECIPE_STEPS - 1)
        quant.save(ctx, p)
        quant.share(out, p.derived(("gelu", x.dtype, approximate), out.dtype))
        ctx.approximate = approximate
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    @_first_order_only
    def backward(ctx, grad):
        (px,) = quant.load(ctx)
        return gelu_input_grad(px, grad, ctx.approximate, ctx.x_dtype), None, None, None


def gelu_input_grad(px: quant.Packed, grad, approximate: str, x_dtype: torch.dtype):
    """GELU's input gradient from the kept input ``px`` (rebuilt in ``x_dtype``)."""
    if not px.recipe and not px.spec.exact:  # one kernel: x is rebuilt in registers
        return quant.gelu_backward(px, grad, approximate, x_dtype)
    x = quant.dequantize(px, x_dtype)
    return torch.ops.aten.gelu_backward(grad, x, approximate=approximate)


# ---- Softmax ----------------------------------------------------------------------------------


class SoftmaxFn(torch.autograd.Function):
    """Keeps only the output, as unsigned codes (softmax outputs lie in [0, 1])."""

    @staticmethod
    def forward(ctx, x, dim: int, spec: QuantSpec):
        out = torch._softmax(x, dim, False)
        p = quant.quantize(out, spec, signed=False)
        quant.save(ctx, p)
        quant.share(out, p)
        ctx.dim = dim
        return out

    @staticmethod
    @_first_order_only
    def backward(ctx, grad):
        (py,) = quant.load(ctx)
        y = quant.dequantize(py)
        return torch._softmax_backward_data(grad, y, ctx.dim, y.dtype), None, None


# ---- LayerNorm --------------------------------------------------------------------------------


class LayerNormFn(torch.autograd.Function):
    """Keeps the compressed normalized input ``(x - mean) * rstd`` and the fp32 per-row mean
    and rstd; registers it, with the affine parameters, as the (rebuildable) copy of its
    output, so the next Linear (timm's qkv, fc1) keeps no second copy. The normalized input
    is better conditioned for absmax groups than ``x`` itself (no per-row offset).
    In the exact (debug) mode it keeps ``x`` itself. When only the bias needs grad it keeps
    nothing of ``x``."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps: float, spec: QuantSpec):
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
        quant.share(out, p.derived(step, out.dtype, aux=(weight, bias)))
        return out

    @staticmethod
    @_first_order_only
    def backward(ctx, grad):
        px, mean, rstd, weight, bias = quant.load(ctx)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]]
        shape = ctx.x_shape if px is None else px.shape
        gx, gw, gb = layer_norm_backward(
            grad, px, mean, rstd, weight, bias, ctx.normalized_shape, shape, ctx.x_dtype, mask
        )
        return gx, None, gw, gb, None, None


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


# ---- MatMul -----------------------------------------------------------------------------------


def _sum_to(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return g if g.shape == shape else g.sum_to_size(shape)


def _keep_operand(t: torch.Tensor, t0: torch.Tensor | None, spec: QuantSpec):
    """A matmul operand to keep: a Parameter (``t0``, before any autocast cast) as itself, as
    a Linear keeps its weight (it lives anyway; cast again in backward); else compressed."""
    if isinstance(t0, torch.nn.Parameter):
        return t0
    return _keep(t, spec, share_key=t0)


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
        return _fresh(out)

    @staticmethod
    @_first_order_only
    def backward(ctx, grad):
        pa, pb = quant.load(ctx)
        a_shape, b_shape = ctx.shapes
        a_dims, b_dims = len(a_shape), len(b_shape)
        grad_a = grad_b = None
        # Mirror torch.matmul's own folding into one mm when one operand is 2-D, so that the
        # gradients of the exact (debug) mode equal PyTorch's bit for bit.
        if ctx.needs_input_grad[0]:
            b = _operand(pb, ctx.dtypes[1])
            if a_dims == 2 and b_dims >= 3:
                bt = b.transpose(-2, -1).reshape(-1, b.shape[-2])
                gt = grad.transpose(-2, -1).reshape(-1, grad.shape[-2])
                grad_a = (bt.t() @ gt).t()
            else:
                grad_a = _sum_to(torch.matmul(grad, b.transpose(-2, -1)), a_shape)
        if ctx.needs_input_grad[1]:
            a = _operand(pa, ctx.dtypes[0])
            if b_dims == 2 and a_dims >= 3:
                grad_b = a.reshape(-1, a.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])
            else:
                grad_b = _sum_to(torch.matmul(a.transpose(-2, -1), grad), b_shape)
        return grad_a, grad_b, None, None


# ---- fused attention (F.scaled_dot_product_attention) --------------------------------------

SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN = 1, 2, 3  # torch.nn.attention.SDPBackend values


def _keep_in_memory_order(t: torch.Tensor, spec: QuantSpec) -> tuple[quant.Packed, tuple]:
    """Quantizes ``t`` in its memory order (no copy when it is dense), so that backward can
    rebuild a tensor with the same stride order (cuDNN's backward expects it)."""
    order = quant.memory_order(t)
    return quant.quantize(t.permute(order), spec), order


def _restore(p: quant.Packed, order: tuple) -> torch.Tensor:
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return quant.dequantize(p).permute(inverse)


def _joint_base(q, k, v) -> torch.Tensor | None:
    """The contiguous tensor that ``q``, ``k`` and ``v`` are views of and whose elements they
    are together (timm's qkv Linear output, reshaped, permuted and unbound), else None."""
    if torch.compiler.is_compiling():  # no view bases there; a caller passes the tensor
        return None
    base = q._base
    if base is None or k._base is not base or v._base is not base or not base.is_contiguous():
        return None
    if base.dtype != q.dtype or base.numel() != q.numel() + k.numel() + v.numel():
        return None
    return base


def sdpa_backend(q, k, v, dropout_p: float, is_causal: bool, scale) -> int:
    """The fused backend ``F.scaled_dot_product_attention`` runs for these inputs (without a
    mask), -1 for its math path or an error.

    Under torch.compile, where ``_fused_sdp_choice`` cannot be traced, from the checks Dynamo
    folds into constants: flash attention on the CPU; on CUDA flash attention, else the
    memory-efficient kernel (eager mode may pick cuDNN where both are possible)."""
    if not torch.compiler.is_compiling():
        try:
            return int(torch._fused_sdp_choice(q, k, v, None, dropout_p, is_causal, scale=scale))
        except RuntimeError:
            return -1
    if q.device.type == "cpu":
        return SDPA_FLASH
    params = torch.backends.cuda.SDPAParams(q, k, v, None, dropout_p, is_causal, False)
    if torch.backends.cuda.can_use_flash_attention(params):
        return SDPA_FLASH
    if torch.backends.cuda.can_use_efficient_attention(params):
        return SDPA_EFFICIENT
    return -1


def sdpa_run(q, k, v, backend: int, dropout_p: float, is_causal: bool, scale):
    """The fused attention op PyTorch's ``F.scaled_dot_product_attention`` dispatches to for
    ``backend``: ``(out, logsumexp, extra, max_qk)``, ``extra`` the tensors its backward takes
    besides (cumulative lengths, RNG seed and offset), ``max_qk`` its ints (or None)."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=None, scale=scale
        )
        return out, lse, (), None
    if backend == SDPA_CUDNN:
        res = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, dropout_p, is_causal, False, scale=scale
        )
    elif backend == SDPA_FLASH:
        res = aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )
    elif backend == SDPA_EFFICIENT:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, dropout_p, is_causal, scale=scale
        )
        return out, lse, (seed, offset), None
    else:
        raise ValueError(f"mesa_lite SDPAFn: backend {backend} is not supported")
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset = res[:8]
    return out, lse, (cum_q, cum_k, seed, offset), (max_q, max_k)


def sdpa_backward(grad, q, k, v, out, lse, extra, max_qk, cfg: tuple, needs):
    """The gradients of q, k and v through the backend's own backward op; ``cfg`` is
    ``(backend, dropout_p, is_causal, scale)`` and ``needs`` the three needs-grad flags."""
    backend, dropout_p, is_causal, scale = cfg
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=scale
        )
    if backend == SDPA_EFFICIENT:
        seed, offset = extra
        mask = [*needs, False]
        gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, None, out, lse, seed, offset, dropout_p, mask, is_causal,
            scale=scale,
        )  # fmt: skip
        return gq, gk, gv
    cum_q, cum_k, seed, offset = extra
    max_q, max_k = max_qk
    if backend == SDPA_CUDNN:
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k,
            dropout_p, is_causal, scale=scale,
        )  # fmt: skip
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
        seed, offset, scale=scale,
    )  # fmt: skip


def keep_qkv(q, k, v, spec: QuantSpec, split=None) -> tuple[list, object]:
    """What attention keeps of q, k and v: ``(packed list, layout)`` for ``rebuild_qkv``.

    q and k are kept at 8 bits whatever the spec's width; v at the spec's. At 8 bits, when q,
    k and v are views of one tensor that holds just them (timm's qkv output), that tensor is
    kept instead, once (no gathering copies, one launch), and ``rebuild_qkv`` takes the same
    views of its rebuild. ``split``: ``(qkv, heads)`` when the caller made them as timm does,
    ``qkv.reshape(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)``; otherwise the
    tensor is found through ``_base`` (not under torch.compile). Else each is kept in its
    memory order."""
    if spec.bits == 8 and split is not None:
        qkv, heads = split
        return [quant.quantize(qkv, spec)], ("split", (*qkv.shape[:2], heads))
    base = _joint_base(q, k, v) if spec.bits == 8 else None
    if base is not None:
        off = base.storage_offset()
        views = [(t.shape, t.stride(), t.storage_offset() - off) for t in (q, k, v)]
        return [quant.quantize(base, spec)], ("views", views)
    # q and k at 8 bits even when the spec asks for fewer: backward rebuilds the attention
    # probabilities as exp(q k^T * scale - logsumexp), which exponentiates their error (at 2
    # bits all four low gave gradients 70 dB worse than q, k at 8)
    qk_spec = spec if spec.bits == 8 else dataclasses.replace(spec, bits=8, rounding=None)
    kept = [_keep_in_memory_order(t, s) for t, s in ((q, qk_spec), (k, qk_spec), (v, spec))]
    return [p for p, _ in kept], ("orders", [order for _, order in kept])


def split_qkv(qkv: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """timm's q, k, v: views of its qkv Linear's (B, N, 3 * heads * head_dim) output."""
    B, N, _ = qkv.shape
    return qkv.reshape(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


def rebuild_qkv(kept: list, layout) -> list[torch.Tensor]:
    """q, k and v from ``keep_qkv``'s result, with their forward strides."""
    how, info = layout
    if how == "split":
        return split_qkv(quant.dequantize(kept[0]).view(info[0], info[1], -1), info[2])
    if how == "views":  # one copy of the tensor q, k and v are views of
        base = quant.dequantize(kept[0]).reshape(-1)
        return [base.as_strided(*view) for view in info]
    return [_restore(p, o) for p, o in zip(kept, info, strict=True)]


class SDPAFn(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` through the fused backend PyTorch picked (CPU flash,
    CUDA flash, memory-efficient or cuDNN), keeping q, k, v (``keep_qkv``) and the output
    compressed and the fp32 logsumexp.

    Backward dequantizes them in their forward stride order and calls the backend's own
    backward op. Attention masks are not taken here (see ``modules.scaled_dot_product_attention``).
    """

    @staticmethod
    def forward(ctx, q, k, v, backend: int, dropout_p: float, is_causal: bool, scale, spec):
        out, lse, extra, ctx.max_qk = sdpa_run(q, k, v, backend, dropout_p, is_causal, scale)
        out = _fresh(out)
        po, ctx.o_order = _keep_in_memory_order(out, spec)
        kept, ctx.qkv_layout = keep_qkv(q, k, v, spec)
        ctx.n_qkv = len(kept)
        # the output, in memory order, is also the projection's input (timm reshapes it to
        # (B, N, C), a view when the backend wrote it (B, N, H, D)-contiguous as cuDNN does)
        quant.share(out, po, memory_order=True)
        quant.save(ctx, *kept, po, lse, *extra)
        ctx.cfg = (backend, dropout_p, is_causal, scale)
        return out

    @staticmethod
    @_first_order_only
    def backward(ctx, grad):
        saved = quant.load(ctx)
        n = ctx.n_qkv
        q, k, v = rebuild_qkv(saved[:n], ctx.qkv_layout)
        po, lse, *extra = saved[n:]
        out = _restore(po, ctx.o_order)
        needs = ctx.needs_input_grad[:3]
        gq, gk, gv = sdpa_backward(grad, q, k, v, out, lse, extra, ctx.max_qk, ctx.cfg, needs)
        return gq, gk, gv, None, None, None, None, None
