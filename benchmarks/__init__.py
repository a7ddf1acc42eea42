"""User-facing benchmark and training scripts (run as ``python benchmarks/NAME.py``, or installed
as ``mesa-lite-NAME``); installed as ``mesa_lite.benchmarks``."""

import os as _os
import sys as _sys

# A script run as `python benchmarks/NAME.py` has this folder first on sys.path, where kernels.py
# would hide the `kernels` package (Hugging Face's, which transformers imports): the scripts
# import each other as mesa_lite.benchmarks.*, never from the folder, so it comes off the path.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
