"""A dropout mask as 1 bit per element: packing it (Triton), and dropout's backward read straight
from the packed bits (Triton), with their PyTorch references.

Packed order: element ``i`` is bit ``i % 8`` (least significant first) of byte ``i // 8``, in
row-major order, the last byte zero-padded.

``dropout_backward`` is ATen's ``native_dropout_backward`` (``grad * mask * scale``, computed in
fp32 and rounded once to the gradient's dtype, so non-finite gradients stay non-finite where
the mask is 0 too: ``inf * 0`` is NaN) with the mask unpacked in registers: one pass instead of
unpacking a byte mask first.
"""

from __future__ import annotations

import torch

from .group_quant import unpack_stored
from .launch import HAS_TRITON, Launcher
from .launch import use_triton as use_triton_for

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .group_quant import store_as

__all__ = ["pack_bits", "pack_bits_ref", "unpack_bits", "dropout_backward",
           "dropout_backward_ref", "pack_positive", "pack_positive_ref", "relu_backward",
           "relu_backward_ref", "relu_backward_codes", "relu_backward_codes_ref"]  # fmt: skip

_BLOCK = 1024  # bytes per program (8192 elements)
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """1, 2, 4, ..., 128 as uint8 on ``device``, made once per device: built from a Python
    list on each call it would be a host-to-device copy, which waits for the GPU's queue."""
    if torch.compiler.is_compiling():  # a constant of the graph (no cache: a side effect)
        return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8).to(
            device
        )
    return w


def pack_bits_ref(mask: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`pack_bits`."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8).to(torch.uint8) * _weights(mask.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape) -> torch.Tensor:
    """The bool tensor ``pack_bits`` packed, of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    bits = packed.unsqueeze(1).bitwise_and(_weights(packed.device)).ne(0)
    return bits.reshape(-1)[:n].view(shape)


def dropout_backward_ref(grad: torch.Tensor, packed: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch reference of :func:`dropout_backward`: ATen's own op on the unpacked mask."""
    mask = unpack_bits(packed, grad.shape)
    return torch.ops.aten.native_dropout_backward(grad, mask, scale)


def pack_positive_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`pack_positive`."""
    return pack_bits_ref(x.le(0).logical_not_())


def relu_backward_ref(grad: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`relu_backward`."""
    return torch.where(unpack_bits(packed, grad.shape), grad, 0)


def _nonzero(codes: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Where the unsigned 8- or 4-bit ``codes`` (``group_quant``'s order: element ``2i`` in the
    low nibble of byte ``i`` at 4 bits) are not 0: ``n`` bools, flat."""
    if bits == 8:
        return codes.reshape(-1) != 0
    return unpack_stored(codes, bits, n) != 0


def relu_backward_codes_ref(grad: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """PyTorch reference of :func:`relu_backward_codes`."""
    return torch.where(_nonzero(codes, bits, grad.numel()).view(grad.shape), grad, 0)


def relu_backward_codes(
    grad: torch.Tensor, codes: torch.Tensor, bits: int, use_triton: bool | None = None
) -> torch.Tensor:
    """``torch.where(codes != 0, grad, 0)`` for a ReLU whose output is kept as unsigned 8- or
    4-bit codes with code 0 exactly where the output is not positive
    (``group_quant.quantize(positive=True)``): ReLU's backward from its consumer's codes in one
    pass, the codes read in registers (no bool tensor in between). Elements are selected as
    raw bits, exact for every dtype; the result is contiguous, in ``grad``'s logical order,
    which must be the codes' order."""
    if bits not in (8, 4):
        raise ValueError(f"relu_backward_codes: bits must be 8 or 4, got {bits}")
    n = grad.numel()
    need = n if bits == 8 else (n + 1) // 2
    if codes.dtype != torch.uint8 or codes.numel() != need:
        raise ValueError(f"relu_backward_codes: {n} elements at {bits} bits need {need} uint8 "
                         f"code bytes, got {codes.numel()} of {codes.dtype}")  # fmt: skip
    if use_triton is None:
        use_triton = use_triton_for(grad)
    if not use_triton or not grad.is_floating_point():
        return relu_backward_codes_ref(grad, codes, bits).contiguous()
    return _select(_RELU_BACKWARD_CODES, grad, codes.contiguous(), 4 * _BLOCK, bits)


def _select(launcher, grad: torch.Tensor, mask_src: torch.Tensor, block: int, *tail):
    """A selecting kernel's result (``launcher``: ``grad`` where its mask, read from
    ``mask_src``, is set, else 0; ``block`` elements a program, ``tail`` its constexprs before
    ``block``), contiguous; ``grad`` and the result passed as raw bits."""
    if not grad.is_contiguous():
        grad = grad.contiguous()
    n = grad.numel()
    out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    if n:
        as_bits = _BITS_OF[grad.element_size()]
        launcher(((n + block - 1) // block,), grad.view(as_bits), mask_src, out.view(as_bits), n,
                 *tail, block)  # fmt: skip
    return out


def _check_packed(packed: torch.Tensor, n: int, where: str) -> None:
    if packed.dtype != torch.uint8 or packed.numel() != (n + 7) // 8:
        raise ValueError(
            f"{where}: {n} elements need {(n + 7) // 8} packed uint8 bytes, got "
            f"{packed.numel()} of {packed.dtype}"
        )


def pack_bits(mask: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """A bool tensor as uint8, 8 elements per byte (row-major order, zero-padded).

    ``use_triton``: force the path; by default Triton for CUDA tensors, the reference otherwise.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bits: mask must be a bool tensor, got {mask.dtype}")
    if use_triton is None:
        use_triton = use_triton_for(mask)
    if not use_triton:
        return pack_bits_ref(mask)
    return _packed(_PACK, mask.contiguous().view(torch.uint8))


def _packed(launcher, src: torch.Tensor) -> torch.Tensor:
    """``src`` (contiguous) packed 8 elements per byte by a packing kernel's ``launcher``."""
    n = src.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=src.device)
    if n:
        launcher(((nbytes + _BLOCK - 1) // _BLOCK,), src, out, n, nbytes, _BLOCK)
    return out


def dropout_backward(
    grad: torch.Tensor, packed: torch.Tensor, scale: float, use_triton: bool | None = None
) -> torch.Tensor:
    """``native_dropout_backward(grad, mask, scale)`` with ``mask`` given as ``pack_bits``
    packed it, in one pass on the GPU (fp32, fp16 and bf16 gradients; others, and CPU
    tensors, through the reference)."""
    _check_packed(packed, grad.numel(), "dropout_backward")
    if use_triton is None:
        use_triton = use_triton_for(grad)
    if not use_triton or grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return dropout_backward_ref(grad, packed, scale)
    if not grad.is_contiguous():
        grad = grad.contiguous()
    n = grad.numel()
    out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    if n:
        bf16 = grad.dtype == torch.bfloat16
        _DROPOUT_BACKWARD(
            ((n + 8 * _BLOCK - 1) // (8 * _BLOCK),),
            grad, packed, out.view(torch.int16) if bf16 else out, float(scale), n, bf16,
            8 * _BLOCK,
        )  # fmt: skip
    return out


# raw bits of a floating dtype, to select elements without arithmetic (exact for any dtype)
_BITS_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PACKS = (torch.float32, torch.float16, torch.bfloat16)  # what the packer's compare reads


def pack_positive(x: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """``pack_bits(~(x <= 0))`` in one pass over ``x`` (row-major order): the bit ReLU's
    backward needs, set where ``x`` is positive or NaN, read from the output itself (no bool
    tensor in between). ``use_triton`` as in :func:`pack_bits`."""
    if not x.is_floating_point():
        raise TypeError(f"pack_positive: x must be a floating tensor, got {x.dtype}")
    if use_triton is None:
        use_triton = use_triton_for(x)
    if not use_triton or x.dtype not in _PACKS:
        return pack_positive_ref(x)
    # not x.contiguous() on a contiguous x: that returns x itself, and x is often a Function's
    # output (ReLU's), which an op must not return twice (tests/alias_check.py)
    return _packed(_PACK_POSITIVE, x if x.is_contiguous() else x.contiguous())


def relu_backward(
    grad: torch.Tensor, packed: torch.Tensor, use_triton: bool | None = None
) -> torch.Tensor:
    """``torch.where(mask, grad, 0)`` with ``mask`` as :func:`pack_positive` packed it (ReLU's
    ``threshold_backward(grad, out, 0)``), in one pass reading the bits in registers; the
    result is contiguous. Elements are selected as raw bits: exact for every dtype."""
    _check_packed(packed, grad.numel(), "relu_backward")
    if use_triton is None:
        use_triton = use_triton_for(grad)
    if not use_triton or not grad.is_floating_point():
        return relu_backward_ref(grad, packed).contiguous()
    return _select(_RELU_BACKWARD, grad, packed, 8 * _BLOCK)


if HAS_TRITON:

    @triton.jit
    def _pack_positive_kernel(x_ptr, out_ptr, n, nbytes, BLOCK: tl.constexpr):
        # a (BLOCK, 8) tile: byte b takes elements 8b..8b+7, bit j from element 8b+j
        byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        j = tl.arange(0, 8)
        i = byte[:, None] * 8 + j[None, :]
        x = tl.load(x_ptr + i, mask=i < n, other=0.0)
        passes = tl.where(x <= 0, 0, 1)  # NaN compares false: passes, as torch's backward
        packed = tl.sum(passes << j[None, :], axis=1)
        tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)

    @triton.jit
    def _relu_backward_kernel(grad_ptr, packed_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(grad_ptr + offs, mask=inside, other=0)
        byte = tl.load(packed_ptr + offs // 8, mask=inside, other=0).to(tl.int32)
        m = (byte >> (offs % 8).to(tl.int32)) & 1
        tl.store(out_ptr + offs, tl.where(m != 0, g, tl.zeros_like(g)), mask=inside)

    @triton.jit
    def _pack_kernel(mask_ptr, out_ptr, n, nbytes, BLOCK: tl.constexpr):
        byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = byte < nbytes
        packed = tl.zeros([BLOCK], dtype=tl.int32)
        for j in tl.static_range(8):
            i = byte * 8 + j
            m = tl.load(mask_ptr + i, mask=inside & (i < n), other=0).to(tl.int32)
            packed = packed | ((m != 0).to(tl.int32) << j)
        tl.store(out_ptr + byte, packed.to(tl.uint8), mask=inside)

    @triton.jit
    def _dropout_backward_kernel(grad_ptr, packed_ptr, out_ptr, scale, n, OUT_BF16: tl.constexpr,
                                 BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(grad_ptr + offs, mask=inside, other=0).to(tl.float32)
        byte = tl.load(packed_ptr + offs // 8, mask=inside, other=0).to(tl.int32)
        m = ((byte >> (offs % 8).to(tl.int32)) & 1).to(tl.float32)
        store_as(out_ptr, offs, g * m * scale, inside, OUT_BF16)

    @triton.jit
    def _relu_backward_codes_kernel(grad_ptr, codes_ptr, out_ptr, n, BITS: tl.constexpr,
                                    BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(grad_ptr + offs, mask=inside, other=0)
        if BITS == 8:
            c = tl.load(codes_ptr + offs, mask=inside, other=0).to(tl.int32)
        else:  # element 2i in the low nibble of byte i
            byte = tl.load(codes_ptr + offs // 2, mask=inside, other=0).to(tl.int32)
            c = (byte >> ((offs % 2) * 4).to(tl.int32)) & 0xF
        tl.store(out_ptr + offs, tl.where(c != 0, g, tl.zeros_like(g)), mask=inside)

    _PACK = Launcher(_pack_kernel)
    _RELU_BACKWARD_CODES = Launcher(_relu_backward_codes_kernel)
    _PACK_POSITIVE = Launcher(_pack_positive_kernel)
    _RELU_BACKWARD = Launcher(_relu_backward_kernel)
    _DROPOUT_BACKWARD = Launcher(_dropout_backward_kernel)
