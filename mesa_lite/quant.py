"""The packed form of a saved activation and the one switch between Triton and the reference.

A ``Packed`` holds codes + per-group fp32 scales and the metadata to rebuild the tensor. Autograd
Functions keep its tensors through ``ctx.save_for_backward`` (``save``/``load`` below), so
PyTorch's saved-tensor hooks and checkpointing see them.

Sharing: when two ops keep the same tensor object (a softmax output that the next matmul also
keeps), the second reuses the first one's codes instead of quantizing again. The producer opts
in (``quantize(..., share=True)``) for its own fresh output. The registry is
keyed by the tensor's identity, checked against its version counter, and drops an entry when
that tensor dies.
"""

from __future__ import annotations

import weakref

import torch

from mesa_lite.config import QuantSpec
from mesa_lite.kernels import group_quant

__all__ = ["Packed", "quantize", "dequantize", "lookup_shared", "save", "load"]


class Packed:
    """A compressed tensor (a plain slotted class: it is built on every forward and backward).

    Attributes:
        codes: flat codes (int8/uint8 at 8 bits, packed uint8 below), or the exact tensor
            itself when ``spec.exact``.
        scales: fp32, one per group (None when exact).
        shape: the original shape.
        dtype: the original dtype.
        spec: how it was quantized.
        signed: int8 symmetric codes (True) or uint8 non-negative codes (False).
    """

    __slots__ = ("codes", "scales", "shape", "dtype", "spec", "signed")

    def __init__(self, codes, scales, shape, dtype, spec: QuantSpec, signed: bool = True) -> None:
        self.codes = codes
        self.scales = scales
        self.shape = shape
        self.dtype = dtype
        self.spec = spec
        self.signed = signed

    def meta(self) -> tuple:
        """Everything but the tensors, to rebuild with ``Packed(codes, scales, *meta)``."""
        return (self.shape, self.dtype, self.spec, self.signed)

    def nbytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def __repr__(self) -> str:
        return (
            f"Packed(shape={tuple(self.shape)}, dtype={self.dtype}, {self.spec.describe()}, "
            f"signed={self.signed}, {self.nbytes()} bytes)"
        )


def _use_triton(t: torch.Tensor) -> bool:
    return group_quant.HAS_TRITON and t.is_cuda


def quantize(x: torch.Tensor, spec: QuantSpec, signed: bool = True, share: bool = False) -> Packed:
    """Compresses ``x`` as ``spec`` says.

    Args:
        x: the tensor to keep (fp32, fp16 or bf16).
        spec: the layer's QuantSpec.
        signed: False for tensors known to be non-negative (unsigned codes, one more bit).
        share: register the result so that a later op keeping this very tensor reuses it (see
            module doc). Only for tensors made fresh in each forward (an op's own output): a
            tensor that lives across steps would hand the same codes, and the same stochastic
            draw, to every step.
    """
    if spec.exact:
        packed = Packed(x, None, x.shape, x.dtype, spec, signed)
    else:
        codes, scales = group_quant.quantize(
            x,
            spec.group_size,
            signed=signed,
            stochastic=spec.stochastic,
            use_triton=_use_triton(x),
            bits=spec.bits,
        )
        packed = Packed(codes, scales, x.shape, x.dtype, spec, signed)
    if share:
        _register(x, packed)
    return packed


def dequantize(p: Packed, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuilds the tensor of ``p`` in ``dtype`` (the original dtype by default)."""
    dtype = p.dtype if dtype is None else dtype
    if p.spec.exact:
        return p.codes.to(dtype)
    flat = group_quant.dequantize(
        p.codes,
        p.scales,
        p.spec.group_size,
        dtype,
        use_triton=_use_triton(p.codes),
        bits=p.spec.bits,
        signed=p.signed,
        numel=p.shape.numel(),
    )
    return flat.view(p.shape)


# ---- sharing one copy between ops that keep the same tensor --------------------------------

# id(tensor) -> (weakref to tensor, its version, codes, scales, Packed meta)
_SHARED: dict[int, tuple] = {}


def _register(x: torch.Tensor, p: Packed) -> None:
    """Remembers ``p`` as made from ``x`` while ``x`` lives.

    The entry holds the codes strongly (a saved-tensor hook may keep an alias instead of the
    object saved, so a weak reference could die while the storage lives) and is dropped when
    ``x`` dies; codes are smaller than ``x``, so this never outlives a larger tensor. In the
    exact mode the codes are ``x`` itself and are not held.
    """
    key = id(x)
    ref = weakref.ref(x, lambda _r, key=key: _SHARED.pop(key, None))
    codes = None if p.codes is x else p.codes
    _SHARED[key] = (ref, x._version, codes, p.scales, p.meta())


def lookup_shared(x: torch.Tensor, spec: QuantSpec) -> Packed | None:
    """The Packed already made from this very tensor (same object, unmodified), if any.

    Reused only when it was made with the same bits and group size, so the saved precision is
    what ``spec`` asks for.
    """
    entry = _SHARED.get(id(x))
    if entry is None:
        return None
    ref, version, codes, scales, meta = entry
    if ref() is not x or x._version != version:
        return None
    kept = meta[2]
    if kept.exact != spec.exact or kept.bits != spec.bits:
        return None
    if not spec.exact and kept.group_size != spec.group_size:
        return None
    return Packed(x if codes is None else codes, scales, *meta)


# ---- keeping Packed objects on an autograd ctx ----------------------------------------------


def save(ctx, *items: Packed | torch.Tensor | None) -> None:
    """``ctx.save_for_backward`` for a mix of Packed, tensors and None; metadata rides on ctx."""
    tensors: list[torch.Tensor | None] = []
    layout: list[tuple | None] = []
    for item in items:
        if isinstance(item, Packed):
            tensors += [item.codes, item.scales]
            layout.append(item.meta())
        else:
            tensors.append(item)
            layout.append(None)
    ctx.save_for_backward(*tensors)
    ctx.mesa_layout = layout


def load(ctx) -> list[Packed | torch.Tensor | None]:
    """The items given to :func:`save`, in order."""
    saved = iter(ctx.saved_tensors)
    out: list[Packed | torch.Tensor | None] = []
    for meta in ctx.mesa_layout:
        if meta is None:
            out.append(next(saved))
        else:
            codes, scales = next(saved), next(saved)
            out.append(Packed(codes, scales, *meta))
    return out
