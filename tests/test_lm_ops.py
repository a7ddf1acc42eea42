"""The language-model ops of issue 13, one by one against PyTorch: Dropout's 1-bit mask, the
chunked cross-entropy, the elementwise activations (SiLU and transformers' GELU variants),
RMSNorm, Conv1D and the gated MLP block."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    HFStyleRMSNorm,
    assert_equal,
    count_calls,
    interpreter_runs_loops,
    saved_activation_bytes,
    sqnr_db,
)

import mesa_lite
from mesa_lite import Config
from mesa_lite.ops import cross_entropy as ce
from mesa_lite.ops.dropout import dropout, pack_bits, unpack_bits

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}


def _grads(model, x, autocast, seed=3):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
        y = model(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    y.backward(g)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return y, {"input": x.grad, **grads}


def _check(plain, x, autocast, floor):
    """Forward bit-exact; gradients bit-exact in debug_exact and above ``floor`` dB at int8."""
    for exact in (True, False):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=exact))
        assert mesa_lite.wrapped_modules(wrapped), "nothing was converted"
        y0, g0 = _grads(plain, x, autocast)
        y1, g1 = _grads(wrapped, x, autocast)
        assert_equal(y1, y0, "forward")
        for n, a in g0.items():
            if exact:
                assert_equal(g1[n], a, f"grad of {n}")
            else:
                assert sqnr_db(a, g1[n]) >= floor, n  # inf: a bias grad reads no activation


# ---- dropout ---------------------------------------------------------------------------------


def test_bits_round_trip():
    m = torch.rand(3, 5, 7) > 0.4
    packed = pack_bits(m)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(m.numel() / 8)
    assert torch.equal(unpack_bits(packed, m.shape), m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dropout_same_draws_and_exact_gradients_from_one_bit(dtype):
    x = torch.randn(4, 33, 17).to(dtype).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    ref = F.dropout(x, 0.3, training=True)
    torch.manual_seed(0)
    kept, out = saved_activation_bytes(lambda: dropout(x2, 0.3))
    assert_equal(out, ref, "forward")
    assert kept == math.ceil(x.numel() / 8), kept  # the mask, 1 bit per element
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert_equal(x2.grad, x.grad, "grad")


def test_dropout_plain_where_it_does_nothing_or_works_in_place():
    x = torch.randn(8, 8, requires_grad=True)
    for p, training, inplace in ((0.0, True, False), (1.0, True, False), (0.5, False, False)):
        out = dropout(x, p, training, inplace)
        assert "DropoutFn" not in type(out.grad_fn).__name__ if out.grad_fn else True
    layer = mesa_lite.wrap(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0)))
    assert type(layer[1]) is nn.Dropout  # p == 0: nothing to keep, not converted


def test_dropout_nonfinite_stays_nonfinite():
    x = torch.tensor([[float("inf"), float("nan"), 1.0, -float("inf")]] * 8, requires_grad=True)
    torch.manual_seed(0)
    ref = F.dropout(x, 0.5)
    torch.manual_seed(0)
    out = dropout(x, 0.5)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())


# ---- chunked cross-entropy -------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy(dtype, reduction, monkeypatch):
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 700)  # several chunks on a small input
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 101, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 101, (37,), generator=g)
    labels[::5] = -100
    ref_in = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_in.float(), labels, ignore_index=-100, reduction=reduction)
    kept, loss = saved_activation_bytes(lambda: ce.cross_entropy(logits, labels, -100, reduction))
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0), (loss, ref)  # within fp32 rounding
    # a reference to the logits and the labels: no fp32 rows x vocab tensor of its own
    assert kept <= logits.numel() * logits.element_size() + labels.numel() * 8, kept
    ref.backward()
    loss.backward()
    assert sqnr_db(ref_in.grad, logits.grad) > (60 if dtype == torch.float32 else 40)
    assert torch.all(logits.grad[::5] == 0)  # ignored rows


def test_chunked_cross_entropy_bad_input_and_nonfinite():
    with pytest.raises(ValueError, match="expected logits"):
        ce.cross_entropy(torch.randn(2, 3, 4, requires_grad=True), torch.zeros(2, 3).long())
    logits = torch.randn(4, 10)
    logits[1, 3] = float("inf")
    logits.requires_grad_()
    loss = ce.cross_entropy(logits, torch.tensor([1, 2, 3, 4]))
    assert not torch.isfinite(loss)


# ---- activations -----------------------------------------------------------------------------


def _activations():
    acts = {"silu": nn.SiLU}
    try:
        import transformers.activations as a
    except ImportError:
        return acts
    names = ("NewGELUActivation", "GELUTanh", "FastGELUActivation", "QuickGELUActivation",
             "GELUActivation", "SiLUActivation", "AccurateGELUActivation")  # fmt: skip
    acts.update({n: getattr(a, n) for n in names if hasattr(a, n)})
    return acts


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("name", list(_activations()))
def test_activations(name, autocast):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 64), _activations()[name](), nn.Linear(64, 16))
    _check(plain, torch.randn(4, 10, 16) * 2, AUTOCAST[autocast], floor=30.0)


def test_activation_output_shared_with_the_next_linear():
    """The activation's codes rebuild its output for the next Linear: one copy, not two."""
    torch.manual_seed(0)
    net = mesa_lite.wrap(nn.Sequential(nn.Linear(16, 256), nn.SiLU(), nn.Linear(256, 16)))
    x = torch.randn(4, 64, 16)
    kept, _ = saved_activation_bytes(lambda: net(x), params=list(net.parameters()))
    n = 4 * 64 * 256
    assert kept < 1.2 * n + 4 * 64 * 16 * 1.2, kept  # SiLU's int8 input (+ the first input)


# ---- RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("kind", ["hf", "torch", "torch_2d"])
def test_rms_norm(kind, autocast):
    torch.manual_seed(0)
    norm = {"hf": lambda: HFStyleRMSNorm(32), "torch": lambda: nn.RMSNorm(32, eps=1e-6),
            "torch_2d": lambda: nn.RMSNorm((4, 8), eps=1e-6)}[kind]()  # fmt: skip
    if kind == "torch_2d":
        plain = nn.Sequential(nn.Linear(8, 8), norm, nn.Linear(8, 8))
        x = torch.randn(3, 5, 4, 8) * 3
    else:
        plain = nn.Sequential(nn.Linear(32, 32), norm, nn.Linear(32, 32))
        x = torch.randn(3, 20, 32) * 3
    _check(plain, x, AUTOCAST[autocast], floor=30.0)


def test_rms_norm_keeps_int8_input_and_rstd_and_shares_with_the_next_linear():
    torch.manual_seed(0)
    net = mesa_lite.wrap(nn.Sequential(HFStyleRMSNorm(256), nn.Linear(256, 256)))
    x = torch.randn(8, 64, 256, requires_grad=True)
    kept, _ = saved_activation_bytes(lambda: net(x), params=list(net.parameters()))
    rows = 8 * 64
    assert kept == rows * 256 + rows * 256 // 128 * 4 + rows * 4, kept  # codes, scales, rstd


def test_rms_norm_nonfinite_and_fp64():
    net = mesa_lite.wrap(nn.Sequential(HFStyleRMSNorm(8)))
    x = torch.randn(2, 8)
    x[0, 1] = float("inf")
    x.requires_grad_()
    y = net(x)
    assert torch.isfinite(y[1]).all()  # the forward is PyTorch's
    y.sum().backward()
    # non-finite stays non-finite (GradScaler skips the step); it spreads over its group
    assert not torch.isfinite(x.grad[0]).all()
    # fp64 is kept exactly: gradients equal to PyTorch's even at "int8"
    _check(HFStyleRMSNorm(8).double(), torch.randn(2, 8, dtype=torch.float64), None, 200.0)


@pytest.mark.parametrize("kind", ["hf", "torch"])
def test_rms_norm_row_whose_squares_overflow(kind):
    """A finite row whose squares overflow fp32 (rstd 0): PyTorch's input gradient of that row
    is 0 * (its sum of g * x), zeros while that sum is finite, as the compressed backward's;
    NaN where the sum overflows too (|x| near 1e36), which the compressed backward cannot tell
    from its kept row (all zeros) and gives zeros (RELIABILITY, known differences). A NaN for
    every such row was tried and refused: it poisoned steps PyTorch takes."""
    torch.manual_seed(0)
    plain = HFStyleRMSNorm(256) if kind == "hf" else nn.RMSNorm(256, eps=1e-6)
    net = mesa_lite.wrap(nn.Sequential(copy.deepcopy(plain)))
    for scale, torch_nan in ((1e20, False), (3e37, True)):
        x = torch.randn(4, 256).abs()
        x[1] *= scale
        g = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
        grads = []
        for m in (plain, net):
            m.zero_grad()
            xi = x.clone().requires_grad_()
            m(xi).backward(g if not torch_nan else g.abs())
            w = m.weight if m is plain else m[0].weight
            grads.append((xi.grad, w.grad))
        (gx0, gw0), (gx1, gw1) = grads
        assert bool(gx0[1].isnan().all()) == torch_nan, gx0[1, :4]
        assert torch.equal(gx1[1], torch.zeros(256)), gx1[1, :4]
        keep = torch.tensor([0, 2, 3])
        assert torch.isfinite(gx1[keep]).all() and sqnr_db(gx0[keep], gx1[keep]) > 30
        assert torch.isfinite(gw1).all() and sqnr_db(gw0, gw1) > 30


# ---- Conv1D and the gated MLP ----------------------------------------------------------------


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
def test_conv1d(autocast):
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    plain = nn.Sequential(Conv1D(48, 16), nn.GELU(), Conv1D(16, 48))
    _check(plain, torch.randn(3, 20, 16), AUTOCAST[autocast], floor=30.0)


class GatedMLP(nn.Module):
    def __init__(self, h=32, i=88, bias=False, act=nn.SiLU):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act_fn = act()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _gelu_new():
    return pytest.importorskip("transformers.activations").NewGELUActivation()


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_new"])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_block(bias, act, autocast):
    from mesa_lite.integrations.transformers import GatedMlp

    torch.manual_seed(0)
    mlp = GatedMLP(bias=bias, act=nn.SiLU if act == "silu" else _gelu_new)
    plain = nn.Sequential(HFStyleRMSNorm(32), mlp)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert isinstance(wrapped[1], GatedMlp)
    _check(plain, torch.randn(3, 20, 32) * 2, AUTOCAST[autocast], floor=30.0)
    x = torch.randn(4, 64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, _ = saved_activation_bytes(lambda: wrapped(x), params=list(wrapped.parameters()))
    rows = 4 * 64  # the norm's codes (shared by gate and up), gate and up at 8 bits
    assert kept <= rows * (32 + 2 * 88) * 1.1 + rows * 4, kept


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_new"])
def test_gated_product_backward_in_one_pass(act, autocast, monkeypatch):
    """Issue 51: the gated MLP's backward through its product in one pass over the codes of
    gate and up (``kernels/gated.py``). Off CUDA its reference runs, and gives the op-by-op
    form's gradients bit for bit; the kernel (Triton's interpreter) within ulps of them."""
    from mesa_lite.kernels import gated

    from mesa_lite import quant

    torch.manual_seed(0)
    plain = nn.Sequential(HFStyleRMSNorm(32), GatedMLP(bias=True, act=nn.SiLU if act == "silu"
                                                       else _gelu_new))  # fmt: skip
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    x, dtype = torch.randn(3, 20, 32) * 2, AUTOCAST[autocast]
    calls = count_calls(monkeypatch, quant, "gated_backward")
    _, fused = _grads(wrapped, x, dtype)
    assert len(calls) == 1, "the one-pass backward ran"
    with monkeypatch.context() as m:
        m.setattr(quant, "fused_product", lambda *a: False)
        _, per_op = _grads(wrapped, x, dtype)
    assert len(calls) == 1
    _, exact = _grads(plain, x, dtype)
    for n, g in per_op.items():
        if act == "silu":
            assert_equal(fused[n], g, f"reference vs op by op: grad of {n}")
        else:  # F.gelu's tanh form where the op-by-op form reruns the module's own formula
            # (in bf16 op by op, each op rounded): ulps of the activation's output
            assert sqnr_db(g, fused[n]) >= (120 if dtype is None else 40), n
    if torch.cuda.is_available():
        return  # CPU tensors run no compiled kernel: the next test runs it on the GPU
    if not interpreter_runs_loops():
        pytest.skip("Triton's interpreter here cannot run the kernel's loop (Triton 3.6)")
    kernel = count_calls(monkeypatch, gated, "_GATED_BACKWARD")
    monkeypatch.setattr(gated, "use_triton_for", lambda t: True)
    _, k = _grads(wrapped, x, dtype)
    assert len(kernel) == 1, "the kernel ran"
    for n, g in per_op.items():
        # the activation's exp/erf differ by ulps (and the formula, for gelu_new); the 8-bit
        # floor against the exact gradients
        assert sqnr_db(g, k[n]) >= (120 if dtype is None else 40), n
        assert sqnr_db(exact[n], k[n]) >= 30, n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernel")
@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
def test_gated_mlp_backward_in_one_pass_on_cuda(autocast, monkeypatch):
    """The one-pass backward through GatedMlpFn on CUDA (g's gradient written over the down
    projection's input gradient, through the static launcher) against the op-by-op form."""
    from mesa_lite.kernels import gated

    from mesa_lite import quant

    torch.manual_seed(0)
    plain = nn.Sequential(HFStyleRMSNorm(32), GatedMLP(bias=True)).cuda()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    x = (torch.randn(3, 20, 32) * 2).cuda()
    dtype = AUTOCAST[autocast]

    def grads(model):
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            y = model(xx)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y))
        return {"input": xx.grad, **{n: p.grad for n, p in model.named_parameters()}}

    kernel = count_calls(monkeypatch, gated, "_GATED_BACKWARD")
    fused = grads(wrapped)
    assert len(kernel) == 1, "the kernel ran"
    with monkeypatch.context() as m:
        m.setattr(quant, "fused_product", lambda *a: False)
        per_op = grads(wrapped)
    exact = grads(plain)
    for n, g in per_op.items():
        assert sqnr_db(g, fused[n]) >= (100 if dtype is None else 40), n
        assert sqnr_db(exact[n], fused[n]) >= 30, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_product_alone_backward_in_one_pass(dtype, monkeypatch, triton_device):
    """The product between adapter projections (``GatedProductFn``, PEFT's LoRA) takes the
    one-pass backward too, never writing over the incoming gradient."""
    from mesa_lite.kernels import gated

    from mesa_lite import blocks
    from mesa_lite.config import QuantSpec
    from mesa_lite.ops.activation import silu_grad

    gen = torch.Generator().manual_seed(0)
    g0 = (torch.randn(4, 50, 88, generator=gen) * 3).to(dtype=dtype, device=triton_device)
    u0 = torch.randn(4, 50, 88, generator=gen).to(dtype=dtype, device=triton_device)
    dp = torch.randn(4, 50, 88, generator=gen).to(dtype=dtype, device=triton_device)
    spec = QuantSpec()

    def grads(kernel: bool):
        with monkeypatch.context() as m:  # the kernel (compiled, or in the interpreter) or not
            m.setattr(gated, "use_triton_for", lambda t: kernel)
            g, u = g0.clone().requires_grad_(), u0.clone().requires_grad_()
            out = blocks.GatedProductFn.apply(g, u, (F.silu, silu_grad, spec))
            assert_equal(out, F.silu(g0) * u0, "forward")
            before = dp.clone()
            out.backward(dp)
            assert_equal(dp, before, "the incoming gradient is left as it was")
            return g.grad, u.grad

    ref = grads(False)
    if triton_device.type == "cpu" and not interpreter_runs_loops():
        pytest.skip("Triton's interpreter here cannot run the kernel's loop (Triton 3.6)")
    kernel = count_calls(monkeypatch, gated, "_GATED_BACKWARD")
    k = grads(True)
    assert len(kernel) == 1, "the kernel ran"
    g, u = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    (F.silu(g) * u).backward(dp)
    for a, b, exact in zip(ref, k, (g.grad, u.grad), strict=True):
        assert sqnr_db(a, b) >= (120 if dtype == torch.float32 else 40)
        assert sqnr_db(exact, b) >= 30


def test_gated_mlp_frozen_and_with_hooks_runs_per_op():
    torch.manual_seed(0)
    plain = GatedMLP()
    for p in plain.gate_proj.parameters():
        p.requires_grad_(False)
    _check(plain, torch.randn(3, 20, 32), None, floor=30.0)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    wrapped.up_proj.register_forward_hook(lambda m, i, o: o * 2)
    x = torch.randn(2, 5, 32)
    ref = plain.down_proj(plain.act_fn(plain.gate_proj(x)) * plain.up_proj(x) * 2)
    assert_equal(wrapped(x), ref, "the hook ran (per-op path)")


def test_gated_mlp_recognised_by_behaviour_not_name():
    """A module with the same layer names that computes something else is not fused."""
    from mesa_lite.integrations.transformers import GatedMlp

    class NotGated(GatedMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    torch.manual_seed(0)
    wrapped = mesa_lite.wrap(NotGated())
    assert not isinstance(wrapped, GatedMlp)


# ---- the two-projection MLP (GPT-2's) as one Function -----------------------------------------


def _two_layer_mlp(kind: str, act: str, p: float) -> nn.Module:
    acts = {
        "gelu_new": _gelu_new,
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "quick_gelu": lambda: pytest.importorskip("transformers.activations").QuickGELUActivation(),
        "silu": nn.SiLU,
    }
    if kind == "gpt2":
        gpt2 = pytest.importorskip("transformers.models.gpt2.modeling_gpt2")
        config = gpt2.GPT2Config(n_embd=32, resid_pdrop=p, activation_function="gelu_new")
        mlp = gpt2.GPT2MLP(88, config)
        mlp.act = acts[act]()
        return mlp
    layers = [nn.Linear(32, 88), acts[act](), nn.Linear(88, 32)]
    return nn.Sequential(*layers, *([nn.Dropout(p)] if p else []))


def _unfused_grads(wrapped, x, autocast):
    """Gradients of ``wrapped`` with its MLP blocks on their per-op path (a no-op hook)."""
    handles = [m.register_forward_hook(lambda *a: None) for m in wrapped.modules()
               if type(m).__name__.startswith("Mlp[")]  # fmt: skip
    try:
        return _grads(wrapped, x, autocast)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize(
    "kind, act",
    [("gpt2", "gelu_new"), ("gpt2", "quick_gelu"), ("linear", "gelu_tanh"), ("linear", "silu")],
)
def test_two_projection_mlp_block(kind, act, p, autocast):
    """GPT-2's MLP (Conv1D) and a Sequential of Linear, activation, Linear (and dropout) run
    as one ``MlpFn``: forward bit-exact (the same dropout draws), debug_exact gradients exact,
    int8 gradients bit-identical to the per-op path's, which keeps the same bytes."""
    from mesa_lite.blocks import MlpFn
    from mesa_lite.integrations.transformers import Mlp

    torch.manual_seed(0)
    plain = nn.Sequential(nn.LayerNorm(32), _two_layer_mlp(kind, act, p))
    ac = AUTOCAST[autocast]
    x = torch.randn(3, 20, 32) * 2
    _check(plain, x, ac, floor=30.0)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert isinstance(wrapped[1], Mlp)
    calls = []
    apply = MlpFn.apply
    MlpFn.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        y1, g1 = _grads(wrapped, x, ac)
    finally:
        MlpFn.apply = apply
    assert calls, "the block Function did not run"
    y0, g0 = _unfused_grads(wrapped, x, ac)
    assert_equal(y1, y0, "forward, fused vs per-op")
    for n, a in g0.items():
        assert_equal(g1[n], a, f"int8 grad of {n}, fused vs per-op")

    def kept(model):
        with torch.autocast("cpu", dtype=ac or torch.float32, enabled=ac is not None):
            return saved_activation_bytes(lambda: model(x), params=list(model.parameters()))[0]

    fused = kept(wrapped)
    hooks = [m.register_forward_hook(lambda *a: None) for m in wrapped.modules()]
    per_op = kept(wrapped)
    for h in hooks:
        h.remove()
    assert fused == per_op, (fused, per_op)


def test_mlp_block_only_for_the_exact_chain():
    """Dropout between the activation and the second projection, a residual add, an in-place
    dropout or frozen layers: not fused, or fused with the right gradients."""
    from mesa_lite.integrations.transformers import Mlp

    class Residual(nn.Sequential):
        def forward(self, x):
            return super().forward(x) + x

    torch.manual_seed(0)
    between = nn.Sequential(nn.Linear(32, 88), nn.GELU(), nn.Dropout(0.1), nn.Linear(88, 32))
    residual = Residual(nn.Linear(32, 88), nn.GELU(), nn.Linear(88, 32))
    shared = nn.Linear(32, 32)
    twice = nn.Sequential(shared, nn.GELU(), shared)  # one layer called twice
    for model in (between, residual, twice):
        assert not isinstance(mesa_lite.wrap(copy.deepcopy(model)), Mlp), model
    x = torch.randn(2, 7, 32)
    _check(residual, x, torch.bfloat16, floor=30.0)
    inplace = nn.Sequential(nn.Linear(32, 88), nn.GELU(), nn.Linear(88, 32), nn.Dropout(0.5, True))
    wrapped = mesa_lite.wrap(copy.deepcopy(inplace))
    assert isinstance(wrapped, Mlp)  # recognised; runs per-op (the in-place dropout)
    _check(inplace, x, None, floor=30.0)
    frozen = nn.Sequential(nn.Linear(32, 88), nn.SiLU(), nn.Linear(88, 32))
    frozen[0].requires_grad_(False)
    _check(frozen, x, torch.bfloat16, floor=30.0)
    frozen[0].requires_grad_(True)
    frozen[2].requires_grad_(False)
    _check(frozen, x, torch.bfloat16, floor=30.0)


# ---- regressions found by review -------------------------------------------------------------


def test_chunked_cross_entropy_with_every_label_ignored_gives_zero_gradients():
    """PyTorch's loss is NaN and its gradients 0 (an all-prompt micro-batch); NaN gradients
    would wreck the optimizer step."""
    logits = torch.randn(6, 11, requires_grad=True)
    labels = torch.full((6,), -100)
    loss = ce.cross_entropy(logits, labels)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    # "sum" divided by num_items_in_batch = 0 (transformers' Trainer on such a batch)
    logits.grad = None
    (ce.cross_entropy(logits, labels, reduction="sum") / torch.tensor(0.0)).backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_conv1d_with_an_input_that_needs_no_grad():
    """A trained Conv1D after frozen layers (LoRA-style fine-tuning): the weight's gradient
    from the kept input, no input gradient."""
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    plain = Conv1D(8, 4)
    x = torch.randn(3, 5, 4)  # needs no grad
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    assert sqnr_db(plain.weight.grad, wrapped.weight.grad) > 30
    assert_equal(wrapped.bias.grad, plain.bias.grad, "bias grad")


@pytest.mark.parametrize("kind", ["hf", "torch"])
def test_rms_norm_on_an_unbatched_input(kind):
    torch.manual_seed(0)
    norm = HFStyleRMSNorm(16) if kind == "hf" else nn.RMSNorm(16, eps=1e-6)
    _check(norm, torch.randn(16) * 2, None, floor=30.0)


def test_cross_entropy_over_rows_of_any_shape(monkeypatch):
    """``rows=True``: (batch, seq, vocab) logits and (batch, seq) labels give the loss and the
    gradient of the flattened call, the gradient in the logits' own shape; bad shapes are
    refused by name; without grad the plain op runs on the flattened tensors."""
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 7 * 50)  # several chunks
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, 50, generator=g).bfloat16()
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :4] = -100
    a = logits.clone().requires_grad_()
    b = logits.clone().flatten(0, 1).requires_grad_()
    la = ce.cross_entropy(a, labels, rows=True)
    lb = ce.cross_entropy(b, labels.flatten())
    assert_equal(la, lb, "loss")
    la.backward()
    lb.backward()
    assert a.grad.shape == a.shape
    assert_equal(a.grad.flatten(0, 1), b.grad, "gradient")
    with torch.no_grad():
        assert_equal(
            ce.cross_entropy(logits, labels, rows=True),
            F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()),
            "no grad",
        )
    with pytest.raises(ValueError, match=r"expected logits \(\.\.\., vocab\) and labels"):
        ce.cross_entropy(a, labels.flatten(), rows=True)
