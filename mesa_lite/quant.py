"""The packed form of a saved activation and the one switch between Triton and the reference.

A ``Packed`` holds codes + per-group fp32 scales and the metadata to rebuild the tensor. Autograd
Functions keep its tensors through ``ctx.save_for_backward`` (``save``/``load`` below), so
PyTorch's saved-tensor hooks and checkpointing see them.

Sharing: when two ops keep the same tensor object (a softmax output that the next matmul also
keeps), the second reuses the first one's codes instead of quantizing again. The registry holds
only weak references, keyed by the tensor's identity and checked against its version counter.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from mesa_lite.config import QuantSpec
from mesa_lite.kernels import group_quant

__all__ = ["Packed", "quantize", "dequantize", "lookup_shared", "save", "load"]


@dataclasses.dataclass(frozen=True)
class Packed:
    """A compressed tensor.

    Attributes:
        codes: flat int8/uint8 codes, or the exact tensor itself when ``spec.exact``.
        scales: fp32, one per group (None when exact).
        shape: the original shape.
        dtype: the original dtype.
        spec: how it was quantized.
        signed: int8 symmetric codes (True) or uint8 non-negative codes (False).
    """

    codes: torch.Tensor
    scales: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    spec: QuantSpec
    signed: bool = True

    def nbytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n


def _use_triton(t: torch.Tensor) -> bool:
    return group_quant.HAS_TRITON and t.is_cuda


def quantize(x: torch.Tensor, spec: QuantSpec, signed: bool = True) -> Packed:
    """Compresses ``x`` as ``spec`` says; the result is registered for sharing (see module doc).

    Args:
        x: the tensor to keep (fp32, fp16 or bf16).
        spec: the layer's QuantSpec.
        signed: False for tensors known to be non-negative (uint8 codes, one more bit of range).
    """
    if spec.exact:
        packed = Packed(x, None, x.shape, x.dtype, spec, signed)
    else:
        codes, scales = group_quant.quantize(
            x, spec.group_size, signed=signed, stochastic=spec.stochastic, use_triton=_use_triton(x)
        )
        packed = Packed(codes, scales, x.shape, x.dtype, spec, signed)
    _register(x, packed)
    return packed


def dequantize(p: Packed, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuilds the tensor of ``p`` in ``dtype`` (the original dtype by default)."""
    dtype = p.dtype if dtype is None else dtype
    if p.spec.exact:
        return p.codes.to(dtype)
    flat = group_quant.dequantize(
        p.codes, p.scales, p.spec.group_size, dtype, use_triton=_use_triton(p.codes)
    )
    return flat.view(p.shape)


# ---- sharing one copy between ops that keep the same tensor --------------------------------

# id(tensor) -> (weakref to tensor, its version, weakref to codes, weakref to scales, Packed meta)
_SHARED: dict[int, tuple] = {}


def _register(x: torch.Tensor, p: Packed) -> None:
    key = id(x)
    ref = weakref.ref(x, lambda _r, key=key: _SHARED.pop(key, None))
    scales_ref = weakref.ref(p.scales) if p.scales is not None else None
    meta = dataclasses.replace(p, codes=None, scales=None)
    _SHARED[key] = (ref, x._version, weakref.ref(p.codes), scales_ref, meta)


def lookup_shared(x: torch.Tensor, spec: QuantSpec) -> Packed | None:
    """The Packed already made from this very tensor (same object, unmodified), if any.

    Reused only when it was made with the same bits and group size, so the saved precision is
    what ``spec`` asks for.
    """
    entry = _SHARED.get(id(x))
    if entry is None:
        return None
    ref, version, codes_ref, scales_ref, meta = entry
    if ref() is not x or x._version != version:
        return None
    codes = codes_ref()
    scales = scales_ref() if scales_ref is not None else None
    if codes is None or (scales_ref is not None and scales is None):
        return None
    if meta.spec.exact != spec.exact or meta.spec.bits != spec.bits:
        return None
    if not spec.exact and meta.spec.group_size != spec.group_size:
        return None
    return dataclasses.replace(meta, codes=codes, scales=scales)


# ---- keeping Packed objects on an autograd ctx ----------------------------------------------


def save(ctx, *items: Packed | torch.Tensor | None) -> None:
    """``ctx.save_for_backward`` for a mix of Packed, tensors and None; metadata rides on ctx."""
    tensors: list[torch.Tensor | None] = []
    layout: list[Packed | None] = []
    for item in items:
        if isinstance(item, Packed):
            tensors += [item.codes, item.scales]
            layout.append(dataclasses.replace(item, codes=None, scales=None))
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
            out.append(dataclasses.replace(meta, codes=codes, scales=scales))
    return out
