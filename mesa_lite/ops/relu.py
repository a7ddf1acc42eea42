"""ReLU and its piecewise-linear family (ReLU6 / Hardtanh, LeakyReLU, Hardsigmoid): each keeps
1 bit per element, which piece of the function the element fell on, instead of its input or
output (Hardsigmoid's gradient is ``grad / 6`` inside (-3, 3), 0 outside).

torch's ReLU keeps its output and its backward is ``threshold_backward(grad, out, 0)``: zero
where ``out <= 0``, ``grad`` elsewhere (a NaN output passes its gradient). The bit kept is that
condition. Hardtanh (ReLU6 is Hardtanh(0, 6)) passes the gradient unless ``x <= min_val`` or
``x >= max_val`` (NaN passes), LeakyReLU scales it by ``negative_slope`` unless ``x > 0``; the
bit is that condition, taken from the input before the op (in place, torch tests the output,
which gives the same bit). Backward selects or scales the gradient with torch's own backward
ops, so the gradients are torch's bit for bit. Hardtanh's bit is taken by torch's own backward
op on a gradient of ones, so it follows that op's comparisons. One exception: torch's CPU
Hardtanh backward treats a NaN input, and in bf16 an input within rounding of the range's ends,
differently in its vectorized and its scalar loop, so the result depends on where the element
falls, which the gradient's layout and the tensor's size move; the bit follows the layout of
the forward. With ``debug_exact`` Hardtanh runs torch's own op, exact by definition. In place
(``inplace=True``, as timm's ResNets build their ReLUs) the input is modified and returned, as
torch's in-place ops do.

A ReLU module whose every output is kept by a compressed consumer (a convolution, a Linear,
a squeeze-excitation multiply: anything keeping it through ``ops.common.keep``) keeps no bit
of its own: it keeps its output's unsigned codes (8 or 4 bits), registered for the consumer
(``quant.share``, which then keeps nothing new), and its backward takes the condition from
them. The codes are rounded as usual except that a positive (or NaN) output gets at least code
1 and any other code 0 (``group_quant.quantize(positive=True)``), so that "code > 0" is
torch's condition exactly (the consumer sees a positive value below half a step as one step).
Which ReLUs qualify is learned in training, step by step: the module offers each output
(``offer``) and a consumer keeping that very tensor at the same width and group size, in an
order it can read the codes in, claims it (``claim``; reusing them counts). At each call the
module looks at its previous offer; at its first call after a backward (a training step has
ended, every offer of it looked at) it decides for the step to come: codes if every offer was
claimed, its bit otherwise (a max-pool, a flatten, a frozen convolution, another width). A
recompute in backward (activation checkpointing) changes nothing, so it keeps what its
forward kept. At 8 and 4 bits (at 2 a positive value below one step, a third of the
group's largest, would be kept as one step); not under torch.compile (no registry there) or
in debug_exact. The unsigned codes also serve the consumer better than its own signed ones: a
step of 1/255 (1/15) of the group's largest value instead of 1/127 (1/7)."""

from __future__ import annotations

import torch

from mesa_lite import quant
from mesa_lite.config import QuantSpec
from mesa_lite.kernels.bits import (
    pack_bits,
    pack_bits_ref,
    pack_positive,
    pack_positive_ref,
    relu_backward,
    relu_backward_codes,
    relu_backward_codes_ref,
    unpack_bits,
)
from mesa_lite.ops.common import (
    BACKWARDS,
    channels_last_perm,
    first_order_only,
    inverse_perm,
    needs_grad,
    offer,
    plain_under_functorch,
)

F = torch.nn.functional


def _apply(x: torch.Tensor, op: tuple, inplace: bool) -> torch.Tensor:
    """The forward of ``op``: ``("relu",)``, ``("hardtanh", min_val, max_val)`` or
    ``("leaky", negative_slope)``."""
    if op[0] == "relu":
        return F.relu(x, inplace)
    if op[0] == "hardtanh":
        return F.hardtanh(x, op[1], op[2], inplace)
    if op[0] == "hardsigmoid":
        return F.hardsigmoid(x, inplace)
    return F.leaky_relu(x, op[1], inplace)


def _bits(x: torch.Tensor, op: tuple) -> torch.Tensor:
    """The bool condition of ``op`` on its input (Hardtanh, LeakyReLU)."""
    ones = torch.ones_like(x, memory_format=torch.preserve_format)
    if op[0] == "hardtanh":
        return torch.ops.aten.hardtanh_backward(ones, x, op[1], op[2]).ne_(0).bool()
    if op[0] == "hardsigmoid":
        return torch.ops.aten.hardsigmoid_backward(ones, x).ne_(0).bool()
    return x > 0


class ReLUFn(torch.autograd.Function):
    """``op`` (see ``_apply``) out of place, or in place with ``inplace``, keeping its
    condition packed 8 per byte, in the memory order of the output (channels-last too, so that
    the gradient takes the layout torch's backward gives it); with ``share`` (a QuantSpec,
    ReLU only: ``(spec, box)``) the output's 8- or 4-bit codes instead, put in ``box`` with whether
    they are in memory order, for the caller to register for the next convolution."""

    @staticmethod
    def forward(ctx, x, inplace: bool, op: tuple = ("relu",), share=None):
        compiling = torch.compiler.is_compiling()
        ctx.perm = channels_last_perm(x)
        ctx.op = op
        ctx.shared = False
        if share is not None and not compiling and op[0] == "relu":
            out = _apply(x, op, inplace)
            if inplace:
                ctx.mark_dirty(x)
            src = out if ctx.perm is None else out.permute(ctx.perm)
            spec, box = share
            # unsigned codes, 0 exactly where out <= 0 (group_quant's ``positive``)
            codes, scales = quant._quantize(src, spec.group_size, False, spec.stochastic,
                                            spec.bits, None, positive=True)  # fmt: skip
            p = quant.Packed(codes, scales, src.shape, src.dtype, spec, False)
            # registered by the caller once apply has returned: marking an in-place output
            # dirty moves its version on after this forward
            box.append((p, ctx.perm is not None))
            quant.save(ctx, p)
            ctx.shared = True
            ctx.shape = src.shape
            return out
        if op[0] != "relu":  # the condition from the input, before an in-place op changes it
            bits = _bits(x, op)
            src = bits if ctx.perm is None else bits.permute(ctx.perm)
            # the Triton packers are direct launches, which torch.compile cannot trace: there
            # the references' torch ops, which Inductor fuses
            packed = pack_bits_ref(src) if compiling else pack_bits(src)
        out = _apply(x, op, inplace)
        if inplace:
            ctx.mark_dirty(x)
        if op[0] == "relu":  # the bit straight from the output, in one pass
            src = out if ctx.perm is None else out.permute(ctx.perm)
            packed = pack_positive_ref(src) if compiling else pack_positive(src)
        ctx.save_for_backward(packed)
        ctx.shape = src.shape
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        if not torch.compiler.is_compiling():  # (a side effect the compiler would break on)
            BACKWARDS[0] += 1
        perm, op = ctx.perm, ctx.op
        g = grad if perm is None else grad.permute(perm)
        if ctx.shared:  # the condition from the codes: code > 0 exactly where out > 0 (or NaN)
            (p,) = quant.load(ctx)
            if not torch.compiler.is_compiling() and g.is_contiguous():
                # one pass over the codes, the result in the gradient's layout
                out = relu_backward_codes(g, p.codes, p.spec.bits)
            else:
                out = relu_backward_codes_ref(g, p.codes, p.spec.bits)
            return (out if perm is None else out.permute(inverse_perm(perm))), None, None, None
        (packed,) = ctx.saved_tensors
        selects = op[0] in ("relu", "hardtanh")
        if selects and not torch.compiler.is_compiling() and g.is_contiguous():
            # the gradient in the bits' order: one pass, the result in the gradient's layout
            out = relu_backward(g, packed)
            return (out if perm is None else out.permute(inverse_perm(perm))), None, None, None
        passes = unpack_bits(packed, ctx.shape)
        if perm is not None:
            passes = passes.permute(inverse_perm(perm))
        if op[0] == "leaky":
            # torch's own backward on a stand-in input with the kept sign: its arithmetic
            sign = torch.where(passes, 1.0, -1.0).to(grad.dtype)
            return torch.ops.aten.leaky_relu_backward(grad, sign, op[1], False), None, None, None
        if op[0] == "hardsigmoid":  # a stand-in inside (0) or outside (4) of (-3, 3)
            stand_in = torch.where(passes, 0.0, 4.0).to(grad.dtype)
            return torch.ops.aten.hardsigmoid_backward(grad, stand_in), None, None, None
        # where, not masked_fill: masked_fill's result is contiguous whatever the layout
        return torch.where(passes, grad, 0), None, None, None


def relu(
    x: torch.Tensor,
    inplace: bool = False,
    op: tuple = ("relu",),
    exact: bool = False,
    module=None,
    spec: QuantSpec | None = None,
) -> torch.Tensor:
    """``F.relu(x, inplace)`` (or the Hardtanh / LeakyReLU ``op``, see ``_apply``) keeping one
    bit per element when ``x`` needs grad (``exact``, debug_exact: Hardtanh runs torch's op,
    see the module's docstring); otherwise (no grad, non-floating input, inside
    torch.func transforms) the torch op itself. In-place LeakyReLU with a negative slope runs
    torch's op, whose backward refuses it as torch does. ``module`` and ``spec`` (a ReLU
    module and its setting): keep shared 8- or 4-bit codes once a convolution is known to keep
    the module's output (see the module docstring)."""
    if (
        not needs_grad(x)
        or plain_under_functorch("ReLU")
        or (inplace and op[0] == "leaky" and op[1] < 0)
        or (exact and op[0] == "hardtanh")
    ):
        return _apply(x, op, inplace)
    if inplace and torch.compiler.is_compiling():
        # Dynamo breaks the graph at a Function that marks its input dirty; the compiler
        # makes the copy in place again
        return x.copy_(ReLUFn.apply(x, False, op))
    shares = (
        module is not None and op[0] == "relu" and spec is not None and spec.bits in (8, 4)
        and not spec.exact and quant.compressible(x) and not torch.compiler.is_compiling()
    )  # fmt: skip
    state = getattr(module, "_mesa_relu_state", None) if shares else None
    # a recompute in backward (activation checkpointing) keeps what its forward kept: the
    # state changes, and offers are made, only in forwards outside a backward
    learn = shares and torch._C._current_graph_task_id() == -1
    if learn:
        last = getattr(module, "_mesa_last_offer", None)
        if last is not None and not last.claimed:
            module._mesa_unclaimed = True  # an output no consumer kept (or could reuse)
        if last is not None and last.epoch < BACKWARDS[0]:
            # a training step ended since the last offer, every offer of it looked at:
            # codes if each was claimed, the bit otherwise, until the next step says more
            state = "bits" if getattr(module, "_mesa_unclaimed", False) else "share"
            module._mesa_relu_state = state
            module._mesa_unclaimed = False
    if state == "share":
        box = []
        out = ReLUFn.apply(x, inplace, op, (spec, box))
        if box:
            quant.share(out, box[0][0], memory_order=box[0][1])
    else:
        out = ReLUFn.apply(x, inplace, op)
    if learn:
        module._mesa_last_offer = offer(out, spec)
    return out
