"""Kernel vs reference, bit for bit, and the quantizer's guarantees.

On a machine without a GPU the kernels run in Triton's interpreter (see conftest.py).
"""

import pytest
import torch
from conftest import DEVICES, FLOAT_DTYPES, assert_equal, count_calls
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mesa_lite.kernels import group_quant as gq

SHAPES = [(1,), (7,), (13, 17), (3, 5, 129), (0,), (0, 4), (257,), (2, 3, 1000)]
# group sizes per code width (below 8 bits a multiple of the codes per byte)
GROUPS = {8: [1, 7, 128, 1000, 2048], 4: [2, 6, 128, 1000], 2: [4, 12, 128, 2048]}
KERNEL_CASES = [(b, g) for b, gs in GROUPS.items() for g in gs]
BITS = [8, 4, 2]


def _make(shape, dtype, device, signed, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, max(1, shape[-1]))[: shape[-1]]
    if not signed:
        x = x.abs()
    return x.to(dtype=dtype, device=device)


def _step(codes_scales, n, group_size):
    """Per-element quantization step (the group's scale)."""
    _, scales = codes_scales
    return scales.repeat_interleave(group_size)[:n]


def _deq(cs, group_size, dtype, use_triton, bits, signed, n):
    codes, scales = cs
    return gq.dequantize(
        codes, scales, group_size, dtype, use_triton=use_triton, bits=bits, signed=signed, numel=n
    )


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("bits, group_size", KERNEL_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference_nearest(shape, dtype, bits, group_size, signed, triton_device):
    x = _make(shape, dtype, triton_device, signed)
    n = x.numel()
    codes, scales = gq.quantize(x, group_size, signed=signed, use_triton=True, bits=bits)
    # against the reference on the CPU, the one every CPU run uses
    rcodes, rscales = gq.quantize_ref(x.cpu(), group_size, signed=signed, bits=bits)
    assert_equal(codes.cpu(), rcodes, "codes")
    assert_equal(scales.cpu(), rscales, "scales")
    assert codes.dtype == (torch.int8 if signed and bits == 8 else torch.uint8)
    assert codes.numel() == gq.n_code_bytes(n, bits)
    assert scales.numel() == gq.n_groups_of(n, group_size)
    out = _deq((codes, scales), group_size, dtype, True, bits, signed, n)
    ref = _deq((rcodes, rscales), group_size, dtype, False, bits, signed, n)
    assert_equal(out.cpu(), ref, "dequantized")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_kernel_matches_reference_non_contiguous(dtype, triton_device):
    base = _make((64, 96), dtype, triton_device, True)
    for x in (base.t(), base[:, ::3], base[::2, 5:70]):
        assert not x.is_contiguous()
        codes, scales = gq.quantize(x, 128, use_triton=True)
        rcodes, rscales = gq.quantize_ref(x.cpu().contiguous(), 128)
        assert_equal(codes.cpu(), rcodes, "codes")
        assert_equal(scales.cpu(), rscales, "scales")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_nearest_error_within_half_step(use_triton, signed, bits, device, triton_device):
    device = triton_device if use_triton else device
    x = _make((4, 999), torch.float32, device, signed, seed=3)
    cs = gq.quantize(x, 128, signed=signed, use_triton=use_triton, bits=bits)
    out = _deq(cs, 128, torch.float32, use_triton, bits, signed, x.numel())
    step = _step(cs, x.numel(), 128)
    err = (out - x.reshape(-1)).abs()
    # half a step, plus the fp32 roundings of x * (1 / scale) (two) and of code * scale (one)
    bound = 0.5 * step * (1 + 1e-5) + x.reshape(-1).abs() * 2**-22
    worst = (err - bound).argmax()
    assert (err <= bound).all(), f"element {worst}: err {err[worst]} > bound {bound[worst]}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_stochastic_rounding_unbiased_and_within_one_step(
    use_triton, signed, bits, device, triton_device
):
    device = triton_device if use_triton else device
    torch.manual_seed(0)
    x = _make((512,), torch.float32, device, signed, seed=5)
    draws = 400
    # 400 copies in one call: the copies share group boundaries (512 = 8 groups of 64) and
    # so their scales, and each element of each copy draws its own random number.
    xr = x.repeat(draws)
    cs = gq.quantize(xr, 64, signed=signed, stochastic=True, use_triton=use_triton, bits=bits)
    out = _deq(cs, 64, torch.float32, use_triton, bits, signed, xr.numel()).view(draws, -1)
    step = _step(cs, x.numel(), 64)
    assert ((out - x).abs() <= step * (1 + 1e-5)).all(), "stochastic rounding moved > 1 step"
    mean_err = (out.double().mean(0) - x.double()).abs() / step.double()
    # per-draw std <= step/2, so the mean's std <= step / (2 sqrt(400)) = step/40
    assert mean_err.max() < 0.2, f"biased: max |mean - x| = {mean_err.max():.3f} steps"
    assert mean_err.mean() < 0.04


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
def test_stochastic_rounding_reproducible_under_seed(use_triton, device, triton_device):
    """Seeds come from a private counter that restarts when a call sees a new
    ``torch.initial_seed()``: a run seeded alike repeats its draws (another seed seen in
    between stands for a fresh process); ``rounding_state`` / ``set_rounding_state`` replay
    them within a process; torch's generator is not drawn from."""
    device = triton_device if use_triton else device
    x = _make((3000,), torch.bfloat16, device, True, seed=7)

    def q():
        return gq.quantize(x, 128, stochastic=True, use_triton=use_triton)

    torch.manual_seed(7)
    q()  # a call under another seed first, as in a fresh process
    torch.manual_seed(123)
    a = q()
    torch.manual_seed(7)
    q()
    torch.manual_seed(123)
    b = q()
    c = q()
    assert_equal(a[0], b[0], "same seed")
    assert not torch.equal(a[0], c[0]), "different draws gave the same codes"
    saved, rng = gq.rounding_state(), torch.get_rng_state()
    d = q()
    gq.set_rounding_state(saved)
    assert_equal(q()[0], d[0], "restored rounding state")
    assert torch.equal(torch.get_rng_state(), rng), "torch's generator was drawn from"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_stochastic_rounding_refuses_cuda_graph_capture():
    """A CUDA graph would replay the one host seed it captured: a clear error instead."""
    x = torch.randn(4096, device="cuda")
    gq.quantize(x, 128, stochastic=True)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph"), torch.cuda.graph(graph):
        gq.quantize(x, 128, stochastic=True)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):  # nearest rounding captures
        gq.quantize(x, 128)


@pytest.mark.parametrize("bits", [8, 4])  # groups of 2: not a multiple of 4 codes per byte
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_special_values(use_triton, dtype, bits, device, triton_device):
    device = triton_device if use_triton else device
    inf, nan = float("inf"), float("nan")
    big = 1e30 if dtype != torch.float16 else 6e4
    vals = [1.0, inf, -2.0, 3.0, nan, 1.0, 0.0, 0.0, big, -big, -inf, 5.0, 0.0, 1e-3]
    x = torch.tensor(vals, dtype=dtype, device=device)
    codes, scales = gq.quantize(x, 2, use_triton=use_triton, bits=bits)
    out = _deq((codes, scales), 2, dtype, use_triton, bits, True, x.numel()).float().cpu()
    assert out[1] == inf and out[10] == -inf, "inf must keep its sign"
    assert out[4].isnan() and out[5].isnan(), "a group with NaN dequantizes to NaN"
    assert not out[[0, 11]].isfinite().any(), "finite values in an inf group must not look finite"
    assert out[6] == 0 and out[7] == 0, "an all-zero group dequantizes to exact zeros"
    assert torch.isfinite(scales[4]) and out[8] == pytest.approx(big, rel=1e-2), "huge finite"
    assert out[9] == pytest.approx(-big, rel=1e-2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
def test_huge_and_tiny_groups_keep_their_codes(use_triton, signed, bits, triton_device):
    # 1 / scale is subnormal for scales above 2**126 (2-bit groups from ~8.5e37) and would
    # flush to 0 in the compiled multiply, and overflows below 2**-128: the prescale keeps it
    # a normal float at both ends, so each group's largest element gets code +-qmax
    device = triton_device if use_triton else "cpu"
    qmax = gq.qrange(signed, bits)[1]
    vals = [2.5e38, 1.3e38, 0.0, 3e37, 9e37, 5e37, 1e-30, 2e37, 1e-41, 6e-42, 0.0, 1e-43]
    x = torch.tensor(vals, device=device)
    if signed:
        x[[1, 5, 9]] *= -1
    codes, scales = gq.quantize(x, 4, signed=signed, use_triton=use_triton, bits=bits)
    out = _deq((codes, scales), 4, torch.float32, use_triton, bits, signed, x.numel()).cpu()
    stored = _nibbles(codes.cpu(), x.numel(), bits).int() + (
        gq.qrange(signed, bits)[0] if bits < 8 else 0
    )
    for first in (0, 4, 8):
        top = first + int(x[first : first + 4].abs().argmax())
        assert stored[top].abs() == qmax, (first, stored[first : first + 4])
    err = (out - x.cpu()).abs()
    bound = 0.5 * _step((codes, scales.cpu()), x.numel(), 4) * (1 + 1e-5) + x.cpu().abs() * 2**-22
    assert (err <= bound + 2.0**-149).all(), (err, bound)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
def test_float32_max_stays_finite(use_triton, signed, bits, triton_device):
    # absmax / qmax rounds up for some absmax near float32's maximum, and qmax * scale then
    # rounds to inf: a finite activation must not come back as inf (GradScaler would skip a
    # step PyTorch takes)
    device = triton_device if use_triton else "cpu"
    top = torch.finfo(torch.float32).max
    near = [top, torch.nextafter(torch.tensor(top), torch.tensor(0.0)).item(), 3.3e38, 1.7e38]
    vals = []
    for v in near:  # one group of four per absmax, its maximum first
        vals += [v, 0.5 * v, (-v if signed else 0.25 * v), 1.0]
    x = torch.tensor(vals, device=device)
    codes, scales = gq.quantize(x, 4, signed=signed, use_triton=use_triton, bits=bits)
    out = _deq((codes, scales), 4, torch.float32, use_triton, bits, signed, x.numel()).cpu()
    assert out.isfinite().all(), out
    assert torch.isfinite(scales.cpu() * gq.qrange(signed, bits)[1]).all()
    err = (out - x.cpu()).abs()
    bound = 0.5 * _step((codes, scales.cpu()), x.numel(), 4) * (1 + 1e-5) + x.cpu().abs() * 2**-22
    assert (err <= bound).all(), (err, bound)
    if use_triton:  # the kernel's scales equal the reference's, bit for bit
        ref = gq.quantize(x.cpu(), 4, signed=signed, use_triton=False, bits=bits)
        assert torch.equal(scales.cpu().view(torch.int32), ref[1].view(torch.int32))


def test_reference_is_fp32_whatever_the_default_dtype(triton_device):
    # a near-tie: x / scale is 93.4999996; computed in float64 it would round to 93
    x = torch.tensor([5.062565803527832, 3.7271645069122314])
    kernel = gq.quantize(x.to(triton_device), 2, use_triton=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ref = gq.quantize_ref(x, 2)
    finally:
        torch.set_default_dtype(default)
    assert_equal(kernel[0].cpu(), ref[0], "codes")
    assert ref[0].tolist() == [127, 94]


def _nibbles(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    shifts = torch.arange(0, 8, bits, dtype=torch.int32)
    return ((codes.int()[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:n]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [8, 128, 2048])  # one pass, one pass, two passes
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_positive_codes_are_zero_exactly_where_x_is_not_positive(
    dtype, group_size, bits, triton_device
):
    """``positive`` (ReLU's shared codes): the kernel equals the reference bit for bit; code 0
    exactly where ``x <= 0`` (negative, zero, -0.0, -inf), at least 1 for a positive value
    below half a step, +inf and NaN; elsewhere the unsigned codes unchanged. At 4 bits also
    with stochastic rounding (its draws differ from the reference's: the rule is checked)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3000, generator=g) * 10
    tiny = torch.tensor([1e-6, -1e-6, 0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    x = torch.cat([base[:1000], tiny.repeat(50), base[1000:]]).relu_()
    x[::11] = -x[::11]  # negatives too (a ReLU's output has none, the codes' rule holds anyway)
    x[5:3000:97] = 1e-6
    x = x.to(dtype)
    n = x.numel()
    codes, scales = gq.quantize(x.to(triton_device), group_size, signed=False, use_triton=True,
                                positive=True, bits=bits)  # fmt: skip
    rcodes, rscales = gq.quantize_ref(x, group_size, signed=False, positive=True, bits=bits)
    assert_equal(codes.cpu(), rcodes, "codes")
    assert_equal(scales.cpu(), rscales, "scales")
    rcodes = _nibbles(rcodes, n, bits)
    assert torch.equal(rcodes != 0, ~(x <= 0))
    plain, _ = gq.quantize_ref(x, group_size, signed=False, bits=bits)
    moved = rcodes != _nibbles(plain, n, bits)
    assert torch.equal(moved, (_nibbles(plain, n, bits) == 0) & ~(x <= 0))  # 0 -> 1 only
    if bits == 4:
        codes, _ = gq.quantize(x.to(triton_device), group_size, signed=False, use_triton=True,
                               positive=True, bits=4, stochastic=True)  # fmt: skip
        assert torch.equal(_nibbles(codes.cpu(), n, 4) != 0, ~(x <= 0))
    with pytest.raises(ValueError, match="positive codes"):
        gq.quantize(x, 128, signed=True, positive=True)
    with pytest.raises(ValueError, match="positive codes"):
        gq.quantize(x, 128, signed=False, bits=2, positive=True)


def test_argument_errors():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="group_size"):
        gq.quantize(x, 0)
    with pytest.raises(ValueError, match="group_size"):
        gq.quantize_ref(x, -3)
    with pytest.raises(TypeError, match="dtype"):
        gq.quantize(x.double(), 128)
    with pytest.raises(TypeError, match="dtype"):
        gq.quantize(torch.arange(10), 128)
    codes, scales = gq.quantize(x, 4)
    with pytest.raises(ValueError, match="scales"):
        gq.dequantize(codes, scales[:1], 4, torch.float32)
    with pytest.raises(TypeError, match="codes"):
        gq.dequantize(codes.float(), scales, 4, torch.float32)
    with pytest.raises(ValueError, match="bits must be one of"):
        gq.quantize(x, 4, bits=3)
    with pytest.raises(ValueError, match="multiple of 4"):
        gq.quantize(x, 6, bits=2)
    codes, scales = gq.quantize(x, 4, bits=4)
    assert codes.numel() == 5
    with pytest.raises(ValueError, match="need numel and signed"):
        gq.dequantize(codes, scales, 4, torch.float32, bits=4)
    with pytest.raises(ValueError, match="code bytes"):
        gq.dequantize(codes, scales, 4, torch.float32, bits=4, signed=True, numel=13)


# ---- property tests -----------------------------------------------------------------------

_finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
_special = st.sampled_from([float("inf"), float("-inf"), float("nan")])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(st.one_of(_finite, _finite, _finite, _special), min_size=1, max_size=300),
    group_units=st.integers(1, 17),
    bits=st.sampled_from(BITS),
    signed=st.booleans(),
    use_triton=st.booleans(),
)
def test_property_non_finite_preserved_and_error_bound(
    values, group_units, bits, signed, use_triton
):
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if use_triton else "cpu"
    group_size = group_units * gq.per_byte(bits)
    x = torch.tensor(values, dtype=torch.float32, device=dev)
    if not signed:
        x = x.abs()
    codes, scales = gq.quantize(x, group_size, signed=signed, use_triton=use_triton, bits=bits)
    out = _deq((codes, scales), group_size, torch.float32, use_triton, bits, signed, x.numel())
    bad = ~torch.isfinite(x)
    assert not torch.isfinite(out[bad]).any(), "a non-finite input dequantized to a finite value"
    group_ok = torch.isfinite(scales).repeat_interleave(group_size)[: x.numel()]
    step = scales.repeat_interleave(group_size)[: x.numel()]
    err = (out - x).abs()[group_ok]
    bound = 0.5 * step * (1 + 1e-5) + x.abs() * 2**-22  # as test_nearest_error_within_half_step
    # a group of tiny denormals whose scale underflows to 0 flushes to zero (documented)
    qmax = gq.qrange(signed, bits)[1]
    # a denormal scale is rounded to a multiple of 2**-149 (up to 2**-150 off), which moves
    # the top code's value by up to qmax * 2**-150, and the product rounds again
    bound = torch.where(step < 2.0**-126, bound + (qmax + 1) * 2.0**-150, bound)
    bound = torch.where(step == 0, torch.full_like(x, qmax * 2.0**-149), bound)[group_ok]
    assert (err <= bound).all(), (err - bound).max()
    rcodes, rscales = gq.quantize_ref(x.cpu(), group_size, signed=signed, bits=bits)
    assert_equal(codes.cpu(), rcodes, "codes")
    assert_equal(scales.cpu(), rscales, "scales")


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
def test_denormal_group_flushes_to_zero(use_triton, triton_device):
    device = triton_device if use_triton else "cpu"
    x = torch.tensor([1.4e-45, -2.8e-45, 1e-40, 0.0], device=device)
    codes, scales = gq.quantize(x, 2, use_triton=use_triton)
    out = gq.dequantize(codes, scales, 2, torch.float32, use_triton=use_triton).cpu()
    assert scales[0] == 0 and (out[:2] == 0).all(), "scale underflow: flushed to exact zeros"
    assert scales[1] > 0 and abs(out[2] - 1e-40) <= 0.5 * scales[1].cpu() * (1 + 1e-5)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU")
def test_cuda_default_path_is_triton_and_exact():
    x = torch.randn(4096 * 3 + 5, device="cuda", dtype=torch.float16)
    codes, scales = gq.quantize(x, 128)  # default: Triton on CUDA
    rcodes, rscales = gq.quantize_ref(x.cpu(), 128)
    assert_equal(codes.cpu(), rcodes, "codes")
    assert_equal(scales.cpu(), rscales, "scales")
    cuda_ref = gq.quantize_ref(x, 128)  # the reference on CUDA agrees too
    assert_equal(cuda_ref[0].cpu(), rcodes, "codes (reference on CUDA)")


@pytest.fixture
def packed_layout():
    """Sets ``gq.PACKED_LAYOUT`` (how packed codes are written and read: a reshape of the tile,
    lanes, or bytes) for the test, the launch plans rebuilt; restored afterwards."""
    saved = gq.PACKED_LAYOUT

    def use(layout: str) -> None:
        gq.PACKED_LAYOUT = layout
        gq._quantize_plan.cache_clear()
        gq._dequantize_plan.cache_clear()

    yield use
    use(saved)


@pytest.mark.parametrize("bits, group_size", [(4, 6), (4, 128), (4, 1000), (2, 12), (2, 2048)],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_packed_layouts_give_the_bytes_and_values_of_the_reshaped_tile(
    bits, group_size, dtype, packed_layout, triton_device
):
    """Issue 51: the 4- and 2-bit kernels read and write packed codes as lanes (element j of
    every byte) or, quantize, as a tile of bytes ([ROWS, bytes, elements of a byte]); the
    codes, scales and rebuilt values are those of the tile-reshaping path, bit for bit, with
    every option and epilogue, at sizes that end mid-group and mid-byte."""
    g = torch.Generator().manual_seed(3)
    rows, width = 5, 2 * group_size + 3 * (8 // bits)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype).to(triton_device)
    x.view(-1)[7] = float("nan") if group_size > 6 else x.view(-1)[7]
    n = x.numel() - 1  # an odd count: the last byte is half empty at 4 bits
    x = x.view(-1)[:n]
    mean = torch.randn(rows * width, generator=g)[:n].to(triton_device) * 0 + 0.25
    stats = (mean[:1].expand(1).contiguous(), torch.full((1,), 2.0, device=triton_device))
    weight = torch.randn(n, generator=g).to(triton_device)[:n]
    grad = torch.randn(n, generator=g).to(dtype).to(triton_device)
    cases = [dict(), dict(signed=False), dict(stochastic=True), dict(normalize=stats)]
    if bits == 4:
        cases.append(dict(signed=False, positive=True))
    epilogues = [None, ("affine", weight, None), ("unnormalize", *stats),
                 ("gelu", "tanh", dtype), ("gelu_backward", "none", grad),
                 ("silu", dtype), ("silu_backward", grad)]  # fmt: skip
    assert gq.PACKED_LAYOUTS[0] == "tile"
    for kwargs in cases:
        results = []
        state = gq.rounding_state()
        for layout in gq.PACKED_LAYOUTS:
            packed_layout(layout)
            gq.set_rounding_state(state)  # the same stochastic-rounding seed in each
            codes, scales = gq.quantize(x, group_size, use_triton=True, bits=bits, **kwargs)
            signed = kwargs.get("signed", True)
            outs = [gq.dequantize(codes, scales, group_size, dtype, use_triton=True, bits=bits,
                                  signed=signed, numel=n, epilogue=e) for e in epilogues]  # fmt: skip
            results.append((codes, scales, outs))
        (c0, s0, o0) = results[0]
        for layout, (c1, s1, o1) in zip(gq.PACKED_LAYOUTS[1:], results[1:], strict=True):
            assert_equal(c1.cpu(), c0.cpu(), f"codes {layout} {kwargs}")
            assert_equal(s1.cpu(), s0.cpu(), f"scales {layout} {kwargs}")
            for e, a, b in zip(epilogues, o1, o0, strict=True):
                assert_equal(a.cpu(), b.cpu(), f"dequantized {layout} {kwargs} {e and e[0]}")
        if not kwargs.get("stochastic"):
            rc, rs = gq.quantize_ref(x.cpu(), group_size, bits=bits,
                                     **{k: (tuple(t.cpu() for t in v) if k == "normalize" else v)
                                        for k, v in kwargs.items()})  # fmt: skip
            assert_equal(c0.cpu(), rc, f"codes against the reference {kwargs}")
            assert_equal(s0.cpu(), rs, f"scales against the reference {kwargs}")


@pytest.mark.parametrize("bits, signed, layout", [(8, True, "tile"), (8, False, "tile"),
                                                  (4, True, "tile"), (4, False, "bytes"),
                                                  (2, True, "lanes")], ids=str)  # fmt: skip
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_quantize3_is_three_quantize_calls_in_one_launch(bits, signed, layout, dtype,
                                                         packed_layout, triton_device,
                                                         monkeypatch):  # fmt: skip
    """Issue 51: attention's q, k and v quantized in one launch give each tensor's codes and
    scales of its own quantize call, bit for bit: sizes that differ (grouped-query k and v),
    end mid-group and mid-byte, a non-contiguous input, NaN and inf kept."""
    packed_layout(layout)
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 4, 37, 16, generator=g) * 3).to(dtype).to(triton_device)
    k = (torch.randn(2, 1, 37, 16, generator=g) * 0.01).to(dtype).to(triton_device)
    v = (torch.randn(1, 37, 1, 15, generator=g)).to(dtype).to(triton_device).transpose(1, 2)
    q.view(-1)[3], k.view(-1)[200] = float("nan"), float("inf")
    launches = count_calls(monkeypatch, gq, "_QUANTIZE3" if bits == 8 else "_QUANTIZE3_PACKED")
    got = gq.quantize3((q, k, v), 64, signed=signed, use_triton=True, bits=bits)
    assert launches == [1]
    for x, (codes, scales) in zip((q, k, v), got, strict=True):
        want_codes, want_scales = gq.quantize(x, 64, signed=signed, use_triton=True, bits=bits)
        assert_equal(codes.cpu(), want_codes.cpu(), "codes")
        assert_equal(scales.cpu(), want_scales.cpu(), "scales")
        ref_codes, _ = gq.quantize_ref(x.cpu(), 64, signed=signed, bits=bits)
        assert_equal(codes.cpu(), ref_codes, "codes against the reference")


def test_quantize3_refuses_mixed_dtypes():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="share a dtype"):
        gq.quantize3((x, x.half(), x), 8)
    with pytest.raises(TypeError, match="three"):
        gq.quantize3((x, x), 8)
