"""BatchNorm (``mesa_lite.BatchNorm1d/2d/3d``, the opt-in kind ``"batchnorm"``): in training
mode the output, running statistics and ``num_batches_tracked`` are torch's bit for bit, the
gradients too with ``debug_exact``; compressed, the normalized input kept as int8 gives the
bias gradient to fp32 rounding and the others within the int8 floor."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    assert_compiles_like_eager,
    assert_equal,
    count_calls,
    interpreter_runs_loops,
    kept_by_both,
    saved_activation_bytes,
    sqnr_db,
)

import mesa_lite

LAYERS = mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS
CNN = mesa_lite.Config(layers=LAYERS)
EXACT = mesa_lite.Config(layers=LAYERS, debug_exact=True)

# name: (module factory, input shape, channels-last)
CASES = {
    "1d-flat": (lambda: nn.BatchNorm1d(6), (8, 6), False),
    "1d-seq": (lambda: nn.BatchNorm1d(6, momentum=None), (4, 6, 10), False),
    "2d": (lambda: nn.BatchNorm2d(6), (4, 6, 5, 7), False),
    "2d-channels-last": (lambda: nn.BatchNorm2d(6), (4, 6, 5, 7), True),
    "2d-no-affine": (lambda: nn.BatchNorm2d(6, affine=False), (4, 6, 5, 5), False),
    "2d-no-running-stats": (
        lambda: nn.BatchNorm2d(6, track_running_stats=False),
        (3, 6, 4, 4),
        False,
    ),  # fmt: skip
    "3d": (lambda: nn.BatchNorm3d(4), (2, 4, 3, 4, 5), False),
}
MODES = ["fp32", "bf16-autocast"]


def _step(model, name, mode):
    factory, shape, channels_last = CASES[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 3 + 1
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
        out = model(x * 1.0)
    w = torch.linspace(-1, 2, out.numel()).view(out.shape).to(out.dtype)
    (out * w).float().sum().backward()
    return out, [x.grad, *[p.grad for p in model.parameters()]]


def _pair(name, cfg):
    torch.manual_seed(0)
    plain = CASES[name][0]()
    for p in plain.parameters():  # not the init's ones and zeros
        p.data.uniform_(0.5, 1.5)
    return plain, mesa_lite.wrap(copy.deepcopy(plain), cfg)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_debug_exact_matches_torch_bit_for_bit(name, mode):
    plain, wrapped = _pair(name, EXACT)
    for _ in range(2):  # two steps: the running statistics move twice
        out_p, grads_p = _step(plain, name, mode)
        out_w, grads_w = _step(wrapped, name, mode)
    assert_equal(out_w, out_p, "output")
    for i, (a, b) in enumerate(zip(grads_w, grads_p, strict=True)):
        assert_equal(a, b, f"grad {i}")
    for (n, a), b in zip(wrapped.named_buffers(), plain.buffers(), strict=True):
        assert_equal(a, b, n)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_compressed_output_and_statistics_exact_gradients_within_the_floor(name, mode):
    plain, wrapped = _pair(name, CNN)
    assert isinstance(
        wrapped, mesa_lite.BatchNorm1d | mesa_lite.BatchNorm2d | mesa_lite.BatchNorm3d
    )
    out_p, (gx_p, *gp) = _step(plain, name, mode)
    out_w, (gx_w, *gw) = _step(wrapped, name, mode)
    assert_equal(out_w, out_p, "output")
    for (n, a), b in zip(wrapped.named_buffers(), plain.buffers(), strict=True):
        assert_equal(a, b, n)
    assert sqnr_db(gx_p, gx_w) >= 30, sqnr_db(gx_p, gx_w)
    if gp:  # affine: weight within the floor; bias to fp32 rounding (it does not read the
        # input, but the backward kernel's pass sums it, in another order than torch)
        assert sqnr_db(gp[0], gw[0]) >= 30, sqnr_db(gp[0], gw[0])
        assert sqnr_db(gp[1], gw[1]) >= 100, sqnr_db(gp[1], gw[1])


@pytest.mark.parametrize("low", [False, True], ids=["fp32", "half-input"])
@pytest.mark.parametrize("name", ["1d-seq", "2d", "2d-no-affine", "3d", "2d-channels-last"])
def test_backward_from_the_codes_in_two_passes(name, low, monkeypatch, triton_device):
    """Issue 51: a contiguous input's gradients come from x_hat's codes in two kernel passes
    (``kernels/batch_norm_backward.py``, forced here in the interpreter off CUDA), never
    rebuilding the input: within rounding of the path that rebuilds it and runs torch's
    backward, and within the int8 floor of torch's own. A channels-last input takes that
    other path. ``half-input``: a bf16 (CPU) or fp16 (CUDA) input with fp32 parameters, as a
    convolution's output under autocast reaches its BatchNorm."""
    from mesa_lite.kernels import batch_norm_backward as bb

    from mesa_lite.ops import batch_norm as bn_op

    if triton_device.type == "cpu" and not interpreter_runs_loops():
        pytest.skip("the kernels loop over a row: Triton's interpreter before 3.8 cannot")
    dtype = torch.float32
    if low:
        dtype = torch.float16 if triton_device.type == "cuda" else torch.bfloat16
    calls = count_calls(monkeypatch, bb, "batch_norm_backward")
    plain, wrapped = _pair(name, CNN)
    plain, wrapped = plain.to(triton_device), wrapped.to(triton_device)

    def step(model):
        factory, shape, channels_last = CASES[name]
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(shape, generator=g) * 3 + 1).to(triton_device, dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_(True)
        out = model(x * 1.0)
        w = torch.linspace(-1, 2, out.numel(), device=triton_device).view(out.shape)
        (out * w.to(out.dtype)).float().sum().backward()
        grads = [x.grad, *[p.grad for p in model.parameters()]]
        for p in model.parameters():
            p.grad = None
        return grads

    monkeypatch.setattr(bb, "use_triton_for", lambda t: True)
    fused = step(wrapped)
    assert len(calls) == (0 if CASES[name][2] else 1)
    monkeypatch.setattr(bn_op, "FUSED_BACKWARD", False)
    rebuilt = step(wrapped)
    want = step(plain)
    for a, b, c in zip(want, rebuilt, fused, strict=True):
        assert c.dtype == a.dtype and c.shape == a.shape and c.stride() == a.stride()
        floor = 30 if c.dtype == torch.float32 else 25  # the int8 floor; a half input's own
        assert sqnr_db(a, c) >= floor, sqnr_db(a, c)
        # the same codes: x_hat read from them, against the input rebuilt in its dtype
        # (137-149 dB in fp32 here, 58-64 dB with a bf16 input: the rebuilt input's rounding)
        assert sqnr_db(b, c) >= (100 if dtype == torch.float32 else 45), sqnr_db(b, c)


def test_expanded_input():
    """An expanded input (zero strides) trains: its input is rebuilt in row-major order, not
    in the input's overlapping layout (which a copy cannot write), and the gradients are
    those of the same values given contiguous (to fp32 rounding: that input takes the
    kernels' path)."""
    _, wrapped = _pair("2d", CNN)
    w = torch.linspace(-1, 2, 3 * 6 * 5 * 7).view(3, 6, 5, 7)
    grads = []
    for contiguous in (False, True):
        x0 = torch.randn(1, 6, 5, 7, generator=torch.Generator().manual_seed(2))
        x0.requires_grad_(True)
        x = x0.expand(3, 6, 5, 7)
        (wrapped(x.contiguous() if contiguous else x) * w).sum().backward()
        grads.append([x0.grad, *[p.grad.clone() for p in wrapped.parameters()]])
        wrapped.zero_grad()
    for a, b in zip(*grads, strict=True):
        assert sqnr_db(b, a) >= 100, sqnr_db(b, a)


def test_keeps_the_normalized_input_as_int8():
    """torch keeps the fp32 input (4 bytes per element); the wrapped BatchNorm one byte per
    element, an fp32 scale per 128, its per-channel mean and invstd, and (as torch) references
    to the running statistics."""
    plain = nn.BatchNorm2d(16)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CNN)
    x = torch.randn(4, 16, 8, 8, requires_grad=True)
    kept_p, kept_w, out_p, out_w = kept_by_both(plain, wrapped, x * 1.0)
    n = x.numel()
    assert kept_p >= 4 * n
    assert kept_w == n + 4 * math.ceil(n / 128) + 2 * 16 * 4 + 2 * 16 * 4


def test_eval_mode_and_no_grad_run_torch_itself():
    plain, wrapped = _pair("2d", CNN)
    x = torch.randn(2, 6, 4, 4)
    for m in (plain, wrapped):
        m(x)  # a training step's statistics
        m.eval()
    assert_equal(wrapped(x), plain(x))
    wrapped.train()
    with torch.no_grad():
        plain.train()
        assert_equal(wrapped(x), plain(x))


def test_conv_bn_relu_compiles_into_one_graph_within_the_floor():
    """ResNet's stem form under mesa_lite.compile (Inductor, CPU): one graph, gradients within
    the int8 floor of eager mode's, running statistics equal."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip
    eager = mesa_lite.wrap(model, CNN)
    x = torch.randn(4, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    src = assert_compiles_like_eager(eager, x, lambda out: F.cross_entropy(out, torch.arange(4)))
    for (n, a), b in zip(eager.named_buffers(), src.buffers(), strict=True):
        torch.testing.assert_close(b, a, msg=n)


def test_one_value_per_channel_raises_as_torch():
    """A training batch with one value per channel raises F.batch_norm's own error (else the
    running variance would turn NaN)."""
    wrapped = mesa_lite.wrap(nn.BatchNorm1d(3), CNN)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        wrapped(torch.randn(1, 3, requires_grad=True))
    assert torch.isfinite(wrapped.running_var).all()


def test_channels_last_under_compile_matches_eager():
    """aot_eager with debug_exact: the compiled backward gets a contiguous gradient where eager
    mode passes a channels-last one; it is given the input's layout, so bit for bit."""
    torch._dynamo.reset()
    cfg = mesa_lite.Config(layers=LAYERS, debug_exact=True)
    torch.manual_seed(0)
    eager = mesa_lite.wrap(nn.BatchNorm2d(6), cfg)
    src = copy.deepcopy(eager)
    compiled = mesa_lite.compile(src, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 6, 5, 5).to(memory_format=torch.channels_last)
    grads = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_(True)
        m(xi).square().sum().backward()
        grads.append(xi.grad)
    assert_equal(grads[1], grads[0])
    assert_equal(src.weight.grad, eager.weight.grad)


INSTANCE = {
    "2d": lambda: nn.InstanceNorm2d(6),
    "2d-affine": lambda: nn.InstanceNorm2d(6, affine=True),
    "2d-tracked": lambda: nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
    "1d-affine": lambda: nn.InstanceNorm1d(6, affine=True),
    "3d": lambda: nn.InstanceNorm3d(6),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
@pytest.mark.parametrize("name", sorted(INSTANCE))
def test_instance_norm(name, exact, autocast):
    """InstanceNorm (kind "batchnorm"), what at::instance_norm computes with the BatchNorm that
    keeps its normalized input: output, running statistics and (debug_exact) gradients bit for
    bit; compressed, the input gradient within the floor."""
    torch.manual_seed(0)
    plain = INSTANCE[name]()
    if plain.affine:
        with torch.no_grad():
            plain.weight.uniform_(0.5, 1.5)
            plain.bias.uniform_(-1, 1)
    cfg = mesa_lite.Config(layers=CNN.layers, debug_exact=exact)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), cfg)
    assert type(wrapped).mesa_kind == "batchnorm"
    spatial = {"1": (64,), "2": (16, 16), "3": (4, 8, 8)}[name[0]]
    x0 = torch.randn(3, 6, *spatial, generator=torch.Generator().manual_seed(1))
    results = []
    for m in (plain, wrapped):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = m(x * 1.0)
        out.float().backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results.append((out, x.grad, [p.grad for p in m.parameters()]))
    (out_p, gx_p, gp_p), (out_w, gx_w, gp_w) = results
    assert_equal(out_w, out_p, "output")
    for (n, a), b in zip(plain.named_buffers(), wrapped.buffers(), strict=True):
        assert_equal(b, a, n)
    if exact:
        assert_equal(gx_w, gx_p, "input grad")
        for a, b in zip(gp_p, gp_w, strict=True):
            assert_equal(b, a, "parameter grad")
    else:
        assert sqnr_db(gx_p, gx_w) >= 30, sqnr_db(gx_p, gx_w)


def test_instance_norm_unbatched_and_eval():
    plain = nn.InstanceNorm2d(4, affine=True)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(layers=CNN.layers,
                                                                     debug_exact=True))  # fmt: skip
    x = torch.randn(4, 5, 5, generator=torch.Generator().manual_seed(2))  # no batch dim
    assert_equal(wrapped(x), plain(x), "unbatched")
    wrapped.eval()
    plain.eval()
    assert_equal(wrapped(x), plain(x), "eval")


@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_sync_batch_norm_in_one_process(exact):
    """Without a process group nn.SyncBatchNorm computes a plain batch norm: the wrapped one
    keeps its normalized input compressed there (same output, running statistics, and in
    debug_exact gradients, as torch's)."""
    plain = nn.SyncBatchNorm(6)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(layers=CNN.layers,
                                                                     debug_exact=exact))  # fmt: skip
    assert isinstance(wrapped, nn.SyncBatchNorm) and type(wrapped).mesa_kind == "batchnorm"
    x0 = torch.randn(4, 6, 8, 8, generator=torch.Generator().manual_seed(0))
    results = []
    for m in (plain, wrapped):
        x = x0.clone().requires_grad_()
        kept, out = saved_activation_bytes(lambda m=m, x=x: m(x * 1.0), list(m.parameters()))
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results.append((out, x.grad, kept))
    (out_p, gx_p, kept_p), (out_w, gx_w, kept_w) = results
    assert_equal(out_w, out_p, "output")
    for (n, a), b in zip(plain.named_buffers(), wrapped.buffers(), strict=True):
        assert_equal(b, a, n)
    if exact:
        assert_equal(gx_w, gx_p, "input grad")
    else:
        assert sqnr_db(gx_p, gx_w) >= 35
        assert kept_w <= 0.35 * kept_p, (kept_w, kept_p)
