"""Triton kernels and their PyTorch references (installed as ``mesa_lite.kernels``).

This package never imports the rest of mesa_lite.
"""

if __name__ != "mesa_lite.kernels":
    # This folder imported as a top-level `kernels`: the repository root is on sys.path (`python
    # -m pytest` or a source build run there). That name is Hugging Face's package, which
    # transformers imports and whose setuptools plugin every build in its environment loads: the
    # import goes to it, or to an empty stand-in where it is not installed.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _path)
    if _spec is not None and _spec.origin is not None:  # the installed package
        _real = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _real  # what the import statement returns
        _spec.loader.exec_module(_real)
    else:  # none, or only a folder without __init__.py
        # an empty stand-in, as such a folder gives (a namespace package: no __file__, nothing
        # in it), so that a probe for the package (transformers' is_kernels_available, which
        # imports it when no distribution of that name is installed) finds none
        _real = _util.module_from_spec(_machinery.ModuleSpec(__name__, None, is_package=True))
        _real.__path__ = []
        _sys.modules[__name__] = _real
else:
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
