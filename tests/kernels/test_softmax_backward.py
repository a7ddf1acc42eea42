"""Softmax's one-pass backward from its output's codes (``kernels/softmax_backward.py``)
against its reference, the op-by-op form (dequantize, then torch's softmax backward).

The row's sum is a tree of fp32 additions in another order than torch's, so the kernel is
compared to a few ulps; in fp16/bf16 the result's rounding hides that here.
"""

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_equal
from mesa_lite.kernels import group_quant as gq
from mesa_lite.kernels import softmax_backward as sb

BITS_GROUPS = [(8, 128), (8, 100), (4, 128), (2, 12)]


def _inputs(dtype, bits, group_size, device, row_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.softmax(torch.randn(3, 4, row_len, generator=gen) * 3, -1).to(dtype)
    g = torch.randn(3, 4, row_len, generator=gen).to(dtype)
    codes, scales = gq.quantize(y.to(device), group_size, signed=False, use_triton=True, bits=bits)
    return codes, scales, g.to(device)


@pytest.mark.parametrize("row_len", [197, 64, 1000, 5])
@pytest.mark.parametrize("bits, group_size", BITS_GROUPS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_softmax_backward_matches_reference(dtype, bits, group_size, row_len, triton_device):
    codes, scales, g = _inputs(dtype, bits, group_size, triton_device, row_len)
    out = sb.softmax_backward(codes, scales, g, group_size, dtype, bits, use_triton=True)
    cpu = codes.cpu(), scales.cpu(), g.cpu()
    ref = sb.softmax_backward_ref(*cpu, group_size, dtype, bits)
    assert out.shape == g.shape and out.dtype == dtype and out.is_contiguous()
    tol = 8 * {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol,
                               atol=tol * ref.abs().max().item())  # fmt: skip
    # the reference is the op-by-op form
    y = gq.dequantize_ref(cpu[0], cpu[1], group_size, dtype, bits, False, g.numel())
    exact = torch._softmax_backward_data(cpu[2], y.view(g.shape), 2, dtype)
    assert_equal(ref, exact, "reference is torch's softmax backward on the rebuilt output")


def test_softmax_backward_rows_too_long_take_the_reference(triton_device):
    codes, scales, g = _inputs(torch.float16, 8, 128, triton_device, sb.MAX_ROW + 1)
    out = sb.softmax_backward(codes, scales, g, 128, torch.float16, use_triton=True)
    # the reference on the same device: torch's softmax backward sums a row in another order
    # on CUDA than on the CPU (ulps and the sign of zeros differ between the two)
    ref = sb.softmax_backward_ref(codes, scales, g, 128, torch.float16)
    assert_equal(out, ref, "the reference for rows over MAX_ROW")


def test_softmax_backward_non_contiguous_gradient_and_non_finite(triton_device):
    """A transposed gradient is read in logical order; a NaN in the kept output makes its
    row's gradient NaN and leaves the other rows finite."""
    codes, scales, g = _inputs(torch.float32, 8, 64, triton_device, 64)
    gt = g.transpose(0, 1).contiguous().transpose(0, 1)
    out = sb.softmax_backward(codes, scales, gt, 64, torch.float32, use_triton=True)
    assert_equal(out, sb.softmax_backward(codes, scales, g, 64, torch.float32, use_triton=True),
                 "non-contiguous gradient")  # fmt: skip
    y = torch.softmax(torch.randn(4, 64, generator=torch.Generator().manual_seed(2)), -1)
    y[1, 3] = float("nan")
    c, s = gq.quantize(y.to(triton_device), 64, signed=False, use_triton=True)
    out = sb.softmax_backward(c, s, torch.ones_like(y).to(triton_device), 64, torch.float32,
                              use_triton=True).cpu()  # fmt: skip
    assert out[1].isnan().all() and out[[0, 2, 3]].isfinite().all()


def test_softmax_backward_bad_input(triton_device):
    codes, scales, g = _inputs(torch.float32, 8, 128, triton_device, 64)
    with pytest.raises(ValueError, match="gradient must be a torch.float16 tensor"):
        sb.softmax_backward(codes, scales, g, 128, torch.float16)
    with pytest.raises(ValueError, match="softmax_backward: 756 elements at 8 bits need 756"):
        sb.softmax_backward(codes, scales, g[:, :, :63], 128, torch.float32)
    with pytest.raises(TypeError, match="dtype must be"):
        sb.softmax_backward(codes, scales, g.double(), 128, torch.float64)
