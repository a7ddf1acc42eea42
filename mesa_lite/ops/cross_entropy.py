"""Cross-entropy over a large vocabulary without the fp32 ``rows x vocab`` log-probabilities
that ``F.cross_entropy(logits.float(), ...)`` keeps for backward.

``ChunkedCrossEntropyFn`` takes the logits in their own dtype (bf16/fp16 under autocast: the
language model's output, which lives anyway) and works through them a chunk of rows at a time:
the forward sums ``F.cross_entropy(chunk.float(), labels, reduction="sum")`` per chunk, the
backward recomputes each chunk's softmax in fp32. It keeps only a reference to the logits and
the labels. The fp32 temporaries are one chunk's, not the whole batch's.

The loss equals PyTorch's within fp32 rounding, not bit for bit: the sum runs chunk by chunk
instead of in one reduction (tested: relative difference below 1e-6).

Under torch.compile both directions are written whole, without chunks: Inductor fuses the
fp32 upcast, the softmax and the one-hot subtraction into one kernel per direction that
reads the logits and writes their gradient (see ``_compiled_grad`` for how it is written so
that nothing of rows x vocab in fp32 is written out). The logits may come in any shape
``(..., vocab)`` (a language model's ``(batch, seq, vocab)``), and their gradient has that
shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesa_lite.ops.common import first_order_only, plain_under_functorch

# rows per chunk: about this many fp32 elements of logits at a time (64 MiB; at 128 MiB the
# activation peak of GPT-2 small, batch 8 x 1024, was 192 MiB higher and no step faster)
CHUNK_ELEMENTS = 1 << 24


def row_chunks(n: int, vocab: int, elements: int):
    """``(start, end)`` of each chunk of ``n`` rows of ``vocab`` values, about ``elements``
    values a chunk (one row at least)."""
    rows = max(1, elements // max(vocab, 1))
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


class ChunkedCrossEntropyFn(torch.autograd.Function):
    """``F.cross_entropy(logits.float() if upcast else logits, labels, ignore_index=...,
    reduction=...)`` for 2-D ``logits`` (rows x vocab) and 1-D integer ``labels``;
    ``reduction`` "mean" or "sum".

    Each chunk's loss runs under the caller's autocast state, as the whole would: with
    ``upcast`` (transformers' causal-LM loss casts the logits itself) in fp32; without it in
    whatever precision autocast gives ``F.cross_entropy`` on that device (CUDA autocast keeps
    bf16/fp16 log-probabilities and upcasts them for the NLL). The chunks' sums add up in
    fp32. Backward computes the softmax in fp32 in every case."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index: int, reduction: str, upcast: bool = True):
        # rows: every dim but the last (a language model's (batch, seq, vocab) logits as they
        # are: their gradient then has the logits' own shape, which under torch.compile lets
        # Inductor fuse it with the logits' other gradient instead of writing it out in fp32)
        ctx.shape = logits.shape
        given = logits, labels
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1)
        n, vocab = logits.shape
        # Out of place, and no cast to the dtype a tensor has: the tensor returned is one op's
        # result. An in-place sum or a no-op cast returned here makes torch 2.11's compiler
        # route the gradient to a phantom output, zeroing every gradient behind the loss
        # (pytorch/pytorch#180642; tests/alias_check.py finds the class in eager mode).
        total, out_dtype, saved = None, torch.float32, given
        if torch.compiler.is_compiling() and upcast:
            # one reduction, its log-sum-exp kept for backward (rows in fp32): backward is then
            # pointwise, one fused kernel from the logits to their gradient. Recomputed there,
            # the reduction's pointwise epilogue was written out in fp32 by Inductor's CUDA
            # code (rows x vocab, 1,570 MiB on GPT-2 small at batch 8 x 1024)
            x = logits.float()
            # log_softmax's form, not torch.logsumexp's (which makes a row with +inf give
            # +inf): a non-finite row gives NaN, as F.cross_entropy's does
            top = x.amax(-1, keepdim=True)
            lse = (x - top).exp().sum(-1).log() + top.squeeze(-1)
            keep = labels.ne(ignore_index)
            # gathered at the labels as given (0 where ignored): an out-of-range label fails
            # Inductor's bounds check as F.cross_entropy's does
            picked = x.gather(1, torch.where(keep, labels, 0).unsqueeze(1)).squeeze(1)
            total = torch.where(keep, lse - picked, 0.0).sum()
            saved = (*given, lse.view(ctx.shape[:-1]))
        if total is not None:
            spans = []
        else:  # the chunks, or the whole under compile (the other autocast precisions)
            compiling = torch.compiler.is_compiling()
            spans = [(0, n)] if compiling else row_chunks(n, vocab, CHUNK_ELEMENTS)
        for a, b in spans:
            chunk = logits[a:b].float() if upcast else logits[a:b]
            part = F.cross_entropy(chunk, labels[a:b], ignore_index=ignore_index, reduction="sum")
            out_dtype = part.dtype
            part = part if part.dtype == torch.float32 else part.float()
            total = part if total is None else total + part
        if total is None:  # no rows
            total = logits.new_zeros((), dtype=torch.float32)
        count = labels.ne(ignore_index).sum()
        ctx.save_for_backward(*saved)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        if reduction == "mean":
            ctx.count = count
            total = total / count
        return total if total.dtype == out_dtype else total.to(out_dtype)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        logits, labels, *lse = ctx.saved_tensors  # in their own shapes
        vocab = logits.shape[-1]
        scale = grad.float()
        if ctx.reduction == "mean":  # no label left: PyTorch's gradient is 0 (the loss is NaN)
            scale = scale / ctx.count.clamp_min(1)
        if torch.compiler.is_compiling():
            g = _compiled_grad(logits, labels, ctx.ignore_index, scale, *lse)
            return g, None, None, None, None
        logits, labels = logits.reshape(-1, vocab), labels.reshape(-1)
        n = logits.shape[0]
        out = torch.empty_like(logits)
        for a, b in row_chunks(n, vocab, CHUNK_ELEMENTS):
            lab = labels[a:b]
            keep = lab.ne(ctx.ignore_index).unsqueeze(1)
            g = torch.softmax(logits[a:b].float(), -1)
            g.scatter_add_(1, lab.clamp(0, vocab - 1).unsqueeze(1), -keep.float())
            g.mul_(scale)
            # ignored rows get 0, as in PyTorch, even where the scale is not finite (a sum
            # divided by num_items_in_batch = 0 when every label is ignored)
            g.masked_fill_(~keep, 0.0)
            out[a:b] = g
        return out.view(ctx.shape), None, None, None, None


def _compiled_grad(logits, labels, ignore_index: int, scale, lse=None) -> torch.Tensor:
    """The backward's gradient as one expression (pointwise on the fp32 softmax) that Inductor
    fuses: no scatter, no slices written into a buffer. ``lse``: the forward's log-sum-exp of
    each row (computed here when not given)."""
    vocab = logits.shape[-1]
    keep = labels.ne(ignore_index).unsqueeze(-1)
    hit = torch.arange(vocab, device=logits.device) == labels.clamp(0, vocab - 1).unsqueeze(-1)
    x = logits.float()
    # every rows x vocab value read by one op only: Inductor writes out (realizes) an exp that
    # two ops read, rows x vocab in fp32 (1,570 MiB for GPT-2 small at batch 8 x 1024): the
    # softmax's exp(x - max) feeds its sum and its division, and a where(hit, g - 1, g) reads
    # g twice. exp(x - logsumexp(x)) keeps the reduction's exp inside the reduction, and the
    # one-hot is subtracted as a float mask (the generated CPU code holds no fp32 buffer then)
    lse = torch.logsumexp(x, -1) if lse is None else lse
    g = (torch.exp(x - lse.unsqueeze(-1)) - (hit & keep).float()) * scale
    return torch.where(keep, g, 0.0).to(logits.dtype)


def cross_entropy(logits, labels, ignore_index: int = -100, reduction: str = "mean",
                  upcast: bool = True, rows: bool = False):  # fmt: skip
    """``F.cross_entropy(logits.float() if upcast else logits, labels, ...)`` for 2-D logits
    through ``ChunkedCrossEntropyFn`` (logits that need no grad, or other reductions: the
    plain op). ``rows``: ``logits`` of any shape ``(..., vocab)`` with ``labels`` of shape
    ``(...)``, taken as ``logits.view(-1, vocab)`` and ``labels.view(-1)``."""
    if rows:
        if logits.dim() < 2 or tuple(labels.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"cross_entropy: expected logits (..., vocab) and labels (...), got "
                f"{tuple(logits.shape)} and {tuple(labels.shape)}"
            )
    elif logits.dim() != 2 or labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(
            f"cross_entropy: expected logits (rows, vocab) and labels (rows,), got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    plain = reduction not in ("mean", "sum") or not (
        torch.is_grad_enabled() and logits.requires_grad
    )
    if plain or plain_under_functorch("the chunked cross-entropy"):
        x = logits.float() if upcast else logits
        if rows:
            x, labels = x.flatten(0, -2), labels.flatten()
        return F.cross_entropy(x, labels, ignore_index=ignore_index, reduction=reduction)
    return ChunkedCrossEntropyFn.apply(logits, labels, ignore_index, reduction, upcast)
