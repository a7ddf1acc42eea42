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
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                continue
            width = t.shape[-1]  # the vocabulary, or the products' padded vocabulary
            if width in (VOCAB, lce.padded_vocab(VOCAB)) and t.numel() != width * HIDDEN:
                self.rows = max(self.rows, t.numel() // width)  # not the weight: logits
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


class _Products(TorchDispatchMode):
    """Records the shapes of every matrix product's operands."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.shapes.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_products_run_on_the_vocabulary_padded_to_a_multiple_of_64(bias, small_chunks):
    """Each chunk's logits, the input's and the weight's gradients are products over the
    vocabulary padded with zero rows of the weight (50 -> 64): aligned strides for cuBLAS
    (GPT-2's 50,257 is odd). The gradients are the unpadded ones (shapes and values)."""
    x, w, b, labels = _inputs(bias=bias)
    with _Products() as seen:
        loss = lce.linear_cross_entropy(x, w, b, labels)
        grads = _grads(loss, x, w, b)
    vocab_dims = {d for shapes in seen.shapes for s in shapes for d in s if d in (VOCAB, 64)}
    assert len(seen.shapes) == 3 * 5 and vocab_dims == {64}, seen.shapes  # 5 chunks
    ref = _grads(F.cross_entropy(F.linear(x, w, b), labels), x, w, b)
    for a, e in zip(grads, ref, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
    aligned = torch.randn(64, 37, requires_grad=True)  # already a multiple: no copy
    assert lce._padded(aligned, None) is aligned and lce.padded_vocab(50257) == 50304


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


def test_the_accumulate_op_and_the_inductor_path_match_eager(small_chunks):
    """``mesa_lite::addmm_fp32`` and ``mesa_lite::add_sum_fp32``, the weight's and the bias's
    gradient summed per chunk under torch.compile, pass PyTorch's custom-op checks and give
    eager's gradients under Inductor, fp32 and bf16 autocast."""
    g = torch.Generator().manual_seed(3)
    acc = torch.randn(VOCAB, HIDDEN, generator=g)
    a = torch.randn(VOCAB, 8, generator=g).bfloat16()
    b = torch.randn(8, HIDDEN, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.mesa_lite.addmm_fp32, (acc, a, b))
    ref = acc + (a @ b).float()
    torch.testing.assert_close(torch.ops.mesa_lite.addmm_fp32(acc, a, b), ref, rtol=0, atol=0)
    assert lce.accumulate_mm(acc.clone(), a, b).equal(ref)
    torch.library.opcheck(torch.ops.mesa_lite.add_sum_fp32, (acc[0], b))
    ref = acc[0] + b.float().sum(0)
    torch.testing.assert_close(torch.ops.mesa_lite.add_sum_fp32(acc[0], b), ref, rtol=0, atol=0)
    assert lce.accumulate_sum(acc[0].clone(), b).equal(ref)
    x, w, bias, labels = _inputs(seed=2)
    fn = torch.compile(lce.linear_cross_entropy, backend="inductor", fullgraph=True)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            want = _grads(lce.linear_cross_entropy(x, w, bias, labels), x, w, bias)
            got = _grads(fn(x, w, bias, labels), x, w, bias)
        for n, p, q in zip("x w b".split(), got, want, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{n}, {autocast}")


def test_each_chunk_adds_to_the_weight_and_bias_gradients_through_one_opaque_op(small_chunks):
    """Under torch.compile every chunk adds to the weight's and the bias's gradients through
    ``mesa_lite::addmm_fp32`` and ``mesa_lite::add_sum_fp32``, and the graph holds no
    pointwise additions of vocab x hidden tensors. Written as ``gw + (g.t() @ h).float()``,
    Inductor fused the chain over every chunk into one kernel at the loop's end on CUDA, every
    chunk's product and softmax gradient alive at once: a compiled GPT-2 small (batch 8 x 1024,
    25 chunks) held 3,875 MiB at its peak, 1,727 MiB with the ops
    (``benchmarks/results/llm_fused_head_gpt2_h200.md``, ``..._compiled_gpt2_h100.md``). The
    fused chain did not form with the head compiled alone, so the test reads the graph."""
    graphs = []

    def backend(gm, inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(g, _):
            graphs.append(g)
            return g

        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)

    x, w, b, labels = _inputs(seed=4)
    fn = torch.compile(lce.linear_cross_entropy, backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fn(x, w, b, labels).backward()
    calls = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    chunks = -(-ROWS // 8)
    assert calls.count("mesa_lite.addmm_fp32.default") == chunks, calls
    assert calls.count("mesa_lite.add_sum_fp32.default") == chunks, calls
    wide_adds = [
        n for g in graphs for n in g.graph.nodes
        if n.op == "call_function" and str(n.target) == "aten.add.Tensor"
        and tuple(n.meta["val"].shape) == (VOCAB, HIDDEN)
    ]  # fmt: skip
    assert not wide_adds, wide_adds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the fp32-accumulator "
                    "sum (torch.addmm out_dtype) runs on CUDA only")  # fmt: skip
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_bf16_gradients_match_the_plain_head_and_loss(compiled, monkeypatch):
    """On CUDA the weight's gradient comes from the product's fp32 accumulator: the gradients,
    eager and under Inductor, are at least as close to an fp64 reference as plain bf16's."""
    g = torch.Generator().manual_seed(5)
    rows, hidden, vocab = 700, 64, 3000
    x = torch.randn(rows, hidden, generator=g).cuda().requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.1).cuda().requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).cuda().requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g).cuda()
    labels[::7] = -100
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 128 * vocab)  # 6 chunks, the last one short
    fn = lce.linear_cross_entropy
    if compiled:
        fn = torch.compile(fn, fullgraph=True, dynamic=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(x, w, b).float(), labels)
        got = fn(x, w, b, labels)
    exact = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), labels)
    if compiled:
        # Inductor fuses the logits' bf16 rounding into the loss (emulate_precision_casts is off
        # by default), so its loss differs from eager's by about 1e-5 (H200, torch 2.11: 1.1e-5):
        # it must be as close to the fp64 loss as plain bf16's, not equal to it
        assert abs(got.double() - exact) <= abs(ref.double() - exact) + 5e-5 * exact.abs()
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    for a, e, t in zip(_grads(got, x, w, b), _grads(ref, x, w, b), _grads(exact, x, w, b),
                       strict=True):  # fmt: skip
        assert a.dtype == torch.float32
        assert sqnr_db(t, a) >= sqnr_db(t, e) - 1.0 and sqnr_db(t, a) > 35, (
            sqnr_db(t, a), sqnr_db(t, e))  # fmt: skip
