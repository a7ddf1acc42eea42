"""MaxPool2d (``mesa_lite.MaxPool2d``, the opt-in kind ``"pool"``): a byte per output (the
maximum's offset in its window) instead of torch's input and int64 indices; output and
gradient bit for bit torch's, ties and NaN included (the indices are torch's own)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    assert_compiles_like_eager,
    assert_equal,
    kept_by_both,
    saved_activation_bytes,
)

import mesa_lite

CNN = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)

POOLS = {
    "resnet-stem": dict(kernel_size=3, stride=2, padding=1),
    "2x2": dict(kernel_size=2),
    "dilated-ceil": dict(kernel_size=3, stride=2, padding=1, dilation=2, ceil_mode=True),
    "rect": dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0)),
    "overlap-16x16": dict(kernel_size=16, stride=1),
    "one-element-tuples": dict(kernel_size=(3,), stride=(2,), padding=(1,)),
    "empty-stride": dict(kernel_size=2, stride=()),
}


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "unbatched"])
@pytest.mark.parametrize("name", list(POOLS))
def test_output_and_gradient_bit_for_bit(name, layout):
    plain = nn.MaxPool2d(**POOLS[name])
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CNN)
    assert isinstance(wrapped, mesa_lite.MaxPool2d)
    x = torch.randn(2, 3, 19, 17, generator=torch.Generator().manual_seed(0))
    x[0, 0, :6, :6] = 1.0  # ties: torch's first maximum wins in both
    x[1, 2, 3, 3] = float("nan")
    x[1, 1, :4, :4] = float("-inf")
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "unbatched":
        x = x[0]
    results = []
    for m in (plain, wrapped):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results.append((out, xi.grad))
    (out_p, g_p), (out_w, g_w) = results
    assert_equal(out_w, out_p, "output")
    assert_equal(g_w, g_p, "grad")
    assert g_w.stride() == g_p.stride()


def test_keeps_a_byte_per_output():
    """torch keeps the input (4 bytes per element, fp32) and int64 indices; here a byte per
    output."""
    plain = nn.MaxPool2d(3, 2, 1)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CNN)
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    kept_p, kept_w, out_p, _ = kept_by_both(plain, wrapped, x * 1.0)
    assert kept_p == 4 * x.numel() + 8 * out_p.numel()
    assert kept_w == out_p.numel()


def test_indices_wanted_or_large_windows_run_plain():
    """``return_indices=True`` returns torch's indices; a window over 256 elements does not fit
    a byte: both run ``F.max_pool2d`` itself."""
    x = torch.randn(1, 2, 20, 20, requires_grad=True)
    with_idx = mesa_lite.wrap(nn.MaxPool2d(2, return_indices=True), CNN)
    out, idx = with_idx(x)
    ref, ref_idx = F.max_pool2d(x, 2, return_indices=True)
    assert_equal(out, ref)
    assert_equal(idx, ref_idx)
    big = mesa_lite.wrap(nn.MaxPool2d(17, 1), CNN)
    kept_p, kept_w, _, _ = kept_by_both(nn.MaxPool2d(17, 1), big, x * 1.0)
    assert kept_w == kept_p


def test_compiles_into_one_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                          nn.Flatten(), nn.LazyLinear(4))  # fmt: skip
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    model(x)
    assert_compiles_like_eager(mesa_lite.wrap(model, CNN), x, lambda out: out.square().sum())


AVG = {
    "avg2": lambda: nn.AvgPool2d(2),
    "avg3-ceil-nopad-count": lambda: nn.AvgPool2d(
        3, 2, 1, ceil_mode=True, count_include_pad=False
    ),  # fmt: skip
    "avg-divisor": lambda: nn.AvgPool2d((2, 3), divisor_override=5),
    "adaptive3": lambda: nn.AdaptiveAvgPool2d(3),
    "adaptive5x7": lambda: nn.AdaptiveAvgPool2d((5, 7)),
    "adaptive1": lambda: nn.AdaptiveAvgPool2d(1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("name", sorted(AVG))
def test_average_pooling_keeps_nothing(name, layout, dtype):
    """AvgPool2d and AdaptiveAvgPool2d (kind "pool"): torch keeps their input for backward
    (except adaptive pooling to one value, a mean); wrapped, nothing, with output and
    gradient bit for bit torch's (its backward ops read only the input's shape)."""
    plain = AVG[name]()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(layers={"pool"}))
    assert type(wrapped).mesa_kind == "pool"
    x0 = torch.randn(2, 4, 11, 13, generator=torch.Generator().manual_seed(0)).to(dtype)
    if layout == "channels_last":
        x0 = x0.to(memory_format=torch.channels_last)
    results = []
    for m in (plain, wrapped):
        x = x0.clone().requires_grad_()
        kept, out = saved_activation_bytes(lambda m=m, x=x: m(x * 1.0))
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(dtype))
        results.append((out, x.grad, kept))
    (out_p, gx_p, kept_p), (out_w, gx_w, kept_w) = results
    assert_equal(out_w, out_p, "output")
    assert_equal(gx_w, gx_p, "input grad")
    assert gx_w.stride() == gx_p.stride()
    assert kept_w == 0
    assert kept_p == (0 if name == "adaptive1" else x0.numel() * x0.element_size())


def test_average_pooling_compiles_like_eager():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AvgPool2d(2), nn.Conv2d(4, 4, 1),
                        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 2))  # fmt: skip
    wrapped = mesa_lite.wrap(net, mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | {"pool"}))
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    assert_compiles_like_eager(wrapped, x, lambda o: o.square().mean(), 60.0)
