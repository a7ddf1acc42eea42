"""A language model's head and its cross-entropy in one Function, the logits never built whole.

``LinearCrossEntropyFn`` takes the head's input ``x`` (rows x hidden), its weight and bias and
the labels, and works through the rows a chunk at a time: each chunk's logits (``x @ W^T + b``
in autocast's dtype, as the head computes them), their cross-entropy in fp32 (as
transformers' causal-LM loss upcasts them), and at once their gradient, the softmax minus the
one-hot labels, in the logits' dtype, multiplied back into the gradients of ``x``, the weight
and the bias. Forward keeps those three gradients (the approach of Liger-Kernel's fused
linear cross-entropy), and the weight and bias themselves for autograd's in-place check;
backward scales the gradients by the loss's gradient. No
tensor of rows x vocab exists outside one chunk, forward or backward.

The loss equals transformers' within fp32 rounding (each chunk's is ``F.cross_entropy``'s own
two steps, ``log_softmax`` then ``nll_loss``, bit for bit the plain op on that chunk's fp32
logits; the chunks' sums add up in fp32). The softmax for the gradient is those
log-probabilities' ``exp``, in place. The gradients are
those of the plain head and loss computed chunk by chunk: the weight's and bias's are summed
over the chunks in fp32 (on CUDA the weight's straight from the product's fp32 accumulator)
where the plain backward sums all rows in one low-precision matrix product, so they differ
from plain's by that rounding, not more. No host synchronization: the number of labels that
count (the mean's denominator) stays a tensor, so the Function traces into one graph under
torch.compile.

Under torch.compile each chunk's addition to the weight's and the bias's gradients is one
opaque op (``mesa_lite::addmm_fp32``, ``mesa_lite::add_sum_fp32``). Written as
``gw + (g.t() @ h).float()`` and ``gb + g.float().sum(0)``, Inductor fused each chain of
additions over all chunks into kernels that ran at the end of the loop, so every chunk's
vocab x hidden product and every chunk's softmax gradient were alive at once: a compiled
GPT-2 small (batch 8 x 1024, 25 chunks, 74 MiB and 32 MiB each) peaked 3,875 MiB above its
step's start, 1,727 MiB with the ops (``benchmarks/results/llm_fused_head_gpt2_h200.md``,
``llm_fused_head_compiled_gpt2_h100.md``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite.ops.common import autocast_cast, autocast_dtype, cast, first_order_only
from mesa_lite.ops.cross_entropy import row_chunks

# rows per chunk: about this many fp32 elements of logits at a time (64 MiB)
CHUNK_ELEMENTS = 1 << 24
# the products run on a vocabulary padded with zero rows of the weight to a multiple of this:
# with GPT-2's 50,257 the logits' rows are not 16-byte aligned, and cuBLAS took kernels for
# unaligned operands that ran the head's three products per chunk at about 80-115 TFLOP/s on
# the H100 (benchmarks/results/llm_head_profile_gpt2_h100.txt); the plain head has the same
# cost, and Inductor pads the plain compiled one's strides itself
VOCAB_ALIGN = 64


class LinearCrossEntropyFn(torch.autograd.Function):
    """``F.cross_entropy(F.linear(x, weight, bias).float(), labels, ignore_index=...,
    reduction="sum")`` for 2-D ``x`` (rows x hidden) and 1-D integer ``labels``, the linear
    in ``dtype`` (autocast's cast target; None: no cast). Returns the fp32 sum."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels, ignore_index: int, dtype):
        xc = autocast_cast(x, dtype)
        n, vocab = xc.shape[0], weight.shape[0]
        # the weight (and bias) cast as autocast would, with zero rows up to a multiple of
        # VOCAB_ALIGN (see padded_vocab): every product below then has aligned strides
        w, b = _padded(weight, dtype), _padded(bias, dtype)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        gx = torch.empty_like(xc) if need_x else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        gb = torch.zeros(vocab, dtype=torch.float32, device=w.device) if need_b else None
        total = None
        with torch.autocast(xc.device.type, enabled=False):  # cast above, as autocast would
            for start, end in row_chunks(n, vocab, CHUNK_ELEMENTS):
                h, t = xc[start:end], labels[start:end]
                logits_padded = F.linear(h, w, b)
                logits = logits_padded[:, :vocab]  # each row as the unpadded product's
                z = logits.float()
                # F.cross_entropy's own two steps (its result bit for bit), the
                # log-probabilities kept for the gradient
                logp = torch.log_softmax(z, dim=-1)
                part = F.nll_loss(logp, t, ignore_index=ignore_index, reduction="sum")
                total = part if total is None else total + part
                if not (need_x or need_w or need_b):
                    continue
                keep = t.ne(ignore_index)
                # softmax minus the one-hot labels, zero on the rows that do not count: in
                # place over the log-probabilities (one chunk-sized fp32 buffer, not three)
                g = logp.exp_()
                one = keep.to(g.dtype).unsqueeze(1)
                g.scatter_add_(1, torch.where(keep, t, 0).unsqueeze(1), -one).mul_(one)
                # as the plain backward: the logits' dtype from here; zero in the padding
                gp = _zero_padded(g, 1, w.shape[0], logits.dtype)
                if need_x:
                    gx[start:end] = gp @ w
                if need_w:
                    gw = accumulate_mm(gw, gp.t(), h)
                if need_b:
                    gb = accumulate_sum(gb, gp[:, :vocab])
        if total is None:  # no rows: the plain op's sum over nothing
            total = xc.new_zeros((), dtype=torch.float32)
        ctx.x_dtype = x.dtype
        # the weight and bias too (parameters, kept anyway): autograd's check then raises, as
        # for the plain head, if they are changed in place before backward
        ctx.save_for_backward(gx, gw, gb, weight, bias)
        return total

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        gx, gw, gb, weight, bias = ctx.saved_tensors
        # scaled in fp32, one rounding to each input's dtype (a bf16 product would round twice)
        out_x = None if gx is None else (gx.float() * grad).to(ctx.x_dtype)
        out_w = None if gw is None else (gw[: weight.shape[0]] * grad).to(weight.dtype)
        out_b = None if gb is None else (gb * grad).to(bias.dtype)
        return out_x, out_w, out_b, None, None, None


def padded_vocab(vocab: int) -> int:
    """``vocab`` rounded up to a multiple of ``VOCAB_ALIGN``."""
    return -(-vocab // VOCAB_ALIGN) * VOCAB_ALIGN


def _padded(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``autocast_cast(t, dtype)`` (a weight or bias, vocabulary first) with zero rows up to
    ``padded_vocab``, cast and padded in one copy; ``t`` itself where neither is needed."""
    if t is None:
        return None
    target = autocast_cast(t[:0], dtype).dtype  # autocast's rule, on no data
    return _zero_padded(t, 0, padded_vocab(t.shape[0]), target)


def _zero_padded(t: torch.Tensor, dim: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` with zeros after it along ``dim`` up to ``size``, cast and padded in
    one copy; ``t`` cast (itself in its own dtype) where it has ``size`` already."""
    if t.shape[dim] == size:
        return cast(t, dtype)
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_zeros(shape, dtype=dtype)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` for an fp32 ``acc``: on CUDA, for fp16/bf16 ``a`` and ``b``, through the
    matrix product's own fp32 accumulator (no rounding of the product to their dtype, no
    temporary of its size); elsewhere the product rounded to its dtype, then added in fp32,
    in place in eager mode. Under torch.compile one opaque op (see the module docstring).
    Returns the sum (the caller rebinds ``acc``)."""
    if torch.compiler.is_compiling():
        return torch.ops.mesa_lite.addmm_fp32(acc, a, b)
    if _fp32_accumulator(a):
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    return acc.add_((a @ b).float())


def accumulate_sum(acc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``acc + g.float().sum(0)`` for an fp32 ``acc``; in place in eager mode, under
    torch.compile one opaque op (see the module docstring)."""
    if torch.compiler.is_compiling():
        return torch.ops.mesa_lite.add_sum_fp32(acc, g)
    return acc.add_(g.float().sum(0))


def _fp32_accumulator(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype in (torch.float16, torch.bfloat16)


@torch.library.custom_op("mesa_lite::addmm_fp32", mutates_args=())
def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _fp32_accumulator(a):
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    return acc + (a @ b).float()


@_addmm_fp32.register_fake
def _(acc, a, b):
    return torch.empty_like(acc)


@torch.library.custom_op("mesa_lite::add_sum_fp32", mutates_args=())
def _add_sum_fp32(acc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return acc + g.float().sum(0)


@_add_sum_fp32.register_fake
def _(acc, g):
    return torch.empty_like(acc)


def linear_cross_entropy(x, weight, bias, labels, ignore_index: int = -100,
                         num_items_in_batch=None) -> torch.Tensor:  # fmt: skip
    """The cross-entropy of ``F.linear(x, weight, bias)`` (under autocast's cast, upcast to
    fp32) against ``labels``, ``x`` of shape ``(..., hidden)`` and ``labels`` of ``x``'s
    leading shape: the mean over the labels that are not ``ignore_index``, or the sum divided
    by ``num_items_in_batch`` when given (transformers' reduction). See the module docstring.

    Raises:
        TypeError: labels that are not an integer tensor.
        ValueError: labels whose shape is not ``x``'s leading shape.
    """
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"linear_cross_entropy: labels must be an integer tensor, got {got}")
    if labels.shape != x.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: labels of shape {tuple(labels.shape)} do not match the "
            f"{tuple(x.shape[:-1])} positions of the head's input {tuple(x.shape)}"
        )
    dtype = autocast_dtype("linear", x.device)
    rows = labels.reshape(-1).to(x.device)
    total = LinearCrossEntropyFn.apply(
        x.reshape(-1, x.shape[-1]), weight, bias, rows, ignore_index, dtype
    )
    if num_items_in_batch is None:
        return total / rows.ne(ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
