"""Triton kernels and their PyTorch references (installed as ``mesa_lite.kernels``).

This package never imports the rest of mesa_lite.
"""

from .bits import dropout_backward, dropout_backward_ref, pack_bits, pack_bits_ref, unpack_bits
from .group_quant import (
    EPILOGUES,
    HAS_TRITON,
    SUPPORTED_BITS,
    dequantize,
    dequantize_ref,
    n_code_bytes,
    n_groups_of,
    next_rounding_seed,
    per_byte,
    qrange,
    quantize,
    quantize_ref,
    rounding_state,
    set_rounding_state,
)
from .launch import Launcher, use_triton

__all__ = [
    "dropout_backward",
    "dropout_backward_ref",
    "pack_bits",
    "pack_bits_ref",
    "unpack_bits",
    "EPILOGUES",
    "Launcher",
    "use_triton",
    "HAS_TRITON",
    "SUPPORTED_BITS",
    "n_code_bytes",
    "per_byte",
    "dequantize",
    "dequantize_ref",
    "n_groups_of",
    "qrange",
    "quantize",
    "quantize_ref",
    "next_rounding_seed",
    "rounding_state",
    "set_rounding_state",
]
