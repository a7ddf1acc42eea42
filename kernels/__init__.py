"""Triton kernels and their PyTorch references (installed as ``mesa_lite.kernels``).

This package never imports the rest of mesa_lite.
"""

from .group_quant import (
    HAS_TRITON,
    dequantize,
    dequantize_ref,
    n_groups_of,
    qrange,
    quantize,
    quantize_ref,
)

__all__ = [
    "HAS_TRITON",
    "dequantize",
    "dequantize_ref",
    "n_groups_of",
    "qrange",
    "quantize",
    "quantize_ref",
]
