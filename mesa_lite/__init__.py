"""mesa_lite: keep training activations for backward in 8 bits.

import mesa_lite
mesa_lite.wrap(model)   # in place; forward unchanged, backward from int8 copies
"""

from mesa_lite import report
from mesa_lite.config import LAYER_KINDS, Config, QuantSpec
from mesa_lite.modules import GELU, LayerNorm, Linear, MatMul, Softmax
from mesa_lite.report import MemoryReport, memory_report
from mesa_lite.wrap import register, unwrap, wrap, wrapped_modules

__version__ = "0.1.0"

__all__ = [
    "LAYER_KINDS",
    "Config",
    "GELU",
    "LayerNorm",
    "Linear",
    "MatMul",
    "MemoryReport",
    "QuantSpec",
    "Softmax",
    "__version__",
    "memory_report",
    "report",
    "register",
    "unwrap",
    "wrap",
    "wrapped_modules",
]
