"""MaxPool2d (``mesa_lite.MaxPool2d``, the opt-in kind ``"pool"``): a byte per output (the
maximum's offset in its window) instead of torch's input and int64 indices; output and
gradient bit for bit torch's, ties and NaN included (the indices are torch's own)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_compiles_like_eager, assert_equal, kept_by_both

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
