"""mesa_lite.graphed: CUDA-graphed training steps (torch.cuda.make_graphed_callables).

On the GPU: graphed steps against eager ones of the same model (plain and wrapped), BatchNorm
statistics, dropout draws, the fallback for calls the graphs cannot serve, memory and ungraph.
Everywhere: what is refused before capture, with the reason.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import sqnr_db

import mesa_lite
from mesa_lite import Config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


class Net(nn.Module):
    """A small pre-norm transformer-ish block stack with a classifier head."""

    def __init__(self, width=64, depth=2, classes=10, p=0.0):
        super().__init__()
        self.embed = nn.Linear(48, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
                nn.Dropout(p),
            )  # fmt: skip
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h).mean(1))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _batches(n, shape, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g).to(device),
             torch.randint(0, 10, (shape[0],), generator=g).to(device)) for _ in range(n)]  # fmt: skip


def _steps(model, batches, dtype, static=None):
    """AdamW steps under autocast; per step the loss and every parameter's gradient. With
    ``static`` each batch is copied into that one input tensor first (a graphed loop)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for x, y in batches:
        if static is not None:
            static.copy_(x)
            x = static
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


# ---- refused before capture (any machine) ---------------------------------------------------


def test_refusals_name_the_problem():
    x = torch.randn(2, 8, 48)
    with pytest.raises(ValueError, match="evaluation mode"):
        mesa_lite.graphed(Net().eval(), (x,))
    m = Net()
    m.blocks[1][2].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"module 'blocks.1.2' \(GELU\) has a forward hook"):
        mesa_lite.graphed(m, (x,))
    m = Net()
    m.register_full_backward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="the model has a backward hook"):
        mesa_lite.graphed(m, (x,))
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        with pytest.raises(ValueError, match="global module forward_pre hook"):
            mesa_lite.graphed(Net(), (x,))
    finally:
        handle.remove()
    m = mesa_lite.wrap(Net(), Config(bits=4))  # 4 bits round stochastically by default
    with pytest.raises(ValueError, match="rounds stochastically"):
        mesa_lite.graphed(m, (x,))
    m = Net()
    m.head.weight.register_hook(lambda g: g * 2)
    with pytest.raises(ValueError, match="parameter 'head.weight' has a tensor hook"):
        mesa_lite.graphed(m, (x,))
    m = Net()
    m.register_buffer("scale", torch.ones(3, requires_grad=True))
    with pytest.raises(ValueError, match="buffer 'scale' requires grad"):
        mesa_lite.graphed(m, (x,))
    with pytest.raises(ValueError, match="autocast must be"):
        mesa_lite.graphed(Net(), (x,), autocast=torch.float64)
    with pytest.raises(ValueError, match="sample argument 1 is a int"):
        mesa_lite.graphed(Net(), (x, 3))
    with pytest.raises(ValueError, match="fallback must be"):
        mesa_lite.graphed(Net(), (x,), fallback="skip")
    with pytest.raises(ValueError, match="warmup must be"):
        mesa_lite.graphed(Net(), (x,), warmup=0)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        mesa_lite.graphed(lambda t: t, (x,))
    with pytest.raises(ValueError, match="not graphed"):
        mesa_lite.graph_memory(Net())
    assert mesa_lite.graph_info(Net()) is None
    m = Net()
    assert mesa_lite.ungraph(m) is m and "forward" not in vars(m)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only message")
def test_without_a_gpu_the_error_says_so():
    with pytest.raises(ValueError, match="need a CUDA device"):
        mesa_lite.graphed(Net(), (torch.randn(2, 8, 48),))


@cuda
def test_off_gpu_parameters_and_inputs_are_refused():
    with pytest.raises(ValueError, match="parameter 'embed.weight' is on cpu"):
        mesa_lite.graphed(Net(), (torch.randn(2, 8, 48, device="cuda"),))
    with pytest.raises(ValueError, match="sample argument 0 is on cpu"):
        mesa_lite.graphed(Net().cuda(), (torch.randn(2, 8, 48),))


# ---- on the GPU -----------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "mesa"])
def test_graphed_steps_match_eager_steps(wrapped, dtype):
    """Three AdamW steps, graphed and eager, from the same weights: the same losses and
    gradients (the same kernels replayed; wrapped: the same codes), and the wrapped model's
    gradients above the 8-bit floor against the plain eager model's."""
    torch.manual_seed(0)
    plain = Net().cuda()
    model = mesa_lite.wrap(copy.deepcopy(plain)) if wrapped else copy.deepcopy(plain)
    batches = _batches(3, (16, 8, 48))
    eager = _steps(copy.deepcopy(model), batches, dtype)
    static = batches[0][0].clone()
    g = mesa_lite.graphed(copy.deepcopy(model), (static,), autocast=dtype, fallback="error")
    replayed = _steps(g, batches, dtype, static=static)
    assert mesa_lite.graph_info(g).replays == 3 and mesa_lite.graph_info(g).eager_calls == 0
    reference = _steps(copy.deepcopy(plain), batches, dtype)
    for (l0, g0), (l1, g1), (_, gp) in zip(eager, replayed, reference, strict=True):
        assert l1 == pytest.approx(l0, rel=1e-3, abs=1e-3)
        for n, a in g0.items():
            assert sqnr_db(a.float(), g1[n].float()) >= 50.0, n
            if wrapped:
                assert sqnr_db(gp[n].float(), g1[n].float()) >= 20.0, n


@cuda
def test_batchnorm_statistics_and_the_partial_batch():
    """Warm-up and capture leave BatchNorm's statistics as they were; each replay updates
    them as an eager step does. A batch of another size runs eagerly (a warning, once), or
    raises with fallback='error'."""
    torch.manual_seed(0)
    model = ConvNet().cuda()
    before = {n: b.clone() for n, b in model.named_buffers()}
    eager = copy.deepcopy(model)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    g = mesa_lite.graphed(model, (x,), autocast=torch.bfloat16)
    for n, b in g.named_buffers():
        assert torch.equal(b, before[n]), n
    with torch.autocast("cuda", torch.bfloat16):
        g(x).sum().backward()
        eager(x).sum().backward()
    for (n, a), b in zip(g.named_buffers(), eager.buffers(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-5), n
    small = x[:3].clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cuda", torch.bfloat16):
            out = g(small)
            g(small)
            ref = eager(small)
    said = [str(w.message) for w in caught if "mesa_lite.graphed" in str(w.message)]
    assert len(said) == 1 and "[3, 3, 16, 16]" in said[0] and "[8, 3, 16, 16]" in said[0], said
    assert out.shape == (3, 10) and torch.allclose(out.float(), ref.float(), atol=1e-2)
    assert mesa_lite.graph_info(g).eager_calls == 2
    strict = mesa_lite.graphed(ConvNet().cuda(), (x,), fallback="error")
    with pytest.raises(ValueError, match="differ from the captured"):
        strict(small)
    with pytest.raises(ValueError, match="keyword arguments"):
        strict(x=x)


@cuda
def test_dropout_draws_new_masks_on_each_replay():
    torch.manual_seed(0)
    model = mesa_lite.wrap(Net(p=0.5).cuda())
    x = torch.randn(16, 8, 48, device="cuda")
    g = mesa_lite.graphed(model, (x,), autocast=torch.float16, fallback="error")
    with torch.autocast("cuda", torch.float16):
        first = g(x)
        first.sum().backward()
        first = first.clone()
        second = g(x)
        second.sum().backward()
    assert not torch.equal(first, second) and mesa_lite.graph_info(g).replays == 2


@cuda
def test_memory_outputs_eval_and_ungraph():
    """The pool holds the replays' memory; outputs are the graph's static buffers (the next
    call overwrites them: documented), the caller's sample tensor is not; evaluation and
    no_grad run eagerly; ungraph gives the model's own forward back and removes its hooks."""
    torch.manual_seed(0)
    model = mesa_lite.wrap(Net().cuda())
    x = torch.randn(16, 8, 48, device="cuda")
    kept = x.clone()
    g = mesa_lite.graphed(model, (x,), autocast=torch.float16)
    mem = mesa_lite.graph_memory(g)
    assert mem["reserved"] > 0 and mem["reserved"] >= mem["allocated"] > 0, mem
    with torch.autocast("cuda", torch.float16):
        a = g(x + 1)
        a.sum().backward()
        b = g(x + 2)
        b.sum().backward()
    assert a.data_ptr() == b.data_ptr() and mesa_lite.graph_info(g).replays == 2
    assert torch.equal(x, kept), "the sample tensor became the graph's input buffer"
    g.eval()
    with torch.autocast("cuda", torch.float16):
        e1 = g(x)
    g.train()
    with torch.no_grad(), torch.autocast("cuda", torch.float16):
        e2 = g(x)
    assert torch.equal(e1, e2)
    assert mesa_lite.graph_info(g).eager_calls == 2
    mesa_lite.ungraph(g)
    assert "forward" not in vars(g) and mesa_lite.graph_info(g) is None
    with torch.autocast("cuda", torch.float16):
        g(x).sum().backward()
    with pytest.raises(ValueError, match="graphed already"):
        mesa_lite.graphed(mesa_lite.graphed(g, (x,)), (x,))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@cuda
def test_accumulated_gradients_and_two_calls_before_backward():
    """PyTorch's graphed backward hands back the graph's own gradient buffers: kept as
    p.grad they were overwritten by the next replay, and accumulation (micro-batches,
    zero_grad(set_to_none=False)) added them twice. Gradients now accumulate as eager ones
    do; a second call before the first one's backward runs eagerly (the first one's saved
    activations are the graph's), and both backward passes are right."""
    torch.manual_seed(0)
    plain = mesa_lite.wrap(Net().cuda())
    batches = _batches(3, (16, 8, 48), seed=3)
    eager = copy.deepcopy(plain)
    g = mesa_lite.graphed(copy.deepcopy(plain), (batches[0][0],), autocast=torch.bfloat16,
                          fallback="error")  # fmt: skip
    for m in (eager, g):  # three micro-batches accumulated, then two more steps' worth
        for x, y in batches:
            with torch.autocast("cuda", torch.bfloat16):
                F.cross_entropy(m(x), y).backward()
    ref, got = _grads(eager), _grads(g)
    assert ref.keys() == got.keys()
    for n, a in ref.items():
        assert sqnr_db(a.float(), got[n].float()) >= 50.0, n
    for m in (eager, g):  # zero_grad(set_to_none=False): the buffers are kept and zeroed
        for p in m.parameters():
            p.grad.zero_()
        with torch.autocast("cuda", torch.bfloat16):
            F.cross_entropy(m(batches[1][0]), batches[1][1]).backward()
    ref, got = _grads(eager), _grads(g)
    for n, a in ref.items():
        assert sqnr_db(a.float(), got[n].float()) >= 50.0, n
    lenient = mesa_lite.graphed(copy.deepcopy(plain), (batches[0][0],), autocast=torch.bfloat16)
    for m in (eager, lenient):  # two views, one backward
        m.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cuda", torch.bfloat16):
                loss = F.cross_entropy(m(batches[0][0]), batches[0][1]) + F.cross_entropy(
                    m(batches[2][0]), batches[2][1]
                )
            loss.backward()
    assert any("backward has not run" in str(w.message) for w in caught)
    ref, got = _grads(eager), _grads(lenient)
    for n, a in ref.items():
        assert sqnr_db(a.float(), got[n].float()) >= 50.0, n
    info = mesa_lite.graph_info(lenient)
    assert info.replays == 1 and info.eager_calls == 1
    with torch.autocast("cuda", torch.bfloat16):  # a step dropped before its backward
        lenient(batches[0][0])
        lenient(batches[1][0]).sum().backward()
    assert info.replays == 3, "a dropped output must not block the next replay"


@cuda
def test_copies_pickles_and_calls_the_capture_cannot_serve():
    """A deep copy (a timm model EMA) and a pickled copy come out ungraphed, running on their
    own parameters; a call under another autocast, with a replaced parameter or of another
    batch size runs eagerly; a forward that replaces a buffer is refused."""

    torch.manual_seed(0)
    model = mesa_lite.wrap(Net().cuda())
    g = mesa_lite.graphed(model, (torch.randn(16, 8, 48, device="cuda"),), autocast=torch.float16)
    for twin in (copy.deepcopy(g), torch.load(_saved(g), weights_only=False)):
        assert mesa_lite.graph_info(twin) is None
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
        with torch.autocast("cuda", torch.float16):
            out = twin(torch.randn(16, 8, 48, device="cuda"))
        out.sum().backward()
        assert all(p.grad is not None for p in twin.parameters())
        assert all(p.grad is None for p in g.parameters()), "the copy ran the original"
        mesa_lite.ungraph(twin)
        assert "forward" not in vars(twin)
    info = mesa_lite.graph_info(g)
    h = torch.randn(16, 8, 48, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cuda", torch.bfloat16):
            g(h)
        with torch.autocast("cuda", torch.float16):
            g(h[:8])
            g.head.weight.data = g.head.weight.data.clone()
            g(h)
    said = " ".join(str(w.message) for w in caught)
    assert "autocast state differs" in said and "differ from the captured" in said, said
    assert "replaced or moved" in said, said
    assert info.replays == 0 and info.eager_calls == 3

    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(48, 10)
            self.register_buffer("avg", torch.zeros(10))

        def forward(self, t):
            out = self.lin(t)
            self.avg = 0.9 * self.avg + 0.1 * out.detach().mean((0, 1))
            return out

    with pytest.raises(ValueError, match="replaces a buffer"):
        mesa_lite.graphed(Ema().cuda(), (h,))


def _saved(model):
    import io

    f = io.BytesIO()
    torch.save(model, f)
    f.seek(0)
    return f


@cuda
def test_frozen_parameters_and_a_changed_requires_grad():
    torch.manual_seed(0)
    model = mesa_lite.wrap(Net().cuda())
    model.embed.requires_grad_(False)
    x = torch.randn(16, 8, 48, device="cuda")
    g = mesa_lite.graphed(model, (x,), autocast=torch.float16, fallback="error")
    with torch.autocast("cuda", torch.float16):
        g(x).sum().backward()
    assert g.embed.weight.grad is None and g.head.weight.grad is not None
    g.embed.requires_grad_(True)
    with (
        pytest.raises(ValueError, match="requires_grad changed"),
        torch.autocast("cuda", torch.float16),
    ):
        g(x)


# ---- the replay wrapper's logic, on any machine ----------------------------------------------


class _FakeGraphed(torch.autograd.Function):
    """Stands in for PyTorch's graphed callable on the CPU: computes ``x @ w.T`` and, as the
    real one does, hands back gradients in the same static buffers on every call."""

    buffers: dict = {}

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = _FakeGraphed.buffers.setdefault("w", torch.empty_like(w))
        gw.copy_(g.t() @ x)
        return None, gw.detach()


def _fake_graphed(model, sample):
    """``model`` (one Linear, no bias) with GraphedForward over ``_FakeGraphed``: the wrapper
    as graphed() installs it, without CUDA."""
    from mesa_lite import graphs

    info = graphs.GraphInfo(
        signature=graphs._signature((sample,)),
        requires_grad=tuple(p.requires_grad for p in model.parameters()),
        graphed_forward=lambda x: _FakeGraphed.apply(x, model.weight),
        eager_forward=lambda x: torch.nn.functional.linear(x, model.weight),
        own_forward=None,
        pool=(0, 0),
        fallback="eager",
        autocast=None,
    )
    info.storage = graphs._storage(model)
    info.specs = graphs._specs(model)
    model.__dict__[graphs._KEY] = info
    model.forward = graphs.GraphedForward(model)
    return model, info


def test_replayed_gradients_accumulate_and_a_pending_backward_is_respected():
    """The wrapper's logic with a stand-in for PyTorch's graphed callable that, like it,
    returns the same gradient buffers on every call: gradients accumulate over micro-batches
    and across steps without zero_grad(set_to_none=True) as eager ones do (without the copy
    they came back as the stand-in's buffer, doubled); a second call before the first one's
    backward runs eagerly; a call whose output was dropped unanswered does not block replays."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, generator=g) for _ in range(3)]
    eager = nn.Linear(3, 2, bias=False)
    model, info = _fake_graphed(copy.deepcopy(eager), xs[0])
    for m in (eager, model):
        for x in xs:  # three micro-batches into one gradient
            m(x).pow(2).sum().backward()
    assert torch.allclose(model.weight.grad, eager.weight.grad, rtol=1e-6, atol=1e-6)
    assert model.weight.grad.data_ptr() != _FakeGraphed.buffers["w"].data_ptr()
    assert info.replays == 3 and info.eager_calls == 0
    for m in (eager, model):  # set_to_none=False
        m.weight.grad.zero_()
        m(xs[1]).sum().backward()
    assert torch.allclose(model.weight.grad, eager.weight.grad, rtol=1e-6, atol=1e-6)
    for m in (eager, model):  # two calls, one backward
        m.weight.grad = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (m(xs[0]).sum() + m(xs[2]).pow(2).sum()).backward()
    assert any("backward has not run" in str(w.message) for w in caught)
    assert torch.allclose(model.weight.grad, eager.weight.grad, rtol=1e-6, atol=1e-6)
    assert info.replays == 5 and info.eager_calls == 1
    model(xs[0])  # dropped before its backward
    model(xs[1]).sum().backward()
    assert info.replays == 7, "a dropped output must not block the next replay"


def _twice_linear(m, x):
    return torch.nn.functional.linear(x, m.weight) * 2


def test_copies_of_a_graphed_model_keep_its_own_forward_and_layouts_do_not_matter():
    """Found by review: a copy of a graphed model whose forward was set on the instance ran
    the class's forward instead; a sample that is a non-contiguous view sent every later call
    of that layout to the eager forward (its clone's strides were compared)."""
    import functools

    from mesa_lite import graphs

    model = nn.Linear(6, 2, bias=False)
    own = functools.partial(_twice_linear, model)
    model.forward = own
    sample = torch.randn(4, 12)[:, :6]  # a view with strides (12, 1)
    assert graphs._signature((sample,)) == graphs._signature((sample.clone(),))
    model, info = _fake_graphed(model, sample)
    info.own_forward = own  # as graphed() records a forward set on the instance
    x = torch.randn(3, 6)
    for twin in (copy.deepcopy(model), torch.load(_saved(model), weights_only=False)):
        assert graphs.graph_info(twin) is None
        forward = vars(twin)["forward"]
        assert isinstance(forward, functools.partial) and forward.args[0] is twin
        assert torch.equal(twin(x), _twice_linear(twin, x))
