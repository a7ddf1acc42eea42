"""The 1-bit dropout mask kernels against their references: packing a bool mask, and dropout's
backward read from the packed bits (ATen's ``native_dropout_backward`` bit for bit)."""

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_equal
from mesa_lite.kernels import bits

SIZES = [1, 7, 8, 9, 1000, 8 * 1024 + 3, 3 * 8192]


@pytest.mark.parametrize("n", SIZES)
def test_pack_bits_matches_reference(n, triton_device):
    g = torch.Generator().manual_seed(n)
    mask = (torch.rand(n, generator=g) < 0.7).to(triton_device)
    packed = bits.pack_bits(mask, use_triton=True)
    ref = bits.pack_bits_ref(mask.cpu())
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
    assert_equal(packed.cpu(), ref, "packed")
    assert torch.equal(bits.unpack_bits(ref, (n,)), mask.cpu())


def test_pack_bits_non_contiguous_and_empty(triton_device):
    mask = torch.rand(6, 10) < 0.5
    t = mask.t().to(triton_device)  # not contiguous: packed in row-major order of t
    assert_equal(bits.pack_bits(t, use_triton=True).cpu(), bits.pack_bits_ref(t.cpu()), "packed")
    empty = torch.zeros(0, dtype=torch.bool, device=triton_device)
    assert bits.pack_bits(empty, use_triton=True).numel() == 0
    with pytest.raises(TypeError, match="bool"):
        bits.pack_bits(torch.ones(3, device=triton_device), use_triton=True)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dropout_backward_from_bits_matches_aten(dtype, n, triton_device):
    g = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=g) * 3).to(dtype)
    grad[: min(n, 3)] = torch.tensor([float("inf"), float("nan"), -float("inf")][: min(n, 3)])
    mask = torch.rand(n, generator=g) < 0.8
    scale = 1.0 / (1.0 - 0.2)
    packed = bits.pack_bits_ref(mask)
    out = bits.dropout_backward(grad.to(triton_device), packed.to(triton_device), scale, True)
    ref = torch.ops.aten.native_dropout_backward(grad, mask, scale)  # ATen on the CPU
    assert out.dtype == dtype and out.shape == grad.shape
    assert_equal(out.cpu(), ref, "grad")  # inf * 0 and NaN * 0 stay NaN, as ATen's
    assert_equal(bits.dropout_backward_ref(grad, packed, scale), ref, "reference")


def test_dropout_backward_checks_the_packed_mask(triton_device):
    grad = torch.randn(20, device=triton_device)
    with pytest.raises(ValueError, match="3 packed uint8 bytes"):
        bits.dropout_backward(grad, torch.zeros(4, dtype=torch.uint8, device=triton_device), 2.0)
    with pytest.raises(ValueError, match="packed uint8"):
        bits.dropout_backward(grad, torch.zeros(3, dtype=torch.int8, device=triton_device), 2.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dropout_backward_matches_cuda_native_dropout_backward(dtype):
    x = torch.randn(37, 129, device="cuda").to(dtype)
    _, mask = torch.native_dropout(x, 0.3, True)
    grad = torch.randn_like(x)
    ref = torch.ops.aten.native_dropout_backward(grad, mask, 1 / 0.7)
    out = bits.dropout_backward(grad, bits.pack_bits(mask), 1 / 0.7)
    assert_equal(out, ref, "grad")
    assert_equal(bits.pack_bits(mask), bits.pack_bits_ref(mask), "packed")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_relu_bits_and_backward_match_threshold_backward(dtype, n, triton_device):
    """The ReLU pair: bits packed from the output itself (positive or NaN pass, -0.0 and 0
    do not), and the backward read from them, bit for bit as ATen's threshold_backward."""
    g = torch.Generator().manual_seed(n)
    out = torch.relu(torch.randn(n, generator=g)).to(dtype)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 0.0, 1e-30])[: min(n, 5)]
    out[: special.numel()] = special.to(dtype)
    grad = (torch.randn(n, generator=g) * 3).to(dtype)
    grad[-min(n, 2) :] = torch.tensor([float("nan"), -float("inf")][: min(n, 2)]).to(dtype)
    packed = bits.pack_positive(out.to(triton_device), use_triton=True)
    assert_equal(packed.cpu(), bits.pack_positive_ref(out), "packed")
    assert torch.equal(bits.unpack_bits(packed.cpu(), (n,)), ~(out <= 0))
    got = bits.relu_backward(grad.to(triton_device), packed, use_triton=True)
    ref = torch.ops.aten.threshold_backward(grad, out, 0)
    assert got.dtype == dtype and got.is_contiguous()
    assert_equal(got.cpu(), ref, "grad")  # NaN gradients of blocked elements become 0, as ATen's
    assert_equal(bits.relu_backward_ref(grad, packed.cpu()), ref, "reference")


def test_relu_bits_layouts_and_checks(triton_device):
    x = torch.relu(torch.randn(6, 10)).t().to(triton_device)  # packed in row-major order of x
    assert_equal(bits.pack_positive(x, use_triton=True).cpu(), bits.pack_positive_ref(x.cpu()),
                 "packed")  # fmt: skip
    assert bits.pack_positive(x[:0], use_triton=True).numel() == 0
    with pytest.raises(TypeError, match="floating"):
        bits.pack_positive(torch.ones(3, dtype=torch.int32, device=triton_device))
    with pytest.raises(ValueError, match="2 packed uint8 bytes"):
        bits.relu_backward(torch.randn(9, device=triton_device),
                           torch.zeros(3, dtype=torch.uint8, device=triton_device))  # fmt: skip


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("nbits", [8, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_relu_backward_from_codes_matches_threshold_backward(dtype, nbits, n, triton_device):
    """ReLU's backward from its consumer's unsigned codes (code 0 exactly where the output is
    not positive, ``quantize(positive=True)``): one pass, bit for bit as ATen's
    threshold_backward on the output, NaN and infinite gradients included."""
    from mesa_lite.kernels import group_quant as gq

    g = torch.Generator().manual_seed(n)
    out = torch.relu(torch.randn(n, generator=g)).to(dtype)
    special = torch.tensor([float("nan"), -0.0, 1e-30, 0.0, 3.0])[: min(n, 5)]
    out[: special.numel()] = special.to(dtype)
    grad = (torch.randn(n, generator=g) * 3).to(dtype)
    grad[-min(n, 2) :] = torch.tensor([float("nan"), -float("inf")][: min(n, 2)]).to(dtype)
    codes, _ = gq.quantize(out.to(triton_device), 32, signed=False, bits=nbits, positive=True)
    got = bits.relu_backward_codes(grad.to(triton_device), codes, nbits, use_triton=True)
    ref = torch.ops.aten.threshold_backward(grad, out, 0)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == grad.shape
    assert_equal(got.cpu(), ref, "grad")
    assert_equal(bits.relu_backward_codes_ref(grad, codes.cpu(), nbits), ref, "reference")


def test_relu_backward_from_codes_checks(triton_device):
    grad = torch.randn(2, 5, device=triton_device).t()  # read in logical order
    codes = torch.tensor([0, 3, 1, 0, 9, 0, 0, 2, 1, 1], dtype=torch.uint8, device=triton_device)
    got = bits.relu_backward_codes(grad, codes, 8, use_triton=True)
    assert_equal(got, torch.where(codes.view(5, 2) != 0, grad, 0).contiguous(), "transposed")
    assert bits.relu_backward_codes(grad[:0], codes[:0], 8, use_triton=True).numel() == 0
    with pytest.raises(ValueError, match="10 elements at 4 bits need 5 uint8 code bytes"):
        bits.relu_backward_codes(grad, codes, 4)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        bits.relu_backward_codes(grad, codes, 2)
