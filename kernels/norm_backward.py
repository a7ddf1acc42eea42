"""LayerNorm and RMSNorm backward from the kept codes of the normalized input, in one launch.

A norm keeps ``x_hat`` (``(x - mean) * rstd``, or ``x * rstd`` for RMSNorm) as group codes
(``group_quant``) and the fp32 ``rstd`` of each row. Its backward needs, per row of ``N``
elements, with ``dy`` the output gradient and ``g = dy * weight``::

    dx = rstd * (g - (x_hat * mean(g * x_hat) + mean(g)))     (RMSNorm: no ``mean(g)``)
    dweight = sum over rows of dy * x_hat;  dbias = sum over rows of dy

The unfused path rebuilds ``x`` (a dequantize kernel) and hands it to PyTorch's
``native_layer_norm_backward`` (which recomputes ``x_hat`` and launches its own kernels), or
runs the formula as a dozen torch ops (RMSNorm). Here one kernel reads the codes, the scales
and ``dy``, and writes ``dx`` and per-program partial sums of ``dweight`` and ``dbias``; one
``sum`` over the programs finishes them (Liger-Kernel's shape for its norms).

``hf`` is the Hugging Face RMSNorm (``weight * (h * rstd).to(x_dtype)``): ``g`` is rounded to
the input's dtype (``(dy * weight).to(x_dtype)``) and ``dweight`` sums ``dy * x_hat`` with
``x_hat`` rounded to the input's dtype and each product to the gradient's, as autograd runs
that formula; the sums themselves are fp32.

The kernel and ``norm_backward_ref`` compute the same fp32 operations; the row means and the
column sums are reductions whose order differs between them (and from PyTorch's), so they agree
to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools

import torch

from .group_quant import _GELU_MID as _MID
from .group_quant import _check_sizes, dequantize_ref, per_byte, qrange
from .launch import HAS_TRITON, Launcher
from .launch import use_triton as use_triton_for

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .group_quant import dequantize_tile, round_to, store_as

    @triton.jit
    def _norm_backward_kernel(
        codes_ptr,  # codes of x_hat, row-major (n,) int8 at 8 bits, packed uint8 below
        scales_ptr,  # (n_groups,) fp32
        grad_ptr,  # (n,) the output gradient, contiguous
        w_ptr,  # (row_len,) the weight (HAS_W; else any pointer, unread)
        rstd_ptr,  # (n_rows,) fp32
        gx_ptr,  # (n,) the input gradient (int16 holding bf16 bits when OUT_BF16)
        part_ptr,  # (programs, 2, row_len) fp32: each program's sums of dweight, dbias terms
        n_rows,
        row_len,
        group_size,
        rows_per_prog,  # a multiple of ROWS
        QMIN: tl.constexpr,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,
        CENTER: tl.constexpr,  # LayerNorm: subtract mean(g) too
        HAS_W: tl.constexpr,
        NEED_X: tl.constexpr,
        PARTS: tl.constexpr,  # write the partial sums
        HF: tl.constexpr,  # Hugging Face RMSNorm's roundings (module docstring)
        MID_X: tl.constexpr,  # the input's dtype, 0 fp32, 1 fp16, 2 bf16 (HF)
        MID_G: tl.constexpr,  # the gradient's dtype (HF)
        OUT_BF16: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,  # >= row_len: a row is one tile
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols[None, :] < row_len
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cols < row_len, other=0.0).to(tl.float32)[None, :]
        acc_w = tl.zeros([BLOCK], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK], dtype=tl.float32)
        first = pid.to(tl.int64) * rows_per_prog  # 64-bit: rows past 2**31 stay positive
        for start in range(0, rows_per_prog, ROWS):
            rows = first + start + tl.arange(0, ROWS)
            row_ok = rows < n_rows
            offs = rows.to(tl.int64)[:, None] * row_len + cols[None, :]
            mask = row_ok[:, None] & cmask
            s = tl.load(scales_ptr + offs // group_size, mask=mask, other=0.0)
            xh = dequantize_tile(codes_ptr, offs, mask, s, QMIN, BITS, PER_BYTE)
            dy = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                g = dy * w
            else:
                g = dy
            if HF:
                g = round_to(g, MID_X)
                acc_w += tl.sum(round_to(dy * round_to(xh, MID_X), MID_G), axis=0)
            else:
                acc_w += tl.sum(dy * xh, axis=0)
            acc_b += tl.sum(dy, axis=0)
            if NEED_X:
                rs = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
                c1 = (tl.sum(xh * g, axis=1) / row_len)[:, None]
                if CENTER:
                    c2 = (tl.sum(g, axis=1) / row_len)[:, None]
                    gx = (g - (xh * c1 + c2)) * rs
                else:
                    gx = (g - xh * c1) * rs
                store_as(gx_ptr, offs, gx, mask, OUT_BF16)
        if PARTS:
            at = part_ptr + pid.to(tl.int64) * 2 * row_len + cols
            tl.store(at, acc_w, mask=cols < row_len)
            tl.store(at + row_len, acc_b, mask=cols < row_len)

    # one Launcher per warp count (_launch_shape)
    _NORM_BACKWARD = {w: Launcher(_norm_backward_kernel, num_warps=w) for w in (4, 8, 16)}

# Rows longer than this take the unfused path (a row is one tile of registers; ptxas for sm_90
# spills registers from 16384-element rows, and at 4 and 2 bits from 8192: not yet timed).
MAX_ROW = 8192


def fits(row_len: int, *dtypes: torch.dtype) -> bool:
    """Whether rows of ``row_len`` elements (gradient and input of ``dtypes``) take the
    one-launch kernel."""
    return HAS_TRITON and 0 < row_len <= MAX_ROW and all(d in _MID for d in dtypes)


@functools.lru_cache(maxsize=64)
def _launch_shape(row_len: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps): a tile of about 4096 elements, a row at most."""
    block = triton.next_power_of_2(row_len)
    rows = max(1, 4096 // block)
    return rows, block, 4 if block <= 1024 else (8 if block <= 4096 else 16)


@functools.lru_cache(maxsize=8)
def _max_programs(device: torch.device) -> int:
    """Programs for a launch: a few per SM on CUDA (each then sums many rows into its partial
    dweight and dbias); few in the interpreter, where each program runs in turn."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _check(codes, scales, group_size, bits, grad, rstd, weight, row_len) -> int:
    n = grad.numel()
    if row_len <= 0 or n % row_len:
        raise ValueError(f"norm_backward: rows of {row_len} elements must split {n} elements")
    _check_sizes(codes, scales, group_size, bits, n)
    if rstd.numel() != n // row_len or rstd.dtype != torch.float32:
        raise ValueError(
            f"norm_backward: needs one fp32 rstd per row ({n // row_len}), got "
            f"{rstd.numel()} of {rstd.dtype}"
        )
    if weight is not None and weight.numel() != row_len:
        raise ValueError(f"norm_backward: the weight has {weight.numel()} elements, rows {row_len}")
    return n // row_len


def norm_backward(
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bits: int,
    grad: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    x_dtype: torch.dtype,
    row_len: int,
    *,
    center: bool,
    hf: bool = False,
    need_x: bool = True,
    need_sums: bool = True,
    use_triton: bool | None = None,
) -> tuple:
    """A norm's gradients from the signed codes of its normalized input (module docstring).

    Args:
        codes, scales, group_size, bits: the kept ``x_hat`` (``group_quant.quantize``, signed,
            row-major over ``grad``'s elements).
        grad: the output gradient.
        rstd: fp32, one per row.
        weight: the affine weight (``row_len`` elements), or None.
        x_dtype: the input's dtype, which ``dx`` takes.
        row_len: elements per row (the normalized dims).
        center: LayerNorm (True) or RMSNorm (False).
        hf: the Hugging Face RMSNorm's roundings.
        need_x: compute ``dx``; need_sums: compute the column sums.
        use_triton: force the path; by default Triton for CUDA tensors, the reference otherwise.

    Returns:
        ``(dx, dweight, dbias)``: ``dx`` of ``grad``'s shape in ``x_dtype`` (None without
        ``need_x``), the fp32 column sums of ``dy * x_hat`` and of ``dy``, ``row_len`` each
        (None without ``need_sums``); the caller casts them to the parameters' dtypes.
    """
    if use_triton is None:
        use_triton = use_triton_for(grad)
    if not use_triton:  # (checks its arguments itself)
        return norm_backward_ref(codes, scales, group_size, bits, grad, rstd, weight, x_dtype,
                                 row_len, center=center, hf=hf, need_x=need_x,
                                 need_sums=need_sums)  # fmt: skip
    n_rows = _check(codes, scales, group_size, bits, grad, rstd, weight, row_len)
    grad = grad.contiguous()
    device = grad.device
    dx = torch.empty(grad.shape, dtype=x_dtype, device=device) if need_x else None
    rows, block, warps = _launch_shape(row_len)
    per_prog = -(-n_rows // _max_programs(device))
    per_prog = max(rows, -(-per_prog // rows) * rows)  # a multiple of ROWS
    programs = max(1, -(-n_rows // per_prog))
    shape = (programs, 2, row_len) if need_sums else (1,)  # unread without the sums
    parts = torch.empty(shape, dtype=torch.float32, device=device)
    if n_rows:
        bf16 = x_dtype == torch.bfloat16
        out = grad if dx is None else (dx.view(torch.int16) if bf16 else dx)
        _NORM_BACKWARD[warps](
            (programs,), codes.contiguous(), scales.contiguous(), grad,
            grad if weight is None else weight.contiguous(), rstd.contiguous(), out, parts,
            n_rows, row_len, group_size, per_prog,
            qrange(True, bits)[0], bits, per_byte(bits), center, weight is not None, need_x,
            need_sums, hf, _MID[x_dtype], _MID[grad.dtype], bf16 and need_x, rows, block,
        )  # fmt: skip
    if not need_sums:
        return dx, None, None
    sums = parts.sum(0) if n_rows else parts.new_zeros(2, row_len)
    return dx, sums[0], sums[1]


def norm_backward_ref(codes, scales, group_size, bits, grad, rstd, weight, x_dtype, row_len, *,
                      center, hf=False, need_x=True, need_sums=True) -> tuple:  # fmt: skip
    """PyTorch reference of :func:`norm_backward`, same arguments (but ``use_triton``) and
    result: the same fp32 operations, as torch ops."""
    n_rows = _check(codes, scales, group_size, bits, grad, rstd, weight, row_len)
    n = grad.numel()
    xh = dequantize_ref(codes, scales, group_size, torch.float32, bits, True, n)
    xh = xh.view(n_rows, row_len)
    dy = grad.reshape(n_rows, row_len).float()
    g = dy if weight is None else dy * weight.reshape(1, row_len).float()
    if hf:
        g = g.to(x_dtype).float()
    dx = None
    if need_x:
        c1 = (xh * g).sum(1, keepdim=True) / row_len
        if center:
            dx = (g - (xh * c1 + g.sum(1, keepdim=True) / row_len)) * rstd.reshape(-1, 1)
        else:
            dx = (g - xh * c1) * rstd.reshape(-1, 1)
        dx = dx.to(x_dtype).view(grad.shape)
    if not need_sums:
        return dx, None, None
    prod = (dy * xh.to(x_dtype).float()).to(grad.dtype).float() if hf else dy * xh
    return dx, prod.sum(0), dy.sum(0)
