"""ReLU (``mesa_lite.ReLU``, the opt-in layer kind ``"relu"``): 1 bit per element kept, output
and gradients bit for bit torch's (the bit is exactly what torch's backward tests), in place or
not, with NaN and inf, channels-last, after a convolution, and under torch.compile."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    assert_compiles_like_eager,
    assert_equal,
    count_calls,
    kept_by_both,
    saved_activation_bytes,
    sqnr_db,
)

import mesa_lite

CNN = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | {"conv", "relu"})


def _input(shape=(2, 4, 6, 6), layout="contiguous"):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x.view(-1)[:5] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf")])
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    return x


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("mode", ["fp32", "bf16-autocast", "fp16"])
def test_output_and_gradient_bit_for_bit(inplace, layout, mode):
    """After a Linear scale (so the ReLU's input is not a leaf, as in a network), with zeros,
    -0, NaN and infinities in the input; the gradient weighting has infinities too."""
    dtype = torch.float16 if mode == "fp16" else torch.float32
    results = []
    for wrap in (False, True):
        act = nn.ReLU(inplace=inplace)
        if wrap:
            act = mesa_lite.wrap(act, CNN)
            assert isinstance(act, mesa_lite.ReLU)
        x = _input(layout=layout).to(dtype).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16-autocast"):
            h = x * 1.5  # a non-leaf input, so in place is allowed
            out = act(h)
        g = torch.linspace(-2, 2, out.numel()).view(out.shape).to(out.dtype)
        g.view(-1)[7] = float("inf")
        out.backward(g)
        results.append((out.detach().clone(), x.grad))
    (out_p, gx_p), (out_w, gx_w) = results
    assert_equal(out_w, out_p, "output")
    assert_equal(gx_w, gx_p, "input grad")


def test_keeps_one_bit_per_element():
    """torch keeps the output (4 bytes per element at fp32); the wrapped ReLU a bit."""
    x = torch.randn(4, 8, 10, 10, requires_grad=True)
    plain, wrapped = nn.ReLU(), mesa_lite.wrap(nn.ReLU(), CNN)
    kept_p, _ = saved_activation_bytes(lambda: plain(x * 1.0))
    kept_w, _ = saved_activation_bytes(lambda: wrapped(x * 1.0))
    assert kept_p == 4 * x.numel()
    assert kept_w == math.ceil(x.numel() / 8)


def test_conv_relu_conv_keeps_codes_and_bits():
    """Conv -> ReLU -> Conv with both kinds on: the second convolution keeps the ReLU output
    as int8 codes and the ReLU a bit per element, about 1.1 bytes per element where torch
    keeps the 4-byte output once (shared by the ReLU and the convolution); the gradients are
    within the int8 floor, the input's exact at the first convolution's weight."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True),
                          nn.Conv2d(16, 8, 3, padding=1))  # fmt: skip
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CNN)
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    kept_p, kept_w, out_p, out_w = kept_by_both(plain, wrapped, x)
    assert_equal(out_w, out_p)
    mid = 2 * 16 * 16 * 16  # the ReLU output's elements
    n = x.numel()
    assert kept_p == 4 * n + 4 * mid  # the input and the shared ReLU output
    assert kept_w == (n + 4 * math.ceil(n / 128)) + (mid + 4 * math.ceil(mid / 128)) + mid // 8
    out_p.square().sum().backward()
    out_w.square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert sqnr_db(p.grad, q.grad) >= 30, (name, sqnr_db(p.grad, q.grad))


# gradient SQNR floors of the ReLU-sharing chain, measured worst over 3 seeds: 8 bits 48.6 dB,
# 4 bits (stochastic rounding) 19.7 dB; at 4 bits the second convolution's weight gradient from
# the ReLU's shared codes measured 35.7-37.0 dB against 34.2-40.4 from its own signed codes
SHARE_FLOOR = {8: 30.0, 4: 15.0}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_relu_feeding_a_conv_keeps_the_conv_s_codes_only(inplace, layout, bits):
    """Once a training step has shown that a ReLU's output is kept by a convolution, the ReLU
    keeps that output's 8- or 4-bit codes (registered for the convolution, which keeps nothing
    new) and no bit: a bit per element less. Its backward takes the condition from the
    codes, exactly torch's: the gradient at its input is ``grad_out`` where the output is
    positive and 0 elsewhere, also for positive outputs far below one code step."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=inplace),
                          nn.Conv2d(16, 8, 3, padding=1))  # fmt: skip
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), dataclasses.replace(CNN, bits=bits))
    x = torch.randn(2, 8, 16, 16)
    if layout == "channels_last":
        plain, wrapped = (m.to(memory_format=torch.channels_last) for m in (plain, wrapped))
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    kept_p, first, _, out_w = kept_by_both(plain, wrapped, x)
    out_w.sum().backward()  # a training step: the offer was claimed, a backward has run
    wrapped.zero_grad()
    kept_p, second, out_p, out_w = kept_by_both(plain, wrapped, x)
    assert wrapped[1]._mesa_relu_state == "share"
    assert_equal(out_w, out_p)
    mid = 2 * 16 * 16 * 16
    assert first - second == mid // 8  # the bits are gone, the codes are the conv's
    with torch.no_grad():  # outputs far below a code step next to large ones, in every group
        wrapped[0].bias[:4] = 1e-6
        plain[0].bias[:4] = 1e-6
    if not inplace:  # (a full backward hook on an in-place module is refused by torch)
        # the ReLU's input gradient is torch's condition on the upstream gradient, bit for bit
        seen = {}
        hooks = [
            wrapped[0].register_forward_hook(lambda m, a, o: seen.update(pre=o.detach())),
            wrapped[1].register_full_backward_hook(
                lambda m, gi, go: seen.update(gin=gi[0], gout=go[0])
            ),
        ]  # fmt: skip
        wrapped(x).square().sum().backward()
        pre = seen["pre"]
        assert ((pre > 0) & (pre < pre.abs().amax() / 1000)).any()
        assert_equal(seen["gin"], torch.where(pre > 0, seen["gout"], 0))
        for h in hooks:
            h.remove()
        wrapped.zero_grad()
    wrapped(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert sqnr_db(p.grad, q.grad) >= SHARE_FLOOR[bits], (name, sqnr_db(p.grad, q.grad))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_shared_relu_backward_reads_the_codes_in_one_pass(layout, bits, monkeypatch,
                                                         triton_device):  # fmt: skip
    """Issue 51: a sharing ReLU's backward is one kernel over the consumer's codes
    (``kernels.bits.relu_backward_codes``, forced here: compiled on the GPU, else in the
    interpreter): the input gradient is torch's condition on the upstream gradient bit for bit,
    in either layout."""
    from mesa_lite.kernels import bits as kbits

    torch.manual_seed(0)
    wrapped = mesa_lite.wrap(nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                                           nn.Conv2d(16, 8, 3, padding=1)),
                             dataclasses.replace(CNN, bits=bits)).to(triton_device)  # fmt: skip
    x = torch.randn(2, 8, 16, 16).to(triton_device)
    if layout == "channels_last":
        wrapped = wrapped.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    wrapped(x).sum().backward()  # the first step: the offer is claimed
    wrapped.zero_grad()
    calls = count_calls(monkeypatch, kbits, "_RELU_BACKWARD_CODES")  # the kernel launched
    monkeypatch.setattr(kbits, "use_triton_for", lambda t: True)
    seen = {}
    wrapped[0].register_forward_hook(lambda m, a, o: seen.update(pre=o.detach()))
    wrapped[1].register_full_backward_hook(lambda m, gi, go: seen.update(gin=gi[0], gout=go[0]))
    wrapped(x).square().sum().backward()
    assert wrapped[1]._mesa_relu_state == "share" and len(calls) == 1
    pre = seen["pre"]
    assert_equal(seen["gin"], torch.where(pre > 0, seen["gout"], 0))
    assert seen["gin"].stride() == seen["gout"].stride()


@pytest.mark.parametrize("bits", [8, 4])
def test_shared_relu_codes_keep_torch_s_condition_on_nan_inf_and_zero(bits):
    """The codes' condition (code > 0) is ``not out <= 0``, torch's: NaN and +inf outputs pass
    their gradient, zeros and -0.0 do not."""
    from mesa_lite.ops.relu import relu

    class Owner:  # stands for a ReLU module known to feed a convolution
        _mesa_relu_state = "share"

    spec = mesa_lite.Config(bits=bits).spec_for("x", "linear")
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30,
                      3.0, -2.0, 1e-8] * 13, requires_grad=True)  # fmt: skip
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    (got,) = torch.autograd.grad(relu(x * 1.0, module=Owner(), spec=spec), x, g)
    (want,) = torch.autograd.grad(F.relu(x * 1.0), x, g)
    assert_equal(got, want)


def test_relu_keeps_its_bit_before_a_pool_and_at_two_bits():
    """A ReLU whose output no convolution keeps (before max-pooling), or one of whose uses
    does not, keeps its bit; at 2 bits nothing is shared (a positive value below a step would
    be kept as a third of its group's largest)."""
    torch.manual_seed(0)
    cfg2 = mesa_lite.Config(bits=2, layers=mesa_lite.DEFAULT_LAYERS | {"conv", "relu", "pool"})
    for cfg, pool in ((CNN, True), (cfg2, False)):
        layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True)]
        layers += [nn.MaxPool2d(2)] if pool else [nn.Conv2d(8, 8, 3, padding=1)]
        net = mesa_lite.wrap(nn.Sequential(*layers), cfg)
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        first, out = saved_activation_bytes(lambda net=net, x=x: net(x), list(net.parameters()))
        out.sum().backward()
        second, _ = saved_activation_bytes(lambda net=net, x=x: net(x), list(net.parameters()))
        assert getattr(net[1], "_mesa_relu_state", None) != "share"
        assert first == second

    class Twice(nn.Module):  # one ReLU module used before a convolution and before a pool
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
            self.act, self.pool = nn.ReLU(), nn.MaxPool2d(2)

        def forward(self, x):
            return self.pool(self.act(self.conv2(self.act(self.conv1(x)))))

    net = mesa_lite.wrap(Twice(), mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | {
        "conv", "relu", "pool"}))  # fmt: skip
    x = torch.randn(2, 3, 8, 8)
    for _ in range(3):
        net(x).sum().backward()
    assert net.act._mesa_relu_state == "bits"


def _step(net, x):
    kept, out = saved_activation_bytes(lambda: net(x), list(net.parameters()))
    out.float().square().sum().backward()
    return kept


def test_relu_sharing_under_activation_checkpointing():
    """torch.utils.checkpoint (non-reentrant) recomputes in backward what its forward kept:
    the ReLU decides nothing during a recompute, so the first steps, where it learns, and
    the later ones, where it shares, pass torch's check of the recomputed tensors; gradients
    within the floor of plain's."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            conv = lambda i, o: nn.Conv2d(i, o, 3, padding=1)  # noqa: E731
            self.a = nn.Sequential(conv(3, 8), nn.ReLU(), conv(8, 8))
            self.b = nn.Sequential(conv(8, 8), nn.ReLU(), conv(8, 8))

        def forward(self, x):
            y = checkpoint(self.a, x, use_reentrant=False)
            return checkpoint(self.b, y, use_reentrant=False)

    torch.manual_seed(0)
    plain = Net()
    net = mesa_lite.wrap(copy.deepcopy(plain), CNN)
    x = torch.randn(2, 3, 8, 8)
    for _ in range(3):
        net.zero_grad(), plain.zero_grad()
        net(x).square().sum().backward()
        plain(x).square().sum().backward()
        for (name, p), q in zip(plain.named_parameters(), net.parameters(), strict=True):
            assert sqnr_db(p.grad, q.grad) >= 30, (name, sqnr_db(p.grad, q.grad))
    assert net.a[1]._mesa_relu_state == "share"


@pytest.mark.parametrize("tail", ["linear", "se"])
def test_relu_keeps_its_bit_where_the_consumer_cannot_read_the_codes(tail):
    """A channels-last ReLU output registers codes in memory order; a consumer reading in
    logical order (a squeeze-excitation multiply, a Linear on the non-contiguous tensor)
    could not reuse them, so it does not claim the output: the ReLU keeps its bit and the
    step keeps no more than before sharing existed."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    last = timm.layers.SEModule(16) if tail == "se" else nn.Linear(16, 4)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(True), last)
    cfg = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)
    net = mesa_lite.wrap(net.to(memory_format=torch.channels_last), cfg)
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    if tail == "linear":
        x = x[..., :16]
    kept = [_step(net, x) for _ in range(3)]
    assert net[2]._mesa_relu_state == "bits"
    # (the squeeze-excitation's own ReLU feeds its second 1x1 convolution: it shares)
    assert kept[2] == kept[1] <= kept[0], kept


def test_relu_goes_back_to_its_bit_when_its_consumer_stops_keeping():
    """The decision is made anew each step: once the convolution after it is frozen (it keeps
    no input), the ReLU keeps its bit again, what a model frozen from the start keeps; unwrap
    drops what it learned, and a new wrap starts over."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),  # noqa: E731
                                 nn.Conv2d(8, 8, 3, padding=1))  # fmt: skip
    net, frozen = mesa_lite.wrap(make(), CNN), mesa_lite.wrap(make(), CNN)
    frozen[2].requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    for _ in range(2):
        _step(net, x)
    assert net[1]._mesa_relu_state == "share"
    net[2].requires_grad_(False)
    for _ in range(2):
        _step(net, x)
    assert net[1]._mesa_relu_state == "bits"
    assert _step(net, x) == _step(frozen, x)
    mesa_lite.unwrap(net)
    assert not any(k.startswith("_mesa") for k in vars(net[1]))
    mesa_lite.wrap(net, CNN)
    assert getattr(net[1], "_mesa_relu_state", None) is None


def test_relu_is_opt_in_and_in_place_on_a_leaf_fails_as_in_torch():
    assert type(mesa_lite.wrap(nn.ReLU())) is nn.ReLU
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        nn.ReLU(inplace=True)(leaf)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        mesa_lite.wrap(nn.ReLU(inplace=True), CNN)(leaf)


def test_compiles_into_one_graph_with_torch_gradients():
    """torch.compile (Inductor, CPU): one graph, and the ReLU's gradient is exact, so only the
    convolutions' kept inputs separate it from eager mode (within the int8 floor)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))  # fmt: skip
    x = torch.randn(4, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    model(x)
    assert_compiles_like_eager(
        mesa_lite.wrap(model, CNN), x, lambda out: F.cross_entropy(out, torch.arange(4))
    )


def test_channels_last_gradient_keeps_the_layout():
    """The input gradient takes the output's layout, as torch's ``threshold_backward`` gives
    it: a BatchNorm before it then reduces in the same order, bit for bit with debug_exact."""
    cfg = mesa_lite.Config(layers=CNN.layers, debug_exact=True)
    x = torch.randn(4, 6, 5, 5, generator=torch.Generator().manual_seed(0))
    x = x.to(memory_format=torch.channels_last)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.BatchNorm2d(6), nn.ReLU())
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), cfg)
    grads = []
    for m in (plain, wrapped):
        xi = x.clone().requires_grad_(True)
        m(xi).square().sum().backward()
        grads.append((xi.grad, m[0].weight.grad))
        h = xi.detach() * 1
        h.requires_grad_(True)
        (g,) = torch.autograd.grad(m[1](h), h, torch.ones_like(h))
        assert g.is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(*grads, strict=True):
        assert_equal(b, a)


FAMILY = {
    "ReLU6": lambda inplace: nn.ReLU6(inplace=inplace),
    "Hardtanh": lambda inplace: nn.Hardtanh(-0.5, 0.75, inplace=inplace),
    "LeakyReLU": lambda inplace: nn.LeakyReLU(0.1, inplace=inplace),
    "LeakyReLU-negative": lambda inplace: nn.LeakyReLU(-0.3, inplace=False),
    "Hardsigmoid": lambda inplace: nn.Hardsigmoid(inplace=inplace),
}


@pytest.mark.parametrize("exact", [False, True], ids=["int8", "debug_exact"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", sorted(FAMILY))
def test_relu_family_bit_for_bit(name, inplace, dtype, layout, exact):
    """ReLU6, Hardtanh and LeakyReLU keep 1 bit; outputs and input gradients are torch's bit
    for bit, with infinities, zeros, the range's ends and non-finite gradients; with NaN too,
    except compressed Hardtanh in channels-last (torch's CPU kernel treats a NaN by its
    position in its loops, which the gradient's layout changes; see ops/relu.py)."""
    cfg = mesa_lite.Config(layers=CNN.layers | {"activation"}, debug_exact=exact)
    nan = exact or name not in ("Hardtanh", "ReLU6") or layout == "contiguous"
    results = []
    for wrap in (False, True):
        act = FAMILY[name](inplace)
        if wrap:
            act = mesa_lite.wrap(act, cfg)
            assert type(act).mesa_kind == ("activation" if name == "Hardsigmoid" else "relu")
        x0 = _input() * 4
        x0.view(-1)[5:11] = torch.tensor([0.75, 6.0, -0.5, 0.7, 3.0, -3.0])
        if not nan:
            x0 = torch.nan_to_num(x0, nan=1.0)
        if layout == "channels_last":
            x0 = x0.to(memory_format=torch.channels_last)
        x = x0.to(dtype).requires_grad_()
        out = act(x * 1.0)
        g = torch.linspace(-2, 2, out.numel()).view(out.shape).to(dtype)
        g.view(-1)[9] = float("inf")
        out.backward(g)
        results.append((out.detach().clone(), x.grad))
    (out_p, gx_p), (out_w, gx_w) = results
    assert_equal(out_w, out_p, "output")
    assert_equal(gx_w, gx_p, "input grad")
    assert gx_w.stride() == gx_p.stride()


@pytest.mark.parametrize("name", ["ReLU6", "LeakyReLU"])
def test_relu_family_keeps_a_bit(name):
    plain = nn.Sequential(nn.Linear(16, 64), FAMILY[name](False), nn.Linear(64, 8))
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(layers={"relu"}))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    params = [*plain.parameters(), *wrapped.parameters()]
    kept_p, _ = saved_activation_bytes(lambda: plain[1](plain[0](x)), params)
    kept_w, _ = saved_activation_bytes(lambda: wrapped[1](wrapped[0](x)), params)
    # both keep the first Linear's fp32 input (2,048 bytes, that layer is not wrapped); for
    # the activation plain keeps its fp32 input (8,192), the wrapped one 1 bit per element
    assert (kept_p, kept_w) == (2048 + 8192, 2048 + 8192 // 32)


def test_inplace_negative_slope_leaky_relu_raises_as_torch():
    act = mesa_lite.wrap(nn.LeakyReLU(-0.2, inplace=True), CNN)
    x = torch.randn(4, 4, requires_grad=True)
    out = act(x * 1.0)
    with pytest.raises(RuntimeError, match="negative slope"):
        out.sum().backward()


@pytest.mark.parametrize("exact", [False, True], ids=["int8", "debug_exact"])
def test_relu_family_compiles_like_eager(exact):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU6(inplace=True), nn.Conv2d(6, 6, 1),
                        nn.LeakyReLU(0.1, inplace=True), nn.Conv2d(6, 2, 1))  # fmt: skip
    wrapped = mesa_lite.wrap(net, mesa_lite.Config(layers=CNN.layers, debug_exact=exact))
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    assert_compiles_like_eager(wrapped, x, lambda o: o.square().mean(), 60.0 if exact else 30.0)
