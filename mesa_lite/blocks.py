"""Block-level Functions: a transformer block's two halves, each one autograd Function.

``NormAttentionFn`` is LayerNorm -> qkv Linear -> fused attention -> output projection;
``NormMlpFn`` is LayerNorm -> fc1 -> GELU -> fc2. Each computes its forward with the very ops
the per-op modules run (so outputs are bit-identical to PyTorch's), keeps what the per-op
path keeps (the normalized input once for the LayerNorm and the next Linear, q/k/v once as the
qkv output, the attention output once for attention and the projection, the GELU input once
for GELU and fc2), and computes the gradients with the per-op backward helpers of
``mesa_lite/ops``. What one op hands the next stays inside the Function, so no sharing registry
is needed: one autograd node and one Python call per half instead of four or five, and a form
``torch.compile`` can trace.

The casts are those autocast makes for each op (``autocast_dtype`` per op, given in the
configuration tuples), done inside the Function; backward casts the gradients back as
autograd's cast nodes would.

The integrations decide when a block may take this path (``integrations/timm.py``: timm's
vision-transformer ``Block`` with its sub-layers wrapped alike, no dropout, no hooks); otherwise
the block runs its own forward through the per-op modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.ops.activation import (
    activation_grad,
    autocast_state,
    run_activation,
    silu_grad,
    silu_input_grad,
)
from mesa_lite.ops.attention import (
    _keep_in_memory_order,
    _restore,
    fused_backends,
    keep_qkv,
    rebuild_qkv,
    sdpa_backend,
    sdpa_backward,
    sdpa_run,
    split_qkv,
)
from mesa_lite.ops.common import (
    autocast_cast,
    first_order_only,
    fresh,
    keep,
    kept_cast,
    recast,
    weight_cast,
)
from mesa_lite.ops.dropout import dropout_backward, dropout_forward
from mesa_lite.ops.gelu import gelu_input_grad
from mesa_lite.ops.layer_norm import keep_normalized, layer_norm_backward
from mesa_lite.ops.linear import (
    _folded_col_major,
    addmm_backward,
    addmm_col_major,
    addmm_forward,
    linear_backward,
)

__all__ = ["NormAttentionFn", "NormMlpFn", "GatedMlpFn", "GatedProductFn", "MlpFn", "Unsupported"]


class Unsupported(Exception):
    """Raised from a block Function's forward (before anything is kept) for inputs it does not
    take (attention that PyTorch would run on its math path); the caller runs the per-op path."""


def _layer_norm(x, weight, bias, norm_cfg):
    """LayerNorm's forward as the per-op module runs it: ``(out, cast input, mean, rstd)``."""
    shape, eps, dtype = norm_cfg
    xc = autocast_cast(x, dtype)
    wc, bc = autocast_cast(weight, dtype), autocast_cast(bias, dtype)
    out, mean, rstd = torch.native_layer_norm(xc, shape, wc, bc, eps)
    return out, xc, mean, rstd


def _norm_linear_grads(ctx, grad, w, b_dtype, p_ln, mean, rstd, ln_w, ln_b, w_cast=None):
    """The gradients of a half's head, LayerNorm -> Linear, from the gradient of the Linear's
    output: ``(x, LayerNorm weight, bias, Linear weight, bias)``, each cast back to the dtype
    before autocast's casts (None where not needed). Inputs 0-4 of the Function are these.
    ``w_cast``: the Linear weight's forward cast, where kept (``kept_cast``)."""
    norm_cfg, dtype = ctx.cfg[0], ctx.cfg[1]
    shape, eps, ln_dtype = norm_cfg
    wc, bc = recast(ln_w, ln_dtype), recast(ln_b, ln_dtype)
    n = ctx.needs_input_grad
    need_ln = n[0] or n[1] or n[2]

    def rebuild_h():  # the Linear's input: the LayerNorm output, from its normalized input
        p = p_ln.derived(("affine", ctx.h_dtype, shape, eps), ctx.h_dtype, aux=(wc, bc))
        return quant.dequantize(p, grad.dtype)

    g_h, g_w, g_b = linear_backward(
        grad, rebuild_h, w, dtype, ctx.hc_col_major, (need_ln, n[3], n[4]), w.dtype, b_dtype,
        w_cast,
    )  # fmt: skip
    if not need_ln:
        return None, None, None, g_w, g_b
    x_shape, x_dtype, xc_dtype = ctx.x_meta
    gx, gw, gb = layer_norm_backward(
        g_h.to(ctx.h_dtype), p_ln, mean, rstd, wc, bc, shape, x_shape, xc_dtype, list(n[:3])
    )
    gx = None if gx is None else gx.to(x_dtype)
    gw = None if gw is None else gw.to(ln_w.dtype)
    gb = None if gb is None else gb.to(ln_b.dtype)
    return gx, gw, gb, g_w, g_b


def _keep_norm(xc, mean, rstd, spec, keep: bool):
    """What the LayerNorm keeps: ``(packed normalized input, mean, rstd)``, or Nones when
    ``keep`` is False (only its bias needs a gradient)."""
    if not keep:
        return None, None, None
    return keep_normalized(xc, mean, rstd, spec), mean, rstd


def _dtypes(t: torch.Tensor | None):
    return None if t is None else t.dtype


class NormAttentionFn(torch.autograd.Function):
    """``proj(attention(qkv(layer_norm(x))))`` as timm's vision-transformer block computes
    its first half (before layer scale, drop path and the residual add).

    Inputs: ``x``, the LayerNorm's weight and bias, the qkv Linear's weight and bias, the
    projection's weight and bias (biases may be None), and ``cfg``:
    ``(norm_cfg, linear_dtype, num_heads, head_dim, is_causal, spec)``, ``norm_cfg`` being
    ``(normalized_shape, eps, layer_norm_dtype)``; the dtypes are autocast's cast targets for
    each op (None: no cast).
    """

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, qkv_w, qkv_b, proj_w, proj_b, cfg):
        norm_cfg, dtype, heads, head_dim, is_causal, spec = cfg
        h, xc, mean, rstd = _layer_norm(x, ln_w, ln_b, norm_cfg)
        hc = autocast_cast(h, dtype)
        qkv_wc = weight_cast(qkv_w, dtype)
        qkv = F.linear(hc, qkv_wc, autocast_cast(qkv_b, dtype))
        B, N, _ = qkv.shape
        q, k, v = split_qkv(qkv, heads)
        backend = _sdpa_choice(q, k, v, is_causal)
        out, lse, extra, ctx.max_qk = sdpa_run(q, k, v, backend, 0.0, is_causal, None)
        o = out.transpose(1, 2).reshape(B, N, heads * head_dim)
        proj_wc = weight_cast(proj_w, dtype)
        y = F.linear(o, proj_wc, autocast_cast(proj_b, dtype))

        n = ctx.needs_input_grad
        need_ln = n[0] or n[1] or n[2]
        need_qkv = need_ln or n[3] or n[4]  # the gradient of the qkv output
        # the weights' casts where kept, for the products that read them (input gradients)
        casts = (kept_cast(qkv_w, qkv_wc, spec) if need_ln else None,
                 kept_cast(proj_w, proj_wc, spec) if need_qkv else None)  # fmt: skip
        p_ln, mean, rstd = _keep_norm(xc, mean, rstd, spec, n[0] or n[1] or n[3])
        ctx.x_meta = (x.shape, x.dtype, xc.dtype)
        kept, ctx.qkv_layout = keep_qkv(q, k, v, spec, (qkv, heads)) if need_qkv else ([], None)
        po = None  # the output: attention's backward and the projection's weight gradient
        if need_qkv or n[5]:
            po, ctx.o_order = _keep_in_memory_order(out, spec)
        if not need_qkv:
            lse, extra = None, ()
        ctx.n_qkv = len(kept)
        quant.save(ctx, p_ln, mean, rstd, ln_w, ln_b, qkv_w, proj_w, *casts, po, lse, *kept,
                   *extra)  # fmt: skip
        ctx.cfg = cfg
        ctx.sdpa = (backend, 0.0, is_causal, None)
        ctx.h_dtype, ctx.hc_col_major = h.dtype, _folded_col_major(hc)
        ctx.o_meta = (o.dtype, _folded_col_major(o), out.shape)
        ctx.bias_dtypes = (_dtypes(qkv_b), _dtypes(proj_b))
        return fresh(y)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        loaded = quant.load(ctx)
        p_ln, mean, rstd, ln_w, ln_b, qkv_w, proj_w, qkv_wc, proj_wc, po, lse, *rest = loaded
        kept, extra = rest[: ctx.n_qkv], rest[ctx.n_qkv :]
        dtype = ctx.cfg[1]
        n = ctx.needs_input_grad
        need_ln = n[0] or n[1] or n[2]
        need_qkv = need_ln or n[3] or n[4]
        o_dtype, o_col_major, out_shape = ctx.o_meta
        qkv_b_dtype, proj_b_dtype = ctx.bias_dtypes
        B, H, N, D = out_shape

        # the attention output, rebuilt once: the projection's input and attention's backward
        out = _restore(po, ctx.o_order) if po is not None else None

        def rebuild_o():
            return out.transpose(1, 2).reshape(B, N, H * D).to(o_dtype)

        g_o, g_pw, g_pb = linear_backward(
            grad, rebuild_o, proj_w, dtype, o_col_major, (need_qkv, n[5], n[6]),
            proj_w.dtype, proj_b_dtype, proj_wc,
        )  # fmt: skip
        gx = g_lw = g_lb = g_qw = g_qb = None
        if need_qkv:
            q, k, v = rebuild_qkv(kept, ctx.qkv_layout)
            g_out = g_o.reshape(B, N, H, D).transpose(1, 2)
            gq, gk, gv = sdpa_backward(g_out, q, k, v, out, lse, extra, ctx.max_qk, ctx.sdpa,
                                       (True, True, True))  # fmt: skip
            g_qkv = torch.stack([gq, gk, gv]).permute(1, 3, 0, 2, 4).reshape(B, N, 3 * H * D)
            gx, g_lw, g_lb, g_qw, g_qb = _norm_linear_grads(
                ctx, g_qkv, qkv_w, qkv_b_dtype, p_ln, mean, rstd, ln_w, ln_b, qkv_wc
            )
        return gx, g_lw, g_lb, g_qw, g_qb, g_pw, g_pb, None


class NormMlpFn(torch.autograd.Function):
    """``fc2(gelu(fc1(layer_norm(x))))`` as timm's vision-transformer block computes its
    second half (before layer scale, drop path and the residual add).

    Inputs: ``x``, the LayerNorm's weight and bias, fc1's and fc2's weights and biases (biases
    may be None), and ``cfg``: ``(norm_cfg, linear_dtype, gelu_dtype, approximate, spec)``,
    ``norm_cfg`` being ``(normalized_shape, eps, layer_norm_dtype)``; the dtypes are autocast's
    cast targets for each op (None: no cast).
    """

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w1, b1, w2, b2, cfg):
        norm_cfg, dtype, gelu_dtype, approximate, spec = cfg
        h, xc, mean, rstd = _layer_norm(x, ln_w, ln_b, norm_cfg)
        hc = autocast_cast(h, dtype)
        w1c, w2c = weight_cast(w1, dtype), weight_cast(w2, dtype)
        a = F.linear(hc, w1c, autocast_cast(b1, dtype))
        ac = autocast_cast(a, gelu_dtype)
        g = F.gelu(ac, approximate=approximate)
        gc = autocast_cast(g, dtype)
        y = F.linear(gc, w2c, autocast_cast(b2, dtype))

        n = ctx.needs_input_grad
        need_a = n[0] or n[1] or n[2] or n[3] or n[4]  # the gradient of fc1's output
        p_ln, mean, rstd = _keep_norm(xc, mean, rstd, spec, n[0] or n[1] or n[3])
        ctx.x_meta = (x.shape, x.dtype, xc.dtype)
        # GELU's input, kept once: GELU's backward and fc2's input (its GELU) rebuild from it
        p_a = quant.quantize(ac, spec) if need_a or n[5] else None
        casts = (kept_cast(w1, w1c, spec) if n[0] or n[1] or n[2] else None,
                 kept_cast(w2, w2c, spec) if need_a else None)  # fmt: skip
        quant.save(ctx, p_ln, mean, rstd, ln_w, ln_b, w1, w2, p_a, *casts)
        ctx.cfg = cfg
        ctx.h_dtype, ctx.hc_col_major = h.dtype, _folded_col_major(hc)
        ctx.a_dtypes = (a.dtype, ac.dtype, g.dtype, gc.dtype)
        ctx.gc_col_major = _folded_col_major(gc)
        ctx.bias_dtypes = (_dtypes(b1), _dtypes(b2))
        return fresh(y)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        p_ln, mean, rstd, ln_w, ln_b, w1, w2, p_a, w1c, w2c = quant.load(ctx)
        _, dtype, _, approximate, _ = ctx.cfg
        n = ctx.needs_input_grad
        need_ln = n[0] or n[1] or n[2]
        need_a = need_ln or n[3] or n[4]
        a_dtype, ac_dtype, g_dtype, gc_dtype = ctx.a_dtypes
        b1_dtype, b2_dtype = ctx.bias_dtypes

        def rebuild_gc():
            return quant.dequantize(p_a.derived(("gelu", ac_dtype, approximate), g_dtype), gc_dtype)

        g_gc, g_w2, g_b2 = linear_backward(
            grad, rebuild_gc, w2, dtype, ctx.gc_col_major, (need_a, n[5], n[6]),
            w2.dtype, b2_dtype, w2c,
        )  # fmt: skip
        gx = g_lw = g_lb = g_w1 = g_b1 = None
        if need_a:
            g_a = gelu_input_grad(p_a, g_gc.to(g_dtype), approximate, ac_dtype).to(a_dtype)
            gx, g_lw, g_lb, g_w1, g_b1 = _norm_linear_grads(
                ctx, g_a, w1, b1_dtype, p_ln, mean, rstd, ln_w, ln_b, w1c
            )
        return gx, g_lw, g_lb, g_w1, g_b1, g_w2, g_b2, None


class GatedMlpFn(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))``, the gated MLP of Llama, Mistral, Qwen2 and their kin.

    Inputs: ``x``, the gate, up and down projections' weights and biases (biases may be None),
    and ``cfg``: ``(linear_dtype, fn, grad_fn, spec)``: autocast's cast target for the
    projections (None: no cast), the activation's formula and its direct backward (None:
    autograd on the formula; see ``ops/activation.py``).

    Keeps ``x`` once (or the codes its producer registered: an RMSNorm's), and the gate and up
    projections' outputs compressed; backward rebuilds the activation, the product (the down
    projection's input) and their gradients from those two. The per-op path keeps the
    activation's output and the product besides, each in full or compressed.
    """

    @staticmethod
    def forward(ctx, x, gw, gb, uw, ub, dw, db, cfg):
        dtype, fn, _, spec = cfg
        state = autocast_state(x.device)
        xc = autocast_cast(x, dtype)
        gwc, uwc, dwc = (weight_cast(w, dtype) for w in (gw, uw, dw))
        g = F.linear(xc, gwc, autocast_cast(gb, dtype))
        a = fn(g)
        u = F.linear(xc, uwc, autocast_cast(ub, dtype))
        prod = a * u
        prodc = autocast_cast(prod, dtype)
        y = F.linear(prodc, dwc, autocast_cast(db, dtype))

        n = ctx.needs_input_grad
        need_gu = any(n[:7])
        px = keep(xc, spec, share_key=x) if n[1] or n[3] else None
        pg = quant.quantize(g, spec) if need_gu else None
        pu = quant.quantize(u, spec) if need_gu else None
        casts = (kept_cast(gw, gwc, spec) if n[0] else None,
                 kept_cast(uw, uwc, spec) if n[0] else None,
                 kept_cast(dw, dwc, spec) if need_gu else None)  # fmt: skip
        quant.save(ctx, px, pg, pu, gw, uw, dw, *casts)
        ctx.cfg, ctx.state = cfg, state
        ctx.dtypes = (x.dtype, xc.dtype, g.dtype, a.dtype, u.dtype, prod.dtype, prodc.dtype)
        ctx.bias_dtypes = (_dtypes(gb), _dtypes(ub), _dtypes(db))
        ctx.col_major = (_folded_col_major(xc), _folded_col_major(prodc))
        return fresh(y)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, pg, pu, gw, uw, dw, gwc, uwc, dwc = quant.load(ctx)
        dtype, fn, grad_fn, _ = ctx.cfg
        x_dtype, xc_dtype, g_dtype, a_dtype, u_dtype, prod_dtype, prodc_dtype = ctx.dtypes
        gb_dtype, ub_dtype, db_dtype = ctx.bias_dtypes
        n = ctx.needs_input_grad
        need_gu = n[0] or n[1] or n[2] or n[3] or n[4]
        act = _fused_act(grad_fn)
        if need_gu and act and quant.fused_product(pg, pu, ctx.dtypes[2:]):
            # the product's gradient first; then the product (for the down projection's
            # weight) and its factors' gradients in one pass over the codes, g's over the
            # product's gradient
            col = ctx.col_major[1]
            g_prodc = linear_backward(grad, None, dw, dtype, col, (True, False, False),
                                      dw.dtype, db_dtype, dwc)[0].to(prod_dtype)  # fmt: skip
            prodc, g_g, g_u = quant.gated_backward(pg, pu, g_prodc, act, n[5], in_place=True)
            del g_prodc
            # (prodc bound as a default, not a closure cell: Dynamo, which traces this
            # backward under compile, has no handler for deleting a cell)
            _, g_dw, g_db = linear_backward(grad, lambda p=prodc: p, dw, dtype, col,
                                            (False, n[5], n[6]), dw.dtype, db_dtype)  # fmt: skip
            del prodc
        else:
            g = quant.dequantize(pg, g_dtype)
            u = quant.dequantize(pu, u_dtype)
            a = run_activation(fn, g, ctx.state)

            def rebuild_prodc():
                return autocast_cast(a * u, dtype)

            g_prodc, g_dw, g_db = linear_backward(
                grad, rebuild_prodc, dw, dtype, ctx.col_major[1], (need_gu, n[5], n[6]),
                dw.dtype, db_dtype, dwc,
            )  # fmt: skip
            if need_gu:
                g_g, g_u = _product_grads(g_prodc.to(prod_dtype), g, a, u, fn, grad_fn, ctx.state)
        gx = g_gw = g_gb = g_uw = g_ub = None
        if need_gu:
            xs = []

            def rebuild_x():
                if not xs:
                    xs.append(quant.dequantize(px, xc_dtype))
                return xs[0]

            col = ctx.col_major[0]
            g_xg, g_gw, g_gb = linear_backward(
                g_g, rebuild_x, gw, dtype, col, (n[0], n[1], n[2]), gw.dtype, gb_dtype, gwc
            )
            g_xu, g_uw, g_ub = linear_backward(
                g_u, rebuild_x, uw, dtype, col, (n[0], n[3], n[4]), uw.dtype, ub_dtype, uwc
            )
            if n[0]:
                gx = g_xg.to(x_dtype) + g_xu.to(x_dtype)
        return gx, g_gw, g_gb, g_uw, g_ub, g_dw, g_db, None


def _fused_act(grad_fn) -> str | None:
    """The activation's name in the product's one-pass backward (``kernels/gated.py``) for
    its ``grad_fn`` (``ops/activation.py``): SiLU's, GELU's (by its approximation); None
    (autograd on the formula) takes the op-by-op form."""
    if grad_fn is silu_grad:
        return "silu"
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(grad_fn) if isinstance(grad_fn, str) else None


def _product_grads(g_prod, g, a, u, fn, grad_fn, state):
    """The gradients of ``g`` and ``u`` in ``act(g) * u`` (``a`` = ``act(g)``) from the
    product's gradient ``g_prod``, each in its tensor's dtype."""
    g_a = (g_prod * u).to(a.dtype)
    g_u = (g_prod * a).to(u.dtype)
    return activation_grad(fn, grad_fn, state, g, g_a).to(g.dtype), g_u


class GatedProductFn(torch.autograd.Function):
    """``act(g) * u``, the middle of a gated MLP whose projections cannot run inside
    ``GatedMlpFn`` (PEFT's LoRA layers, other adapters): the projections run as their own
    modules around it. Keeps ``g`` and ``u`` compressed and rebuilds the activation from
    ``g`` in backward; the per-op path keeps the activation's input, and both factors of the
    product in full.

    ``cfg``: ``(fn, grad_fn, spec)``, the activation's formula, its direct backward (None:
    autograd on the formula; see ``ops/activation.py``) and the compression setting.
    """

    @staticmethod
    def forward(ctx, g, u, cfg):
        fn, _, spec = cfg
        state = autocast_state(g.device)
        a = fn(g)
        prod = a * u
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        pg = quant.quantize(g, spec) if need else None
        pu = quant.quantize(u, spec) if need else None
        quant.save(ctx, pg, pu)
        ctx.cfg, ctx.state = cfg, state
        ctx.dtypes = (g.dtype, u.dtype, prod.dtype)
        return fresh(prod)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        pg, pu = quant.load(ctx)
        fn, grad_fn, _ = ctx.cfg
        g_dtype, u_dtype, prod_dtype = ctx.dtypes
        n = ctx.needs_input_grad
        act = _fused_act(grad_fn)
        # (the activation's output has g's dtype: SiLU and GELU run in their input's)
        if act and quant.fused_product(pg, pu, ctx.dtypes):
            _, g_g, g_u = quant.gated_backward(pg, pu, grad.to(prod_dtype), act, False, False)
            return (g_g if n[0] else None), (g_u if n[1] else None), None
        g = quant.dequantize(pg, g_dtype)
        u = quant.dequantize(pu, u_dtype)
        a = run_activation(fn, g, ctx.state)
        g_g, g_u = _product_grads(grad.to(prod_dtype), g, a, u, fn, grad_fn, ctx.state)
        return (g_g if n[0] else None), (g_u if n[1] else None), None


def _project(kind: str, x, w, b, dtype):
    """A projection's forward: ``"linear"`` (``F.linear``, weight (out, in)) or ``"addmm"``
    (Hugging Face's ``Conv1D``, weight (in, out)), with autocast's casts to ``dtype``:
    ``(output, the weight's cast)``."""
    if kind == "addmm":
        wc = autocast_cast(w, dtype)
        return addmm_forward(x, wc, b, dtype), wc
    wc = weight_cast(w, dtype)
    return F.linear(x, wc, autocast_cast(b, dtype)), wc


def _project_col_major(kind: str, x, w) -> tuple:
    return addmm_col_major(x, w) if kind == "addmm" else (_folded_col_major(x),)


def _project_grads(kind: str, grad, rebuild_x, w, dtype, col_major: tuple, needs, b_dtype,
                   w_cast=None):  # fmt: skip
    """``_project``'s gradients (input, weight, bias) with the op's own backward formulas
    (``w_cast``: the weight's forward cast, where kept)."""
    if kind == "addmm":
        return addmm_backward(grad, rebuild_x, w, dtype, *col_major, needs, w.dtype, b_dtype,
                              w_cast)  # fmt: skip
    return linear_backward(grad, rebuild_x, w, dtype, col_major[0], needs, w.dtype, b_dtype,
                           w_cast)  # fmt: skip


class MlpFn(torch.autograd.Function):
    """``dropout(proj2(act(proj1(x))))``: GPT-2's MLP (``Conv1D`` projections, a GELU formula
    and residual dropout) and any MLP module made of two projections, an activation and an
    optional dropout after the second projection.

    Inputs: ``x``, the two projections' weights and biases (biases may be None), and ``cfg``:
    ``(kinds, dtypes, fn, grad_fn, p, spec)``: each projection's kind (``"linear"`` or
    ``"addmm"``, see ``_project``) and autocast cast target (None: no cast), the activation's
    formula and backward (as ``ActivationFn`` takes them, already through ``backward_for``),
    the dropout probability (0: none) and the spec.

    Keeps what the per-op path keeps: ``x`` once (or its producer's codes: a LayerNorm's), the
    activation's input compressed (its output, the second projection's input, is rebuilt from
    it) and the dropout mask as 1 bit per element.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, cfg):
        (k1, k2), (d1, d2), fn, grad_fn, p, spec = cfg
        state = autocast_state(x.device)
        xc = autocast_cast(x, d1)
        a, w1c = _project(k1, xc, w1, b1, d1)
        h = fn(a)
        hc = autocast_cast(h, d2)
        y, w2c = _project(k2, hc, w2, b2, d2)
        packed, ctx.drop = None, None
        if p > 0:
            y, packed, ctx.drop = dropout_forward(y, p)

        n = ctx.needs_input_grad
        need_a = n[0] or n[1] or n[2]  # the gradient of the activation's input
        px = keep(xc, spec, share_key=x) if n[1] else None
        pa = quant.quantize(a, spec) if need_a or n[3] else None
        casts = (kept_cast(w1, w1c, spec) if n[0] else None,
                 kept_cast(w2, w2c, spec) if need_a else None)  # fmt: skip
        quant.save(ctx, px, pa, w1, w2, packed, *casts)
        ctx.cfg, ctx.state = cfg, state
        ctx.dtypes = (x.dtype, xc.dtype, a.dtype, h.dtype, hc.dtype)
        ctx.bias_dtypes = (_dtypes(b1), _dtypes(b2))
        ctx.col_major = (_project_col_major(k1, xc, w1), _project_col_major(k2, hc, w2))
        return fresh(y)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        px, pa, w1, w2, packed, w1c, w2c = quant.load(ctx)
        (k1, k2), (d1, d2), fn, grad_fn, _, _ = ctx.cfg
        x_dtype, xc_dtype, a_dtype, h_dtype, hc_dtype = ctx.dtypes
        b1_dtype, b2_dtype = ctx.bias_dtypes
        n = ctx.needs_input_grad
        need_a = n[0] or n[1] or n[2]
        if packed is not None:
            grad = dropout_backward(grad, packed, ctx.drop)
        # the activation's output from the codes: GELU's and SiLU's in the dequantize kernel
        if isinstance(grad_fn, str):
            step = ("gelu", a_dtype, grad_fn)
        elif grad_fn is silu_grad:  # fn is F.silu
            step = ("silu", a_dtype)
        else:
            step = ("act", a_dtype, fn, ctx.state)

        def rebuild_hc():
            return quant.dequantize(pa.derived(step, h_dtype), hc_dtype)

        g_hc, g_w2, g_b2 = _project_grads(
            k2, grad, rebuild_hc, w2, d2, ctx.col_major[1], (need_a, n[3], n[4]), b2_dtype, w2c
        )
        gx = g_w1 = g_b1 = None
        if need_a:
            g_h = g_hc.to(h_dtype)
            if isinstance(grad_fn, str):
                g_a = gelu_input_grad(pa, g_h.to(a_dtype), grad_fn, a_dtype)
            elif grad_fn is silu_grad:
                g_a = silu_input_grad(pa, g_h.to(a_dtype), a_dtype)
            else:
                a = quant.dequantize(pa, a_dtype)
                g_a = activation_grad(fn, grad_fn, ctx.state, a, g_h)
            g_xc, g_w1, g_b1 = _project_grads(
                k1, g_a.to(a_dtype), lambda: quant.dequantize(px, xc_dtype), w1, d1,
                ctx.col_major[0], (n[0], n[1], n[2]), b1_dtype, w1c,
            )  # fmt: skip
            gx = None if g_xc is None else g_xc.to(x_dtype)
        return gx, g_w1, g_b1, g_w2, g_b2, None


def fused_backend_ok(q, k, v, is_causal: bool) -> bool:
    """Whether PyTorch runs attention on these inputs through a fused backend this path takes."""
    return sdpa_backend(q, k, v, 0.0, is_causal, None) in fused_backends(q.device)


def _sdpa_choice(q, k, v, is_causal: bool) -> int:
    """The fused backend PyTorch picks for these inputs; ``Unsupported`` for the others."""
    backend = sdpa_backend(q, k, v, 0.0, is_causal, None)
    if backend not in fused_backends(q.device):
        raise Unsupported(f"attention on SDPA backend {backend}")
    return backend


def spec_of(*modules) -> QuantSpec | None:
    """The one spec ``modules`` share, or None when they differ or one is exact by config."""
    spec = modules[0].mesa_spec
    for m in modules[1:]:
        if m.mesa_spec != spec:
            return None
    return spec
