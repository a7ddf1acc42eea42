"""Compressed fused attention: the backend PyTorch picks, forward bit-exact, gradients exact in
the debug mode and within the SQNR floor compressed, masks and unsupported backends exact."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_equal, count_calls, saved_activation_bytes, sqnr_db

import mesa_lite
from mesa_lite import QuantSpec
from mesa_lite.modules import scaled_dot_product_attention as mesa_sdpa

# Gradient SQNR floors of q, k, v, measured (worst over 5 seeds on these shapes): 35.8 dB at 8
# bits, 12.2 at 4 and -3.6 at 2 (q, k kept at 8 bits in every case; see SDPAFn).
FLOORS = {8: 30.0, 4: 10.0, 2: -6.0}
AUTOCAST = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _qkv(device, strided: bool):
    """q, k, v of shape (B, H, N, D); strided: views of one (B, N, 3, H, D) buffer, as timm."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 2, 3, 50, 16
    if strided:
        qkv = torch.randn(B, N, 3, H, D, generator=g).to(device).permute(2, 0, 3, 1, 4)
        return [t.clone().requires_grad_() for t in qkv.unbind(0)], qkv
    return [
        torch.randn(B, H, N, D, generator=g).to(device).requires_grad_() for _ in range(3)
    ], None


def _run(fn, q, k, v, device, autocast, **kw):
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        return fn(q, k, v, **kw)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_sdpa_forward_exact_and_grads(exact, autocast, causal, device):
    _compare_with_torch(exact, AUTOCAST[autocast], device, is_causal=causal)


def _compare_with_torch(exact, ac, device, **kw):
    """mesa_lite's SDPA against PyTorch's on the same q, k, v: the compressed Function runs,
    forward bit-exact, gradients exact in debug_exact and above the 8-bit floor otherwise."""
    (q1, k1, v1), _ = _qkv(device, strided=False)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q1, k1, v1))
    ref = _run(F.scaled_dot_product_attention, q1, k1, v1, device, ac, **kw)
    out = _run(mesa_sdpa, q2, k2, v2, device, ac, spec=QuantSpec(exact=exact), **kw)
    assert type(out.grad_fn).__name__ == "SDPAFnBackward", "the compressed Function must run"
    assert_equal(out, ref, "forward")
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    _assert_qkv_grads(exact, (q1, k1, v1), (q2, k2, v2))


def _assert_qkv_grads(exact: bool, ref, got) -> None:
    """The gradients of q, k and v: ``got``'s equal ``ref``'s in debug_exact, else above the
    8-bit floor."""
    for what, a, b in zip("qkv", ref, got, strict=True):
        if exact:
            assert_equal(b.grad, a.grad, f"grad of {what}")
        else:
            db = sqnr_db(a.grad, b.grad)
            assert FLOORS[8] <= db < float("inf"), f"grad of {what}: {db:.1f} dB"


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_sdpa_timm_layout_keeps_stride_order_and_compresses(bits, device):
    (q, k, v), _ = _qkv(device, strided=True)
    spec = QuantSpec(bits=bits)
    kept, out = saved_activation_bytes(lambda: mesa_sdpa(q, k, v, spec=spec))
    ref_kept, ref = saved_activation_bytes(lambda: F.scaled_dot_product_attention(q, k, v))
    assert_equal(out, ref, "forward")
    # q, k at 8 bits always; v and out at `bits`
    assert kept < ref_kept * {8: 0.3, 4: 0.23, 2: 0.2}[bits], (kept, ref_kept)
    g = torch.randn_like(ref)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(grads_ref, grads, strict=True):
        assert sqnr_db(a, b) >= FLOORS[bits]


def test_sdpa_restores_forward_stride_order():
    from mesa_lite.ops.attention import _keep_in_memory_order, _restore

    x = torch.randn(2, 50, 3, 16).permute(0, 2, 1, 3)  # (B, H, N, D) stored as (B, N, H, D)
    p, order = _keep_in_memory_order(x, QuantSpec())
    y = _restore(p, order)
    assert y.shape == x.shape and y.stride() == x.stride()
    assert sqnr_db(x, y) > 35


def _masks(device):
    """Masks as models pass them: a 2-D boolean, a (B, 1, N, N) boolean padding + causal mask
    (Hugging Face's sdpa mask), and an additive float mask (B, 1, N, N)."""
    g = torch.Generator().manual_seed(1)
    n = 50
    square = (torch.rand(n, n, generator=g) > 0.3).to(device)
    square.fill_diagonal_(True)  # every row attends somewhere
    pad = torch.ones(2, n, dtype=torch.bool)
    pad[1, 40:] = False  # the second sequence is padded
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    padded = (causal[None, None] & pad[:, None, None, :]).to(device)
    additive = torch.zeros(2, 1, n, n).masked_fill(~padded.cpu(), float("-inf")).to(device)
    return {"bool2d": square, "padding4d": padded, "additive": additive}


@pytest.mark.parametrize("mask_kind", ["bool2d", "padding4d", "additive"])
@pytest.mark.parametrize("autocast", ["fp32", "bf16"], ids=str)
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_sdpa_with_a_mask_is_compressed(exact, autocast, mask_kind, device):
    """Masked attention runs the fused backend PyTorch picks with the mask (CPU flash, CUDA
    memory-efficient), forward bit-exact, gradients exact in debug_exact, SQNR floor at int8;
    the mask is kept by reference, not copied."""
    _compare_with_torch(exact, AUTOCAST[autocast], device, attn_mask=_masks(device)[mask_kind])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_sdpa_grouped_query_attention(exact, causal, device):
    """k, v with fewer heads than q (``enable_gqa``, as Llama's sdpa attention calls it): the
    fused backend takes them as they are; k and v keep their own (smaller) size."""
    g = torch.Generator().manual_seed(2)
    q1 = torch.randn(2, 8, 40, 16, generator=g).to(device).requires_grad_()
    k1, v1 = (torch.randn(2, 2, 40, 16, generator=g).to(device).requires_grad_() for _ in "kv")
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q1, k1, v1))
    ref = F.scaled_dot_product_attention(q1, k1, v1, is_causal=causal, enable_gqa=True)
    kept, out = saved_activation_bytes(
        lambda: mesa_sdpa(
            q2, k2, v2, is_causal=causal, enable_gqa=True, spec=QuantSpec(exact=exact)
        )
    )
    if mesa_lite.ops.attention.sdpa_backend(q2, k2, v2, 0.0, causal, None, None, True) < 1:
        pytest.skip("PyTorch runs grouped-query attention on its math path here")
    assert type(out.grad_fn).__name__ == "SDPAFnBackward"
    assert_equal(out, ref, "GQA forward")
    if not exact:  # q and out: 2 x 2*8*40*16 codes, k and v 2 x 2*2*40*16, plus scales
        assert kept < 2 * (2 * 8 * 40 * 16 + 2 * 2 * 40 * 16) * 1.2, kept
    gr = torch.randn_like(ref)
    ref.backward(gr)
    out.backward(gr)
    for what, a, b in (("q", q1, q2), ("k", k1, k2), ("v", v1, v2)):
        assert b.grad.shape == a.grad.shape
        if exact:
            assert_equal(b.grad, a.grad, f"grad of {what}")
        else:
            assert sqnr_db(a.grad, b.grad) >= FLOORS[8], what


def test_sdpa_with_a_mask_that_needs_grad_runs_plain_and_warns(device):
    """A learned additive bias needs its own gradient, which the compressed path does not
    give: plain SDPA, exact, with a warning."""
    (q, k, v), _ = _qkv(device, strided=False)
    bias = torch.zeros(50, 50, device=device, requires_grad=True)
    mesa_lite.ops.common._WARNED.clear()
    with pytest.warns(UserWarning, match="mask that needs grad.*not compressed"):
        out = mesa_sdpa(q, k, v, attn_mask=bias, spec=QuantSpec())
    assert_equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias), "forward")
    assert "SDPAFn" not in type(out.grad_fn).__name__
    out.sum().backward()
    assert bias.grad is not None


def test_sdpa_math_backend_runs_plain(device):
    """Dropout on CPU makes PyTorch pick the math path: plain SDPA, exact, with a warning."""
    if device.type != "cpu":
        pytest.skip("CPU backend selection")
    (q, k, v), _ = _qkv(device, strided=False)
    mesa_lite.ops.common._WARNED.clear()
    with pytest.warns(
        UserWarning, match="dropout .*math path on the CPU.* on cpu is not compressed"
    ):
        torch.manual_seed(0)
        out = mesa_sdpa(q, k, v, dropout_p=0.5, spec=QuantSpec())
    torch.manual_seed(0)
    assert_equal(out, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5), "dropout forward")


def test_sdpa_plain_without_grad(device):
    (q, k, v), _ = _qkv(device, strided=False)
    with torch.no_grad():
        out = mesa_sdpa(q, k, v, spec=QuantSpec())
    assert out.grad_fn is None


@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_sdpa_on_views_of_one_qkv_tensor_keeps_it_once(exact, device):
    """timm's layout: q, k, v unbound from one (B, N, 3, H, D) tensor. At 8 bits that tensor is
    kept once (one int8 copy of 3 x B*N*C elements, no gathering copies) and backward takes
    the same strided views of its rebuild: exact gradients in debug_exact, SQNR floor at int8."""
    g = torch.Generator().manual_seed(3)
    B, N, H, D = 2, 40, 3, 16
    qkv = torch.randn(B, N, 3 * H * D, generator=g).to(device).requires_grad_()
    spec = QuantSpec(exact=exact)

    def run(sdpa):
        q, k, v = qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        return sdpa(q, k, v)

    shapes = []

    def pack(t):
        shapes.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(lambda q, k, v: mesa_sdpa(q, k, v, spec=spec))
    ref = run(F.scaled_dot_product_attention)
    assert_equal(out, ref, "forward")
    n = B * N * H * D
    if not exact:
        codes = [s for s in shapes if s[0] == torch.int8]
        assert sorted(c[1] for c in codes) == [n, 3 * n], codes  # qkv once, the output once
    grad = torch.randn(ref.shape, generator=g).to(device)
    (gref,) = torch.autograd.grad(ref, qkv, grad)
    (gout,) = torch.autograd.grad(out, qkv, grad)
    if exact:
        assert_equal(gout, gref, "grad of qkv")
    else:
        assert sqnr_db(gref, gout) >= FLOORS[8]


def _broadcast_inputs(case: str, device):
    """q, k, v as models broadcast them, from the (smaller) tensors that learn: Hugging Face's
    repeat_kv with one key/value head (k, v expanded over the heads, stride 0) and learned
    queries expanded over the batch (Perceiver/Q-Former cross-attention)."""
    g = torch.Generator().manual_seed(4)
    B, H, N, D = 2, 4, 24, 16
    if case == "repeat_kv":
        leaves = [torch.randn(B, H, N, D, generator=g),
                  *(torch.randn(B, 1, N, D, generator=g) for _ in "kv")]  # fmt: skip
    else:  # learned queries
        leaves = [torch.randn(1, H, N, D, generator=g),
                  *(torch.randn(B, H, N, D, generator=g) for _ in "kv")]  # fmt: skip
    leaves = [t.to(device).requires_grad_() for t in leaves]

    def inputs(ts):
        return [t.expand(B, H, N, D) for t in ts]

    return leaves, inputs


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("case", ["repeat_kv", "learned_queries"])
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_sdpa_broadcast_inputs(exact, case, masked, device):
    """q, k or v a stride-0 expanded view: gradients exact in debug_exact and above the floor
    at 8 bits, on every torch (torch 2.11's CPU flash backward computed wrong gradients for the
    dense rebuild with the expanded dim innermost); the expanded tensor's codes are kept once,
    at the un-expanded size."""
    leaves, inputs = _broadcast_inputs(case, device)
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    mask = _masks(device)["padding4d"][..., :24, :24] if masked else None
    ref = F.scaled_dot_product_attention(*inputs(leaves), attn_mask=mask)
    kept, out = saved_activation_bytes(
        lambda: mesa_sdpa(*inputs(twins), attn_mask=mask, spec=QuantSpec(exact=exact))
    )
    assert type(out.grad_fn).__name__ == "SDPAFnBackward"
    assert_equal(out, ref, "forward")
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).to(device)
    ref.backward(g)
    out.backward(g)
    for what, a, b in zip("qkv", leaves, twins, strict=True):
        if exact:
            assert_equal(b.grad, a.grad, f"grad of {what}")
        else:
            db = sqnr_db(a.grad, b.grad)
            assert FLOORS[8] <= db < float("inf"), f"grad of {what}: {db:.1f} dB"
    if not exact:  # the expanded tensors' codes at their own size: fewer bytes than dense ones
        dense_kept, _ = saved_activation_bytes(
            lambda: mesa_sdpa(*(t.contiguous() for t in inputs(twins)), attn_mask=mask,
                              spec=QuantSpec())
        )  # fmt: skip
        spared = sum(out.numel() - t.numel() for t in leaves)  # one int8 code each
        assert kept <= dense_kept - 0.95 * spared, (kept, dense_kept, spared)


def _kept_shapes(fn) -> list[tuple]:
    """The shapes of the tensors ``fn``'s forward saves for backward (each saved one once)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return shapes, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: on the CPU PyTorch "
                    "runs attention with dropout on its math path")  # fmt: skip
@pytest.mark.parametrize("mask_kind", [None, "padding4d", "additive"], ids=str)
@pytest.mark.parametrize("autocast", ["fp16", "bf16"], ids=str)
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_sdpa_dropout_on_cuda_runs_fused_with_pytorchs_draws(exact, autocast, mask_kind):
    """Issue 52: attention with dropout on CUDA (BERT's, in training) takes PyTorch's fused
    kernel with dropout (flash without a mask, memory-efficient with one): under one seed
    the output is PyTorch's bit for bit (the same draws), backward regenerates the mask from
    the kept RNG state, and no tensor of attention probabilities (B, H, N, N) is kept;
    gradients exact in debug_exact, within the 8-bit floor compressed."""
    device = torch.device("cuda")
    ac = AUTOCAST[autocast]
    (q1, k1, v1), _ = _qkv(device, strided=False)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q1, k1, v1))
    kw = dict(dropout_p=0.3, attn_mask=None if mask_kind is None else _masks(device)[mask_kind])
    torch.manual_seed(7)
    ref = _run(F.scaled_dot_product_attention, q1, k1, v1, device, ac, **kw)
    torch.manual_seed(7)
    shapes, out = _kept_shapes(
        lambda: _run(mesa_sdpa, q2, k2, v2, device, ac, spec=QuantSpec(exact=exact), **kw)
    )
    assert type(out.grad_fn).__name__ == "SDPAFnBackward", "the compressed Function must run"
    assert_equal(out, ref, "forward")
    no_drop = _run(F.scaled_dot_product_attention, q1, k1, v1, device, ac,
                   attn_mask=kw["attn_mask"])  # fmt: skip
    assert not torch.equal(out, no_drop), "dropout must have dropped"
    B, H, N, _ = q1.shape
    assert (B, H, N, N) not in shapes, shapes
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    _assert_qkv_grads(exact, (q1, k1, v1), (q2, k2, v2))


@pytest.mark.parametrize("heads", [4, 6], ids=["heads-ne-len", "heads-eq-len"])
def test_fp64_attention_then_an_exact_projection_gives_pytorch_s_gradients(heads):
    """An fp64 attention output is kept itself (fp64 is kept exactly at any spec), in logical
    order, and not offered for reuse: a projection with an exact spec (a layer debugged in
    debug_exact) reading its transposed and reshaped output keeps its own input. Shared, it
    rebuilt the memory-order layout from the logical-order tensor: a view error, or with as
    many heads as tokens silently transposed gradients (a review's repro)."""
    from mesa_lite.ops.linear import linear

    torch.manual_seed(0)
    B, L, D = 2, 6, 8
    leaves = [torch.randn(B, L, heads, D, dtype=torch.float64, requires_grad=True)
              for _ in range(3)]  # fmt: skip
    w = torch.randn(5, heads * D, dtype=torch.float64, requires_grad=True)

    def grads(attn, lin):
        q, k, v = (t.transpose(1, 2) for t in leaves)
        o = attn(q, k, v).transpose(1, 2).reshape(B, L, heads * D)
        return torch.autograd.grad(lin(o, w).square().sum(), (*leaves, w))

    ref = grads(F.scaled_dot_product_attention, F.linear)
    got = grads(lambda q, k, v: mesa_sdpa(q, k, v, spec=QuantSpec()),
                lambda o, w: linear(o, w, None, QuantSpec(exact=True)))  # fmt: skip
    for a, b in zip(got, ref, strict=True):
        assert_equal(a, b, "fp64 gradient")


@pytest.mark.parametrize("case", ["separate", "grouped_query", "repeat_kv"])
@pytest.mark.parametrize("autocast", ["fp32", "bf16"], ids=str)
def test_separate_q_k_v_are_quantized_in_one_launch(case, autocast, triton_device, monkeypatch):
    """Issue 51: q, k and v from separate projections (Hugging Face's attention: separate
    tensors, grouped-query k and v, repeat_kv's expanded views) are quantized in one launch
    (``quant.quantize3``, forced here: compiled on the GPU, else in Triton's interpreter) and
    keep what three quantize calls keep: the forward and every gradient bit for bit."""
    from mesa_lite.kernels import group_quant as gq

    from mesa_lite import quant

    g = torch.Generator().manual_seed(7)
    kv_heads = 4 if case == "separate" else 2
    q = torch.randn(2, 4, 40, 16, generator=g).to(triton_device).requires_grad_()
    k, v = (torch.randn(2, kv_heads, 40, 16, generator=g).to(triton_device).requires_grad_()
            for _ in "kv")  # fmt: skip
    gqa = case == "grouped_query"

    def step():
        kk, vv = k, v
        if case == "repeat_kv":  # Hugging Face's repeat_kv: a stride-0 expand, then reshape
            kk, vv = (t[:, :, None].expand(2, 2, 2, 40, 16).reshape(2, 4, 40, 16) for t in (k, v))
        out = _run(mesa_sdpa, q * 1.0, kk * 1.0, vv, triton_device, AUTOCAST[autocast],
                   enable_gqa=gqa, spec=QuantSpec())  # fmt: skip
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        return out, grads

    calls = count_calls(monkeypatch, gq, "quantize3")
    if mesa_lite.ops.attention.sdpa_backend(q, k, v, 0.0, False, None, None, gqa) < 1:
        pytest.skip("PyTorch runs this attention on its math path here")
    monkeypatch.setattr(quant, "use_triton", lambda t: True)
    one_launch = step()
    assert calls == [1]
    monkeypatch.setattr(quant, "one_launch", lambda xs, spec: False)  # three quantize calls
    three = step()
    assert calls == [1]
    assert_equal(one_launch[0], three[0], "forward")
    for what, a, b in zip("qkv", three[1], one_launch[1], strict=True):
        assert_equal(b, a, f"grad of {what}")
