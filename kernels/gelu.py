"""GELU's and SiLU's math for the dequantize kernel's epilogues (``group_quant.dequantize``):
the activation of a rebuilt input (its output, the next layer's input) and its backward
``grad * act'(x)`` with ``x`` rebuilt from its codes in registers, so no full-precision copy of
``x`` is written and read again.

The formulas are PyTorch's CUDA ones (``GeluCUDAKernelImpl``, ``silu_kernel`` and
``silu_backward_kernel``, forward and backward), in fp32. The references are torch's own
``F.gelu``, ``aten.gelu_backward``, ``F.silu`` and ``aten.silu_backward``; they agree to the
fp32 rounding of ``erf``/``exp``, not bit for bit (different ``erf``/``exp`` implementations).
"""

from __future__ import annotations

from .launch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tanh_of_inner(x):
        """tanh(sqrt(2 / pi) * (x + 0.044715 x^3)), the tanh approximation's inner term."""
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        e = tl.exp(-2.0 * tl.abs(inner))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(inner < 0, -t, t)

    @triton.jit
    def gelu_fp32(x, TANH: tl.constexpr):
        """GELU (exact erf, or the tanh approximation)."""
        if TANH:
            return 0.5 * x * (1.0 + _tanh_of_inner(x))
        else:
            return x * 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def gelu_backward_fp32(x, dy, TANH: tl.constexpr):
        """``dy * gelu'(x)``."""
        if TANH:
            t = _tanh_of_inner(x)
            left_derivative = 0.5 * (1.0 + t)
            inner_derivative = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * (x * x))
            right_derivative = 0.5 * x * (1.0 - t * t) * inner_derivative
            return dy * (left_derivative + right_derivative)
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
            return dy * (cdf + x * pdf)

    @triton.jit
    def silu_fp32(x):
        """SiLU, ``x / (1 + exp(-x))``."""
        return x / (1.0 + tl.exp(-x))

    @triton.jit
    def silu_backward_fp32(x, dy):
        """``dy * silu'(x)``: ``dy * s * (1 + x * (1 - s))`` with ``s = 1 / (1 + exp(-x))``."""
        s = 1.0 / (1.0 + tl.exp(-x))
        return dy * s * (1.0 + x * (1.0 - s))
