"""The fused kernels against their references: quantizing a LayerNorm's normalized input
from x, mean and rstd; dequantizing through an epilogue (affine, unnormalize, GELU, GELU's
backward reading the codes); and the direct launcher.

Quantize and the affine/unnormalize epilogues are bit for bit (IEEE fp32 operations in the
same order). GELU uses ``erf``/``exp``, whose implementations differ between Triton and
torch's CPU kernels, so it is compared to a few ulps of its output dtype.
"""

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_equal
from mesa_lite.kernels import group_quant as gq
from mesa_lite.kernels.launch import Launcher

BITS_GROUPS = [(8, 128), (8, 1000), (8, 7), (4, 128), (2, 12)]


def _x(shape, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale + torch.randn(shape[:-1] + (1,), generator=g)
    return x.to(dtype=dtype, device=device)


def _ulps(dtype):
    return {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]


@pytest.mark.parametrize("bits, group_size", BITS_GROUPS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_quantize_normalized_matches_reference(dtype, bits, group_size, triton_device):
    x = _x((5, 7, 96), dtype, triton_device)
    _, mean, rstd = torch.native_layer_norm(x.float(), (96,), None, None, 1e-5)
    mean, rstd = mean.to(triton_device), rstd.to(triton_device)
    kw = dict(bits=bits, normalize=(mean, rstd))
    codes, scales = gq.quantize(x, group_size, use_triton=True, **kw)
    rcodes, rscales = gq.quantize_ref(
        x.cpu(), group_size, **{**kw, "normalize": (mean.cpu(), rstd.cpu())}
    )
    assert_equal(codes.cpu(), rcodes, "codes")
    assert_equal(scales.cpu(), rscales, "scales")
    # the same as quantizing the normalized tensor written out in fp32
    xhat = (x.float().cpu() - mean.cpu()) * rstd.cpu()
    assert_equal(rcodes, gq.quantize_ref(xhat, group_size, bits=bits)[0], "vs written x_hat")


def test_quantize_normalized_keeps_non_finite(triton_device):
    x = _x((4, 64), torch.float32, triton_device)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    mean = x.mean(-1, keepdim=True)
    rstd = torch.ones_like(mean)
    codes, scales = gq.quantize(x, 64, use_triton=True, normalize=(mean, rstd))
    out = gq.dequantize(codes, scales, 64, torch.float32, use_triton=True)
    assert out.view(4, 64)[1].isnan().all() and out.view(4, 64)[2].isnan().any()
    assert out.view(4, 64)[[0, 3]].isfinite().all()


def _epilogues(device, dtype, rows, row_len):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(row_len, generator=g) + 1).to(device=device, dtype=dtype)
    b = torch.randn(row_len, generator=g).to(device=device, dtype=dtype)
    mean = torch.randn(rows, 1, generator=g).to(device)
    rstd = torch.rand(rows, 1, generator=g).add(0.1).to(device)
    rstd[1] = 0.0  # variance overflow: the mean itself
    return [
        ("affine", w, b),
        ("affine", w, None),
        ("affine", None, b),
        ("unnormalize", mean, rstd),
    ]


@pytest.mark.parametrize("bits, group_size", BITS_GROUPS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dequantize_epilogues_match_reference(dtype, bits, group_size, triton_device):
    rows, row_len = 6, 80
    x = _x((rows, row_len), torch.float32, triton_device)
    codes, scales = gq.quantize(x, group_size, use_triton=True, bits=bits)
    n = x.numel()
    for epi in _epilogues(triton_device, dtype, rows, row_len):
        kw = dict(bits=bits, signed=True, numel=n)
        out = gq.dequantize(codes, scales, group_size, dtype, use_triton=True, epilogue=epi, **kw)
        cpu = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in epi)
        ref = gq.dequantize_ref(codes.cpu(), scales.cpu(), group_size, dtype, epilogue=cpu, **kw)
        assert_equal(out.cpu(), ref, f"{epi[0]}")
        # and the reference is the plain dequantize followed by torch's own ops
        v = gq.dequantize_ref(codes.cpu(), scales.cpu(), group_size, torch.float32, **kw)
        v = v.view(rows, row_len)
        if epi[0] == "affine":
            if cpu[1] is not None:
                v = v * cpu[1].float()
            if cpu[2] is not None:
                v = v + cpu[2].float()
        else:
            v = torch.where(cpu[2] == 0, cpu[1], v / cpu[2] + cpu[1])
        assert_equal(ref.view(rows, row_len), v.to(dtype), f"{epi[0]} as torch ops")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_keeps_subnormal_results(dtype, bits, triton_device):
    # values near float32's smallest normal: code * scale and the affine epilogue's products
    # are subnormal, which PyTorch keeps (fp32 and bf16 share the exponent range); compiled,
    # the kernel must not flush them to zero
    rows, row_len = 4, 64
    x = _x((rows, row_len), torch.float32, triton_device) * 2.0**-126
    codes, scales = gq.quantize(x, 32, use_triton=True, bits=bits)
    kw = dict(bits=bits, signed=True, numel=x.numel())
    w = torch.full((row_len,), 0.03, device=triton_device)
    for epi in (None, ("affine", w, None), ("affine", w, torch.zeros_like(w))):
        out = gq.dequantize(codes, scales, 32, dtype, use_triton=True, epilogue=epi, **kw)
        cpu = epi and tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in epi)
        ref = gq.dequantize_ref(codes.cpu(), scales.cpu(), 32, dtype, epilogue=cpu, **kw)
        tiny = (ref != 0) & (ref.float().abs() < 2.0**-126)
        assert tiny.sum() > 20, "the case must produce subnormal results"
        assert_equal(out.cpu(), ref, f"{epi and epi[0]}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dequantize_gelu_and_gelu_backward(dtype, approximate, triton_device):
    x = _x((3, 333), dtype, triton_device, scale=2.0)
    codes, scales = gq.quantize(x, 128, use_triton=True)
    epi = ("gelu", approximate, dtype)
    out = gq.dequantize(codes, scales, 128, dtype, use_triton=True, epilogue=epi)
    ref = gq.dequantize_ref(codes.cpu(), scales.cpu(), 128, dtype, epilogue=epi)
    tol = 4 * _ulps(dtype)
    atol = tol * ref.abs().max().item()  # gelu(x) ~ x / 2 near 0: relative error grows there
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=atol)
    xq = gq.dequantize_ref(codes.cpu(), scales.cpu(), 128, dtype).view(x.shape)
    torch.testing.assert_close(
        ref,
        torch.nn.functional.gelu(xq.float(), approximate=approximate).to(dtype).view(-1),
        rtol=0,
        atol=0,
    )
    grad = _x(x.shape, dtype, triton_device, seed=4)
    epi = ("gelu_backward", approximate, grad)
    gk = gq.dequantize(codes, scales, 128, dtype, use_triton=True, epilogue=epi)
    epi = ("gelu_backward", approximate, grad.cpu())
    gr = gq.dequantize_ref(codes.cpu(), scales.cpu(), 128, dtype, epilogue=epi).view(x.shape)
    assert gk.shape == (x.numel(),) and gk.dtype == dtype
    gk = gk.view(x.shape)
    # near gelu'(x) = 0 the sum cdf + x * pdf cancels: an absolute bound on the grad's scale
    tol = max(tol, 1e-5)
    atol = tol * grad.abs().max().item()
    torch.testing.assert_close(gk.cpu().float(), gr.float(), rtol=tol, atol=atol)
    exact = torch.ops.aten.gelu_backward(grad.cpu(), xq, approximate=approximate)
    assert_equal(gr, exact, "reference is aten's gelu_backward on the rebuilt input")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dequantize_silu_and_silu_backward(dtype, bits, triton_device):
    """SiLU's epilogues (issue 51): the kernel within a few ulps of the reference (``exp``
    differs), and the reference is torch's F.silu / aten.silu_backward on the rebuilt input
    bit for bit."""
    x = _x((3, 333), dtype, triton_device, scale=4.0)
    kw = dict(bits=bits, signed=True, numel=x.numel())
    codes, scales = gq.quantize(x, 128, use_triton=True, bits=bits)
    cpu_codes, cpu_scales = codes.cpu(), scales.cpu()
    epi = ("silu", dtype)
    out = gq.dequantize(codes, scales, 128, dtype, use_triton=True, epilogue=epi, **kw)
    ref = gq.dequantize_ref(cpu_codes, cpu_scales, 128, dtype, epilogue=epi, **kw)
    tol = 4 * _ulps(dtype)
    atol = tol * ref.abs().max().item()  # silu(x) ~ x / 2 near 0: relative error grows there
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=atol)
    xq = gq.dequantize_ref(cpu_codes, cpu_scales, 128, dtype, **kw).view(x.shape)
    assert_equal(ref, torch.nn.functional.silu(xq).view(-1), "reference is F.silu")
    if dtype != torch.float32:  # a wider output than SiLU's dtype: fp32 SiLU, rounded once
        wide = gq.dequantize(codes, scales, 128, torch.float32, use_triton=True, epilogue=epi,
                             **kw)  # fmt: skip
        wide_ref = gq.dequantize_ref(cpu_codes, cpu_scales, 128, torch.float32, epilogue=epi,
                                     **kw)  # fmt: skip
        torch.testing.assert_close(wide.cpu(), wide_ref, rtol=4 * _ulps(torch.float32) * 4,
                                   atol=1e-6 * wide_ref.abs().max().item())  # fmt: skip
    grad = _x(x.shape, dtype, triton_device, seed=4)
    gk = gq.dequantize(codes, scales, 128, dtype, use_triton=True,
                       epilogue=("silu_backward", grad), **kw)  # fmt: skip
    gr = gq.dequantize_ref(cpu_codes, cpu_scales, 128, dtype,
                           epilogue=("silu_backward", grad.cpu()), **kw)  # fmt: skip
    assert gk.shape == (x.numel(),) and gk.dtype == dtype
    # near silu'(x) = 0 (x ~ -1.28) the sum cancels: an absolute bound on the grad's scale
    tol = max(tol, 1e-5)
    atol = tol * grad.abs().max().item()
    torch.testing.assert_close(gk.cpu().float(), gr.float(), rtol=tol, atol=atol)
    exact = torch.ops.aten.silu_backward(grad.cpu(), xq)
    assert_equal(gr.view(x.shape), exact, "reference is aten's silu_backward")


def test_silu_backward_keeps_non_finite(triton_device):
    x = _x((2, 128), torch.float32, triton_device)
    x[0, 0] = float("nan")
    codes, scales = gq.quantize(x, 128, use_triton=True)
    epi = ("silu_backward", torch.ones_like(x))
    g = gq.dequantize(codes, scales, 128, torch.float32, use_triton=True, epilogue=epi)
    assert g.view(2, 128)[0].isnan().all() and g.view(2, 128)[1].isfinite().all()


def test_gelu_backward_keeps_non_finite(triton_device):
    x = _x((2, 128), torch.float32, triton_device)
    x[0, 0] = float("nan")
    codes, scales = gq.quantize(x, 128, use_triton=True)
    epi = ("gelu_backward", "none", torch.ones_like(x))
    g = gq.dequantize(codes, scales, 128, torch.float32, use_triton=True, epilogue=epi)
    assert g.view(2, 128)[0].isnan().all() and g.view(2, 128)[1].isfinite().all()


def test_epilogue_argument_errors():
    codes, scales = gq.quantize_ref(torch.randn(4, 8), 8)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        gq.dequantize(codes, scales, 8, torch.float32, epilogue=("relu",))
    with pytest.raises(ValueError, match="affine"):
        gq.dequantize(codes, scales, 8, torch.float32, epilogue=("affine", torch.ones(5), None))
    with pytest.raises(ValueError, match="one mean and one rstd per row"):
        gq.quantize(torch.randn(4, 8), 8, normalize=(torch.zeros(3), torch.ones(3)))
    with pytest.raises(TypeError, match="normalize mean"):
        gq.quantize(torch.randn(4, 8), 8, normalize=(torch.zeros(4, dtype=torch.int32),) * 2)
    with pytest.raises(ValueError, match="gradient of 32 elements"):
        gq.dequantize(codes, scales, 8, torch.float32, epilogue=("gelu_backward", "none", None))
    with pytest.raises(ValueError, match="approximate must be"):
        epi = ("gelu_backward", "erf", torch.ones(32))
        gq.dequantize(codes, scales, 8, torch.float32, epilogue=epi)
    with pytest.raises(ValueError, match="bad gelu epilogue"):
        gq.dequantize(codes, scales, 8, torch.float32, epilogue=("gelu", "erf", torch.float32))
    with pytest.raises(ValueError, match="bad silu epilogue"):
        gq.dequantize(codes, scales, 8, torch.float32, epilogue=("silu", "tanh"))
    with pytest.raises(ValueError, match="silu_backward needs a gradient of 32 elements"):
        gq.dequantize(codes, scales, 8, torch.float32, epilogue=("silu_backward", torch.ones(3)))


def test_launcher_key_follows_triton_specialization():
    """Every property Triton's JIT specializes on changes the key; nothing else does."""

    class _P:
        def __init__(self, c):
            self.is_constexpr = c

    class _Fn:
        params = [_P(False), _P(False), _P(True)]

    lk = Launcher(_Fn())
    a = torch.zeros(64)
    base = lk.key((a, 32, 4))
    assert lk.key((torch.ones(64), 64, 4)) == base  # other values, same classes
    assert lk.key((a[1:], 32, 4)) != base  # pointer no longer 16-byte aligned
    assert lk.key((a.half(), 32, 4)) != base  # dtype
    assert lk.key((a, 33, 4)) != base  # not divisible by 16
    assert lk.key((a, 1, 4)) != base  # the value 1
    assert lk.key((a, 2**40, 4)) != base  # 64-bit int
    assert lk.key((a, 32, 8)) != base  # constexpr value


def test_launcher_takes_the_direct_path_under_triton_default_hooks():
    """Triton 3.6+ keeps an empty HookChain as its default launch hook: not a profiler hook,
    so the direct path must stay on (it did not, and every launch went through the JIT)."""
    from mesa_lite.kernels import launch

    assert not launch._hooked()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches compiled kernels")
@pytest.mark.parametrize("bits, group_size", [(8, 128), (8, 1000), (4, 128), (2, 12)], ids=str)
def test_static_launch_matches_the_jit_launch(bits, group_size):
    """Kept kernels launched through PyTorch's static launcher give the codes, scales and
    rebuilt tensors that the JIT launch (``kernel[grid]``) gives, bit for bit: stochastic
    rounding (a seed argument on every call), a misaligned input, the fused epilogues."""
    from mesa_lite.kernels import launch

    if launch._STATIC_LAUNCH is None:
        pytest.skip("this torch has no static launcher")
    x = _x((6, 50, 40), torch.float16, "cuda")
    odd = _x((1, 1201), torch.bfloat16, "cuda")[:, 1:]  # 2 bytes off 16-byte alignment
    mean, rstd = x.float().mean(-1), x.float().var(-1).add(1e-5).rsqrt()
    w, b = torch.rand(40, device="cuda"), torch.randn(40, device="cuda")

    def run():
        out = []
        for t, kw in ((x, {}), (odd, {}), (x, {"normalize": (mean, rstd)})):
            codes, scales = gq.quantize(t, group_size, bits=bits, **kw)
            out += [codes, scales, gq.dequantize(codes, scales, group_size, t.dtype, bits=bits,
                                                 signed=True, numel=t.numel())]  # fmt: skip
        if bits == 8:
            out += gq.quantize(x, group_size, stochastic=True, bits=bits)
        codes, scales = out[6], out[7]
        for epi in (("affine", w, b), ("unnormalize", mean, rstd), ("gelu", "tanh", x.dtype),
                    ("gelu_backward", "none", x.reshape(-1))):  # fmt: skip
            out.append(gq.dequantize(codes, scales, group_size, x.dtype, bits=bits,
                                     signed=True, numel=x.numel(), epilogue=epi))  # fmt: skip
        return out

    state = gq.rounding_state()
    run()  # compiles and keeps each specialization
    launchers = (gq._QUANTIZE, gq._DEQUANTIZE, gq._QUANTIZE_PACKED, gq._DEQUANTIZE_PACKED)
    before = sum(lk.launches[0] for lk in launchers)
    gq.set_rounding_state(state)
    static = run()
    assert sum(lk.launches[0] for lk in launchers) - before >= 8  # the static launcher ran
    try:
        Launcher.direct = False
        gq.set_rounding_state(state)
        jit = run()
    finally:
        Launcher.direct = True
    for a, b_ in zip(static, jit, strict=True):
        assert_equal(a, b_)
