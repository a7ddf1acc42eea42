"""BatchNorm's backward from the codes of its normalized input
(``kernels/batch_norm_backward.py``) against its reference, and the reference against torch's
own BatchNorm backward on the input the codes stand for.

The kernel sums rows as a tree of fp32 additions and the reference with torch's sums, so the
two agree to rounding, not bit for bit.
"""

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_equal, sqnr_db
from mesa_lite.kernels import batch_norm_backward as bb
from mesa_lite.kernels import group_quant as gq

BITS_GROUPS = [(8, 128), (8, 100), (4, 128), (2, 12)]
ULP = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _inputs(shape, dtype, bits, group_size, device, seed=0, affine=True):
    """(x, mean, invstd, weight, grad, codes, scales): the codes of x_hat as the module keeps
    them (the quantize kernel's normalization, rows of the spatial size)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    w = torch.randn(shape[1], generator=gen) if affine else None
    g = torch.randn(shape, generator=gen).to(dtype)
    _, mean, invstd = torch.native_batch_norm(x.float(), None, None, None, None, True, 0.1, 1e-5)
    n = shape[0]
    x, mean, invstd, g = (t.to(device) for t in (x, mean, invstd, g))
    w = None if w is None else w.to(device)
    rows = (mean.repeat(n), invstd.repeat(n))
    codes, scales = gq.quantize(x, group_size, bits=bits, normalize=rows)  # kernel on CUDA
    return x, mean, invstd, w, g, codes, scales


SHAPES = [(4, 6, 5, 7), (2, 3, 3000), (3, 5, 2, 2, 3), (2, 4, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bits, group_size", BITS_GROUPS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_batch_norm_backward_matches_reference(dtype, bits, group_size, shape, triton_device):
    _, _, invstd, w, g, codes, scales = _inputs(shape, dtype, bits, group_size, triton_device)
    dx, sums = bb.batch_norm_backward(codes, scales, g, invstd, w, group_size, bits,
                                      use_triton=True)  # fmt: skip
    cpu = [t.cpu() for t in (codes, scales, g, invstd, w)]
    rdx, rsums = bb.batch_norm_backward_ref(*cpu, group_size, bits)
    assert dx.shape == g.shape and dx.dtype == dtype and dx.is_contiguous()
    assert sums.shape == (2, shape[1]) and sums.dtype == torch.float32
    # sums of fp32 values in two orders: within a few ulps of the sum of magnitudes
    xh = gq.dequantize_ref(cpu[0], cpu[1], group_size, torch.float32, bits, True, g.numel())
    gf = cpu[2].float().view(shape[0], shape[1], -1)
    mags = torch.stack([gf.abs().sum((0, 2)), (gf * xh.view_as(gf)).abs().sum((0, 2))])
    assert ((sums.cpu() - rsums).abs() <= 16 * ULP[torch.float32] * mags + 1e-30).all()
    # the input's gradient: the output's rounding, plus the sums' difference carried through;
    # against the size of its terms, not of the result: with few elements a channel (N x 1 x
    # 1) they cancel to near zero, and the GPU's fused multiply-adds round that cancellation
    # otherwise than the reference. Terms: (|g| + sum|g| / M + |x_hat| * sum|g x_hat| / M)
    # times the channel's weight * invstd (the sums' error is relative to sums of magnitudes)
    scale = cpu[3].float() * (1 if cpu[4] is None else cpu[4].float().abs())
    m = gf.shape[0] * gf.shape[2]
    mag_g, mag_gx = (mags / m).view(2, 1, -1, 1)
    terms = (gf.abs() + mag_g + xh.view_as(gf).abs() * mag_gx) * scale.view(1, -1, 1)
    tol = max(8 * ULP[dtype], 16 * ULP[torch.float32])
    err = (dx.cpu().float() - rdx.float()).view_as(gf).abs()
    assert (err <= tol * terms + 1e-30).all(), (err - tol * terms).max()


@pytest.mark.parametrize("affine", [True, False])
def test_reference_is_torch_batch_norm_backward(affine):
    """The reference's two passes are torch's BatchNorm backward on the input the codes stand
    for (``x_hat / invstd + mean``, in fp64 so that no rounding of the input enters), to fp32
    rounding; the input's gradient skipped where not asked for."""
    shape = (4, 6, 9, 11)
    _, mean, invstd, w, g, codes, scales = _inputs(shape, torch.float32, 8, 128, "cpu",
                                                   affine=affine)  # fmt: skip
    dx, sums = bb.batch_norm_backward_ref(codes, scales, g, invstd, w, 128)
    xh = gq.dequantize_ref(codes, scales, 128, torch.float32, 8, True, g.numel()).view(shape)
    c = (1, -1, 1, 1)
    x64 = xh.double() / invstd.double().view(c) + mean.double().view(c)
    w64 = None if w is None else w.double()
    want = torch.ops.aten.native_batch_norm_backward(
        g.double(), x64, w64, None, None, mean.double(), invstd.double(), True, 1e-5,
        [True, affine, affine],
    )  # fmt: skip
    assert sqnr_db(want[0], dx) >= 120, sqnr_db(want[0], dx)
    if affine:
        assert sqnr_db(want[1], sums[1]) >= 120 and sqnr_db(want[2], sums[0]) >= 120
    none, only_sums = bb.batch_norm_backward_ref(codes, scales, g, invstd, w, 128,
                                                 need_input=False)  # fmt: skip
    assert none is None
    assert_equal(only_sums, sums, "sums without the input's gradient")


def test_batch_norm_backward_sums_only_and_empty(triton_device):
    _, _, invstd, w, g, codes, scales = _inputs((2, 3, 40), torch.float16, 8, 128,
                                                triton_device)  # fmt: skip
    dx, sums = bb.batch_norm_backward(codes, scales, g, invstd, w, 128, use_triton=True)
    none, only = bb.batch_norm_backward(codes, scales, g, invstd, w, 128, need_input=False,
                                        use_triton=True)  # fmt: skip
    assert none is None
    assert_equal(only, sums, "sums without the input's gradient")
    empty = torch.empty(2, 3, 0, dtype=torch.float16, device=triton_device)
    c0, s0 = gq.quantize(empty, 128, use_triton=True)
    dx0, sums0 = bb.batch_norm_backward(c0, s0, empty, invstd, w, 128, use_triton=True)
    assert dx0.shape == empty.shape
    assert_equal(sums0.cpu(), torch.zeros(2, 3), "an empty input's sums")


def test_batch_norm_backward_non_contiguous_gradient_and_non_finite(triton_device):
    """A transposed gradient is read in logical order; a NaN in the gradient makes its
    channel's sums and input gradient NaN (as torch's) and leaves the other channels finite."""
    shape = (3, 4, 6, 5)
    _, _, invstd, w, g, codes, scales = _inputs(shape, torch.float32, 8, 64, triton_device)
    gt = g.transpose(2, 3).contiguous().transpose(2, 3)
    assert not gt.is_contiguous()
    got = bb.batch_norm_backward(codes, scales, gt, invstd, w, 64, use_triton=True)
    want = bb.batch_norm_backward(codes, scales, g, invstd, w, 64, use_triton=True)
    assert_equal(got[0], want[0], "non-contiguous gradient")
    g = g.clone()
    g[1, 2, 3, 4] = float("nan")
    dx, sums = (t.cpu() for t in bb.batch_norm_backward(codes, scales, g, invstd, w, 64,
                                                         use_triton=True))  # fmt: skip
    assert dx[:, 2].isnan().all() and sums[:, 2].isnan().all()
    others = [0, 1, 3]
    assert dx[:, others].isfinite().all() and sums[:, others].isfinite().all()


def test_batch_norm_backward_bad_input(triton_device):
    _, _, invstd, w, g, codes, scales = _inputs((2, 3, 40), torch.float32, 8, 128,
                                                triton_device)  # fmt: skip
    with pytest.raises(TypeError, match="batch_norm_backward: the gradient must be a float32"):
        bb.batch_norm_backward(codes, scales, g.double(), invstd, w, 128)
    with pytest.raises(ValueError, match=r"must be \(N, C, ...\)"):
        bb.batch_norm_backward(codes, scales, g.view(-1), invstd, w, 128)
    with pytest.raises(ValueError, match="3 channels need 3 invstd and weight values, got 2"):
        bb.batch_norm_backward(codes, scales, g, invstd[:2], w, 128)
    with pytest.raises(ValueError, match="batch_norm_backward: 234 elements at 8 bits need 234"):
        bb.batch_norm_backward(codes, scales, g[:, :, :39], invstd, w, 128)
