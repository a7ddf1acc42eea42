"""Sigmoid and Hardswish (the opt-in layer kind ``"activation"``, with Hardsigmoid, which keeps
a bit: tests/test_relu.py): int8 input kept (Hardswish: and 2 bits, its piece); outputs bit
for bit torch's, gradients bit for bit in ``debug_exact`` and within an SQNR floor
compressed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_equal, saved_activation_bytes, sqnr_db

import mesa_lite

KINDS = mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS
ACTS = {
    "Hardswish": lambda inplace: nn.Hardswish(inplace=inplace),
    "Sigmoid": lambda inplace: nn.Sigmoid(),
}


def _grads(act, x0, dtype, autocast):
    x = x0.clone().to(dtype).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = act(x * 1.0)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out, x.grad


@pytest.mark.parametrize("autocast", [False, True], ids=["eager", "bf16-autocast"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", sorted(ACTS))
def test_debug_exact_bit_for_bit(name, inplace, autocast):
    x0 = torch.randn(4, 8, 30, generator=torch.Generator().manual_seed(0)) * 4
    x0.view(-1)[:5] = torch.tensor([3.0, -3.0, 0.0, float("inf"), float("nan")])
    plain = ACTS[name](inplace)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(layers=KINDS, debug_exact=True))
    assert type(wrapped).mesa_kind == "activation"
    out_p, g_p = _grads(plain, x0, torch.float32, autocast)
    out_w, g_w = _grads(wrapped, x0, torch.float32, autocast)
    assert_equal(out_w, out_p, "output")
    assert_equal(g_w, g_p, "input grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(ACTS))
def test_compressed_within_the_floor(name, dtype):
    """Measured at unit-scale inputs: 40+ dB."""
    x0 = torch.randn(8, 64, 49, generator=torch.Generator().manual_seed(0))
    plain = ACTS[name](False)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(layers=KINDS))
    out_p, g_p = _grads(plain, x0, dtype, False)
    out_w, g_w = _grads(wrapped, x0, dtype, False)
    assert_equal(out_w, out_p, "output")
    assert sqnr_db(g_p, g_w) >= 35, sqnr_db(g_p, g_w)
    h = x0.clone().requires_grad_()
    kept_p, _ = saved_activation_bytes(lambda: plain(h * 1.0))
    kept_w, _ = saved_activation_bytes(lambda: wrapped(h * 1.0))
    limit = 0.35 if name == "Hardswish" else 0.3  # Hardswish keeps 2 bits more
    assert kept_w <= limit * kept_p, (kept_w, kept_p)  # int8 codes and scales against fp32


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(("scale", "floor_db"), [(1.0, 45.0), (4.0, 30.0)])
def test_hardswish_keeps_its_pieces(scale, floor_db, inplace):
    """Its gradient jumps at -3 and 3: the kept pieces keep an input rounded across them on
    its own side (measured 48.7 dB at unit-scale inputs, 31.0 at four times that; 28 without
    the pieces); outside (-3, 3) the gradient is exact; NaN stays NaN."""
    x0 = torch.randn(8, 64, 49, generator=torch.Generator().manual_seed(0)) * scale
    x0.view(-1)[:4] = torch.tensor([-3.0, 3.0, -3.01, 3.01])
    plain = nn.Hardswish(inplace=inplace)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(layers=KINDS))
    out_p, g_p = _grads(plain, x0, torch.float32, False)
    out_w, g_w = _grads(wrapped, x0, torch.float32, False)
    assert_equal(out_w, out_p, "output")
    assert sqnr_db(g_p, g_w) >= floor_db, sqnr_db(g_p, g_w)
    outer = (x0 < -3) | (x0 > 3)
    assert_equal(g_w[outer], g_p[outer], "outer pieces")
    h = x0.clone().requires_grad_()
    kept_p, _ = saved_activation_bytes(lambda: plain(h * 1.0))
    kept_w, _ = saved_activation_bytes(lambda: wrapped(h * 1.0))
    assert kept_w <= 0.35 * kept_p, (kept_w, kept_p)  # int8, scales and 2 bits against fp32
    x = torch.tensor([float("nan"), 1.0, -5.0, 5.0], requires_grad=True)
    wrapped(x * 1.0).sum().backward()
    assert x.grad[0].isnan() or x.grad[0] == 1.0  # non-finite group: stays non-finite or passes


def test_hardswish_compiles_like_eager():
    from conftest import assert_compiles_like_eager

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Hardswish(inplace=True), nn.Conv2d(8, 2, 1))
    wrapped = mesa_lite.wrap(net, mesa_lite.Config(layers=KINDS))
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(1)) * 3
    assert_compiles_like_eager(wrapped, x, lambda o: o.square().mean())
