"""Group-wise absmax quantization to 8, 4 or 2-bit codes: Triton kernels, launchers, references.

The flattened (row-major) tensor is cut into groups of ``group_size`` contiguous elements; the
last group may be short. Each group keeps one fp32 scale ``absmax / qmax`` and one code per
element, ``round(x / scale)`` clamped to ``[qmin, qmax]``:

| bits | signed codes (qmin..qmax) | unsigned codes | storage |
|---|---|---|---|
| 8 | -127..127 (int8; -128 unused) | 0..255 (uint8) | one byte per element |
| 4 | -7..7 | 0..15 | two per byte, ``code - qmin`` in 4 bits |
| 2 | -1..1 | 0..3 | four per byte, ``code - qmin`` in 2 bits |

Unsigned codes are for tensors known to be non-negative (softmax outputs). Packed codes (4 and
2 bits) are stored low bits first: element ``i`` sits in byte ``i // per_byte`` at bit
``(i % per_byte) * bits``; the group size must be a multiple of ``per_byte`` so that no byte
spans two groups.

Non-finite values stay non-finite. A group holding NaN gets a NaN scale, so the whole group
dequantizes to NaN. A group holding +-inf (and no NaN) gets an inf scale; the infinite elements
get code +-qmax and dequantize to +-inf, the finite ones get code 0 and dequantize to NaN
(0 * inf). An all-zero group has scale 0 and dequantizes to exact zeros, and so does a group
whose absmax is a denormal below ``qmax * 2**-149`` (about 1.8e-43 for 8-bit signed): its scale
underflows to 0, so such values flush to zero. (Unsigned codes of -inf clamp to 0: NaN.)
Finite values stay finite: where ``qmax * scale`` would round to inf (an absmax within half a
step of float32's maximum) the scale is taken one ulp smaller, and the largest code clamps.

Bit-exactness between kernel and reference: both compute ``scale = absmax / qmax`` and, once
per group, ``inv = 1 / (scale * p)`` with IEEE round-to-nearest division (``tl.math.div_rn``; a
tensor-by-tensor division in torch), then ``y = (x * p) * inv`` with one rounded multiply
(``mul.rn.f32``, never fused into an FMA nor flushed to zero) and round half to even, so
codes and scales match bit for bit with nearest rounding. ``p`` is 2**64 where the scale is
below 2**-64, 2**-64 where it is 2**64 or more, else 1: it keeps ``inv`` a normal float (finite
for the tiniest scales, and not a subnormal that a flushing multiply would zero for the
largest), and ``x * p`` is exact wherever it can move a code (an element it takes below
2**-126 has ``|x / scale| < 2**-126`` and code 0 either way). ``y`` is ``x / scale`` up to two
roundings (|error| <= 2**-23 |y|, under 1.6e-5 of a step at 8 bits): a per-element division
costs about a third of the kernel's bandwidth (benchmarks/quant_tuning.py).
Stochastic rounding (``floor(y + u)``, u uniform in [0, 1)) draws ``u`` from Philox in the
kernel and from ``torch.rand`` on a local generator in the reference: both are unbiased,
they are not equal.

Stochastic rounding's seed (``next_rounding_seed``) never draws from torch's generators: a
draw there would move every later random op (the dropout masks a checkpointed block's
recompute must replay, data shuffling). Each call takes the next value of a private counter,
mixed with ``torch.initial_seed()`` into a 31-bit seed; the counter restarts at 0 whenever a
call sees a new initial seed (``torch.manual_seed`` with another value, ``torch.seed``, or
``torch.set_rng_state`` of a state seeded otherwise), so a process seeded with
``torch.manual_seed(s)`` repeats its draws. Within one process, ``rounding_state`` and
``set_rounding_state`` save and restore the counter (with torch's RNG state, to resume
bit-identically).
"""

from __future__ import annotations

import functools

import torch

from .launch import HAS_TRITON, INTERPRETING, Launcher
from .launch import use_triton as use_triton_for

if HAS_TRITON:  # without it (or without CUDA) the reference runs
    import triton
    import triton.language as tl

    from .gelu import gelu_backward_fp32, gelu_fp32, silu_backward_fp32, silu_fp32

    # The compiled kernels' explicit round-to-nearest fp32 ops, as PTX: libdevice's mul_rn /
    # add_rn take the .ftz forms under Triton (which sets nvvm-reflect-ftz), flushing
    # subnormal results to zero where PyTorch keeps them; these never flush and are never
    # contracted into an FMA. The interpreter has no inline PTX and needs neither.
    @triton.jit
    def mul_rn(a, b):
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def add_rn(a, b):
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_BITS = (8, 4, 2)


def qrange(signed: bool, bits: int = 8) -> tuple[int, int]:
    """Returns (qmin, qmax) of the code range."""
    top = (1 << (bits - 1)) - 1
    return (-top, top) if signed else (0, (1 << bits) - 1)


def per_byte(bits: int) -> int:
    return 8 // bits


def n_groups_of(numel: int, group_size: int) -> int:
    return (numel + group_size - 1) // group_size


def n_code_bytes(numel: int, bits: int) -> int:
    return (numel + per_byte(bits) - 1) // per_byte(bits)


_CHECKED: set[tuple[int, int]] = set()  # (bits, group_size) pairs already found valid


def _check_bits_group(bits: int, group_size: int, where: str) -> None:
    compiling = torch.compiler.is_compiling()  # no cache there: a read would be guarded on
    if not compiling and type(group_size) is int and (bits, group_size) in _CHECKED:
        return  # checked once: this runs on every quantize and dequantize
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{where}: group_size must be a positive int, got {group_size!r}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{where}: bits must be one of {list(SUPPORTED_BITS)}, got {bits!r}")
    if group_size % per_byte(bits):
        raise ValueError(
            f"{where}: with bits={bits}, group_size must be a multiple of {per_byte(bits)} "
            f"(codes per byte), got {group_size}"
        )
    if not compiling:
        _CHECKED.add((bits, group_size))


# stochastic rounding's seed source: [torch.initial_seed() it counts under, calls since then]
_ROUNDING: list = [None, 0]
_MASK64 = (1 << 64) - 1


def next_rounding_seed() -> int:
    """A 31-bit seed for one stochastic quantization, from the private counter (see the module
    docstring): reproducible under ``torch.manual_seed``, and it leaves torch's generators as
    they are."""
    base = torch.initial_seed()
    state = _ROUNDING
    if state[0] != base:
        state[0], state[1] = base, 0
    n = state[1]
    state[1] = n + 1
    # splitmix64 of (base, n): neighbouring counters give unrelated seeds
    z = (base * 0x9E3779B97F4A7C15 + (n + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def rounding_state() -> tuple:
    """The stochastic-rounding seed counter, ``(initial_seed, calls)``, to save with torch's
    RNG state (``torch.get_rng_state()``) for a bit-identical resume."""
    return tuple(_ROUNDING)


def set_rounding_state(state: tuple) -> None:
    """Restores a ``rounding_state()``."""
    base, n = state
    if not (base is None or isinstance(base, int)) or not isinstance(n, int) or n < 0:
        raise ValueError(f"set_rounding_state: expected (initial_seed, calls), got {state!r}")
    _ROUNDING[0], _ROUNDING[1] = base, n


def _check_quantize_args(
    x: torch.Tensor, group_size: int, bits: int, positive=False, signed=False, normalize=None
) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: x must be a torch.Tensor, got {type(x).__name__}")
    _check_quantize_setting(x.dtype, group_size, bits, positive, signed, normalize is not None)


def _check_quantize_setting(dtype, group_size: int, bits: int, positive, signed, normalized):
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"quantize: x.dtype must be one of float32, float16, bfloat16, got {dtype}")
    _check_bits_group(bits, group_size, "quantize")
    if positive and (bits == 2 or signed or normalized):
        raise ValueError("quantize: positive codes are unsigned 8- or 4-bit codes of x itself")


def _check_dequantize_args(
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    bits: int,
    numel: int,
) -> None:
    _check_dequantize_setting(codes.dtype, scales.dtype, dtype, group_size, bits)
    _check_sizes(codes, scales, group_size, bits, numel)


def _check_dequantize_setting(codes_dtype, scales_dtype, dtype, group_size: int, bits: int):
    _check_bits_group(bits, group_size, "dequantize")
    allowed = (torch.int8, torch.uint8) if bits == 8 else (torch.uint8,)
    if codes_dtype not in allowed:
        raise TypeError(f"dequantize: {bits}-bit codes must be {allowed}, got {codes_dtype}")
    if scales_dtype != torch.float32:
        raise TypeError(f"dequantize: scales must be float32, got {scales_dtype}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dequantize: dtype must be float32, float16 or bfloat16, got {dtype}")


def _check_sizes(codes, scales, group_size: int, bits: int, numel: int,
                 where: str = "dequantize") -> int:  # fmt: skip
    """The number of groups of ``numel`` elements, checked against the codes and scales
    (``where``: the function an error names)."""
    if codes.numel() != n_code_bytes(numel, bits):
        raise ValueError(
            f"{where}: {numel} elements at {bits} bits need {n_code_bytes(numel, bits)} "
            f"code bytes, got {codes.numel()}"
        )
    expected = n_groups_of(numel, group_size)
    if scales.numel() != expected:
        raise ValueError(
            f"{where}: {numel} elements in groups of {group_size} need {expected} "
            f"scales, got {scales.numel()}"
        )
    return expected


if HAS_TRITON:

    @triton.jit
    def _round_half_even(y):
        # Exact for |y| < 2**22 (codes are clamped to |y| <= 255): y + 1.5 * 2**23 lies in
        # [2**23, 2**24), where the fp32 spacing is 1, so the add itself rounds y to the
        # nearest integer, ties to even; the subtraction is exact. Two adds, no multiply to
        # contract into an FMA.
        return (y + 12582912.0) - 12582912.0

    @triton.jit
    def _absmax_bits(x):
        """The largest ``|x|`` of each row of a [ROWS, B] fp32 tile, as fp32 bits: with the
        sign bit cleared, non-negative floats' bit patterns order as the values do, and every
        NaN's is above +inf's (0x7F800000), so one integer max finds both the absmax and
        whether the row holds a NaN."""
        return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)

    @triton.jit
    def row_col(base, c, row_len, span):
        """Row and column, in rows of ``row_len`` elements, of the elements at
        ``base[:, None] + c[None, :]`` (``base``: int64 per tile row; ``c``: int32 columns below
        ``span``). One division per tile row; per element a compare where ``span`` is at most
        ``row_len`` (an element is then in base's row or the next), else a division (rows
        shorter than a group): a 64-bit division per element held these kernels to a third
        of the copy bandwidth."""
        r0 = base // row_len
        w = (base - r0 * row_len)[:, None] + c[None, :]  # int64: a row may pass 2**31
        if span <= row_len:
            dr = (w >= row_len).to(tl.int64)
        else:
            dr = w // row_len
        return r0[:, None] + dr, w - dr * row_len

    @triton.jit
    def _load_x(x_ptr, mean_ptr, rstd_ptr, offs, mask, base, c, group_size, row_len,
                NORM: tl.constexpr):  # fmt: skip
        """fp32 values of a tile (``offs``: ``base[:, None] + c[None, :]``, groups of
        ``group_size``); with NORM the normalized ``(x - mean[row]) * rstd[row]``."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            r, _ = row_col(base, c, row_len, group_size)
            m = tl.load(mean_ptr + r, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(rstd_ptr + r, mask=mask, other=0.0).to(tl.float32)
            x = tl.where(mask, (x - m) * s, 0.0)
        return x

    @triton.jit
    def _scale_of(amax_bits, QMAX: tl.constexpr):
        """absmax / QMAX from the row's absmax bits (NaN where the row holds a NaN), one ulp
        smaller where ``QMAX * scale`` would overflow for a finite absmax."""
        amax = amax_bits.to(tl.float32, bitcast=True)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        over = (scale * QMAX == float("inf")) & (amax_bits < 0x7F800000)
        scale = tl.where(over, (scale.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True),
                         scale)  # fmt: skip
        return tl.where(amax_bits > 0x7F800000, float("nan"), scale)

    @triton.jit
    def _group_scales(
        x_ptr, mean_ptr, rstd_ptr, n, base, row_ok, group_size, row_len,
        QMAX: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """absmax / QMAX per group (NaN where the group holds NaN)."""
        cols = tl.arange(0, BLOCK)
        amax_bits = tl.zeros([ROWS], dtype=tl.int32)
        for start in range(0, group_size, BLOCK):
            c = start + cols
            offs = base[:, None] + c[None, :]
            mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
            x = _load_x(x_ptr, mean_ptr, rstd_ptr, offs, mask, base, c, group_size, row_len,
                        NORM)  # fmt: skip
            amax_bits = tl.maximum(amax_bits, _absmax_bits(x))
        return _scale_of(amax_bits, QMAX)

    @triton.jit
    def _inverse(scale):
        """Per row of scales: whether the scale is finite and non-zero, the prescale (2**64
        below 2**-64, 2**-64 from 2**64 up, else 1) and ``1 / (scale * prescale)`` (IEEE
        division, once per group; 1 where the scale is not finite), each [ROWS, 1]."""
        finite = (scale > 0.0) & (scale < float("inf"))  # False for NaN, inf, 0
        big = tl.where(scale >= 18446744073709551616.0, 5.421010862427522e-20, 1.0)
        pre = tl.where(scale < 5.421010862427522e-20, 18446744073709551616.0, big)
        safe = tl.where(finite, scale * pre, 1.0)
        inv = tl.math.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe)
        return finite[:, None], pre[:, None], inv[:, None]

    @triton.jit
    def _codes(x, finite, pre, inv, offs, seed, QMIN: tl.constexpr, QMAX: tl.constexpr,
               STOCHASTIC: tl.constexpr, POSITIVE: tl.constexpr, RN: tl.constexpr):  # fmt: skip
        """Codes of a [ROWS, B] tile of fp32 values; finite/pre/inv (``_inverse``) are
        [ROWS, 1]. ``POSITIVE`` (unsigned codes): code 0 exactly where ``x <= 0``, at least 1
        elsewhere (NaN too). ``RN``: the product as an explicit round-to-nearest multiply,
        which the compiler never fuses into the rounding's add (the interpreter has none)."""
        xp = x * pre  # exact: a power of two, and |x| <= QMAX * scale
        y = mul_rn(xp, tl.broadcast_to(inv, x.shape)) if RN else xp * inv
        special = tl.where(x == float("inf"), QMAX, tl.where(x == float("-inf"), -QMAX, 0.0))
        y = tl.where(finite, y, special)
        if STOCHASTIC:
            q = tl.floor(y + tl.rand(seed, offs))
        else:
            q = _round_half_even(y)
        q = tl.minimum(tl.maximum(q, QMIN), QMAX)
        if POSITIVE:
            q = tl.where(x <= 0.0, 0.0, tl.maximum(q, 1.0))
        return q

    @triton.jit
    def _pack(stored, ROWS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
              PER_BYTE: tl.constexpr):  # fmt: skip
        """A [ROWS, BLOCK] tile of stored codes (``code - qmin``, int32) packed PER_BYTE to a
        byte, low bits first: [ROWS, BLOCK // PER_BYTE] int32 (a register reshape of the
        contiguous tile, so the loads stay contiguous)."""
        if PER_BYTE == 2:
            e0, e1 = tl.split(tl.reshape(stored, [ROWS, BLOCK // 2, 2]))
            return e0 | (e1 << BITS)
        else:  # 4: element j of a byte at [..., j // 2, j % 2]
            a, b = tl.split(tl.reshape(stored, [ROWS, BLOCK // 4, 2, 2]))
            e0, e2 = tl.split(a)
            e1, e3 = tl.split(b)
            return e0 | (e1 << BITS) | (e2 << (2 * BITS)) | (e3 << (3 * BITS))

    @triton.jit
    def _unpack(byte, ROWS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                PER_BYTE: tl.constexpr):  # fmt: skip
        """The inverse of _pack: [ROWS, BLOCK // PER_BYTE] int32 bytes to the [ROWS, BLOCK]
        stored codes in element order."""
        m = (1 << BITS) - 1
        if PER_BYTE == 2:
            q = tl.join(byte & m, (byte >> BITS) & m)
        else:
            q = tl.join(
                tl.join(byte & m, (byte >> (2 * BITS)) & m),
                tl.join((byte >> BITS) & m, (byte >> (3 * BITS)) & m),
            )
        return tl.reshape(q, [ROWS, BLOCK])

    @triton.jit
    def _code_bytes(base, row_ok, start, group_size, n, PER_BYTE: tl.constexpr,
                    BLOCK_B: tl.constexpr):  # fmt: skip
        """Offsets and masks of the bytes that hold elements ``start`` to
        ``start + BLOCK_B * PER_BYTE`` of each row's group (a group begins at element
        ``base``, a multiple of PER_BYTE), [ROWS, BLOCK_B]: ``bmask`` the whole bytes, below
        ``n // PER_BYTE``, ``tail`` the last byte where ``n % PER_BYTE`` leaves it part-filled.
        Apart, each mask is constant over runs of bytes to the compiler, so the bytes move as
        vectors; ``(n + PER_BYTE - 1) // PER_BYTE`` as one bound stored them a byte at a time."""
        b = start // PER_BYTE + tl.arange(0, BLOCK_B)
        at = (base // PER_BYTE)[:, None] + b[None, :]
        in_group = row_ok[:, None] & (b[None, :] < group_size // PER_BYTE)
        return at, in_group & (at < n // PER_BYTE), in_group & (at == n // PER_BYTE)

    @triton.jit
    def _store_code_bytes(codes_ptr, packed, at, bmask, tail, n, PER_BYTE: tl.constexpr):
        """Stores packed bytes at ``_code_bytes``'s offsets and masks."""
        tl.store(codes_ptr + at, packed.to(tl.uint8), mask=bmask)
        if n % PER_BYTE != 0:
            tl.store(codes_ptr + at, packed.to(tl.uint8), mask=tail)

    @triton.jit
    def _load_code_bytes(codes_ptr, at, bmask, tail, n, PER_BYTE: tl.constexpr):
        """Packed bytes (int32, 0 where masked) at ``_code_bytes``'s offsets and masks."""
        byte = tl.load(codes_ptr + at, mask=bmask, other=0).to(tl.int32)
        if n % PER_BYTE != 0:
            byte = tl.where(tail, tl.load(codes_ptr + at, mask=tail, other=0).to(tl.int32), byte)
        return byte

    @triton.jit
    def _store_codes(codes_ptr, q, offs, mask, base, row_ok, start, group_size, n,
                     QMIN: tl.constexpr, BITS: tl.constexpr, PER_BYTE: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Stores a [ROWS, BLOCK] tile of codes, elements ``start`` onwards of each row's group:
        a byte each at 8 bits, packed below (``_pack``)."""
        if BITS == 8:
            tl.store(codes_ptr + offs, q.to(codes_ptr.dtype.element_ty), mask=mask)
        else:
            packed = _pack(tl.where(mask, (q - QMIN).to(tl.int32), 0), ROWS, BLOCK, BITS,
                           PER_BYTE)  # fmt: skip
            at, bmask, tail = _code_bytes(base, row_ok, start, group_size, n, PER_BYTE,
                                          BLOCK // PER_BYTE)  # fmt: skip
            _store_code_bytes(codes_ptr, packed, at, bmask, tail, n, PER_BYTE)

    @triton.jit
    def _lane(x_ptr, mean_ptr, rstd_ptr, base, row_ok, b, j, group_size, n, row_len,
              PER_BYTE: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
        """Element ``j`` of each byte ``b`` of each row's group: offsets, mask and fp32
        values of a [ROWS, BLOCK // PER_BYTE] tile (a load at a stride of PER_BYTE elements;
        the lanes of a byte together read the group's contiguous span)."""
        c = b * PER_BYTE + j
        offs = base[:, None] + c[None, :]
        mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
        x = _load_x(x_ptr, mean_ptr, rstd_ptr, offs, mask, base, c, group_size, row_len, NORM)
        return offs, mask, x

    @triton.jit
    def _lane_code(x, offs, mask, finite, pre, inv, seed, QMIN: tl.constexpr,
                   QMAX: tl.constexpr, STOCHASTIC: tl.constexpr, POSITIVE: tl.constexpr,
                   RN: tl.constexpr):  # fmt: skip
        """A lane's stored codes (``code - qmin``, int32; 0 where masked)."""
        q = _codes(x, finite, pre, inv, offs, seed, QMIN, QMAX, STOCHASTIC, POSITIVE, RN)
        return tl.where(mask, (q - QMIN).to(tl.int32), 0)

    @triton.jit
    def _quantize_lanes(
        x_ptr, codes_ptr, scales_ptr, mean_ptr, rstd_ptr, n, rows, base, row_ok, group_size,
        row_len, seed, QMIN: tl.constexpr, QMAX: tl.constexpr, BITS: tl.constexpr,
        PER_BYTE: tl.constexpr, STOCHASTIC: tl.constexpr, NORM: tl.constexpr,
        POSITIVE: tl.constexpr, RN: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Packed codes of groups of at most BLOCK elements, the tile loaded as PER_BYTE lanes
        (element j of every byte at once): each byte is OR-ed together from its lanes in
        registers, with no reshape of the tile (``_pack``'s split moves values between
        threads). The same codes and scales as the contiguous path, bit for bit."""
        b = tl.arange(0, BLOCK // PER_BYTE)
        o0, m0, x0 = _lane(x_ptr, mean_ptr, rstd_ptr, base, row_ok, b, 0, group_size, n,
                           row_len, PER_BYTE, NORM)  # fmt: skip
        o1, m1, x1 = _lane(x_ptr, mean_ptr, rstd_ptr, base, row_ok, b, 1, group_size, n,
                           row_len, PER_BYTE, NORM)  # fmt: skip
        amax = tl.maximum(_absmax_bits(x0), _absmax_bits(x1))
        if PER_BYTE == 4:
            o2, m2, x2 = _lane(x_ptr, mean_ptr, rstd_ptr, base, row_ok, b, 2, group_size, n,
                               row_len, PER_BYTE, NORM)  # fmt: skip
            o3, m3, x3 = _lane(x_ptr, mean_ptr, rstd_ptr, base, row_ok, b, 3, group_size, n,
                               row_len, PER_BYTE, NORM)  # fmt: skip
            amax = tl.maximum(amax, tl.maximum(_absmax_bits(x2), _absmax_bits(x3)))
        scale = _scale_of(amax, QMAX)
        tl.store(scales_ptr + rows, scale, mask=row_ok)
        finite, pre, inv = _inverse(scale)
        packed = _lane_code(x0, o0, m0, finite, pre, inv, seed, QMIN, QMAX, STOCHASTIC,
                            POSITIVE, RN)  # fmt: skip
        packed |= _lane_code(x1, o1, m1, finite, pre, inv, seed, QMIN, QMAX, STOCHASTIC,
                             POSITIVE, RN) << BITS  # fmt: skip
        if PER_BYTE == 4:
            packed |= _lane_code(x2, o2, m2, finite, pre, inv, seed, QMIN, QMAX, STOCHASTIC,
                                 POSITIVE, RN) << (2 * BITS)  # fmt: skip
            packed |= _lane_code(x3, o3, m3, finite, pre, inv, seed, QMIN, QMAX, STOCHASTIC,
                                 POSITIVE, RN) << (3 * BITS)  # fmt: skip
        at, bmask, tail = _code_bytes(base, row_ok, 0, group_size, n, PER_BYTE,
                                      BLOCK // PER_BYTE)  # fmt: skip
        _store_code_bytes(codes_ptr, packed, at, bmask, tail, n, PER_BYTE)

    @triton.jit
    def _quantize_bytes(
        x_ptr, codes_ptr, scales_ptr, mean_ptr, rstd_ptr, n, rows, base, row_ok, group_size,
        row_len, seed, QMIN: tl.constexpr, QMAX: tl.constexpr, BITS: tl.constexpr,
        PER_BYTE: tl.constexpr, STOCHASTIC: tl.constexpr, NORM: tl.constexpr,
        POSITIVE: tl.constexpr, RN: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Packed codes of groups of at most BLOCK elements, the tile loaded as
        [ROWS, BLOCK // PER_BYTE, PER_BYTE]: a byte's elements lie along the last axis, in one
        thread (the load's contiguous axis), so each byte is a sum of its shifted codes in
        registers, with neither a reshape of the tile (``_pack``'s split moves values between
        threads) nor strided loads (``_quantize_lanes``). The same codes and scales as the
        contiguous path, bit for bit."""
        j = tl.arange(0, PER_BYTE)
        c = tl.arange(0, BLOCK // PER_BYTE)[:, None] * PER_BYTE + j[None, :]  # [B, PER_BYTE]
        offs = base[:, None, None] + c[None, :]
        mask = row_ok[:, None, None] & (c[None, :] < group_size) & (offs < n)
        # base[:, None] + c[None, :] in _load_x's row_col is this [ROWS, B, PER_BYTE] tile
        x = _load_x(x_ptr, mean_ptr, rstd_ptr, offs, mask, base[:, None], c, group_size,
                    row_len, NORM)  # fmt: skip
        amax = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), axis=1)
        scale = _scale_of(amax, QMAX)
        tl.store(scales_ptr + rows, scale, mask=row_ok)
        finite, pre, inv = _inverse(scale)
        q = _codes(x, finite[:, None], pre[:, None], inv[:, None], offs, seed, QMIN, QMAX,
                   STOCHASTIC, POSITIVE, RN)  # fmt: skip
        stored = tl.where(mask, (q - QMIN).to(tl.int32), 0)
        packed = tl.sum(stored << (j * BITS)[None, None, :], axis=2)  # disjoint bits: an OR
        at, bmask, tail = _code_bytes(base, row_ok, 0, group_size, n, PER_BYTE,
                                      BLOCK // PER_BYTE)  # fmt: skip
        _store_code_bytes(codes_ptr, packed, at, bmask, tail, n, PER_BYTE)

    @triton.jit
    def _quantize_kernel(
        x_ptr,  # (n,) fp32/fp16/bf16, contiguous
        codes_ptr,  # (n,) int8/uint8 at 8 bits; (ceil(n / PER_BYTE),) uint8 below
        scales_ptr,  # (n_groups,) fp32
        mean_ptr,  # (n // row_len,) fp32 with NORM (else any pointer, unread)
        rstd_ptr,  # (n // row_len,) fp32 with NORM
        n,
        n_groups,
        group_size,
        row_len,  # elements per row of mean/rstd (NORM)
        seed,
        QMIN: tl.constexpr,
        QMAX: tl.constexpr,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,  # 8 // BITS
        STOCHASTIC: tl.constexpr,
        NORM: tl.constexpr,  # quantize (x - mean[row]) * rstd[row] in fp32
        POSITIVE: tl.constexpr,  # code 0 exactly where x <= 0 (see _codes)
        ONE_PASS: tl.constexpr,  # group_size <= BLOCK: one load per element
        RN: tl.constexpr,  # compiled: explicit round-to-nearest multiply (see _codes)
        # packed codes, ONE_PASS: 0 a reshape of the tile (_pack), 1 the tile as lanes
        # (_quantize_lanes), 2 the tile as bytes (_quantize_bytes); PACKED_LAYOUTS's order
        PACKING: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Each program quantizes ROWS groups.
        _quantize_program(
            tl.program_id(0), x_ptr, codes_ptr, scales_ptr, mean_ptr, rstd_ptr, n, n_groups,
            group_size, row_len, seed, QMIN, QMAX, BITS, PER_BYTE, STOCHASTIC, NORM, POSITIVE,
            ONE_PASS, RN, PACKING, ROWS, BLOCK,
        )  # fmt: skip

    @triton.jit
    def _quantize_program(
        pid, x_ptr, codes_ptr, scales_ptr, mean_ptr, rstd_ptr, n, n_groups, group_size,
        row_len, seed, QMIN: tl.constexpr, QMAX: tl.constexpr, BITS: tl.constexpr,
        PER_BYTE: tl.constexpr, STOCHASTIC: tl.constexpr, NORM: tl.constexpr,
        POSITIVE: tl.constexpr, ONE_PASS: tl.constexpr, RN: tl.constexpr,
        PACKING: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program ``pid`` of ``_quantize_kernel``: groups ``pid * ROWS`` onwards."""
        rows = pid * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_groups
        base = rows.to(tl.int64) * group_size
        if ONE_PASS and PACKING == 1 and BITS < 8:
            _quantize_lanes(
                x_ptr, codes_ptr, scales_ptr, mean_ptr, rstd_ptr, n, rows, base, row_ok,
                group_size, row_len, seed, QMIN, QMAX, BITS, PER_BYTE, STOCHASTIC, NORM,
                POSITIVE, RN, ROWS, BLOCK,
            )  # fmt: skip
        elif ONE_PASS and PACKING == 2 and BITS < 8:
            _quantize_bytes(
                x_ptr, codes_ptr, scales_ptr, mean_ptr, rstd_ptr, n, rows, base, row_ok,
                group_size, row_len, seed, QMIN, QMAX, BITS, PER_BYTE, STOCHASTIC, NORM,
                POSITIVE, RN, BLOCK,
            )  # fmt: skip
        elif ONE_PASS:
            cols = tl.arange(0, BLOCK)
            offs = base[:, None] + cols[None, :]
            mask = row_ok[:, None] & (cols[None, :] < group_size) & (offs < n)
            x = _load_x(x_ptr, mean_ptr, rstd_ptr, offs, mask, base, cols, group_size,
                        row_len, NORM)  # fmt: skip
            scale = _scale_of(_absmax_bits(x), QMAX)
            tl.store(scales_ptr + rows, scale, mask=row_ok)
            finite, pre, inv = _inverse(scale)
            q = _codes(x, finite, pre, inv, offs, seed, QMIN, QMAX, STOCHASTIC, POSITIVE, RN)
            _store_codes(codes_ptr, q, offs, mask, base, row_ok, 0, group_size, n,
                         QMIN, BITS, PER_BYTE, ROWS, BLOCK)  # fmt: skip
        else:
            # one pass for the scales, one for the codes
            scale = _group_scales(
                x_ptr, mean_ptr, rstd_ptr, n, base, row_ok, group_size, row_len,
                QMAX, NORM, ROWS, BLOCK,
            )  # fmt: skip
            tl.store(scales_ptr + rows, scale, mask=row_ok)
            finite, pre, inv = _inverse(scale)
            cols = tl.arange(0, BLOCK)
            for start in range(0, group_size, BLOCK):
                c = start + cols
                offs = base[:, None] + c[None, :]
                mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
                x = _load_x(x_ptr, mean_ptr, rstd_ptr, offs, mask, base, c, group_size,
                            row_len, NORM)  # fmt: skip
                q = _codes(x, finite, pre, inv, offs, seed, QMIN, QMAX, STOCHASTIC, POSITIVE, RN)
                _store_codes(codes_ptr, q, offs, mask, base, row_ok, start, group_size, n,
                             QMIN, BITS, PER_BYTE, ROWS, BLOCK)  # fmt: skip

    @triton.jit
    def _quantize3_kernel(
        x0_ptr, x1_ptr, x2_ptr, c0_ptr, c1_ptr, c2_ptr, s0_ptr, s1_ptr, s2_ptr, n0, n1, n2,
        g0, g1, g2, p0, p1, group_size, QMIN: tl.constexpr, QMAX: tl.constexpr,
        BITS: tl.constexpr, PER_BYTE: tl.constexpr, ONE_PASS: tl.constexpr, RN: tl.constexpr,
        PACKING: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Three tensors quantized alike in one launch (attention's q, k and v): the first
        ``p0`` programs take x0's ``g0`` groups, the next ``p1`` x1's, the rest x2's, each
        program as ``_quantize_kernel``'s (nearest rounding, no normalization). The counts
        come from the host: ``n + group_size - 1`` in the kernel's int32 wrapped for a tensor
        near 2**31 elements."""
        pid = tl.program_id(0)
        if pid < p0:
            _quantize_program(
                pid, x0_ptr, c0_ptr, s0_ptr, x0_ptr, x0_ptr, n0, g0, group_size, 1, 0, QMIN,
                QMAX, BITS, PER_BYTE, False, False, False, ONE_PASS, RN, PACKING, ROWS, BLOCK,
            )  # fmt: skip
        elif pid < p0 + p1:
            _quantize_program(
                pid - p0, x1_ptr, c1_ptr, s1_ptr, x1_ptr, x1_ptr, n1, g1, group_size, 1, 0,
                QMIN, QMAX, BITS, PER_BYTE, False, False, False, ONE_PASS, RN, PACKING, ROWS,
                BLOCK,
            )  # fmt: skip
        else:
            _quantize_program(
                pid - p0 - p1, x2_ptr, c2_ptr, s2_ptr, x2_ptr, x2_ptr, n2, g2, group_size, 1,
                0, QMIN, QMAX, BITS, PER_BYTE, False, False, False, ONE_PASS, RN, PACKING, ROWS,
                BLOCK,
            )  # fmt: skip

    @triton.jit
    def _bf16_bits_rtne(v):
        # fp32 -> bf16 bit pattern, round to nearest even, NaN kept NaN. Done in integers because
        # Triton's interpreter truncates fp32 -> bf16 casts instead of rounding them.
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(v != v, 0x7FC0, rounded).to(tl.int16)

    @triton.jit
    def round_to(v, MID: tl.constexpr):
        """fp32 ``v`` rounded to nearest even in fp16 (MID 1) or bf16 (MID 2), back in fp32;
        MID 0: ``v`` itself."""
        if MID == 1:
            return v.to(tl.float16).to(tl.float32)
        elif MID == 2:
            hi = _bf16_bits_rtne(v).to(tl.int32) & 0xFFFF
            return (hi << 16).to(tl.float32, bitcast=True)
        else:
            return v

    @triton.jit
    def store_as(out_ptr, offs, v, mask, OUT_BF16: tl.constexpr):
        """Stores fp32 ``v`` in the output's dtype (bf16 as int16 bits when OUT_BF16)."""
        if OUT_BF16:
            tl.store(out_ptr + offs, _bf16_bits_rtne(v), mask=mask)
        else:
            tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def dequantize_tile(codes_ptr, offs, mask, s, QMIN: tl.constexpr, BITS: tl.constexpr,
                        PER_BYTE: tl.constexpr):  # fmt: skip
        """``code * scale`` in fp32 for a tile of element offsets (``s`` broadcasts)."""
        if BITS == 8:
            q = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32)
        else:
            byte = tl.load(codes_ptr + offs // PER_BYTE, mask=mask, other=0).to(tl.int32)
            shift = (offs % PER_BYTE).to(tl.int32) * BITS
            q = (((byte >> shift) & ((1 << BITS) - 1)) + QMIN).to(tl.float32)
        return q * s

    @triton.jit
    def rows_tile(codes_ptr, scales_ptr, grad_ptr, base, row_ok, start, row_len,
                  GROUP: tl.constexpr, QMIN: tl.constexpr, BITS: tl.constexpr,
                  PER_BYTE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Columns ``start + [0, BLOCK)`` of rows of ``row_len`` elements starting at ``base``
        (int64 per row; ``row_ok`` the rows in range): offsets, mask, the value rebuilt from
        its codes in fp32 (a row may span groups: each element's scale, ``GROUP`` a constant so
        that the division is a shift) and the gradient at the same offsets in fp32. The tile
        of the backwards that work on whole rows (softmax's, BatchNorm's)."""
        c = start + tl.arange(0, BLOCK)
        offs = base[:, None] + c[None, :]
        mask = row_ok[:, None] & (c < row_len)[None, :]
        s = tl.load(scales_ptr + offs // GROUP, mask=mask, other=0.0)
        v = dequantize_tile(codes_ptr, offs, mask, s, QMIN, BITS, PER_BYTE)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return offs, mask, v, g

    @triton.jit
    def _epilogue(v, offs, mask, base, c, group_size, p1_ptr, p2_ptr, row_len,
                  EPI: tl.constexpr, HAS_P1: tl.constexpr, HAS_P2: tl.constexpr,
                  MID: tl.constexpr, RN: tl.constexpr):  # fmt: skip
        """The dequantize kernel's elementwise step on the fp32 products ``v`` of a tile of
        element offsets ``base[:, None] + c[None, :]`` (``dequantize``'s ``epilogue``; EPI 0:
        ``v`` itself)."""
        if EPI == 1:  # v * weight[col] + bias[col], each rounded (two fp32 ops, as torch)
            _, col = row_col(base, c, row_len, group_size)
            if HAS_P1:
                w = tl.load(p1_ptr + col, mask=mask, other=0.0).to(tl.float32)
                v = mul_rn(v, w) if RN else v * w
            if HAS_P2:
                b = tl.load(p2_ptr + col, mask=mask, other=0.0).to(tl.float32)
                v = add_rn(v, b) if RN else v + b
        elif EPI == 2:  # v / rstd[row] + mean[row]; the mean where rstd is 0
            r, _ = row_col(base, c, row_len, group_size)
            m = tl.load(p1_ptr + r, mask=mask, other=0.0).to(tl.float32)
            rs = tl.load(p2_ptr + r, mask=mask, other=1.0).to(tl.float32)
            v = tl.where(rs == 0.0, m, tl.math.div_rn(v, rs) + m)
        elif EPI == 3 or EPI == 4:
            v = gelu_fp32(round_to(v, MID), EPI == 4)
        elif EPI == 5 or EPI == 6:
            dy = tl.load(p1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = gelu_backward_fp32(round_to(v, MID), dy, EPI == 6)
        elif EPI == 7:
            v = silu_fp32(round_to(v, MID))
        elif EPI == 8:
            dy = tl.load(p1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = silu_backward_fp32(round_to(v, MID), dy)
        return v

    @triton.jit
    def _dequantize_kernel(
        codes_ptr,  # (n,) int8/uint8 at 8 bits; (ceil(n / PER_BYTE),) uint8 below
        scales_ptr,  # (n_groups,) fp32
        out_ptr,  # (n,) fp32/fp16, or int16 holding bf16 bits when OUT_BF16
        p1_ptr,  # EPI 1: weight (row_len,); EPI 2: mean (n // row_len,); EPI 5, 6: grad (n,)
        p2_ptr,  # EPI 1: bias (row_len,); EPI 2: rstd (n // row_len,)
        n,
        n_groups,
        group_size,
        row_len,
        QMIN: tl.constexpr,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,  # 8 // BITS, a power of two: // and % are shifts and masks
        OUT_BF16: tl.constexpr,
        # 0 none, 1 affine, 2 unnormalize, 3/4 GELU (erf/tanh), 5/6 GELU backward (erf/tanh),
        # 7 SiLU, 8 SiLU backward
        EPI: tl.constexpr,
        HAS_P1: tl.constexpr,
        HAS_P2: tl.constexpr,
        MID: tl.constexpr,  # GELU (backward): its input dtype, 0 fp32, 1 fp16, 2 bf16
        RN: tl.constexpr,  # compiled: explicit round-to-nearest ops, which are never fused
        LANES: tl.constexpr,  # packed codes: written as lanes (element j of every byte)
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Tiled like the quantize kernel: one scale load per group, no per-element division.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_groups
        base = rows.to(tl.int64) * group_size
        s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if BITS < 8 and LANES:
            # each byte loaded once; lane j writes element j of every byte, so no reshape
            # of the tile (``_unpack``'s join moves values between threads)
            b = tl.arange(0, BLOCK // PER_BYTE)
            for start in range(0, group_size, BLOCK):
                at, bmask, tail = _code_bytes(base, row_ok, start, group_size, n, PER_BYTE,
                                              BLOCK // PER_BYTE)  # fmt: skip
                byte = _load_code_bytes(codes_ptr, at, bmask, tail, n, PER_BYTE)
                for j in tl.static_range(PER_BYTE):
                    c = start + b * PER_BYTE + j
                    offs = base[:, None] + c[None, :]
                    mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
                    q = ((byte >> (j * BITS)) & ((1 << BITS) - 1)) + QMIN
                    v = _epilogue(q.to(tl.float32) * s, offs, mask, base, c, group_size,
                                  p1_ptr, p2_ptr, row_len, EPI, HAS_P1, HAS_P2, MID,
                                  RN)  # fmt: skip
                    store_as(out_ptr, offs, v, mask, OUT_BF16)
        else:
            cols = tl.arange(0, BLOCK)
            for start in range(0, group_size, BLOCK):
                c = start + cols
                offs = base[:, None] + c[None, :]
                mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
                if BITS == 8:
                    v = dequantize_tile(codes_ptr, offs, mask, s, QMIN, BITS, PER_BYTE)
                else:  # each byte loaded once, unpacked in registers
                    at, bmask, tail = _code_bytes(base, row_ok, start, group_size, n,
                                                  PER_BYTE, BLOCK // PER_BYTE)  # fmt: skip
                    byte = _load_code_bytes(codes_ptr, at, bmask, tail, n, PER_BYTE)
                    q = _unpack(byte, ROWS, BLOCK, BITS, PER_BYTE) + QMIN
                    v = q.to(tl.float32) * s
                v = _epilogue(v, offs, mask, base, c, group_size, p1_ptr, p2_ptr, row_len,
                              EPI, HAS_P1, HAS_P2, MID, RN)  # fmt: skip
                store_as(out_ptr, offs, v, mask, OUT_BF16)


# How the kernels write and read packed (4- and 2-bit) codes: "tile", a reshape of the
# contiguous tile (``_pack``, ``_unpack``); "lanes", element j of every byte at once
# (``_quantize_lanes``; the dequantize kernel's LANES branch); "bytes", quantize's tile loaded
# as [ROWS, bytes, elements of a byte] (``_quantize_bytes``; dequantize as "tile"). All give the
# same bytes and values; the choice is speed (docs/RESULTS.md). Read when a setting is first
# planned (the plans are cached: set it before the first quantize, or clear _quantize_plan's
# and _dequantize_plan's caches).
PACKED_LAYOUTS = ("tile", "lanes", "bytes")
PACKED_LAYOUT = "tile"


@functools.lru_cache(maxsize=64)
def _launch_shape(group_size: int, bits: int = 8) -> tuple[int, int]:
    """(ROWS, BLOCK): BLOCK covers a group up to 1024 elements, ROWS fills ~4096 elements per
    program at 8 bits and ~1024 below (packed codes ran at about a fifth of the bandwidth
    with 4096 on the H200; benchmarks/results/quant_tuning_shapes_gpu.md)."""
    block = min(triton.next_power_of_2(group_size), 1024)
    rows = max(1, (4096 if bits == 8 else 1024) // block)
    return rows, block


def _code_dtype(signed: bool, bits: int) -> torch.dtype:
    return torch.int8 if (signed and bits == 8) else torch.uint8


EPILOGUES = ("affine", "unnormalize", "gelu", "gelu_backward", "silu", "silu_backward")
_GELU_MID = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _check_normalize(normalize, n: int) -> int:
    """The row length of ``normalize = (mean, rstd)`` for ``n`` elements."""
    mean, rstd = normalize
    for name, t in (("mean", mean), ("rstd", rstd)):
        if not isinstance(t, torch.Tensor) or t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"normalize {name} must be a float32, float16 or bfloat16 tensor")
    rows = mean.numel()
    if n == 0 and rows == 0 == rstd.numel():
        return 1
    if rows == 0 or rstd.numel() != rows or n % rows:
        raise ValueError(
            f"normalize needs one mean and one rstd per row of {n} elements, got "
            f"{mean.numel()} and {rstd.numel()}"
        )
    return n // rows


def _epilogue_args(epilogue, n: int, dtype: torch.dtype) -> tuple:
    """(EPI, p1, p2, row_len, HAS_P1, HAS_P2, MID) for the dequantize kernel, checked (``n``
    elements rebuilt in ``dtype``)."""
    kind = epilogue[0]
    if kind == "affine":
        _, w, b = epilogue
        sizes = {t.numel() for t in (w, b) if t is not None}
        row_len = sizes.pop() if len(sizes) == 1 else 0
        if row_len == 0 or n % row_len:
            raise ValueError(f"dequantize: affine weight/bias must split {n} elements in rows")
        return 1, w, b, row_len, w is not None, b is not None, 0
    if kind == "unnormalize":
        _, mean, rstd = epilogue
        row_len = _check_normalize((mean, rstd), n)
        return 2, mean, rstd, row_len, True, True, 0
    if kind == "gelu":
        _, approximate, mid = epilogue
        if approximate not in ("none", "tanh") or mid not in _GELU_MID:
            raise ValueError(f"dequantize: bad gelu epilogue {epilogue!r}")
        return 3 + (approximate == "tanh"), None, None, 1, False, False, _GELU_MID[mid]
    if kind == "gelu_backward":
        _, approximate, grad = epilogue
        if approximate not in ("none", "tanh"):
            raise ValueError(f"dequantize: gelu_backward approximate must be 'none' or 'tanh', "
                             f"got {approximate!r}")  # fmt: skip
        if not isinstance(grad, torch.Tensor) or grad.numel() != n:
            raise ValueError(f"dequantize: gelu_backward needs a gradient of {n} elements")
        return 5 + (approximate == "tanh"), grad, None, 1, True, False, _GELU_MID[dtype]
    if kind == "silu":
        if len(epilogue) != 2 or epilogue[1] not in _GELU_MID:
            raise ValueError(f"dequantize: bad silu epilogue {epilogue!r}")
        return 7, None, None, 1, False, False, _GELU_MID[epilogue[1]]
    if kind == "silu_backward":
        grad = epilogue[1] if len(epilogue) == 2 else None
        if not isinstance(grad, torch.Tensor) or grad.numel() != n:
            raise ValueError(f"dequantize: silu_backward needs a gradient of {n} elements")
        return 8, grad, None, 1, True, False, _GELU_MID[dtype]
    raise ValueError(f"dequantize: epilogue must be one of {EPILOGUES}, got {kind!r}")


if HAS_TRITON:
    _QUANTIZE = Launcher(_quantize_kernel)
    _DEQUANTIZE = Launcher(_dequantize_kernel)
    # 4 and 2 bits: fewer warps for the smaller programs (the fastest measured on the H200)
    _QUANTIZE_PACKED = Launcher(_quantize_kernel, num_warps=1)
    _DEQUANTIZE_PACKED = Launcher(_dequantize_kernel, num_warps=2)
    _QUANTIZE3 = Launcher(_quantize3_kernel)
    _QUANTIZE3_PACKED = Launcher(_quantize3_kernel, num_warps=1)


@functools.lru_cache(maxsize=256, typed=True)
def _quantize_plan(dtype, group_size, bits, positive, signed, normalized, stochastic) -> tuple:
    """``(code dtype, launcher, ROWS, the constexpr arguments)`` of a quantize setting, its
    arguments checked (raises as ``_check_quantize_args``)."""
    _check_quantize_setting(dtype, group_size, bits, positive, signed, normalized)
    if not HAS_TRITON:
        return _code_dtype(signed, bits), None, 1, ()
    rows, block = _launch_shape(group_size, bits)
    qmin, qmax = qrange(signed, bits)
    tail = (qmin, qmax, bits, per_byte(bits), stochastic, normalized, positive,
            group_size <= block, not INTERPRETING, PACKED_LAYOUTS.index(PACKED_LAYOUT), rows,
            block)  # fmt: skip
    launcher = _QUANTIZE if bits == 8 else _QUANTIZE_PACKED
    return _code_dtype(signed, bits), launcher, rows, tail


@functools.lru_cache(maxsize=256, typed=True)
def _dequantize_plan(codes_dtype, scales_dtype, dtype, group_size, bits, signed) -> tuple:
    """``(launcher, ROWS, QMIN, the constexpr arguments after EPI..MID)`` of a dequantize
    setting, its arguments checked (raises as ``_check_dequantize_args``, but the sizes)."""
    _check_dequantize_setting(codes_dtype, scales_dtype, dtype, group_size, bits)
    if not HAS_TRITON:
        return None, 1, 0, ()
    rows, block = _launch_shape(group_size, bits)
    launcher = _DEQUANTIZE if bits == 8 else _DEQUANTIZE_PACKED
    lanes = PACKED_LAYOUT == "lanes"
    return launcher, rows, qrange(signed, bits)[0], (not INTERPRETING, lanes, rows, block)


def quantize(
    x: torch.Tensor,
    group_size: int = 128,
    signed: bool = True,
    stochastic: bool = False,
    use_triton: bool | None = None,
    bits: int = 8,
    normalize: tuple[torch.Tensor, torch.Tensor] | None = None,
    positive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` in groups of ``group_size`` flattened elements.

    Args:
        x: fp32, fp16 or bf16 tensor of any shape and layout.
        group_size: elements per scale (a multiple of 2 at 4 bits, of 4 at 2 bits).
        signed: symmetric signed codes if True, unsigned codes otherwise (negative inputs
            clamp to 0 in unsigned mode).
        stochastic: round stochastically (unbiased) instead of to nearest even.
        use_triton: force the path; by default Triton for CUDA tensors, the reference otherwise.
        bits: 8, 4 or 2.
        normalize: ``(mean, rstd)``, fp32, one per row of ``x`` (rows of
            ``numel // mean.numel()`` elements): quantize ``(x.float() - mean) * rstd``, a
            LayerNorm's normalized input, without writing it.
        positive: unsigned 8- or 4-bit codes only: code 0 exactly where ``x <= 0``, at
            least 1 elsewhere (a positive value that rounds to 0, NaN): "code > 0" is then the
            condition of ReLU's backward (``ops/relu.py``).

    Returns:
        ``(codes, scales)``: flat codes (``x.numel()`` bytes at 8 bits, packed below), and
        fp32 scales, one per group.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: x must be a torch.Tensor, got {type(x).__name__}")
    # the checks and launch constants of this setting, once (host time on every call)
    code_dtype, launcher, rows, tail = _quantize_plan(
        x.dtype, group_size, bits, positive, signed, normalize is not None, stochastic
    )
    row_len = 1 if normalize is None else _check_normalize(normalize, x.numel())
    if stochastic and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "quantize: stochastic rounding takes a fresh seed from the host on every call; "
            "captured in a CUDA graph (torch.compile mode='reduce-overhead', torch.cuda.graph) "
            "every replay would reuse one seed. Use rounding='nearest' (the 8-bit default) "
            "with CUDA graphs"
        )
    if use_triton is None:
        use_triton = use_triton_for(x)
    if not use_triton:
        return quantize_ref(x, group_size, signed, stochastic, bits, normalize, positive)
    if not x.is_contiguous():  # the kernel reads a dense row-major block (no view needed)
        x = x.contiguous()
    n = x.numel()
    ng = n_groups_of(n, group_size)
    codes = torch.empty(n_code_bytes(n, bits), dtype=code_dtype, device=x.device)
    scales = torch.empty(ng, dtype=torch.float32, device=x.device)
    if n == 0:
        return codes, scales
    mean, rstd = (x, x) if normalize is None else (t.contiguous() for t in normalize)
    # The Philox seed: reproducible under torch.manual_seed, no draw from torch's generators.
    seed = next_rounding_seed() if stochastic else 0
    launcher(
        ((ng + rows - 1) // rows,),  # not triton.cdiv: a constexpr function, ~8 us a call
        x, codes, scales, mean, rstd, n, ng, group_size, row_len, seed, *tail,
    )  # fmt: skip
    return codes, scales


def quantize3(
    xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    group_size: int = 128,
    signed: bool = True,
    use_triton: bool | None = None,
    bits: int = 8,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Quantizes three tensors alike (attention's q, k and v), each as ``quantize(x,
    group_size, signed, bits=bits)`` would, bit for bit, in one kernel launch where Triton
    runs: ``[(codes, scales)] * 3``. Nearest rounding, no normalization. The three share a
    dtype and a device; their sizes may differ (grouped-query k and v)."""
    if len(xs) != 3 or not all(isinstance(x, torch.Tensor) for x in xs):
        raise TypeError("quantize3: xs must be three torch.Tensors")
    x0 = xs[0]
    if any(x.dtype != x0.dtype or x.device != x0.device for x in xs):
        raise ValueError(
            f"quantize3: the three tensors must share a dtype and a device, got "
            f"{[(x.dtype, str(x.device)) for x in xs]}"
        )
    code_dtype, _, rows, tail = _quantize_plan(x0.dtype, group_size, bits, False, signed, False,
                                               False)  # fmt: skip
    if use_triton is None:
        use_triton = use_triton_for(x0)
    if not use_triton or any(x.numel() == 0 for x in xs):
        return [quantize(x, group_size, signed, use_triton=use_triton, bits=bits) for x in xs]
    xs = [x if x.is_contiguous() else x.contiguous() for x in xs]
    ns = [x.numel() for x in xs]
    ngs = [n_groups_of(n, group_size) for n in ns]
    codes = [torch.empty(n_code_bytes(n, bits), dtype=code_dtype, device=x0.device) for n in ns]
    scales = [torch.empty(ng, dtype=torch.float32, device=x0.device) for ng in ngs]
    programs = [(ng + rows - 1) // rows for ng in ngs]
    qmin, qmax, _, per, _, _, _, one_pass, rn, packing = tail[:10]
    launcher = _QUANTIZE3 if bits == 8 else _QUANTIZE3_PACKED
    launcher(
        (sum(programs),), *xs, *codes, *scales, *ns, *ngs, *programs[:2], group_size, qmin, qmax,
        bits, per, one_pass, rn, packing, rows, tail[-1],
    )  # fmt: skip
    return list(zip(codes, scales, strict=True))


def quantize_ref(
    x: torch.Tensor,
    group_size: int = 128,
    signed: bool = True,
    stochastic: bool = False,
    bits: int = 8,
    normalize: tuple[torch.Tensor, torch.Tensor] | None = None,
    positive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`quantize`, same arguments and results."""
    _check_quantize_args(x, group_size, bits, positive, signed, normalize)
    xf = x.reshape(-1).float()  # not x.contiguous(): that returns x itself (alias_check)
    if normalize is not None:
        row_len = _check_normalize(normalize, xf.numel())
        mean, rstd = (t.reshape(-1, 1).float() for t in normalize)
        xf = ((xf.view(-1, row_len) - mean) * rstd).view(-1)
    n = xf.numel()
    ng = n_groups_of(n, group_size)
    code_dtype = _code_dtype(signed, bits)
    if n == 0:
        return (
            torch.empty(0, dtype=code_dtype, device=x.device),
            torch.empty(0, dtype=torch.float32, device=x.device),
        )
    qmin, qmax = qrange(signed, bits)
    pad = ng * group_size - n
    # 2-D (groups, group_size) throughout: under torch.compile Inductor then makes one kernel of
    # the group reduction and the codes
    xp = (torch.nn.functional.pad(xf, (0, pad)) if pad else xf).view(ng, group_size)
    # One integer max finds each group's absmax and its NaNs: |x|'s bits order as the values
    # do, and every NaN's lie above +inf's (0x7F800000), so a group holding a NaN gets a NaN
    # bit pattern, a NaN absmax and a NaN scale; the kernel does the same.
    amax = torch.bitwise_and(xp.view(torch.int32), 0x7FFFFFFF).amax(dim=1).view(torch.float32)
    # Tensor-by-tensor division: CUDA turns division by a Python scalar into a reciprocal multiply.
    scale = amax / torch.full_like(amax, qmax)
    # one ulp down where qmax * scale would overflow for a finite absmax (an absmax within
    # half a step of float32's maximum), so that no finite value dequantizes to inf
    over = (scale * qmax).isinf() & amax.isfinite()
    scale = torch.where(over, (scale.view(torch.int32) - 1).view(torch.float32), scale)
    finite = (scale > 0) & (scale < float("inf"))
    # x * (1 / scale), the kernel's steps: the prescale keeps 1 / scale a normal float (one
    # division per group, one rounded multiply); fp32 whatever torch's default dtype is
    one = torch.ones_like(scale)
    pre = torch.where(
        scale < 2.0**-64, one * 2.0**64, torch.where(scale >= 2.0**64, one * 2.0**-64, one)
    )
    safe = torch.where(finite, scale * pre, 1.0)
    inv = one / safe
    y = (xp * pre[:, None]) * inv[:, None]
    special = torch.where(xp == float("inf"), float(qmax), 0.0)
    special = torch.where(xp == float("-inf"), float(-qmax), special)
    y = torch.where(finite[:, None], y, special)
    if stochastic:  # uniforms from a local generator: torch's own are left as they are
        gen = torch.Generator(device=y.device)
        gen.manual_seed(next_rounding_seed())
        q = torch.floor(y + torch.rand(y.shape, generator=gen, device=y.device, dtype=y.dtype))
    else:
        q = torch.round(y)
    q = q.clamp_(qmin, qmax)
    if positive:
        q = torch.where(xp <= 0, 0.0, q.clamp(min=1))
    if bits == 8:
        codes = q.to(code_dtype).view(-1)
        return (codes[:n] if pad else codes), scale
    q = q.view(-1)[:n]
    k = per_byte(bits)
    stored = torch.nn.functional.pad((q - qmin).to(torch.int32), (0, (-n) % k)).view(-1, k)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=x.device)
    return (stored << shifts).sum(dim=1).to(torch.uint8), scale


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    use_triton: bool | None = None,
    bits: int = 8,
    signed: bool | None = None,
    numel: int | None = None,
    epilogue: tuple | None = None,
) -> torch.Tensor:
    """Rebuilds the flat tensor ``code * scale`` in ``dtype`` (fp32 product, then one cast).

    Args:
        codes: flat codes from :func:`quantize`.
        scales: fp32 scales, one per group.
        group_size: the group size used to quantize.
        dtype: output dtype.
        use_triton: force the path; by default Triton for CUDA tensors, the reference otherwise.
        bits: the code width used to quantize.
        signed: how it was quantized; at 8 bits the codes' dtype says it (int8 or uint8).
        numel: number of elements; required below 8 bits (a byte holds several).
        epilogue: one elementwise step applied to the fp32 product ``v`` before the cast,
            in the same pass: ``("affine", weight, bias)`` gives ``v * weight + bias`` over
            rows of ``weight.numel()`` elements (either may be None; two fp32 roundings, as
            torch's separate ops); ``("unnormalize", mean, rstd)`` gives
            ``v / rstd + mean`` per row (``mean`` where ``rstd`` is 0), a LayerNorm's input
            from its normalized input; ``("gelu", approximate, mid)`` gives GELU of ``v``
            rounded to ``mid`` (the dtype the forward GELU ran in), computed in fp32;
            ``("gelu_backward", approximate, grad)`` gives GELU's input gradient
            ``grad * gelu'(v)``, ``v`` rounded to ``dtype`` (the GELU input's dtype) and
            ``grad`` (the output gradient, ``numel`` elements in row-major order) read in place;
            ``("silu", mid)`` and ``("silu_backward", grad)`` the same for SiLU.

    Returns:
        A flat, contiguous tensor with ``numel`` elements.
    """
    numel, signed = _resolve_layout(codes, bits, signed, numel)
    launcher, rows, qmin, tail = _dequantize_plan(
        codes.dtype, scales.dtype, dtype, group_size, bits, signed
    )
    ng = _check_sizes(codes, scales, group_size, bits, numel)
    if use_triton is None:
        use_triton = use_triton_for(codes)
    if not use_triton:
        return dequantize_ref(codes, scales, group_size, dtype, bits, signed, numel, epilogue)
    if not codes.is_contiguous():
        codes = codes.contiguous()
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if numel == 0:
        return out
    if epilogue is None:
        epi, p1, p2, row_len, has1, has2, mid = 0, codes, codes, 1, False, False, 0
    else:
        epi, p1, p2, row_len, has1, has2, mid = _epilogue_args(epilogue, numel, dtype)
        p1 = codes if p1 is None else p1.contiguous()
        p2 = codes if p2 is None else p2.contiguous()
    bf16 = dtype == torch.bfloat16
    launcher(
        ((ng + rows - 1) // rows,),  # not triton.cdiv: a constexpr function, ~8 us a call
        codes, scales.contiguous(),
        out.view(torch.int16) if bf16 else out, p1, p2, numel, ng, group_size, row_len,
        qmin, bits, per_byte(bits), bf16, epi, has1, has2, mid, *tail,
    )  # fmt: skip
    return out


def _resolve_layout(codes, bits, signed, numel) -> tuple[int, bool]:
    if bits == 8:
        inferred = codes.dtype == torch.int8
        if signed is not None and signed != inferred:
            raise ValueError(f"dequantize: signed={signed} but the codes are {codes.dtype}")
        return (codes.numel() if numel is None else numel), inferred
    if numel is None or signed is None:
        raise ValueError(f"dequantize: {bits}-bit codes need numel and signed")
    return numel, signed


def epilogue_ref(v: torch.Tensor, epilogue: tuple | None, dtype: torch.dtype) -> torch.Tensor:
    """The reference of a dequantize epilogue on the flat fp32 product ``v``, rebuilding a
    tensor of ``dtype`` (fp32 result; the caller casts)."""
    if epilogue is None:
        return v
    epi, p1, p2, row_len, _, _, _ = _epilogue_args(epilogue, v.numel(), dtype)
    if epi == 1:
        rows = v.view(-1, row_len)
        if p1 is not None:
            rows = rows * p1.reshape(-1).float()
        if p2 is not None:
            rows = rows + p2.reshape(-1).float()
        return rows.reshape(-1)
    if epi == 2:
        rows = v.view(-1, row_len)
        mean, rstd = p1.reshape(-1, 1).float(), p2.reshape(-1, 1).float()
        return torch.where(rstd == 0, mean, rows / rstd + mean).reshape(-1)
    if epi == 7:  # as GELU's: SiLU in fp32 of the input rounded to mid
        return torch.nn.functional.silu(v.to(epilogue[1]).float())
    if epi == 8:
        return torch.ops.aten.silu_backward(p1.reshape(-1).to(dtype), v.to(dtype)).float()
    approximate = epilogue[1]
    if epi <= 4:
        return torch.nn.functional.gelu(v.to(epilogue[2]).float(), approximate=approximate)
    grad = p1.reshape(-1).to(dtype)
    return torch.ops.aten.gelu_backward(grad, v.to(dtype), approximate=approximate).float()


def unpack_stored(codes: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Packed 4- or 2-bit codes as the values stored (``code - qmin``), int32, ``n`` of them,
    flat (element ``j`` of byte ``i`` in its bits ``j * bits`` up)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    stored = (codes.reshape(-1).to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)
    return stored.view(-1)[:n]


def dequantize_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    bits: int = 8,
    signed: bool | None = None,
    numel: int | None = None,
    epilogue: tuple | None = None,
) -> torch.Tensor:
    """PyTorch reference of :func:`dequantize`, same arguments and result."""
    n, signed = _resolve_layout(codes, bits, signed, numel)
    _check_dequantize_args(codes, scales, group_size, dtype, bits, n)
    if n == 0:
        return torch.empty(0, dtype=dtype, device=codes.device)
    codes = codes.reshape(-1)
    if bits == 8:
        q = codes.float()
    else:
        q = (unpack_stored(codes, bits, n) + qrange(signed, bits)[0]).float()
    if epilogue is None and not torch.compiler.is_compiling():
        # one fp32 temporary at a time; under torch.compile the functional form below, which
        # Inductor makes one kernel of
        out = torch.empty(n, dtype=dtype, device=codes.device)
        full = n // group_size * group_size
        if full:
            body = q[:full].view(-1, group_size) * scales[: full // group_size, None]
            out[:full] = body.view(-1).to(dtype)
        if full < n:
            out[full:] = (q[full:] * scales[-1]).to(dtype)
        return out
    v = torch.nn.functional.pad(q, (0, -n % group_size)).view(-1, group_size)
    v = (v * scales[:, None]).view(-1)[:n]
    return epilogue_ref(v, epilogue, dtype).to(dtype)
