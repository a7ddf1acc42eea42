"""Convolutions (``mesa_lite.Conv1d/2d/3d``, the opt-in layer kind ``"conv"``): forward bit for
bit torch's, gradients bit for bit with ``debug_exact``, the weight's gradient within the int8
floor compressed (the input's and bias's never read the kept input: exact), what is kept, the
layouts and padding forms, torch.compile, and the opt-in switch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_compiles_like_eager, assert_equal, kept_by_both, sqnr_db

import mesa_lite

CONV = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | {"conv"})
EXACT = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | {"conv"}, debug_exact=True)

# name: (module factory, input shape)
CASES = {
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), (2, 4, 20)),
    "conv2d-stride": (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1), (2, 4, 12, 12)),
    "conv2d-groups-dilation-nobias": (
        lambda: nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2, bias=False),
        (2, 4, 11, 9),
    ),
    "depthwise": (lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), (2, 8, 10, 10)),
    "conv3d": (lambda: nn.Conv3d(2, 4, 3, padding=1), (1, 2, 6, 5, 6)),
    "reflect": (lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"), (2, 4, 9, 9)),
    "circular": (lambda: nn.Conv1d(4, 6, 5, padding=2, padding_mode="circular"), (2, 4, 16)),
    "same": (lambda: nn.Conv2d(4, 6, 3, padding="same", dilation=2), (2, 4, 9, 9)),
    "valid": (lambda: nn.Conv2d(4, 6, 3, padding="valid"), (2, 4, 9, 9)),
}
MODES = ["fp32", "bf16-autocast"]


def _run(model, x, mode):
    """Forward under the mode, backward of a fixed weighting; (output, grads of x and params)."""
    x = x.detach().clone().requires_grad_(True)
    if x.dim() == 4 and model._test_channels_last:
        x = x.to(memory_format=torch.channels_last).detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
        out = model(x)
    w = torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype)
    (out * w).float().sum().backward()
    return out, [x.grad, *[p.grad for p in model.parameters()]]


def _pair(name, layout, cfg):
    factory, shape = CASES[name]
    torch.manual_seed(0)
    plain = factory()
    if layout == "channels_last":
        plain = plain.to(memory_format=torch.channels_last)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), cfg)
    for m in (plain, wrapped):
        m._test_channels_last = layout == "channels_last"
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return plain, wrapped, x


def _layouts(name):
    return ["contiguous", "channels_last"] if len(CASES[name][1]) == 4 else ["contiguous"]


PARAMS = [(n, lay, m) for n in CASES for lay in _layouts(n) for m in MODES]


@pytest.mark.parametrize(("name", "layout", "mode"), PARAMS)
def test_debug_exact_matches_torch_bit_for_bit(name, layout, mode):
    plain, wrapped, x = _pair(name, layout, EXACT)
    out_p, grads_p = _run(plain, x, mode)
    out_w, grads_w = _run(wrapped, x, mode)
    assert_equal(out_w, out_p, "output")
    assert out_w.stride() == out_p.stride()
    for i, (gw, gp) in enumerate(zip(grads_w, grads_p, strict=True)):
        assert_equal(gw, gp, f"grad {i}")
        assert gw.stride() == gp.stride(), i


@pytest.mark.parametrize(("name", "layout", "mode"), PARAMS)
def test_compressed_forward_exact_weight_gradient_within_the_floor(name, layout, mode):
    plain, wrapped, x = _pair(name, layout, CONV)
    assert isinstance(wrapped, mesa_lite.Conv1d | mesa_lite.Conv2d | mesa_lite.Conv3d)
    out_p, (gx_p, gwt_p, *gb_p) = _run(plain, x, mode)
    out_w, (gx_w, gwt_w, *gb_w) = _run(wrapped, x, mode)
    assert_equal(out_w, out_p, "output")
    assert_equal(gx_w, gx_p, "input grad (reads the weight, not the kept input)")
    for a, b in zip(gb_w, gb_p, strict=True):
        assert_equal(a, b, "bias grad")
    # int8 of the input: measured 42-52 dB over these cases
    assert sqnr_db(gwt_p, gwt_w) >= 30, sqnr_db(gwt_p, gwt_w)
    assert gwt_w.dtype == gwt_p.dtype == torch.float32


def test_channels_last_input_is_kept_without_a_copy():
    """A channels-last input is kept in its own memory order: with ``debug_exact`` the very
    storage of the input (no contiguous copy), as torch keeps it."""
    torch.manual_seed(0)
    wrapped = mesa_lite.wrap(nn.Conv2d(8, 8, 3, padding=1), EXACT)
    wrapped = wrapped.to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 8, 8).to(memory_format=torch.channels_last).requires_grad_(True)
    kept = []

    def pack(t):
        kept.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = wrapped(x)
    assert x.untyped_storage().data_ptr() in kept
    out.sum().backward()
    assert x.grad.is_contiguous(memory_format=torch.channels_last)


def test_uneven_same_padding_runs_the_plain_op():
    """``padding="same"`` with an even kernel pads one side more: the plain op runs (exact)."""
    torch.manual_seed(0)
    plain = nn.Conv2d(4, 6, 4, padding="same")
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CONV)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    kept_p, kept_w, out_p, out_w = kept_by_both(plain, wrapped, x)
    assert_equal(out_w, out_p)
    assert kept_w == kept_p


def test_keeps_int8_input_and_nothing_when_frozen():
    """fp32 input: about a quarter of the bytes (codes plus fp32 scales per 128); a frozen
    convolution whose input needs grad keeps no input at all (torch keeps it)."""
    torch.manual_seed(0)
    plain = nn.Conv2d(16, 16, 3, padding=1)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CONV)
    x = torch.randn(4, 16, 16, 16, requires_grad=True)
    kept_p, kept_w, _, _ = kept_by_both(plain, wrapped, x)
    n = x.numel()
    assert kept_p == 4 * n
    assert kept_w == n + 4 * math.ceil(n / 128)
    for m in (plain, wrapped):
        m.requires_grad_(False)
    kept_p, kept_w, _, out = kept_by_both(plain, wrapped, x)
    assert kept_p == 4 * n and kept_w == 0
    out.sum().backward()  # the input's gradient without the kept input
    x2 = x.detach().requires_grad_(True)
    plain(x2).sum().backward()
    assert_equal(x.grad, x2.grad)


def test_non_finite_input_reaches_the_weight_gradient():
    """An inf in the input makes the weight's gradient non-finite, as in torch (AMP's
    GradScaler then skips the step)."""
    wrapped = mesa_lite.wrap(nn.Conv2d(2, 2, 3), CONV)
    x = torch.randn(1, 2, 6, 6)
    x[0, 1, 2, 3] = float("inf")
    wrapped(x).sum().backward()
    assert not torch.isfinite(wrapped.weight.grad).all()


def test_conv_is_opt_in_and_unwraps():
    """The default Config leaves convolutions alone; with "conv" they convert in place with the
    same parameters and state_dict keys, and unwrap restores the torch classes."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 3, 8, 8))  # materialize the lazy layer
    keys = list(model.state_dict())
    assert "conv" not in mesa_lite.Config().layers
    default = mesa_lite.wrap(copy.deepcopy(model))
    assert type(default[0]) is nn.Conv2d
    wrapped = mesa_lite.wrap(copy.deepcopy(model), CONV)
    assert isinstance(wrapped[0], mesa_lite.Conv2d) and list(wrapped.state_dict()) == keys
    mesa_lite.unwrap(wrapped)
    assert type(wrapped[0]) is nn.Conv2d


def test_compiles_into_one_graph_within_the_floor():
    """torch.compile (Inductor, CPU) of a small CNN with wrapped convolutions: one graph, no
    break; gradients within the int8 floor of eager mode's."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    assert_compiles_like_eager(
        mesa_lite.wrap(model, CONV), x, lambda out: F.cross_entropy(out, torch.arange(4))
    )


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_unbatched_input_as_torch_runs_it(nd):
    """An unbatched input (C, *spatial) runs as a batch of one, as torch's convolution does:
    output and gradients bit for bit with debug_exact."""
    torch.manual_seed(0)
    plain = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[nd - 1](3, 4, 3)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), EXACT)
    grads = []
    for m in (plain, wrapped):
        x = torch.randn((3,) + (6,) * nd, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        out = m(x)
        out.square().sum().backward()
        grads.append((out, x.grad, m.weight.grad))
    for a, b in zip(*grads, strict=True):
        assert_equal(b, a)


def test_subclass_with_its_own_conv_forward_is_skipped(caplog):
    """A convolution that overrides ``_conv_forward`` (weight standardization) and not
    ``forward`` keeps its own computation, named in wrap's log."""

    class StdConv(nn.Conv2d):
        def _conv_forward(self, x, weight, bias):
            w = (weight - weight.mean((1, 2, 3), keepdim=True)) / (weight.std() + 1e-5)
            return super()._conv_forward(x, w, bias)

    m = StdConv(3, 4, 3)
    with caplog.at_level("INFO", logger="mesa_lite"):
        mesa_lite.wrap(m, CONV)
    assert not isinstance(m, mesa_lite.Conv2d)
    assert "StdConv x1 (subclass with its own _conv_forward)" in caplog.text


def test_lazy_modules_are_skipped_until_initialized(caplog):
    """A lazy module (its class changes on its first call) is skipped with the reason; after a
    first call it converts."""
    m = nn.Sequential(nn.LazyConv2d(6, 3), nn.LazyLinear(2))
    with caplog.at_level("INFO", logger="mesa_lite"):
        mesa_lite.wrap(m, CONV)
    assert "lazy parameters not initialized: wrap after a first call" in caplog.text
    m(torch.randn(2, 4, 5, 5, requires_grad=True)).sum().backward()
    mesa_lite.wrap(m, CONV)
    assert isinstance(m[0], mesa_lite.Conv2d) and isinstance(m[1], mesa_lite.Linear)


TRANSPOSED = {
    "t1d": (lambda: nn.ConvTranspose1d(4, 6, 4, stride=2), (2, 4, 9), None),
    "t2d-output-padding": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1),
        (2, 4, 7, 7), None,
    ),
    "t2d-groups-dilation-output-size": (
        lambda: nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1, groups=2, dilation=2),
        (2, 4, 7, 7), [16, 16],
    ),
    "t3d-nobias": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2, bias=False), (1, 2, 3, 4, 4),
                   None),
}  # fmt: skip


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
@pytest.mark.parametrize("name", sorted(TRANSPOSED))
def test_conv_transpose(name, exact, layout):
    """ConvTranspose1d/2d/3d (kind "conv"): int8 input kept; output and input gradient bit for
    bit (the weight is kept exactly), weight gradients bit for bit in debug_exact and at 38+
    dB compressed (measured 39.6-59.0), under bf16 autocast, with output_size too."""
    make, shape, output_size = TRANSPOSED[name]
    if layout == "channels_last" and len(shape) != 4:
        pytest.skip("channels-last is 4-D")
    torch.manual_seed(0)
    plain = make()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), EXACT if exact else CONV)
    assert type(wrapped).mesa_kind == "conv"
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    if layout == "channels_last":
        x0 = x0.to(memory_format=torch.channels_last)
        plain, wrapped = (m.to(memory_format=torch.channels_last) for m in (plain, wrapped))
    results = []
    for m in (plain, wrapped):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            out = m(x * 1.0, output_size) if output_size else m(x * 1.0)
        out.float().backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results.append((out, x.grad, [p.grad for p in m.parameters()]))
    (out_p, gx_p, gp_p), (out_w, gx_w, gp_w) = results
    assert_equal(out_w, out_p, "output")
    assert out_w.stride() == out_p.stride()
    assert_equal(gx_w, gx_p, "input grad")
    for a, b in zip(gp_p, gp_w, strict=True):
        if exact:
            assert_equal(b, a, "parameter grad")
        else:
            assert sqnr_db(a, b) >= 38, sqnr_db(a, b)


def test_conv_transpose_unbatched_runs_plain_and_kept_bytes():
    plain = nn.ConvTranspose2d(4, 6, 3, stride=2)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CONV)
    x = torch.randn(4, 5, 5, generator=torch.Generator().manual_seed(2), requires_grad=True)
    assert_equal(wrapped(x), plain(x), "unbatched")
    xb = torch.randn(8, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    kept_p, kept_w, out_p, out_w = kept_by_both(plain, wrapped, xb.requires_grad_())
    assert_equal(out_w, out_p, "output")
    assert kept_w <= 0.3 * kept_p, (kept_w, kept_p)  # int8 codes and scales against fp32
