"""GroupNorm (``mesa_lite.GroupNorm``, the opt-in layer kind ``"groupnorm"``): int8 normalized
input kept; output bit for bit torch's, gradients bit for bit in ``debug_exact`` and within an
SQNR floor compressed, for row-major and channels-last inputs, fp32 and bf16 autocast, without
affine parameters or with frozen ones, and under torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_compiles_like_eager, assert_equal, kept_by_both, sqnr_db

import mesa_lite

CNN = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)
EXACT = mesa_lite.Config(layers=CNN.layers, debug_exact=True)


def _net(affine=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.GroupNorm(4, 8, affine=affine),
                         nn.SiLU(), nn.Conv2d(8, 4, 1)).train()  # fmt: skip


def _run(model, x, autocast):
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = model(x)
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_output_and_gradients(exact, layout, autocast):
    plain = _net()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), EXACT if exact else CNN)
    assert type(wrapped[1]).mesa_kind == "groupnorm"
    x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(1))
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
        plain, wrapped = (m.to(memory_format=torch.channels_last) for m in (plain, wrapped))
    out_p, out_w = _run(plain, x, autocast), _run(wrapped, x, autocast)
    assert_equal(out_w, out_p, "output")
    assert out_w.stride() == out_p.stride()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        if exact:
            assert_equal(q.grad, p.grad, name)
        else:  # measured 43-67 dB
            assert sqnr_db(p.grad, q.grad) >= 35, (name, sqnr_db(p.grad, q.grad))


@pytest.mark.parametrize("shape", [(4, 6), (3, 6, 5), (2, 6, 3, 4, 2)])
def test_other_ranks_and_no_affine(shape):
    gn = nn.GroupNorm(3, 6, affine=False)
    wrapped = mesa_lite.wrap(copy.deepcopy(gn), EXACT)
    assert type(wrapped).mesa_kind == "groupnorm"
    grads = []
    for m in (gn, wrapped):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).requires_grad_()
        out = m(x * 1.0)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        grads.append((out, x.grad))
    assert_equal(grads[1][0], grads[0][0], "output")
    assert_equal(grads[1][1], grads[0][1], "input grad")


def test_frozen_weight_and_kept_bytes():
    plain = nn.GroupNorm(4, 16)
    plain.weight.requires_grad_(False)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CNN)
    x = torch.randn(4, 16, 12, 12, generator=torch.Generator().manual_seed(3)).requires_grad_()
    kept_p, kept_w, out_p, out_w = kept_by_both(plain, wrapped, x)
    assert_equal(out_w, out_p, "output")
    assert kept_w <= 0.3 * kept_p, (kept_w, kept_p)  # int8 codes and scales against fp32
    g = torch.linspace(-1, 1, out_p.numel()).view(out_p.shape)
    (gx_p,) = torch.autograd.grad(out_p, x, g)
    gx_w, gb_w = torch.autograd.grad(out_w, (x, wrapped.bias), g)
    assert sqnr_db(gx_p, gx_w) >= 35
    assert wrapped.weight.grad is None and gb_w is not None


def test_bad_group_count_raises_as_torch():
    wrapped = mesa_lite.wrap(nn.GroupNorm(3, 6), CNN)
    wrapped.num_groups = 4  # 6 channels do not split in 4 groups
    with pytest.raises(RuntimeError, match="divisible by num_groups"):
        wrapped(torch.randn(2, 6, 3, 3, requires_grad=True))


def test_compiles_like_eager():
    wrapped = mesa_lite.wrap(_net(), CNN)
    x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(1))
    assert_compiles_like_eager(wrapped, x, lambda out: out.square().mean())
