"""Group-wise absmax quantization to 8-bit codes: Triton kernels, launchers, PyTorch references.

The flattened (row-major) tensor is cut into groups of ``group_size`` contiguous elements; the
last group may be short. Each group keeps one fp32 scale ``absmax / qmax`` and one code per
element, ``round(x / scale)`` clamped to ``[qmin, qmax]``:

- signed:   int8 codes in [-127, 127], qmax = 127 (symmetric; -128 is never produced);
- unsigned: uint8 codes in [0, 255],  qmax = 255, for tensors known to be non-negative.

Non-finite values stay non-finite. A group holding NaN gets a NaN scale, so the whole group
dequantizes to NaN. A group holding +-inf (and no NaN) gets an inf scale; the infinite elements
get code +-qmax and dequantize to +-inf, the finite ones get code 0 and dequantize to NaN
(0 * inf). An all-zero group has scale 0 and dequantizes to exact zeros, and so does a group
whose absmax is a denormal below ``qmax * 2**-149`` (about 1.8e-43 signed, 3.6e-43 unsigned):
its scale underflows to 0, so such values flush to zero.

Bit-exactness between kernel and reference: both compute ``scale = absmax / qmax`` and
``x / scale`` with IEEE round-to-nearest division (``tl.math.div_rn``; a tensor-by-tensor
division in torch), and round half to even, so codes and scales match bit for bit with nearest
rounding. Stochastic rounding (``floor(y + u)``, u uniform in [0, 1)) draws ``u`` from Philox in
the kernel and from ``torch.rand`` in the reference: both are unbiased, they are not equal.
"""

from __future__ import annotations

import functools

import torch

try:  # Triton is optional: without it (or without CUDA) the reference runs.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def qrange(signed: bool) -> tuple[int, int]:
    """Returns (qmin, qmax) of the 8-bit code range."""
    return (-127, 127) if signed else (0, 255)


def n_groups_of(numel: int, group_size: int) -> int:
    return (numel + group_size - 1) // group_size


def _check_quantize_args(x: torch.Tensor, group_size: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"quantize: x.dtype must be one of float32, float16, bfloat16, got {x.dtype}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"quantize: group_size must be a positive int, got {group_size!r}")


def _check_dequantize_args(
    codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> None:
    if codes.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"dequantize: codes must be int8 or uint8, got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"dequantize: scales must be float32, got {scales.dtype}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dequantize: dtype must be float32, float16 or bfloat16, got {dtype}")
    expected = n_groups_of(codes.numel(), group_size)
    if scales.numel() != expected:
        raise ValueError(
            f"dequantize: {codes.numel()} codes in groups of {group_size} need {expected} "
            f"scales, got {scales.numel()}"
        )


if HAS_TRITON:

    @triton.jit
    def _round_half_even(y):
        # Exact for |y| < 2**22: y - floor(y) and the parity test involve no rounding.
        r = tl.floor(y)
        d = y - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        up = (d > 0.5) | ((d == 0.5) & odd)
        return r + up.to(tl.float32)

    @triton.jit
    def _quantize_kernel(
        x_ptr,  # (n,) fp32/fp16/bf16, contiguous
        codes_ptr,  # (n,) int8 (signed) or uint8 (unsigned)
        scales_ptr,  # (n_groups,) fp32
        n,
        n_groups,
        group_size,
        seed,
        QMIN: tl.constexpr,
        QMAX: tl.constexpr,
        STOCHASTIC: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Each program quantizes ROWS groups, walking each group in chunks of BLOCK elements:
        # one pass for absmax (and a NaN flag), one for the codes.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_groups
        base = rows.to(tl.int64) * group_size
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([ROWS], dtype=tl.float32)
        has_nan = tl.zeros([ROWS], dtype=tl.int32)
        for start in range(0, group_size, BLOCK):
            c = start + cols
            offs = base[:, None] + c[None, :]
            mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
            a = tl.abs(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32))
            is_nan = a != a
            has_nan = tl.maximum(has_nan, tl.max(is_nan.to(tl.int32), axis=1))
            amax = tl.maximum(amax, tl.max(tl.where(is_nan, 0.0, a), axis=1))
        scale = tl.math.div_rn(amax, tl.full([ROWS], QMAX, tl.float32))
        scale = tl.where(has_nan > 0, float("nan"), scale)
        tl.store(scales_ptr + rows, scale, mask=row_ok)

        finite = (scale > 0.0) & (scale < float("inf"))  # False for NaN, inf and 0
        safe = tl.where(finite, scale, 1.0)
        for start in range(0, group_size, BLOCK):
            c = start + cols
            offs = base[:, None] + c[None, :]
            mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], (ROWS, BLOCK)))
            special = tl.where(x == float("inf"), QMAX, tl.where(x == float("-inf"), -QMAX, 0.0))
            y = tl.where(finite[:, None], y, special)
            if STOCHASTIC:
                q = tl.floor(y + tl.rand(seed, offs))
            else:
                q = _round_half_even(y)
            q = tl.minimum(tl.maximum(q, QMIN), QMAX)
            tl.store(codes_ptr + offs, q.to(codes_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bf16_bits_rtne(v):
        # fp32 -> bf16 bit pattern, round to nearest even, NaN kept NaN. Done in integers because
        # Triton's interpreter truncates fp32 -> bf16 casts instead of rounding them.
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(v != v, 0x7FC0, rounded).to(tl.int16)

    @triton.jit
    def _dequantize_kernel(
        codes_ptr,  # (n,) int8/uint8
        scales_ptr,  # (n_groups,) fp32
        out_ptr,  # (n,) fp32/fp16, or int16 holding bf16 bits when OUT_BF16
        n,
        n_groups,
        group_size,
        OUT_BF16: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Tiled like the quantize kernel: one scale load per group, no per-element division.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_groups
        base = rows.to(tl.int64) * group_size
        s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)[:, None]
        cols = tl.arange(0, BLOCK)
        for start in range(0, group_size, BLOCK):
            c = start + cols
            offs = base[:, None] + c[None, :]
            mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
            v = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32) * s
            if OUT_BF16:
                tl.store(out_ptr + offs, _bf16_bits_rtne(v), mask=mask)
            else:
                tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=64)
def _launch_shape(group_size: int) -> tuple[int, int]:
    """(ROWS, BLOCK): BLOCK covers a group up to 1024 elements, ROWS fills ~4096 per program."""
    block = min(triton.next_power_of_2(group_size), 1024)
    rows = max(1, 4096 // block)
    return rows, block


def quantize(
    x: torch.Tensor,
    group_size: int = 128,
    signed: bool = True,
    stochastic: bool = False,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` in groups of ``group_size`` flattened elements.

    Args:
        x: fp32, fp16 or bf16 tensor of any shape and layout.
        group_size: elements per scale.
        signed: int8 codes in [-127, 127] if True, uint8 codes in [0, 255] otherwise
            (negative inputs clamp to 0 in unsigned mode).
        stochastic: round stochastically (unbiased) instead of to nearest even.
        use_triton: force the path; by default Triton for CUDA tensors, the reference otherwise.

    Returns:
        ``(codes, scales)``: codes flat with ``x.numel()`` elements, fp32 scales, one per group.
    """
    _check_quantize_args(x, group_size)
    if use_triton is None:
        use_triton = HAS_TRITON and x.is_cuda
    if not use_triton:
        return quantize_ref(x, group_size, signed, stochastic)
    x = x.contiguous().view(-1)
    n = x.numel()
    ng = n_groups_of(n, group_size)
    codes = torch.empty(n, dtype=torch.int8 if signed else torch.uint8, device=x.device)
    scales = torch.empty(ng, dtype=torch.float32, device=x.device)
    if n == 0:
        return codes, scales
    qmin, qmax = qrange(signed)
    # The Philox seed comes from torch's CPU generator: reproducible under torch.manual_seed.
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if stochastic else 0
    rows, block = _launch_shape(group_size)
    grid = (triton.cdiv(ng, rows),)
    _quantize_kernel[grid](
        x, codes, scales, n, ng, group_size, seed,
        QMIN=qmin, QMAX=qmax, STOCHASTIC=stochastic, ROWS=rows, BLOCK=block,
    )  # fmt: skip
    return codes, scales


def quantize_ref(
    x: torch.Tensor, group_size: int = 128, signed: bool = True, stochastic: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`quantize`, same arguments and results."""
    _check_quantize_args(x, group_size)
    xf = x.contiguous().view(-1).float()
    n = xf.numel()
    ng = n_groups_of(n, group_size)
    code_dtype = torch.int8 if signed else torch.uint8
    if n == 0:
        return (
            torch.empty(0, dtype=code_dtype, device=x.device),
            torch.empty(0, dtype=torch.float32, device=x.device),
        )
    qmin, qmax = qrange(signed)
    xp = torch.nn.functional.pad(xf, (0, ng * group_size - n)).view(ng, group_size)
    a = xp.abs()
    is_nan = torch.isnan(a)
    amax = torch.where(is_nan, 0.0, a).amax(dim=1)
    # Tensor-by-tensor division: CUDA turns division by a Python scalar into a reciprocal multiply.
    scale = amax / torch.full_like(amax, qmax)
    scale = torch.where(is_nan.any(dim=1), float("nan"), scale)
    finite = (scale > 0) & (scale < float("inf"))
    safe = torch.where(finite, scale, 1.0)
    y = xp / safe[:, None].expand_as(xp)
    special = torch.where(xp == float("inf"), float(qmax), 0.0)
    special = torch.where(xp == float("-inf"), float(-qmax), special)
    y = torch.where(finite[:, None], y, special)
    q = torch.floor(y + torch.rand_like(y)) if stochastic else torch.round(y)
    codes = q.clamp_(qmin, qmax).to(code_dtype).view(-1)[:n]
    return codes, scale


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Rebuilds the flat tensor ``codes * scale`` in ``dtype`` (fp32 product, then one cast).

    Args:
        codes: flat int8/uint8 codes from :func:`quantize`.
        scales: fp32 scales, one per group.
        group_size: the group size used to quantize.
        dtype: output dtype.
        use_triton: force the path; by default Triton for CUDA tensors, the reference otherwise.

    Returns:
        A flat, contiguous tensor with ``codes.numel()`` elements.
    """
    _check_dequantize_args(codes, scales, group_size, dtype)
    if use_triton is None:
        use_triton = HAS_TRITON and codes.is_cuda
    if not use_triton:
        return dequantize_ref(codes, scales, group_size, dtype)
    codes = codes.contiguous().view(-1)
    n = codes.numel()
    out = torch.empty(n, dtype=dtype, device=codes.device)
    if n == 0:
        return out
    bf16 = dtype == torch.bfloat16
    ng = n_groups_of(n, group_size)
    rows, block = _launch_shape(group_size)
    _dequantize_kernel[(triton.cdiv(ng, rows),)](
        codes,
        scales.contiguous(),
        out.view(torch.int16) if bf16 else out,
        n,
        ng,
        group_size,
        OUT_BF16=bf16,
        ROWS=rows,
        BLOCK=block,
    )
    return out


def dequantize_ref(
    codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """PyTorch reference of :func:`dequantize`, same arguments and result."""
    _check_dequantize_args(codes, scales, group_size, dtype)
    n = codes.numel()
    if n == 0:
        return torch.empty(0, dtype=dtype, device=codes.device)
    codes = codes.reshape(-1)
    out = torch.empty(n, dtype=dtype, device=codes.device)
    full = n // group_size * group_size
    if full:
        body = codes[:full].view(-1, group_size).float() * scales[: full // group_size, None]
        out[:full] = body.view(-1).to(dtype)
    if full < n:
        out[full:] = (codes[full:].float() * scales[-1]).to(dtype)
    return out
