"""One saved copy per tensor: LayerNorm -> Linear, GELU -> Linear, softmax -> matmul and the
attention output -> projection share codes; sharing refuses whatever would be wrong."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_equal, saved_activation_bytes, sqnr_db

import mesa_lite
from mesa_lite import Config, QuantSpec


class Chain(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, 4 * c)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.norm(x))))


AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _grads(model, x, autocast, device):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        y = model(x)
    y.backward(torch.ones_like(y) / y.numel() ** 0.5)
    return y, [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_chain_shares_and_gradients_hold(exact, autocast, device):
    torch.manual_seed(0)
    plain = Chain().to(device)
    with torch.no_grad():
        plain.norm.weight.add_(torch.randn_like(plain.norm.weight) * 0.2)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=exact))
    x = torch.randn(4, 30, 64, device=device) * 2 + 3  # a per-row offset, as residual streams
    y_ref, g_ref = _grads(plain, x, AUTOCAST[autocast], device)
    y, g = _grads(wrapped, x, AUTOCAST[autocast], device)
    assert_equal(y, y_ref, "forward")
    for i, (a, b) in enumerate(zip(g_ref, g, strict=True)):
        if exact:
            assert_equal(b, a, f"grad {i}")
        else:
            assert sqnr_db(a, b) >= 30, f"grad {i}: {sqnr_db(a, b):.1f} dB"
    if not exact:
        report = mesa_lite.memory_report(wrapped, x, autocast=AUTOCAST[autocast], print_table=False)
        kept = {r.name: r.compressed_bytes for r in report.rows}
        assert kept["fc1"] == 0 and kept["fc2"] == 0, kept
        n = x.numel()
        # LayerNorm: int8 x_hat + scales + fp32 mean, rstd; GELU: int8 input + scales
        assert kept["norm"] == n + n // 128 * 4 + 2 * 4 * n // 64
        assert kept["act"] == 4 * n + 4 * n // 128 * 4


def test_no_sharing_across_different_specs():
    torch.manual_seed(0)
    model = mesa_lite.wrap(Chain(), Config(overrides={"fc2": {"group_size": 64}}))
    x = torch.randn(4, 30, 64)
    kept = {
        r.name: r.compressed_bytes
        for r in mesa_lite.memory_report(model, x, print_table=False).rows
    }
    assert kept["fc1"] == 0, "same spec: shared"
    assert kept["fc2"] == 4 * x.numel() + 4 * x.numel() // 64 * 4, "other group size: own copy"


def test_no_sharing_after_in_place_change():
    """An in-place op between producer and consumer must not let the consumer rebuild the
    tensor as it was before."""
    torch.manual_seed(0)
    norm, fc = nn.LayerNorm(64), nn.Linear(64, 32)
    wnorm, wfc = mesa_lite.wrap(copy.deepcopy(norm)), mesa_lite.wrap(copy.deepcopy(fc))
    x = torch.randn(8, 64)

    def run(n, f):
        y = n(x)
        y = y.mul_(3).add_(5)  # in place: y's version changes
        f(y).sum().backward()
        return f.weight.grad

    g_ref, g = run(norm, fc), run(wnorm, wfc)
    assert sqnr_db(g_ref, g) >= 30, sqnr_db(g_ref, g)


def test_attention_output_shared_with_projection(device):
    """SDPA's output, reshaped (B, N, C) for the projection: a view when the backend wrote it
    (B, N, H, D)-contiguous; then the projection keeps nothing new."""
    torch.manual_seed(0)
    B, N, H, D = 2, 40, 3, 16
    qkv = torch.randn(B, N, 3, H, D, device=device).permute(2, 0, 3, 1, 4)
    q, k, v = (t.clone().requires_grad_() for t in qkv.unbind(0))
    proj = mesa_lite.wrap(nn.Linear(H * D, H * D).to(device))
    spec = QuantSpec()

    def fwd():
        out = mesa_lite.modules.scaled_dot_product_attention(q, k, v, spec=spec)
        return out, proj(out.transpose(1, 2).reshape(B, N, H * D))

    ref_out = F.scaled_dot_product_attention(q, k, v)
    is_view = ref_out.transpose(1, 2).is_contiguous()
    kept, (out, y) = saved_activation_bytes(fwd, proj.parameters())
    attn_only, _ = saved_activation_bytes(
        lambda: mesa_lite.modules.scaled_dot_product_attention(q, k, v, spec=spec)
    )
    if is_view:
        assert kept == attn_only, "the projection must reuse the attention output's codes"
    else:
        assert kept > attn_only
    y.sum().backward()
    g_proj = proj.weight.grad.clone()
    proj.weight.grad = None
    plain = nn.Linear(H * D, H * D).to(device)
    plain.load_state_dict(proj.state_dict())
    plain(ref_out.transpose(1, 2).reshape(B, N, H * D)).sum().backward()
    assert sqnr_db(plain.weight.grad, g_proj) >= 30


class TwoConvs(nn.Module):
    """One input read by two convolutions (a ResNet's first block: conv1 and the
    downsample)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 8, 1)
        self.b = nn.Conv2d(8, 16, 1, stride=2)

    def forward(self, x):
        x = x[:, :, ::2, ::2].clone()  # a plain op's output (keeps nothing): no codes
        return self.a(x).sum() + self.b(x).sum()


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_convolutions_reading_one_input_keep_one_copy(channels_last):
    torch.manual_seed(0)
    plain = TwoConvs()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(layers={"conv"}))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    x = x.to(memory_format=fmt).requires_grad_()
    assert x[:, :, ::2, ::2].clone().is_contiguous(memory_format=fmt)
    params = list(wrapped.parameters())
    kept, _ = saved_activation_bytes(lambda: wrapped(x), params)
    codes = 4 * 8 * 8 * 8  # one int8 copy of the input (+ its scales)
    assert codes < kept < 1.1 * codes, kept
    ref = torch.autograd.grad(plain(x), [x, *plain.parameters()])
    got = torch.autograd.grad(wrapped(x), [x, *params])
    for r, g in zip(ref, got, strict=True):
        assert sqnr_db(r, g) > 35.0


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_a_convolution_offers_no_codes_for_a_tensor_the_user_holds(channels_last):
    """A convolution reading a leaf (a batch buffer refilled each step through ``.data``, which
    moves no version counter) keeps its own codes each step: none are registered for the
    buffer, so the next step's gradients come from the next step's values."""
    from mesa_lite import quant

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(layers={"conv", "linear"}))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    buf = torch.zeros(2, 3, 8, 8).to(memory_format=fmt)
    for step in range(3):
        buf.data.copy_(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(step)))
        grads = []
        for model in (plain, wrapped):
            model.zero_grad()
            model(buf).square().sum().backward()
            grads.append(model[0].weight.grad)
        assert sqnr_db(grads[0], grads[1]) > 35.0, step
        assert quant.lookup_shared(buf, QuantSpec()) is None
