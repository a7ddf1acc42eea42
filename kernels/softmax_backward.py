"""Softmax's backward over the last dimension in one pass from its output's codes.

``y * (g - sum(g * y))`` per row, ``y`` rebuilt from its (unsigned) 8-, 4- or 2-bit codes in
registers: one launch, and no full-size copy of ``y`` written and read again, where the
op-by-op form dequantizes ``y`` (a tensor of rows x row length: attention's probabilities,
batch x heads x tokens x tokens) and then runs torch's softmax backward on it.

The formula is torch's (``_softmax_backward_data``: fp32 arithmetic for every input dtype, the
row's sum first, then ``y * (g - sum)``), on ``y`` rounded to its dtype as the dequantized
tensor is. The row's sum is a tree of fp32 additions whose order differs from torch's
kernels, so results agree to a few ulps, not bit for bit (``softmax_backward_ref`` is the
op-by-op form itself).
"""

from __future__ import annotations

import torch

from .group_quant import _GELU_MID as _MID
from .group_quant import _check_sizes, dequantize_ref, per_byte, qrange
from .launch import HAS_TRITON, Launcher
from .launch import use_triton as use_triton_for

# the longest row the kernel holds in registers (a program's rows x BLOCK <= 8192 elements);
# longer rows take the op-by-op form
MAX_ROW = 8192

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .group_quant import round_to, rows_tile, store_as

    @triton.jit
    def _softmax_backward_kernel(
        codes_ptr,  # codes of the output y, flat in row-major order
        scales_ptr,  # (n_groups,) fp32
        grad_ptr,  # (n_rows * row_len,) the output's gradient
        out_ptr,  # the input's gradient (int16 bits for bf16)
        n_rows,
        row_len,
        GROUP: tl.constexpr,  # elements a scale (a constant: the division below is a shift)
        QMIN: tl.constexpr,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,
        MID: tl.constexpr,  # y's dtype, the gradients' too: 0 fp32, 1 fp16, 2 bf16
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        # a whole row a tile (scales found per element: a division by a runtime group size,
        # 64-bit per element, cost more than the rest; GROUP is a constant)
        offs, mask, y, g = rows_tile(codes_ptr, scales_ptr, grad_ptr, rows.to(tl.int64) * row_len,
                                     rows < n_rows, 0, row_len, GROUP, QMIN, BITS, PER_BYTE,
                                     BLOCK)  # fmt: skip
        y = round_to(y, MID)
        dot = tl.sum(g * y, axis=1)
        store_as(out_ptr, offs, y * (g - dot[:, None]), mask, MID == 2)

    _SOFTMAX_BACKWARD = Launcher(_softmax_backward_kernel)
    _SOFTMAX_BACKWARD_WIDE = Launcher(_softmax_backward_kernel, num_warps=8)  # rows > 2048


def _launch_shape(row_len: int) -> tuple[int, int]:
    """(ROWS, BLOCK): a row a BLOCK (a power of two), about 4096 elements a program."""
    block = 1 << max(row_len - 1, 0).bit_length()
    return max(1, 4096 // block), block


def _check(codes, scales, grad, group_size: int, dtype, bits: int, row_len: int) -> int:
    """The number of groups, the arguments checked."""
    if dtype not in _MID:
        raise TypeError(
            f"softmax_backward: dtype must be float32, float16 or bfloat16, got {dtype}"
        )
    if not isinstance(grad, torch.Tensor) or grad.dtype != dtype:
        raise ValueError(f"softmax_backward: the gradient must be a {dtype} tensor, got "
                         f"{getattr(grad, 'dtype', type(grad).__name__)}")  # fmt: skip
    n = grad.numel()
    if row_len < 1 or n % row_len:
        raise ValueError(f"softmax_backward: a row length of {row_len} does not divide the "
                         f"gradient's {n} elements")  # fmt: skip
    return _check_sizes(codes, scales, group_size, bits, n, "softmax_backward")


def softmax_backward(
    codes: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    bits: int = 8,
    signed: bool = False,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Softmax's input gradient over the last dimension of ``grad`` (rows of
    ``grad.shape[-1]``) from the codes of its output ``y`` (``group_quant.quantize`` of ``y``
    in row-major order, rebuilt in ``dtype``, ``grad``'s dtype too), in one pass.

    Returns a contiguous tensor of ``grad``'s shape and dtype; rows longer than ``MAX_ROW``
    take the reference.
    """
    row_len = grad.shape[-1] if isinstance(grad, torch.Tensor) and grad.dim() else 1
    ng = _check(codes, scales, grad, group_size, dtype, bits, row_len)
    if use_triton is None:
        use_triton = use_triton_for(grad)
    if not use_triton or row_len > MAX_ROW:
        return softmax_backward_ref(codes, scales, grad, group_size, dtype, bits, signed)
    g = grad.contiguous()
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    n = g.numel()
    if n == 0 or ng == 0:
        return out
    n_rows = n // row_len
    rows, block = _launch_shape(row_len)
    bf16 = dtype == torch.bfloat16
    launcher = _SOFTMAX_BACKWARD if block <= 2048 else _SOFTMAX_BACKWARD_WIDE
    launcher(
        ((n_rows + rows - 1) // rows,),
        codes.contiguous(), scales.contiguous(), g, out.view(torch.int16) if bf16 else out,
        n_rows, row_len, group_size, qrange(signed, bits)[0], bits, per_byte(bits),
        _MID[dtype], rows, block,
    )  # fmt: skip
    return out


def softmax_backward_ref(codes, scales, grad, group_size: int, dtype, bits: int = 8,
                         signed: bool = False) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :func:`softmax_backward`: the op-by-op form, ``y`` dequantized
    then torch's own softmax backward."""
    row_len = grad.shape[-1] if grad.dim() else 1
    _check(codes, scales, grad, group_size, dtype, bits, row_len)
    y = dequantize_ref(codes, scales, group_size, dtype, bits, signed, grad.numel())
    y = y.view(grad.shape)
    return torch._softmax_backward_data(grad.contiguous(), y, grad.dim() - 1, dtype)
