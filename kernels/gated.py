"""The gated MLP's backward through its product in one pass: ``act(g) * u`` (Llama's, Mistral's
and Qwen2's SwiGLU, GeGLU) from the 8-, 4- or 2-bit codes of ``g`` and ``u``.

Given the product's gradient ``dp``, one kernel rebuilds ``g`` and ``u`` from their codes in
registers and writes the product itself (the down projection's input, for its weight's
gradient) and the gradients of ``g`` and ``u``: the work of two dequantizes, the activation,
three products and the activation's backward, seven launches and their full-size temporaries
in the op-by-op form (``blocks.GatedMlpFn``), in the shape Liger-Kernel gives its SwiGLU
backward.

Every step rounds to the tensors' dtype where the op-by-op form rounds, so the results are
those ops' own but for the activation's ``exp``/``erf``, whose implementations differ between
Triton and torch (a few ulps; ``gated_backward_ref`` is the ops themselves).
"""

from __future__ import annotations

import functools

import torch

from .group_quant import _GELU_MID as _MID
from .group_quant import (
    _check_sizes,
    _launch_shape,
    dequantize_ref,
    per_byte,
    qrange,
)
from .launch import HAS_TRITON, Launcher
from .launch import use_triton as use_triton_for

# the activations, as the op-by-op form computes them: name -> (forward, backward(grad, x))
ACTIVATIONS = {
    "silu": (torch.nn.functional.silu, torch.ops.aten.silu_backward),
    "gelu": (
        torch.nn.functional.gelu,
        lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="none"),
    ),
    "gelu_tanh": (
        functools.partial(torch.nn.functional.gelu, approximate="tanh"),
        lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),
    ),
}
_ACT_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .gelu import gelu_backward_fp32, gelu_fp32, silu_backward_fp32, silu_fp32
    from .group_quant import dequantize_tile, round_to, store_as

    @triton.jit
    def _act(x, ACT: tl.constexpr):
        if ACT == 0:
            return silu_fp32(x)
        else:
            return gelu_fp32(x, ACT == 2)

    @triton.jit
    def _act_backward(x, dy, ACT: tl.constexpr):
        if ACT == 0:
            return silu_backward_fp32(x, dy)
        else:
            return gelu_backward_fp32(x, dy, ACT == 2)

    @triton.jit
    def _gated_backward_kernel(
        g_codes_ptr,  # (n,) codes of g at 8 bits; packed below
        g_scales_ptr,  # (n_groups,) fp32
        u_codes_ptr,  # the same for u
        u_scales_ptr,
        dp_ptr,  # (n,) the product's gradient (bf16 read as bf16; only stores take int16 bits)
        prod_ptr,  # (n,) out: act(g) * u (not written unless WRITE_PROD)
        gg_ptr,  # (n,) out: g's gradient (may be dp_ptr: each element is read before written)
        gu_ptr,  # (n,) out: u's gradient
        n,
        n_groups,
        group_size,
        QMIN: tl.constexpr,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,
        ACT: tl.constexpr,  # 0 SiLU, 1 GELU (erf), 2 GELU (tanh)
        MID: tl.constexpr,  # the tensors' dtype: 0 fp32, 1 fp16, 2 bf16
        WRITE_PROD: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # tiled as the dequantize kernel: ROWS groups a program, one scale load per group
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_groups
        base = rows.to(tl.int64) * group_size
        s_g = tl.load(g_scales_ptr + rows, mask=row_ok, other=0.0)[:, None]
        s_u = tl.load(u_scales_ptr + rows, mask=row_ok, other=0.0)[:, None]
        cols = tl.arange(0, BLOCK)
        for start in range(0, group_size, BLOCK):
            c = start + cols
            offs = base[:, None] + c[None, :]
            mask = row_ok[:, None] & (c[None, :] < group_size) & (offs < n)
            # each value rounded to the tensors' dtype where the op-by-op form has a tensor
            g = round_to(dequantize_tile(g_codes_ptr, offs, mask, s_g, QMIN, BITS, PER_BYTE), MID)
            u = round_to(dequantize_tile(u_codes_ptr, offs, mask, s_u, QMIN, BITS, PER_BYTE), MID)
            a = round_to(_act(g, ACT), MID)
            if WRITE_PROD:
                store_as(prod_ptr, offs, a * u, mask, MID == 2)
            dp = tl.load(dp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g_a = round_to(dp * u, MID)
            store_as(gu_ptr, offs, dp * a, mask, MID == 2)
            store_as(gg_ptr, offs, _act_backward(g, g_a, ACT), mask, MID == 2)

    _GATED_BACKWARD = Launcher(_gated_backward_kernel)
    _GATED_BACKWARD_PACKED = Launcher(_gated_backward_kernel, num_warps=2)


def _check(g, u, dp, group_size: int, dtype, act: str, bits: int, numel: int) -> int:
    """The number of groups, the arguments checked."""
    if act not in ACTIVATIONS:
        raise ValueError(f"gated_backward: act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    if dtype not in _MID:
        raise TypeError(f"gated_backward: dtype must be float32, float16 or bfloat16, got {dtype}")
    if not isinstance(dp, torch.Tensor) or dp.dtype != dtype:
        raise ValueError(f"gated_backward: the product's gradient must be a {dtype} tensor, "
                         f"got {getattr(dp, 'dtype', type(dp).__name__)}")  # fmt: skip
    (gc, gs), (uc, us) = g, u
    if gc.dtype != uc.dtype or gc.shape != uc.shape or gs.shape != us.shape:
        raise ValueError("gated_backward: g's and u's codes and scales must match in shape "
                         "and dtype")  # fmt: skip
    return _check_sizes(gc, gs, group_size, bits, numel, "gated_backward")


def gated_backward(
    g: tuple[torch.Tensor, torch.Tensor],
    u: tuple[torch.Tensor, torch.Tensor],
    dp: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    act: str = "silu",
    bits: int = 8,
    signed: bool = True,
    use_triton: bool | None = None,
    write_prod: bool = True,
    in_place: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The backward of ``act(g) * u`` from the codes of ``g`` and ``u``, in one pass.

    Args:
        g, u: ``(codes, scales)`` of each factor's input, from ``group_quant.quantize`` with
            the same group size, bits and signedness, ``dp.numel()`` elements each.
        dp: the product's gradient, ``dtype``, in row-major order.
        dtype: the dtype ``g``, ``u``, the activation, the product and their gradients all
            have (the op-by-op form's when they agree).
        act: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``.
        write_prod: also return ``act(g) * u`` (else None).
        in_place: write g's gradient over ``dp`` (when contiguous; the caller's own tensor).

    Returns:
        ``(act(g) * u or None, g's gradient, u's gradient)``, flat, ``dtype``.
    """
    n = dp.numel() if isinstance(dp, torch.Tensor) else -1
    ng = _check(g, u, dp, group_size, dtype, act, bits, n)
    if use_triton is None:
        use_triton = use_triton_for(dp)
    if not use_triton:
        return gated_backward_ref(g, u, dp, group_size, dtype, act, bits, signed, write_prod)
    flat = dp.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    prod = torch.empty(n if write_prod else 0, dtype=dtype, device=dp.device)
    gg = flat if in_place and flat.data_ptr() == dp.data_ptr() else torch.empty_like(flat)
    gu = torch.empty_like(flat)
    if n == 0:
        return (prod if write_prod else None), gg, gu
    rows, block = _launch_shape(group_size, bits)
    launcher = _GATED_BACKWARD if bits == 8 else _GATED_BACKWARD_PACKED
    bf16 = dtype == torch.bfloat16

    def out(t):
        return t.view(torch.int16) if bf16 else t

    (gc, gs), (uc, us) = g, u
    launcher(
        ((ng + rows - 1) // rows,),
        gc.contiguous(), gs.contiguous(), uc.contiguous(), us.contiguous(),
        flat, out(prod if write_prod else gu), out(gg), out(gu), n, ng, group_size,
        qrange(signed, bits)[0], bits, per_byte(bits), _ACT_IDS[act], _MID[dtype], write_prod,
        rows, block,
    )  # fmt: skip
    return (prod if write_prod else None), gg, gu


def gated_backward_ref(g, u, dp, group_size: int, dtype, act: str = "silu", bits: int = 8,
                       signed: bool = True, write_prod: bool = True):  # fmt: skip
    """PyTorch reference of :func:`gated_backward` (never in place): the op-by-op form's
    own ops on the rebuilt factors."""
    n = dp.numel()
    _check(g, u, dp, group_size, dtype, act, bits, n)
    fn, backward = ACTIVATIONS[act]
    gx = dequantize_ref(*g, group_size, dtype, bits, signed, n)
    ux = dequantize_ref(*u, group_size, dtype, bits, signed, n)
    a = fn(gx)
    d = dp.reshape(-1)
    g_u = d * a
    g_g = backward(d * ux, gx)
    return (a * ux if write_prod else None), g_g, g_u
