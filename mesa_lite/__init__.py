"""mesa_lite: keep training activations for backward in 8 bits.

import mesa_lite
mesa_lite.wrap(model)   # in place; forward unchanged, backward from int8 copies
model = mesa_lite.compile(model)   # torch.compile, with the Inductor options it needs

The names below are loaded on first use (PEP 562), so ``import mesa_lite`` alone imports
neither torch nor timm: command-line tools built on it answer ``--help`` at once.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it ("" for a submodule of that name)
_WHERE = {
    "LAYER_KINDS": "mesa_lite.config",
    "OPT_IN_KINDS": "mesa_lite.config",
    "BatchNorm1d": "mesa_lite.modules",
    "BatchNorm2d": "mesa_lite.modules",
    "BatchNorm3d": "mesa_lite.modules",
    "Config": "mesa_lite.config",
    "Conv1d": "mesa_lite.modules",
    "Conv2d": "mesa_lite.modules",
    "Conv3d": "mesa_lite.modules",
    "DEFAULT_LAYERS": "mesa_lite.config",
    "INDUCTOR_OPTIONS": "mesa_lite.compiling",
    "compile": "mesa_lite.compiling",
    "graphed": "mesa_lite.graphs",
    "ungraph": "mesa_lite.graphs",
    "graph_info": "mesa_lite.graphs",
    "graph_memory": "mesa_lite.graphs",
    "QuantSpec": "mesa_lite.config",
    "ReLU": "mesa_lite.modules",
    "GELU": "mesa_lite.modules",
    "LayerNorm": "mesa_lite.modules",
    "Linear": "mesa_lite.modules",
    "MatMul": "mesa_lite.modules",
    "MaxPool2d": "mesa_lite.modules",
    "Softmax": "mesa_lite.modules",
    "MemoryReport": "mesa_lite.report",
    "memory_report": "mesa_lite.report",
    "MemoryBreakdown": "mesa_lite.breakdown",
    "memory_breakdown": "mesa_lite.breakdown",
    "register": "mesa_lite.wrap",
    "supported_layers": "mesa_lite.wrap",
    "unwrap": "mesa_lite.wrap",
    "wrap": "mesa_lite.wrap",
    "wrapped_modules": "mesa_lite.wrap",
    "report": "",
    "planner": "",
    "rounding_state": "mesa_lite.kernels.group_quant",
    "set_rounding_state": "mesa_lite.kernels.group_quant",
}

__all__ = sorted([*_WHERE, "__version__"])

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads these
    from mesa_lite import report  # noqa: F401
    from mesa_lite.breakdown import MemoryBreakdown, memory_breakdown  # noqa: F401
    from mesa_lite.compiling import INDUCTOR_OPTIONS, compile  # noqa: F401
    from mesa_lite.config import (  # noqa: F401
        DEFAULT_LAYERS,
        LAYER_KINDS,
        OPT_IN_KINDS,
        Config,
        QuantSpec,
    )
    from mesa_lite.graphs import graph_info, graph_memory, graphed, ungraph  # noqa: F401
    from mesa_lite.kernels.group_quant import rounding_state, set_rounding_state  # noqa: F401
    from mesa_lite.modules import (  # noqa: F401
        GELU,
        BatchNorm1d,
        BatchNorm2d,
        BatchNorm3d,
        Conv1d,
        Conv2d,
        Conv3d,
        LayerNorm,
        Linear,
        MatMul,
        MaxPool2d,
        ReLU,
        Softmax,
    )
    from mesa_lite.report import MemoryReport, memory_report  # noqa: F401
    from mesa_lite.wrap import register, supported_layers, unwrap, wrap, wrapped_modules  # noqa: F401


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'mesa_lite' has no attribute {name!r}")
    value = (
        importlib.import_module(f"mesa_lite.{name}")
        if where == ""
        else getattr(importlib.import_module(where), name)
    )
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps ``mesa_lite.wrap`` the function: importing the submodule ``mesa_lite.wrap``
    (``from mesa_lite.wrap import register``) makes Python set the package attribute ``wrap``
    to that module, which would shadow the function of the same name."""

    def __setattr__(self, name: str, value) -> None:
        if name == "wrap" and isinstance(value, types.ModuleType):
            value = value.wrap
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
