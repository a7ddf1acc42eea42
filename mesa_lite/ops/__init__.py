"""One file per op: its autograd Function(s), its functional form (what the drop-in module in
``mesa_lite/modules.py`` calls: autocast casts, the plain-path checks, the Function), the
helpers its backward shares with the block-level Functions (``mesa_lite/blocks.py``), its
autocast probe and, where it has one, its recipe step (how its output is rebuilt from the codes
of its input). Its kernels are in ``kernels/`` and reached through ``mesa_lite.quant``.

``common`` holds what every op shares.
"""

from mesa_lite.ops import (  # noqa: F401
    activation,
    attention,
    batch_norm,
    conv,
    cross_entropy,
    dropout,
    gelu,
    layer_norm,
    linear,
    matmul,
    max_pool,
    relu,
    rms_norm,
    softmax,
)
