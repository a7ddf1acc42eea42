"""BatchNorm's backward in training mode from the codes of its normalized input ``x_hat``.

The input (N, C, *spatial) is read in row-major order as N * C rows of S = prod(spatial)
elements, row ``n * C + c`` in channel ``c``; ``x_hat`` is rebuilt from its 8-, 4- or 2-bit
codes in registers, never written out. Two kernels, where the op-by-op form dequantizes the
whole input (``x_hat / invstd + mean``, written out in the input's dtype) and runs torch's
backward on it, which reads that input twice more:

1. per row, ``sum(g)`` and ``sum(g * x_hat)`` in fp32, written as (2, N * C) partial sums,
   which ``torch.sum`` adds over N (a fixed order: the result does not vary run to run);
2. ``dx = (g - sum_g / M - x_hat * sum_gx / M) * weight * invstd`` per channel, M = N * S:
   torch's formula (``batch_norm_backward``'s ``grad_mean`` and ``proj_scale``), with
   ``(x - mean) * invstd`` being ``x_hat`` itself.

The weight's gradient is ``sum(g * x_hat)`` and the bias's ``sum(g)``, per channel, as torch's.
Sums of fp32 values in another order than torch's, and ``x_hat`` from the codes rather than
recomputed from a rounded input: results agree with the op-by-op form to rounding, not bit
for bit (``batch_norm_backward_ref`` is the same two passes in torch ops).
"""

from __future__ import annotations

import torch

from .group_quant import _check_sizes, dequantize_ref, per_byte, qrange
from .launch import HAS_TRITON, Launcher
from .launch import use_triton as use_triton_for

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .group_quant import rows_tile, store_as

    @triton.jit
    def _bn_sums_kernel(
        codes_ptr,  # codes of x_hat, flat in row-major order
        scales_ptr,  # (n_groups,) fp32
        grad_ptr,  # (n_rows * S,) the output's gradient
        part_ptr,  # (2, n_rows) fp32: sum(g), sum(g * x_hat) per row
        n_rows,
        S,
        GROUP: tl.constexpr,  # elements a scale (a constant: the division is a shift)
        QMIN: tl.constexpr,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        base = rows.to(tl.int64) * S
        acc_g = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        acc_gx = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for start in range(0, S, BLOCK):
            _, _, xh, g = rows_tile(codes_ptr, scales_ptr, grad_ptr, base, row_ok, start, S,
                                    GROUP, QMIN, BITS, PER_BYTE, BLOCK)  # fmt: skip
            acc_g += g
            acc_gx += g * xh
        tl.store(part_ptr + rows, tl.sum(acc_g, axis=1), mask=row_ok)
        tl.store(part_ptr + n_rows + rows, tl.sum(acc_gx, axis=1), mask=row_ok)

    @triton.jit
    def _bn_input_grad_kernel(
        codes_ptr,
        scales_ptr,
        grad_ptr,
        sums_ptr,  # (2, C) fp32: sum(g), sum(g * x_hat) per channel
        weight_ptr,  # (C,) any float dtype (HAS_WEIGHT)
        invstd_ptr,  # (C,) fp32
        out_ptr,  # the input's gradient (int16 bits for bf16)
        n_rows,
        S,
        C,
        m,  # N * S, the elements of a channel
        GROUP: tl.constexpr,
        QMIN: tl.constexpr,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        OUT_BF16: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        base = rows.to(tl.int64) * S
        ch = rows % C
        # 1 / M as torch's kernels take it: M in fp32, then a division (rounded to nearest);
        # (added to an fp32 tensor: Triton passes an M of 1 as a constant, with no .to)
        inv_m = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32),
                               tl.full([ROWS], 0.0, tl.float32) + m)  # fmt: skip
        # per row, torch's grad_mean, proj_scale (on x_hat: times invstd^-1 twice cancels)
        # and grad_scale
        mean_g = tl.load(sums_ptr + ch, mask=row_ok, other=0.0) * inv_m
        proj = tl.load(sums_ptr + C + ch, mask=row_ok, other=0.0) * inv_m
        scale = tl.load(invstd_ptr + ch, mask=row_ok, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            scale = scale * tl.load(weight_ptr + ch, mask=row_ok, other=0.0).to(tl.float32)
        for start in range(0, S, BLOCK):
            offs, mask, xh, g = rows_tile(codes_ptr, scales_ptr, grad_ptr, base, row_ok, start,
                                          S, GROUP, QMIN, BITS, PER_BYTE, BLOCK)  # fmt: skip
            dx = (g - xh * proj[:, None] - mean_g[:, None]) * scale[:, None]
            store_as(out_ptr, offs, dx, mask, OUT_BF16)

    _SUMS = Launcher(_bn_sums_kernel)
    _INPUT_GRAD = Launcher(_bn_input_grad_kernel)


def _launch_shape(S: int) -> tuple[int, int]:
    """(ROWS, BLOCK): a row's columns in BLOCKs of up to 2048, about 4096 elements a program."""
    block = min(1 << max(S - 1, 0).bit_length(), 2048)
    return max(1, 4096 // block), block


def _check(codes, scales, grad, group_size: int, bits: int, invstd, weight) -> tuple:
    """(N, C, S, groups), the arguments checked."""
    where = "batch_norm_backward"
    if not isinstance(grad, torch.Tensor) or grad.dtype not in _DTYPES:
        raise TypeError(f"{where}: the gradient must be a float32, float16 or bfloat16 "
                        f"tensor, got {getattr(grad, 'dtype', type(grad).__name__)}")  # fmt: skip
    if grad.dim() < 2:
        raise ValueError(f"{where}: the gradient must be (N, C, ...), got shape "
                         f"{tuple(grad.shape)}")  # fmt: skip
    n, c = grad.shape[0], grad.shape[1]
    s = grad.numel() // max(n * c, 1)
    if invstd.numel() != c or (weight is not None and weight.numel() != c):
        raise ValueError(f"{where}: {c} channels need {c} invstd and weight values, got "
                         f"{invstd.numel()} and "
                         f"{'none' if weight is None else weight.numel()}")  # fmt: skip
    return n, c, s, _check_sizes(codes, scales, group_size, bits, grad.numel(), where)


def batch_norm_backward(
    codes: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    group_size: int,
    bits: int = 8,
    signed: bool = True,
    need_input: bool = True,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """BatchNorm's gradients in training mode from the codes of ``x_hat`` (the normalized
    input, ``group_quant.quantize`` in row-major order), the output's gradient ``grad``
    (N, C, ...), the saved per-channel ``invstd`` and the ``weight`` (None: no affine).

    Returns ``(dx or None, sums)``: the input's gradient (contiguous, ``grad``'s shape and
    dtype; None unless ``need_input``) and ``sums`` (2, C) fp32, ``sum(g)`` (the bias's
    gradient) and ``sum(g * x_hat)`` (the weight's) per channel.
    """
    n, c, s, ng = _check(codes, scales, grad, group_size, bits, invstd, weight)
    if use_triton is None:
        use_triton = use_triton_for(grad)
    if not use_triton:
        return batch_norm_backward_ref(codes, scales, grad, invstd, weight, group_size, bits,
                                       signed, need_input)  # fmt: skip
    g = grad.contiguous()
    rows = n * c
    if g.numel() == 0 or ng == 0:
        sums = g.new_zeros((2, c), dtype=torch.float32)
        return (torch.empty_like(g) if need_input else None), sums
    qmin, per = qrange(signed, bits)[0], per_byte(bits)
    r, block = _launch_shape(s)
    grid = ((rows + r - 1) // r,)
    part = torch.empty((2, rows), dtype=torch.float32, device=g.device)
    codes = codes.contiguous()
    _SUMS(grid, codes, scales, g, part, rows, s, group_size, qmin, bits, per, r, block)
    sums = part.view(2, n, c).sum(1)
    if not need_input:
        return None, sums
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    bf16 = g.dtype == torch.bfloat16
    w = invstd if weight is None else weight.contiguous()
    _INPUT_GRAD(
        grid, codes, scales, g, sums, w, invstd.contiguous(),
        out.view(torch.int16) if bf16 else out, rows, s, c, n * s, group_size, qmin,
        bits, per, weight is not None, bf16, r, block,
    )  # fmt: skip
    return out, sums


def batch_norm_backward_ref(codes, scales, grad, invstd, weight, group_size: int,
                            bits: int = 8, signed: bool = True,
                            need_input: bool = True) -> tuple:  # fmt: skip
    """PyTorch reference of :func:`batch_norm_backward`, the same two passes in torch ops:
    row sums in fp32, added over N, then the input's gradient in fp32, one cast."""
    n, c, s, _ = _check(codes, scales, grad, group_size, bits, invstd, weight)
    xh = dequantize_ref(codes, scales, group_size, torch.float32, bits, signed, grad.numel())
    xh = xh.view(n, c, s)
    g = grad.reshape(n, c, s).float()
    sums = torch.stack([g.sum(2), (g * xh).sum(2)]).sum(1)
    if not need_input:
        return None, sums
    one = torch.ones((), dtype=torch.float32)
    inv_m = one / torch.tensor(float(n * s), dtype=torch.float32)  # as the kernel
    scale = invstd.float()
    if weight is not None:
        scale = scale * weight.float()
    mean_g, proj = (sums[0] * inv_m).view(c, 1), (sums[1] * inv_m).view(c, 1)
    dx = (g - xh * proj - mean_g) * scale.view(c, 1)
    return dx.to(grad.dtype).view(grad.shape), sums
