"""GELU backward reading the compressed input: ``grad * gelu'(x)`` with ``x`` rebuilt from its
codes inside the kernel, so no full-precision copy of ``x`` is written and read again.

The formulas are PyTorch's CUDA ones (``GeluCUDAKernelImpl`` backward), computed in fp32 on
``x`` rounded to the dtype the forward GELU ran in. The reference (:func:`gelu_backward_ref`)
rebuilds ``x`` with ``dequantize_ref`` and calls ``aten.gelu_backward``; the two agree to
fp32 rounding of ``erf``/``exp``, not bit for bit (different ``erf`` implementations).
"""

from __future__ import annotations

import torch

from .group_quant import (
    _GELU_MID,
    HAS_TRITON,
    _check_dequantize_args,
    _launch_shape,
    _resolve_layout,
    dequantize_ref,
    n_groups_of,
    per_byte,
    qrange,
    use_triton_for,
)
from .launch import Launcher

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .group_quant import dequantize_tile, round_to, store_as

    @triton.jit
    def _gelu_backward_kernel(
        codes_ptr,  # codes of the GELU input
        scales_ptr,  # (n_groups,) fp32
        grad_ptr,  # (n,) the output gradient, contiguous
        out_ptr,  # (n,) the input gradient (int16 bits when OUT_BF16)
        n,
        n_groups,
        group_size,
        QMIN: tl.constexpr,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,
        OUT_BF16: tl.constexpr,
        TANH: tl.constexpr,
        MID: tl.constexpr,  # the GELU input dtype: 0 fp32, 1 fp16, 2 bf16
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_groups
        base = rows.to(tl.int64) * group_size
        s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)[:, None]
        cols = tl.arange(0, BLOCK)
        for start in range(0, group_size, BLOCK):
            c = start + cols
            offs = base[:, None] + c[None, :]
            mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
            x = round_to(dequantize_tile(codes_ptr, offs, mask, s, QMIN, BITS, PER_BYTE), MID)
            dy = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if TANH:
                x_sq = x * x
                inner = 0.7978845608028654 * (x + 0.044715 * (x_sq * x))
                e = tl.exp(-2.0 * tl.abs(inner))
                t = (1.0 - e) / (1.0 + e)
                t = tl.where(inner < 0, -t, t)
                left = 0.5 * x
                right = 1.0 + t
                left_derivative = 0.5 * right
                inner_derivative = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x_sq)
                right_derivative = left * (1.0 - t * t) * inner_derivative
                g = dy * (left_derivative + right_derivative)
            else:
                cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
                pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
                g = dy * (cdf + x * pdf)
            store_as(out_ptr, offs, g, mask, OUT_BF16)

    _GELU_BACKWARD = Launcher(_gelu_backward_kernel)


def gelu_backward(
    grad: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    approximate: str = "none",
    use_triton: bool | None = None,
    bits: int = 8,
    signed: bool | None = None,
) -> torch.Tensor:
    """The GELU input gradient from the output gradient and the input's codes.

    Args:
        grad: the output gradient (any layout; shape of the GELU input).
        codes, scales, group_size, bits, signed: the input's quantization, as
            :func:`~group_quant.dequantize` takes them.
        dtype: the dtype of the GELU input (and of the result).
        approximate: "none" or "tanh", as the forward GELU.
        use_triton: force the path; by default Triton for CUDA tensors.

    Returns:
        The input gradient, ``grad``'s shape, contiguous, in ``dtype``.
    """
    n = grad.numel()
    _, signed = _resolve_layout(codes, bits, signed, n)
    _check_dequantize_args(codes, scales, group_size, dtype, bits, n)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu_backward: approximate must be 'none' or 'tanh': {approximate!r}")
    if use_triton is None:
        use_triton = use_triton_for(codes)
    if not use_triton:
        return gelu_backward_ref(grad, codes, scales, group_size, dtype, approximate, bits, signed)
    grad = grad.contiguous()
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    if n == 0:
        return out
    bf16 = dtype == torch.bfloat16
    ng = n_groups_of(n, group_size)
    rows, block = _launch_shape(group_size)
    _GELU_BACKWARD(
        (triton.cdiv(ng, rows),),
        codes, scales, grad, out.view(torch.int16) if bf16 else out, n, ng, group_size,
        qrange(signed, bits)[0], bits, per_byte(bits), bf16, approximate == "tanh",
        _GELU_MID[dtype], rows, block,
    )  # fmt: skip
    return out


def gelu_backward_ref(
    grad: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    approximate: str = "none",
    bits: int = 8,
    signed: bool | None = None,
) -> torch.Tensor:
    """PyTorch reference of :func:`gelu_backward`."""
    x = dequantize_ref(codes, scales, group_size, dtype, bits, signed, grad.numel())
    g = torch.ops.aten.gelu_backward(grad, x.view(grad.shape), approximate=approximate)
    return g.contiguous()
