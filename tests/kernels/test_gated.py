"""The gated product's one-pass backward (``kernels/gated.py``) against its reference, the
op-by-op form's own ops on the rebuilt factors (issue 51).

The products and roundings are IEEE fp32 operations in the op-by-op order, so the product and
u's gradient agree bit for bit but where the activation's ``exp``/``erf`` differ between Triton
and torch's CPU kernels by an ulp; g's gradient goes through the activation's derivative. All
three are compared to a few ulps of their dtype, on the scale of the values.
"""

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_equal
from mesa_lite.kernels import gated
from mesa_lite.kernels import group_quant as gq

ACTS = ["silu", "gelu", "gelu_tanh"]
BITS_GROUPS = [(8, 128), (8, 100), (4, 128), (2, 12)]


def _t(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype=dtype, device=device)


def _ulps(dtype):
    return {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]


def _inputs(dtype, bits, group_size, device, shape=(5, 301)):
    """Codes of g and u (g on a wide range, through the activation's bend) and a gradient."""
    g = _t(shape, dtype, device, 0, scale=3.0)
    u = _t(shape, dtype, device, 1)
    dp = _t(shape, dtype, device, 2)
    pg = gq.quantize(g, group_size, use_triton=True, bits=bits)
    pu = gq.quantize(u, group_size, use_triton=True, bits=bits)
    return pg, pu, dp


def _close(actual, expected, dtype, scale, what):
    tol = 8 * _ulps(dtype)
    torch.testing.assert_close(actual.cpu().float(), expected.float(), rtol=tol,
                               atol=tol * scale, msg=lambda m: f"{what}: {m}")  # fmt: skip


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bits, group_size", BITS_GROUPS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_gated_backward_matches_reference(dtype, bits, group_size, act, triton_device):
    pg, pu, dp = _inputs(dtype, bits, group_size, triton_device)
    kw = dict(bits=bits, signed=True)
    prod, gg, gu = gated.gated_backward(pg, pu, dp, group_size, dtype, act, use_triton=True,
                                        **kw)  # fmt: skip
    cpu = tuple(t.cpu() for t in (*pg, *pu))
    rprod, rgg, rgu = gated.gated_backward_ref(cpu[:2], cpu[2:], dp.cpu(), group_size, dtype,
                                               act, **kw)  # fmt: skip
    for out, ref, what in ((prod, rprod, "product"), (gg, rgg, "g's grad"), (gu, rgu, "u's grad")):
        assert out.shape == (dp.numel(),) and out.dtype == dtype, what
        _close(out, ref, dtype, ref.abs().max().item(), what)
    # the reference is the op-by-op form: dequantize, the activation, the products, its backward
    g = gq.dequantize_ref(*cpu[:2], group_size, dtype, bits, True, dp.numel())
    u = gq.dequantize_ref(*cpu[2:], group_size, dtype, bits, True, dp.numel())
    fn, backward = gated.ACTIVATIONS[act]
    d = dp.cpu().reshape(-1)
    assert_equal(rprod, fn(g) * u, "reference product")
    assert_equal(rgu, d * fn(g), "reference u's grad")
    assert_equal(rgg, backward(d * u, g), "reference g's grad")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_gated_backward_in_place_and_without_the_product(dtype, triton_device):
    """g's gradient written over the product's gradient, the product left out: the same
    values as a separate output."""
    pg, pu, dp = _inputs(dtype, 8, 128, triton_device)
    _, gg, gu = gated.gated_backward(pg, pu, dp, 128, dtype, "silu", use_triton=True)
    dp2 = dp.clone()
    prod, gg2, gu2 = gated.gated_backward(pg, pu, dp2, 128, dtype, "silu", use_triton=True,
                                          write_prod=False, in_place=True)  # fmt: skip
    assert prod is None
    assert gg2.data_ptr() == dp2.data_ptr(), "in place: g's gradient over dp"
    assert_equal(gg2, gg, "in place")
    assert_equal(gu2, gu, "u's grad")
    # a non-contiguous gradient: read through a contiguous copy, never written through
    dpt = dp.view(5, 301).t().contiguous().t()
    before = dpt.clone()
    _, gg3, _ = gated.gated_backward(pg, pu, dpt, 128, dtype, "silu", use_triton=True,
                                     in_place=True)  # fmt: skip
    assert_equal(dpt, before, "a non-contiguous gradient is left alone")
    assert_equal(gg3, gg, "from a non-contiguous gradient")


def test_gated_backward_keeps_non_finite(triton_device):
    """A NaN or inf in g's group gives NaN gradients in that group and finite ones elsewhere,
    so GradScaler still sees the overflow."""
    g = _t((4, 128), torch.float32, triton_device, 0, scale=3.0)
    g[1, 5] = float("nan")
    g[2, 7] = float("inf")
    u = _t((4, 128), torch.float32, triton_device, 1)
    dp = _t((4, 128), torch.float32, triton_device, 2)
    pg = gq.quantize(g, 128, use_triton=True)
    pu = gq.quantize(u, 128, use_triton=True)
    _, gg, gu = gated.gated_backward(pg, pu, dp, 128, torch.float32, "silu", use_triton=True)
    gg, gu = gg.view(4, 128).cpu(), gu.view(4, 128).cpu()
    assert gg[1].isnan().all() and gg[2].isnan().any() and gu[1].isnan().all()
    assert gg[[0, 3]].isfinite().all() and gu[[0, 3]].isfinite().all()


def test_gated_backward_bad_input(triton_device):
    pg, pu, dp = _inputs(torch.float32, 8, 128, triton_device)
    with pytest.raises(ValueError, match="act must be one of"):
        gated.gated_backward(pg, pu, dp, 128, torch.float32, "relu")
    with pytest.raises(ValueError, match="gated_backward: 1204 elements at 8 bits need 1204"):
        gated.gated_backward(pg, pu, dp[:-1], 128, torch.float32, "silu")
    with pytest.raises(ValueError, match="gradient must be a torch.float16"):
        gated.gated_backward(pg, pu, dp, 128, torch.float16, "silu")
    with pytest.raises(ValueError, match="must match in shape"):
        gated.gated_backward(pg, (pu[0][:-1], pu[1]), dp, 128, torch.float32, "silu")
    with pytest.raises(TypeError, match="dtype must be"):
        gated.gated_backward(pg, pu, dp, 128, torch.float64, "silu")
