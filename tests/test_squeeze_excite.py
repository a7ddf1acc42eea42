"""Squeeze-excitation (the opt-in layer kind ``"se"``: timm's ``SqueezeExcite`` and
``SEModule``) and in-place SiLU (``nn.SiLU(inplace=True)``, as timm's EfficientNets build it):
outputs bit for bit torch's, gradients bit for bit in ``debug_exact`` and within an SQNR floor
compressed, the multiply's input kept once (the SiLU's codes), and under torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_compiles_like_eager, assert_equal, kept_by_both, sqnr_db

import mesa_lite
from mesa_lite.config import QuantSpec
from mesa_lite.ops.mul import scale_mul

timm = pytest.importorskip("timm")
from timm.layers.squeeze_excite import SEModule  # noqa: E402
from timm.models._efficientnet_blocks import SqueezeExcite  # noqa: E402

CNN = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)
EXACT = mesa_lite.Config(layers=CNN.layers, debug_exact=True)


def _x(shape=(2, 8, 5, 5), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _block(se):
    """Conv -> BatchNorm -> SiLU (in place) -> squeeze-excitation -> Conv, as in EfficientNet
    (no bias before the BatchNorm: its gradient would be rounding noise around 0)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU(inplace=True),
                         se, nn.Conv2d(8, 4, 1)).train()  # fmt: skip


SES = {
    "SqueezeExcite": lambda: SqueezeExcite(8, act_layer=nn.SiLU),
    "SEModule": lambda: SEModule(8, rd_ratio=0.5, act_layer=nn.ReLU),
}


@pytest.mark.parametrize("se", sorted(SES))
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_block_output_and_gradients(se, exact):
    plain = _block(SES[se]())
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), EXACT if exact else CNN)
    assert type(wrapped[3]).mesa_kind == "se" and type(wrapped[2]).mesa_kind == "silu"
    x = _x()
    outs = []
    for m in (plain, wrapped):
        out = m(x)
        (out * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum().backward()
        outs.append(out)
    assert_equal(outs[1], outs[0], "output")
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        if exact:
            assert_equal(q.grad, p.grad, name)
        else:
            assert sqnr_db(p.grad, q.grad) >= 30, (name, sqnr_db(p.grad, q.grad))
    # the running statistics moved alike
    assert_equal(wrapped[1].running_var, plain[1].running_var, "running_var")


def test_multiply_keeps_the_silu_codes_once():
    """In the block the SiLU's output feeds the squeeze (kept nothing) and the multiply: the
    multiply reuses the SiLU's registered codes, so the block keeps well under half of plain."""
    plain = _block(SES["SqueezeExcite"]())
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CNN)
    x = _x((2, 8, 16, 16)).requires_grad_()
    kept_p, kept_w, out_p, out_w = kept_by_both(plain, wrapped, x)
    assert_equal(out_w, out_p, "output")
    # plain keeps (fp32) the conv inputs, BatchNorm's input, SiLU's output and the multiply's
    # two inputs; int8 with the SiLU's codes shared keeps about a quarter of it
    assert kept_w <= 0.3 * kept_p, (kept_w, kept_p)
    sole = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(layers=CNN.layers - {"silu"}))
    _, kept_sole, _, _ = kept_by_both(plain, sole, x)
    assert kept_w < kept_sole  # without the SiLU's codes the multiply keeps its own copy


@pytest.mark.parametrize("gate_shape", [(2, 8, 1, 1), (1, 8, 1, 1), (8, 1, 1)])
@pytest.mark.parametrize("needs", ["both", "x", "gate"])
def test_scale_mul_against_torch(gate_shape, needs):
    x0, g0 = _x(), torch.rand(gate_shape, generator=torch.Generator().manual_seed(1))
    spec = QuantSpec()
    grads = []
    for fn in (torch.mul, lambda a, b: scale_mul(a, b, spec)):
        x = x0.clone().requires_grad_(needs in ("both", "x"))
        g = g0.clone().requires_grad_(needs in ("both", "gate"))
        out = fn(x, g)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        grads.append((out, x.grad, g.grad))
    (out_p, gx_p, gg_p), (out_w, gx_w, gg_w) = grads
    assert_equal(out_w, out_p, "output")
    if gx_p is not None:
        assert_equal(gx_w, gx_p, "x grad")  # grad * gate: the gate is kept exactly
    else:
        assert gx_w is None
    if gg_p is not None:
        assert gg_w.shape == gg_p.shape and sqnr_db(gg_p, gg_w) >= 35, sqnr_db(gg_p, gg_w)
    else:
        assert gg_w is None


def test_scale_mul_full_size_gate_is_the_plain_product():
    x, g = _x().requires_grad_(), _x(seed=1).requires_grad_()
    out = scale_mul(x, g, QuantSpec())
    assert out.grad_fn.name() == "MulBackward0"


@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_inplace_silu_overwrites_its_input_as_torch(exact):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 12), nn.SiLU(inplace=True), nn.Linear(12, 3))
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), EXACT if exact else CNN)
    x = _x((4, 6))
    hidden = []
    for m in (plain, wrapped):
        h = m[0](x)
        out = m[2](m[1](h))
        hidden.append(h)  # overwritten in place by the SiLU
        out.square().sum().backward()
    assert_equal(hidden[1], hidden[0], "SiLU output in its input's storage")
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        if exact:
            assert_equal(q.grad, p.grad, name)
        else:
            assert sqnr_db(p.grad, q.grad) >= 35, (name, sqnr_db(p.grad, q.grad))


def test_inplace_silu_on_a_leaf_raises_as_torch():
    silu = mesa_lite.wrap(nn.SiLU(inplace=True), CNN)
    with pytest.raises(RuntimeError, match="leaf"):
        silu(torch.randn(3, requires_grad=True))


def test_compiles_like_eager():
    wrapped = mesa_lite.wrap(_block(SES["SqueezeExcite"]()), CNN)
    assert_compiles_like_eager(wrapped, _x(), lambda out: out.square().mean())


def test_inplace_silu_debug_exact_compiles_like_eager():
    """Under compile the in-place SiLU runs out of place and is copied back: kept exactly, the
    kept input must be a copy, or backward would read the SiLU's output (found by review)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 4, 1), nn.SiLU(inplace=True), nn.Conv2d(4, 2, 1)).train()
    wrapped = mesa_lite.wrap(copy.deepcopy(net), EXACT)
    assert_compiles_like_eager(wrapped, _x((2, 4, 5, 5)), lambda o: o.square().sum(), 60.0)


@pytest.mark.parametrize("inplace", [True, False])
def test_inplace_silu_debug_exact_under_non_reentrant_checkpoint(inplace):
    """torch.utils.checkpoint (non-reentrant) around Linear -> SiLU -> Linear: bit for bit in
    debug_exact (the in-place SiLU's exact copy must not be offered to the next layer, which
    would find it in the recompute but not in the forward)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.SiLU(inplace=inplace), nn.Linear(12, 3))
    wrapped = mesa_lite.wrap(copy.deepcopy(net), EXACT)
    x = _x((4, 6))
    for m in (net, wrapped):
        checkpoint(m, x, use_reentrant=False).square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), wrapped.parameters(), strict=True):
        assert_equal(q.grad, p.grad, name)
