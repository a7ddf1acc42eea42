"""Fused attention (``F.scaled_dot_product_attention``): q, k, v and the output kept compressed,
through the fused backend PyTorch picks."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.common import (
    assume_constant_result,
    autocast_cast,
    autocast_dtype,
    first_order_only,
    fresh,
    needs_grad,
    plain_under_functorch,
    register_probe,
    shared_output,
    warn_once,
)

register_probe("sdpa", 1, lambda a: F.scaled_dot_product_attention(*[a[None, None]] * 3))

SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN = 1, 2, 3  # torch.nn.attention.SDPBackend values


def _keep_in_memory_order(t: torch.Tensor, spec: QuantSpec) -> tuple[quant.Packed, tuple]:
    """Quantizes ``t`` in its memory order (no copy when it is dense), so that backward can
    rebuild a tensor with the same stride order (cuDNN's backward expects it). A broadcast
    ``t`` (dims of stride 0, as Hugging Face's repeat_kv or learned queries expanded over the
    batch make) is kept at its un-expanded size and expanded again on rebuild: the layout
    PyTorch's own backward gets (a dense rebuild put the expanded dim innermost, which torch
    2.11's CPU flash backward computed wrong gradients for). In the exact mode ``t`` itself is
    kept, as is an fp64 ``t`` (kept exactly at any spec): a permuted view of a Function's
    output saved for its backward would tie the output to its own graph node, a cycle
    autograd frees only in backward (a forward with no backward leaked its graph)."""
    if spec.exact or not quant.compressible(t):
        return quant.quantize(t, spec), (tuple(range(t.dim())), None)
    view, layout = _memory_view(t)
    return quant.quantize(view, spec), layout


def _memory_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """``t`` un-expanded and permuted to its memory order (``_keep_in_memory_order``): the view
    to quantize and ``(order, expand)`` for ``_restore``."""
    broadcast = [d for d in range(t.dim()) if t.stride(d) == 0 and t.shape[d] > 1]
    expand = None
    if broadcast:
        expand = tuple(t.shape)
        t = t[tuple(slice(0, 1) if d in broadcast else slice(None) for d in range(t.dim()))]
    order = quant.memory_order(t)
    return t.permute(order), (order, expand)


def _restore(p: quant.Packed, layout: tuple) -> torch.Tensor:
    order, expand = layout
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    t = quant.dequantize(p).permute(inverse)
    return t if expand is None else t.expand(expand)


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


def sdpa_backend(q, k, v, dropout_p: float, is_causal: bool, scale, mask=None,
                 enable_gqa: bool = False, mask_grad: bool | None = None) -> int:  # fmt: skip
    """The fused backend ``F.scaled_dot_product_attention`` runs for these inputs, -1 for its
    math path or an error.

    Under torch.compile, where ``_fused_sdp_choice`` cannot be traced, the choice is made once
    while tracing, on empty tensors of the same layout (``assume_constant_result``), honouring
    the backends the user enabled (``sdpa_kernel``): PyTorch's own choice, as in eager mode.
    ``mask_grad``: whether the mask PyTorch would see needs grad (None: ``mask``'s own flag;
    the choice depends on it)."""
    grad = bool(mask.requires_grad) if mask_grad is None and mask is not None else mask_grad
    if not torch.compiler.is_compiling():
        if mask is not None and grad != mask.requires_grad:
            mask = mask.detach().requires_grad_(grad)  # what PyTorch would see
        return _fused_choice(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
    layout = tuple((tuple(t.shape), tuple(t.stride())) for t in (q, k, v))
    m = None
    if mask is not None:
        m = (tuple(mask.shape), tuple(mask.stride()), mask.dtype, bool(grad))
    flags = (float(dropout_p), bool(is_causal), bool(enable_gqa))
    return _backend_constant(
        layout, q.dtype, str(q.device), m, *flags, scale, sdpa_backends_enabled()
    )


def _empty_like_layout(layout, dtype, device):
    return (torch.empty_strided(sh, st, dtype=dtype, device=device) for sh, st in layout)


def _fused_choice(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """PyTorch's own choice (``_fused_sdp_choice``), -1 where it raises."""
    try:
        return int(torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                           enable_gqa=enable_gqa))  # fmt: skip
    except RuntimeError:
        return -1


@assume_constant_result
def _backend_constant(layout, dtype, device: str, mask, dropout_p, is_causal, enable_gqa, scale,
                      enabled) -> int:  # fmt: skip
    """PyTorch's own choice (``_fused_sdp_choice``) for tensors of ``layout`` (shapes and
    strides) on ``device``, made once while torch.compile traces, on empty tensors of the same
    layout (Dynamo cannot trace the choice, nor ``SDPAParams``, on every torch version): the
    kernels eager mode and the compiled plain model run (on CUDA cuDNN, flash or
    memory-efficient attention; on the CPU flash attention or the math path, whichever the
    installed torch takes for dropout). ``enabled``, the backends the user enabled, is an
    argument so that a change of it is a new constant."""
    q, k, v = _empty_like_layout(layout, dtype, device)
    bias = None
    if mask is not None:
        bias = torch.empty_strided(mask[0], mask[1], dtype=mask[2], device=device)
        bias.requires_grad_(mask[3])  # PyTorch's choice depends on it
    return _fused_choice(q, k, v, bias, dropout_p, is_causal, scale, enable_gqa)


def fused_backends(device: torch.device) -> tuple[int, ...]:
    """The SDPA backends whose ops ``sdpa_run`` and ``sdpa_backward`` call on ``device``."""
    return (SDPA_FLASH,) if device.type == "cpu" else (SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN)


def sdpa_backends_enabled() -> tuple[bool, bool, bool, bool]:
    """Which SDPA backends the user left enabled (flash, memory-efficient, cuDNN, math)."""
    C = torch._C
    return (C._get_flash_sdp_enabled(), C._get_mem_efficient_sdp_enabled(),
            C._get_cudnn_sdp_enabled(), C._get_math_sdp_enabled())  # fmt: skip


def attention_bias(mask, q, k, backend: int):
    """The additive bias PyTorch's ``F.scaled_dot_product_attention`` hands ``backend`` for
    ``attn_mask`` (None: None): a boolean mask becomes 0 / -inf in q's dtype (cuDNN: 0 /
    -65504), and the memory-efficient kernel gets it expanded to (B, H, L, S) with its last
    dim padded to a multiple of 16 (ATen's ``convert_boolean_attn_mask`` and
    ``preprocess_mask``)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        fill = -65504.0 if backend == SDPA_CUDNN else float("-inf")
        zero = torch.scalar_tensor(0.0, dtype=q.dtype, device=mask.device)
        mask = torch.where(mask.logical_not(), fill, zero)
    if backend != SDPA_EFFICIENT or q.device.type == "cpu":
        return mask
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask.shape[-1] % 16:
        pad = 16 - mask.shape[-1] % 16
        return F.pad(mask, (0, pad))[..., : mask.shape[-1]]
    if mask.stride(0) % 16 or mask.stride(1) % 16 or mask.stride(2) % 16:
        return mask.contiguous()
    return mask


def sdpa_run(q, k, v, backend: int, dropout_p: float, is_causal: bool, scale, bias=None):
    """The fused attention op PyTorch's ``F.scaled_dot_product_attention`` dispatches to for
    ``backend``: ``(out, logsumexp, extra, max_qk)``, ``extra`` the tensors its backward takes
    besides (cumulative lengths, RNG seed and offset), ``max_qk`` its ints (or None).
    ``bias``: ``attention_bias`` of the mask (not with flash attention on CUDA)."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=bias, scale=scale
        )
        return out, lse, (), None
    if backend == SDPA_CUDNN:
        res = aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, True, dropout_p, is_causal, False, scale=scale
        )
    elif backend == SDPA_FLASH:
        res = aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )
    elif backend == SDPA_EFFICIENT:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, scale=scale
        )
        return out, lse, (seed, offset), None
    else:
        raise ValueError(f"mesa_lite SDPAFn: backend {backend} is not supported")
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset = res[:8]
    return out, lse, (cum_q, cum_k, seed, offset), (max_q, max_k)


def sdpa_backward(grad, q, k, v, out, lse, extra, max_qk, cfg: tuple, needs, bias=None):
    """The gradients of q, k and v through the backend's own backward op; ``cfg`` is
    ``(backend, dropout_p, is_causal, scale)``, ``needs`` the three needs-grad flags and
    ``bias`` the forward's ``attention_bias``."""
    backend, dropout_p, is_causal, scale = cfg
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=bias, scale=scale
        )
    if backend == SDPA_EFFICIENT:
        seed, offset = extra
        mask = [*needs, False]
        gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal,
            scale=scale,
        )  # fmt: skip
        return gq, gk, gv
    cum_q, cum_k, seed, offset = extra
    max_q, max_k = max_qk
    if backend == SDPA_CUDNN:
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k,
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
    memory order: at 8 bits in one launch where the kernels run (``quant.quantize3``, as for
    Hugging Face's separate projections)."""
    if spec.bits == 8 and split is not None:
        qkv, heads = split
        return [quant.quantize(qkv, spec)], ("split", (*qkv.shape[:2], heads))
    base = _joint_base(q, k, v) if spec.bits == 8 else None
    if base is not None:
        off = base.storage_offset()
        views = [(t.shape, t.stride(), t.storage_offset() - off) for t in (q, k, v)]
        return [quant.quantize(base, spec)], ("views", views)
    if spec.bits == 8 and quant.one_launch((q, k, v), spec):  # Hugging Face's projections
        views = [_memory_view(t) for t in (q, k, v)]
        kept = quant.quantize3([t for t, _ in views], spec)
        return kept, ("orders", [layout for _, layout in views])
    # q and k at 8 bits even when the spec asks for fewer: backward rebuilds the attention
    # probabilities as exp(q k^T * scale - logsumexp), which exponentiates their error (at 2
    # bits all four low gave gradients 70 dB worse than q, k at 8)
    qk_spec = spec if spec.bits == 8 else dataclasses.replace(spec, bits=8, rounding=None)
    kept = [_keep_in_memory_order(t, s) for t, s in ((q, qk_spec), (k, qk_spec), (v, spec))]
    return [p for p, _ in kept], ("orders", [order for _, order in kept])


def split_qkv(qkv: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """timm's q, k, v: views of its qkv Linear's (B, N, 3 * heads * head_dim) output."""
    B, N, C3 = qkv.shape
    return qkv.reshape(B, N, 3, heads, C3 // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def rebuild_qkv(kept: list, layout) -> list[torch.Tensor]:
    """q, k and v from ``keep_qkv``'s result, with their forward strides."""
    how, info = layout
    if how == "split":
        return split_qkv(quant.dequantize(kept[0]).view(info[0], info[1], -1), info[2])
    if how == "views":  # one copy of the tensor q, k and v are views of
        base = quant.dequantize(kept[0]).reshape(-1)
        return [base.as_strided(*view) for view in info]
    return [_restore(p, o) for p, o in zip(kept, info, strict=True)]


def _save_attention(ctx, q, k, v, out, spec: QuantSpec, *rest) -> torch.Tensor:
    """Saves q, k, v (``keep_qkv``) and the output compressed, then ``rest`` as they are;
    returns the output the Function returns (``shared_output``'s)."""
    po, ctx.o_order = _keep_in_memory_order(out, spec)
    kept, ctx.qkv_layout = keep_qkv(q, k, v, spec)
    ctx.n_qkv = len(kept)
    # the output, in memory order, is also the projection's input (timm reshapes it to
    # (B, N, C), a view when the backend wrote it (B, N, H, D)-contiguous as cuDNN does);
    # kept exactly (the exact mode, an fp64 output) the output is kept itself in logical
    # order (see _keep_in_memory_order), not shared: the projection keeps its input itself
    if not po.spec.exact:
        out = shared_output(out, po, memory_order=True)
    quant.save(ctx, *kept, po, *rest)
    return out


def _load_attention(ctx):
    """``(q, k, v, out, rest)`` from ``_save_attention``."""
    saved = quant.load(ctx)
    n = ctx.n_qkv
    q, k, v = rebuild_qkv(saved[:n], ctx.qkv_layout)
    return q, k, v, _restore(saved[n], ctx.o_order), saved[n + 1 :]


class SDPAFn(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` through the fused backend PyTorch picked (CPU flash,
    CUDA flash, memory-efficient or cuDNN), keeping q, k, v (``keep_qkv``) and the output
    compressed and the fp32 logsumexp.

    Backward dequantizes them in their forward stride order and calls the backend's own
    backward op. ``mask``: the ``attn_mask`` as given (boolean or additive; kept by reference,
    as it is one tensor for all layers, and converted again in backward), or None. k and v may
    have fewer heads than q (grouped-query attention, ``enable_gqa``).
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, backend: int, dropout_p: float, is_causal: bool, scale, spec):
        bias = attention_bias(mask, q, k, backend)
        out, lse, extra, ctx.max_qk = sdpa_run(q, k, v, backend, dropout_p, is_causal, scale, bias)
        out = fresh(out)
        out = _save_attention(ctx, q, k, v, out, spec, lse, mask, *extra)
        ctx.cfg = (backend, dropout_p, is_causal, scale)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        q, k, v, out, (lse, mask, *extra) = _load_attention(ctx)
        needs = ctx.needs_input_grad[:3]
        bias = attention_bias(mask, q, k, ctx.cfg[0])
        gq, gk, gv = sdpa_backward(grad, q, k, v, out, lse, extra, ctx.max_qk, ctx.cfg, needs, bias)
        return gq, gk, gv, None, None, None, None, None, None


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    spec: QuantSpec | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` keeping q, k, v and the output compressed.

    Runs the fused backend PyTorch itself picks for these inputs (so the output is
    bit-identical): CPU flash attention, or CUDA flash, memory-efficient or cuDNN attention,
    with a boolean or additive ``attn_mask`` (padding masks; kept by reference) and grouped
    k/v heads (``enable_gqa``) where that backend takes them. Where PyTorch would pick its
    math path (dropout on the CPU, shapes no fused kernel takes) the call runs as plain
    PyTorch, uncompressed, with a one-time warning; a mask that needs grad too.
    """
    plain = spec is None or not needs_grad(q, k, v) or plain_under_functorch("attention")
    dtype = None if plain else autocast_dtype("sdpa", q.device)
    # right to left, as autocast casts them (its C++ argument expansion): when q, k, v are one
    # tensor, the order of the casts is the order their gradients are summed in
    mc = autocast_cast(attn_mask, dtype)
    vc, kc, qc = autocast_cast(v, dtype), autocast_cast(k, dtype), autocast_cast(q, dtype)
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    if plain or not (qc.dtype == kc.dtype == vc.dtype):  # mixed dtypes: torch's own error
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            **kwargs,
        )  # fmt: skip
    q, k, v = qc, kc, vc
    backend = sdpa_backend(q, k, v, dropout_p, is_causal, scale, mc, enable_gqa)
    if mc is not None and mc.requires_grad:
        backend = -2
    if backend not in fused_backends(q.device):
        why = "a mask that needs grad" if backend == -2 else f"SDPA backend {backend}"
        fix = ""
        if backend in (-1, 0) and q.device.type == "cpu" and dropout_p > 0:
            why = "dropout (PyTorch runs attention with dropout on its math path on the CPU)"
            fix = " (compressed with attention dropout 0, or on CUDA)"
        elif backend in (-1, 0):
            why = "inputs no fused SDPA kernel takes (PyTorch's math path)"
        elif backend == -2:
            fix = " (compressed with a mask that does not need grad)"
        warn_once(
            f"sdpa-{why}-{q.device.type}",
            f"mesa_lite: attention with {why} on {q.device.type} is not compressed; "
            f"it runs as plain F.scaled_dot_product_attention{fix}",
        )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            **kwargs,
        )  # fmt: skip
    return SDPAFn.apply(q, k, v, mc, backend, dropout_p, is_causal, scale, spec)


def window_bias(rel_bias: torch.Tensor, mask: torch.Tensor | None, heads: int, batch: int):
    """timm Swin's additive attention bias, as its fused path computes it: the relative-position
    bias ``rel_bias`` (1, heads, N, N), plus for shifted windows the (windows, N, N) ``mask``
    repeated over the ``batch`` (windows x images) dimension."""
    if mask is None:
        return rel_bias
    windows, n = mask.shape[0], mask.shape[-1]
    mask = mask.view(1, windows, 1, n, n).expand(batch // windows, -1, heads, -1, -1)
    return rel_bias + mask.reshape(-1, heads, n, n)


def _bias_grad(gb: torch.Tensor, rel_bias: torch.Tensor, windowed: bool) -> torch.Tensor:
    """The gradient of ``rel_bias`` from the gradient ``gb`` of the (batch, heads, N, N) bias
    in q's dtype, in autograd's order for timm's graph: with a window mask the bias was made
    in fp32 and cast, so the cast's backward comes first and the sum over the batch second;
    without, the cast (1, heads, N, N) bias was expanded, so the sum comes first."""
    if windowed:
        return gb.to(rel_bias.dtype).sum(0, keepdim=True)
    return gb.sum(0, keepdim=True).to(rel_bias.dtype)


class WindowSDPAFn(torch.autograd.Function):
    """Memory-efficient fused attention (CUDA) with timm Swin's learnt additive bias, keeping
    q, k, v and the output compressed (as ``SDPAFn``) and of the bias only its parts: the
    (1, heads, N, N) relative-position bias and the window mask, a buffer. The full
    (windows x images, heads, N, N) bias, which PyTorch keeps, is made again in backward,
    whose kernel also gives its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, rel_bias, mask, full, dropout_p: float, scale, spec):
        bias = attention_bias(full, q, k, SDPA_EFFICIENT)
        out, lse, extra, _ = sdpa_run(q, k, v, SDPA_EFFICIENT, dropout_p, False, scale, bias)
        out = fresh(out)
        out = _save_attention(ctx, q, k, v, out, spec, lse, rel_bias, mask, *extra)
        ctx.cfg = (SDPA_EFFICIENT, dropout_p, False, scale)
        ctx.full_dtype = full.dtype
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        q, k, v, out, (lse, rel_bias, mask, seed, offset) = _load_attention(ctx)
        full = window_bias(rel_bias, mask, q.shape[1], q.shape[0]).to(ctx.full_dtype)
        bias = attention_bias(full, q, k, SDPA_EFFICIENT)
        needs = [*ctx.needs_input_grad[:3], ctx.needs_input_grad[3]]
        _, dropout_p, _, scale = ctx.cfg
        gq, gk, gv, gb = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, bias, out, lse, seed, offset, dropout_p, needs, False, scale=scale
        )
        g_rel = _bias_grad(gb, rel_bias, mask is not None) if needs[3] else None
        return gq, gk, gv, g_rel, None, None, None, None, None


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_bias: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float = 0.0,
    spec: QuantSpec | None = None,
) -> torch.Tensor:
    """timm Swin's fused window attention: ``F.scaled_dot_product_attention(q, k, v,
    attn_mask=window_bias(rel_bias, mask, ...), dropout_p=dropout_p)``, compressed.

    Where PyTorch runs it with memory-efficient attention (CUDA; the bias needs grad, which
    the other fused kernels do not give) q, k, v and the output are kept compressed and the
    full bias not at all (``WindowSDPAFn``); in debug_exact PyTorch's op runs. Elsewhere
    (the CPU, where PyTorch takes its math path for a bias that needs grad; other CUDA
    backends) it runs as plain PyTorch, uncompressed, with a one-time warning.
    """
    heads = q.shape[1]
    # debug_exact runs PyTorch's op itself: in fp32 with a window mask the relative-position
    # gradient rebuilt here measured 8e-4 (relative) from PyTorch's on the H200 (fp16: equal)
    plain = spec is None or spec.exact or not needs_grad(q, k, v)
    plain = plain or plain_under_functorch("attention")
    if not plain and (mask is not None and mask.requires_grad):
        plain = True  # timm's mask is a buffer; one that learns is not this op's
    if plain:
        full = window_bias(rel_bias, mask, heads, q.shape[0])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full, dropout_p=dropout_p)
    dtype = autocast_dtype("sdpa", q.device)
    with torch.no_grad():  # the full bias is made again in backward, not kept
        full = autocast_cast(window_bias(rel_bias, mask, heads, q.shape[0]), dtype)
    vc, kc, qc = autocast_cast(v, dtype), autocast_cast(k, dtype), autocast_cast(q, dtype)
    backend = -1
    if qc.dtype == kc.dtype == vc.dtype:
        backend = sdpa_backend(qc, kc, vc, dropout_p, False, None, full,
                               mask_grad=rel_bias.requires_grad)  # fmt: skip
    if backend != SDPA_EFFICIENT or q.device.type != "cuda":
        warn_once(
            f"window-attention-{backend}-{q.device.type}",
            f"mesa_lite: Swin's fused window attention runs with SDPA backend {backend} on "
            f"{q.device.type} (compressed with the memory-efficient backend on CUDA only); "
            "it runs as plain F.scaled_dot_product_attention",
        )
        full = window_bias(rel_bias, mask, heads, q.shape[0])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full, dropout_p=dropout_p)
    return WindowSDPAFn.apply(qc, kc, vc, rel_bias, mask, full, dropout_p, None, spec)
