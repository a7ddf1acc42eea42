"""Sigmoid (the opt-in layer kind ``"activation"``, with Hardsigmoid, which keeps a bit:
tests/test_relu.py): int8 input kept; outputs bit for bit torch's, gradients bit for bit in
``debug_exact`` and within an SQNR floor compressed. Hardswish stays plain: its gradient jumps
at -3 and 3, and an int8 input that lands across them took the gradient to 27-29 dB at input
spreads of 3 and more (review, 2026-12-02); it needs the region kept as a bit as well."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_equal, saved_activation_bytes, sqnr_db

import mesa_lite

KINDS = mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS
ACTS = {"Sigmoid": lambda inplace: nn.Sigmoid()}


def _grads(act, x0, dtype, autocast):
    x = x0.clone().to(dtype).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = act(x * 1.0)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out, x.grad


@pytest.mark.parametrize("autocast", [False, True], ids=["eager", "bf16-autocast"])
@pytest.mark.parametrize("name", sorted(ACTS))
def test_debug_exact_bit_for_bit(name, autocast):
    x0 = torch.randn(4, 8, 30, generator=torch.Generator().manual_seed(0)) * 4
    x0.view(-1)[:5] = torch.tensor([3.0, -3.0, 0.0, float("inf"), float("nan")])
    plain = ACTS[name](False)
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
    assert kept_w <= 0.3 * kept_p, (kept_w, kept_p)  # int8 codes and scales against fp32


def test_hardswish_stays_plain():
    wrapped = mesa_lite.wrap(nn.Sequential(nn.Linear(4, 4), nn.Hardswish()),
                             mesa_lite.Config(layers=KINDS))  # fmt: skip
    assert type(wrapped[1]) is nn.Hardswish
