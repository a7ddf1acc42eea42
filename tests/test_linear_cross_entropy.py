"""The fused head and cross-entropy (issue 52, item 1): ``linear_cross_entropy`` against the
plain ``F.cross_entropy(F.linear(x, W, b).float(), labels)``, loss and gradients, with chunks
forced small, ignored rows, fp32 and bf16 autocast; and no tensor of rows x vocab, forward or
backward."""

import pytest
import torch
import torch.nn.functional as F
from conftest import sqnr_db
from torch.utils._python_dispatch import TorchDispatchMode

from mesa_lite.ops import linear_cross_entropy as lce

ROWS, HIDDEN, VOCAB = 37, 24, 50


def _inputs(seed=0, bias=True, ignored=(3, 4, 20)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HIDDEN, generator=g, requires_grad=True)
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(VOCAB, generator=g) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    labels[list(ignored)] = -100
    return x, w, b, labels


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 rows at this vocabulary: 5 chunks, the last one short."""
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 8 * VOCAB)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("num_items", [None, 29], ids=["mean", "sum-over-items"])
def test_fp32_loss_and_gradients_match_the_plain_head_and_loss(bias, num_items, small_chunks):
    x, w, b, labels = _inputs(bias=bias)
    logits = F.linear(x, w, b).float()
    if num_items is None:
        ref = F.cross_entropy(logits, labels)
    else:
        ref = F.cross_entropy(logits, labels, reduction="sum") / num_items
    got = lce.linear_cross_entropy(x, w, b, labels, num_items_in_batch=num_items)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    for a, e in zip(_grads(got * 3.0, x, w, b), _grads(ref * 3.0, x, w, b), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_matches_the_plain_head_and_loss(small_chunks):
    """Under autocast the head runs in bf16 as plain's does; the weight's gradient sums the
    chunks in fp32 where plain sums every row in one bf16 product, so it is at least as
    accurate: within the bf16 rounding of plain's against an fp32 reference."""
    x, w, b, labels = _inputs(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(x, w, b).float(), labels)
        got = lce.linear_cross_entropy(x, w, b, labels)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    exact = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), labels)
    for a, e, t in zip(_grads(got, x, w, b), _grads(ref, x, w, b), _grads(exact, x, w, b),
                       strict=True):  # fmt: skip
        assert a.dtype == e.dtype == torch.float32
        assert sqnr_db(t, a) >= sqnr_db(t, e) - 3.0 and sqnr_db(t, a) > 40, (
            sqnr_db(t, a), sqnr_db(t, e))  # fmt: skip


def test_every_label_ignored_gives_nan_as_the_plain_mean_does(small_chunks):
    x, w, b, labels = _inputs(ignored=range(ROWS))
    got = lce.linear_cross_entropy(x, w, b, labels)
    assert torch.isnan(got) and torch.isnan(F.cross_entropy(F.linear(x, w, b), labels))
    gx, gw, gb = _grads(lce.linear_cross_entropy(x, w, b, labels, num_items_in_batch=1), x, w, b)
    assert not gx.any() and not gw.any() and not gb.any()


def test_frozen_weight_and_input_without_grad(small_chunks):
    x, w, b, labels = _inputs()
    w.requires_grad_(False)
    (gx, gb) = _grads(lce.linear_cross_entropy(x, w, b, labels), x, b)
    rx, rb = _grads(F.cross_entropy(F.linear(x, w, b), labels), x, b)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gb, rb, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        assert torch.allclose(lce.linear_cross_entropy(x, w, b, labels),
                              F.cross_entropy(F.linear(x, w, b), labels), rtol=1e-6)  # fmt: skip


class _LargestLogits(TorchDispatchMode):
    """Records the most rows of any tensor whose last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB:
                if t.numel() != VOCAB * HIDDEN:  # the weight (transposed): not logits
                    self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def test_no_tensor_of_rows_by_vocab_exists_forward_or_backward(small_chunks):
    x, w, _, labels = _inputs(bias=False)
    with _LargestLogits() as seen:
        loss = lce.linear_cross_entropy(x, w, None, labels)
        loss.backward()
    assert 0 < seen.rows <= 8, seen.rows  # one chunk's logits at most
    with _LargestLogits() as plain:
        F.cross_entropy(F.linear(x, w), labels).backward()
    assert plain.rows == ROWS  # the measure sees the plain op's logits


def test_bad_labels_get_a_clear_error():
    x, w, b, labels = _inputs()
    with pytest.raises(TypeError, match="labels must be an integer tensor, got torch.float32"):
        lce.linear_cross_entropy(x, w, b, labels.float())
    with pytest.raises(ValueError, match=r"labels of shape \(36,\) do not match the \(37,\)"):
        lce.linear_cross_entropy(x, w, b, labels[1:])
    bad = labels.clone()
    bad[0] = VOCAB  # out of range: the plain op's own error
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        lce.linear_cross_entropy(x, w, b, bad)
