"""What a compiled wrapped model keeps for backward: the partitioner's choice, not the Functions'.

Under torch.compile the Functions' ``save_for_backward`` is only a hint: AOTAutograd merges
identical ops of forward and backward (CSE) and the min-cut partitioner picks what crosses from
forward to backward. These tests run the partitioner Inductor runs (``compiler="inductor"``,
Inductor's decompositions) and read the backward graph's inputs, on the CPU under bf16
autocast: no low-precision copy of a parameter crosses (the parameter itself is free to keep),
and the chunked loss's compiled backward writes no slices into a buffer of the logits' size.
"""

import math
import re

import pytest
import torch
import torch.nn as nn
from conftest import sqnr_db, tiny_lm_config

import mesa_lite
from mesa_lite.ops import cross_entropy as ce


def _recording_backend(graphs: list):
    """An aot_autograd backend with Inductor's partitioner and decompositions, no code
    generation; ``graphs`` gets each (forward, backward) pair."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def partition(joint, inputs, **kwargs):
        kwargs.pop("compiler", None)
        fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kwargs)
        graphs.append((fw, bw))
        return fw, bw

    def boxed(gm, _):
        from functorch.compile import make_boxed_func

        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition,
                        decompositions=select_decomp_table())  # fmt: skip


def _kept(bw) -> list[torch.Tensor]:
    """The fake values of what the backward graph takes from forward (not the tangents)."""
    out = []
    for n in bw.graph.nodes:
        if n.op == "placeholder" and not n.name.startswith("tangents"):
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.gn = nn.GroupNorm(4, 16)
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x):
        h = torch.relu(self.gn(self.bn(self.conv(x))))
        h = h.mean((2, 3))
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))


def _lm(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tiny_lm_config(family)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", ["convnet", "gpt2", "llama"])
def test_compiled_keeps_no_weight_copies(name):
    """No bf16 tensor of a parameter's shape (or its transpose) is kept from forward to
    backward: backward casts the parameter again, as eager mode does."""
    if name == "convnet":
        torch.manual_seed(0)
        model = ConvNet()
        mesa_lite.wrap(model, mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS
                                               | mesa_lite.OPT_IN_KINDS))  # fmt: skip
        args = (torch.randn(2, 3, 8, 8),)
        loss_of = lambda out: out.float().square().mean()  # noqa: E731
    else:
        model = _lm(name)
        mesa_lite.wrap(model)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        args = (ids,)
        loss_of = lambda out: out.logits.float().square().mean()  # noqa: E731
    model.train()
    shapes = set()
    for p in model.parameters():
        if p.dim() >= 2:
            shapes.add(tuple(p.shape))
            shapes.add(tuple(p.shape[::-1]))
    graphs: list = []
    compiled = mesa_lite.compile(model, backend=_recording_backend(graphs), fullgraph=True)
    with torch.autocast("cpu", torch.bfloat16):
        loss = loss_of(compiled(*args))
    loss.backward()
    assert graphs, "nothing was compiled"
    copies = [tuple(v.shape) for _, bw in graphs for v in _kept(bw)
              if v.dtype == torch.bfloat16 and tuple(v.shape) in shapes]  # fmt: skip
    assert not copies, f"bf16 copies of parameters kept for backward: {copies}"
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in model.parameters() if p.dim() >= 2)  # fmt: skip


def test_compiled_loss_backward_is_one_expression(monkeypatch):
    """The compiled loss's backward has no slice writes into a logits-sized buffer (the
    chunks of eager mode) and no reduction, and gives eager's gradient."""
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 64 * 100)  # eager: 64 rows a chunk
    g = torch.Generator().manual_seed(0)
    logits0 = torch.randn(300, 100, generator=g).bfloat16()
    labels = torch.randint(0, 100, (300,), generator=g)
    labels[::7] = -100

    def loss_fn(logits, labels):
        return ce.cross_entropy(logits, labels)

    grads = []
    for compiled in (False, True):
        logits = logits0.clone().requires_grad_()
        graphs: list = []
        fn = torch.compile(loss_fn, backend=_recording_backend(graphs), fullgraph=True) \
            if compiled else loss_fn  # fmt: skip
        fn(logits, labels).backward()
        grads.append(logits.grad.float())
        if compiled:
            ((_, bw),) = graphs
            targets = {str(n.target) for n in bw.graph.nodes if n.op == "call_function"}
            assert not any("scatter" in t or "index_put" in t for t in targets), targets
            # the forward's log-sum-exp is kept: no reduction over the vocabulary in backward
            # (recomputed there, Inductor's CUDA code wrote its epilogue out in fp32)
            reductions = [t for t in targets if any(r in t for r in ("amax", "logsumexp", "sum"))]
            assert not reductions, reductions
    assert sqnr_db(grads[0], grads[1]) > 40


def test_inductor_writes_no_fp32_logits_in_the_loss_backward():
    """Inductor's generated backward of a wrapped GPT-2 (its logits returned, its loss
    mesa_lite's) holds no fp32 buffer of the logits' size: every rows x vocab value of the
    compiled loss gradient is read by one op, so none is written out (GPT-2 small: 1,570 MiB).
    The bf16 gradient of the logits is the one such buffer."""
    transformers = pytest.importorskip("transformers")
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    batch, seq, vocab = 4, 128, 32768  # (smaller, Inductor fused the former form as well)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=seq,
                                  vocab_size=vocab, attn_pdrop=0.0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, loss_type="ForCausalLM")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    model = mesa_lite.wrap(model, mesa_lite.Config(keep_logits=True))
    compiled = mesa_lite.compile(model, backend="inductor")
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()

    _, codes = run_and_get_code(step)
    sizes = (f"({batch}, {seq}, {vocab})", f"({batch * seq}, {vocab})")
    buffers = [line.strip() for code in codes for line in code.splitlines()
               if "empty_strided" in line and any(z in line for z in sizes)]  # fmt: skip
    assert buffers and not [b for b in buffers if "float32" in b], buffers


def test_inductor_builds_no_logits_with_the_head_and_loss_fused(monkeypatch):
    """The head and loss fused (the default, issue 52): Inductor's generated forward and
    backward of a wrapped GPT-2 hold no buffer of all the tokens x vocab, only one chunk's
    (128 tokens here; the plain model's 512 x 32768 logits are 32 MiB in bf16)."""
    transformers = pytest.importorskip("transformers")
    from torch._inductor.utils import run_and_get_code

    from mesa_lite.ops import linear_cross_entropy as lce

    torch._dynamo.reset()
    batch, seq, vocab, chunk = 4, 128, 32768, 128
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", chunk * vocab)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=seq,
                                  vocab_size=vocab, attn_pdrop=0.0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, loss_type="ForCausalLM")  # fmt: skip
    torch.manual_seed(0)
    model = mesa_lite.wrap(transformers.GPT2LMHeadModel(cfg).train())
    compiled = mesa_lite.compile(model, backend="inductor")
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        return out

    out, codes = run_and_get_code(step)
    assert out.logits is None
    shapes = [[int(d) for d in m.split(",") if d.strip()] for code in codes
              for m in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code)]  # fmt: skip
    rows = [math.prod(s[:-1]) for s in shapes if s and s[-1] == vocab]
    assert rows and max(rows) <= chunk, rows


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_compiled_loss_matches_torch_on_edge_rows(reduction):
    """The compiled loss (its log-sum-exp kept from the forward) against F.cross_entropy on the
    fp32 logits and against the eager chunked loss: ignored labels, a whole batch ignored, and
    non-finite logits (+inf, NaN, a row of -inf), which stay NaN in the loss and the gradient
    as torch's do (so GradScaler skips the step)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(64, 50, generator=g).bfloat16()
    y0 = torch.randint(0, 50, (64,), generator=g)
    y0[::5] = -100
    cases = {"plain": (x0, y0), "all ignored": (x0, torch.full_like(y0, -100))}
    for name, value, where in (("+inf", float("inf"), (3, 4)), ("nan", float("nan"), (3, 4)),
                               ("-inf row", float("-inf"), (5, slice(None)))):  # fmt: skip
        x = x0.clone()
        x[where] = value
        cases[name] = (x, y0)

    def loss_fn(logits, labels):
        return ce.cross_entropy(logits, labels, reduction=reduction)

    compiled = torch.compile(loss_fn, fullgraph=True)
    for name, (x, y) in cases.items():
        losses, grads = [], []
        for fn in (loss_fn, compiled):
            logits = x.clone().requires_grad_()
            loss = fn(logits, y)
            loss.backward()
            losses.append(loss.detach())
            grads.append(logits.grad.float())
        ref = torch.nn.functional.cross_entropy(x.float(), y, reduction=reduction)
        for loss in losses:
            torch.testing.assert_close(loss, ref, equal_nan=True, rtol=1e-6, atol=0, msg=name)
        torch.testing.assert_close(grads[1], grads[0], equal_nan=True, rtol=0, atol=1e-2,
                                   msg=name)  # fmt: skip
