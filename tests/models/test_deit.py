"""Whole model: timm DeiT-Tiny wrapped vs plain, fused attention on and off.

On a GPU the full model at batch 8. On CPU the same model cut to 2 of its 12 blocks at batch
2: the same patch embedding, head, and blocks (width 192, 3 heads, 197 tokens), at a 24th of
the compute. The full model took ~30 s a test on CPUs without native bf16, where bf16 autocast
is emulated (issue 11). Every figure the tests check was measured on both sizes (CPU, bf16
autocast, 2026-11-30):

    8 bits           median / worst gradient SQNR  42.6 / 36.9 dB full,  42.3 / 39.3 cut
    explicit attention, kept / plain's: fp32        19% full,  25% cut (the image's share grows)
                                        bf16        31% full,  31% cut
    low bits: see LOW_BIT_FLOORS; kept / 8-bit's is the same at both sizes (to 0.5%)
"""

import copy
import functools
import statistics

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_equal, saved_activation_bytes, sqnr_db

import mesa_lite

pytest.importorskip("timm")

# device type: (blocks, batch)
SIZES = {"cpu": (2, 2), "cuda": (12, 8)}


@functools.cache
def _built(fused: bool, device_type: str):
    """DeiT-Tiny as benchmarks/deit_memory.make_model builds it (seed 0, train mode), with
    SIZES' depth; built once per session, _deit hands out copies."""
    import timm

    torch.manual_seed(0)
    depth = SIZES[device_type][0]
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=depth)
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
    return model.train()


def _deit(fused: bool, device):
    return copy.deepcopy(_built(fused, device.type)).to(device)


def _step(model, x, y, device, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _inputs(device):
    batch = SIZES[device.type][1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 224, 224, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    return x, y


def _dtypes(device):
    return [torch.bfloat16] if device.type == "cpu" else [torch.float16, torch.bfloat16]


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused_attn", "explicit_attn"])
def test_deit_tiny_loss_exact_and_grad_sqnr(fused, device):
    plain = _deit(fused, device)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    kinds = {type(m).__name__ for m in mesa_lite.wrapped_modules(wrapped).values()}
    assert kinds == {"Linear", "LayerNorm", "GELU", "Attention"}
    x, y = _inputs(device)
    for dtype in _dtypes(device):
        loss_ref, g_ref = _step(plain, x, y, device, dtype)
        loss, g = _step(wrapped, x, y, device, dtype)
        assert_equal(loss, loss_ref, f"loss under {dtype}")
        db = sorted((sqnr_db(g_ref[n], g[n]), n) for n in g_ref)
        median = statistics.median(v for v, _ in db)
        print(f"\n{device.type} {dtype} fused={fused}: median {median:.1f} dB, worst five {db[:5]}")
        assert median >= 38.0, f"median gradient SQNR {median:.1f} dB; worst {db[:5]}"
        assert db[0][0] >= 15.0, f"worst gradient SQNR {db[0]}"
        assert median < float("inf"), "no gradient differs from the plain one: nothing compressed"


@pytest.mark.slow
def test_deit_tiny_state_dict_round_trip(device):
    plain = _deit(True, device)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    other = _deit(True, device)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.load_state_dict(wrapped.state_dict(), strict=True)
    wrapped.load_state_dict(other.state_dict(), strict=True)
    for k, v in plain.state_dict().items():
        assert_equal(other.state_dict()[k], v, k)
    x, _ = _inputs(device)
    plain.eval()
    wrapped.eval()
    with torch.no_grad():
        assert_equal(wrapped(x), plain(x), "eval forward")


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, limit", [(None, 0.35), (torch.bfloat16, 0.50)], ids=["fp32", "bf16_autocast"]
)
def test_deit_tiny_explicit_attention_bytes_kept(dtype, limit, device):
    plain = _deit(False, device)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    x, _ = _inputs(device)

    def fwd(model):
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            return model(x)

    ref, _ = saved_activation_bytes(lambda: fwd(plain), plain.parameters())
    ours, _ = saved_activation_bytes(lambda: fwd(wrapped), wrapped.parameters())
    ratio = ours / ref
    print(
        f"\nkept for backward: {ref / 2**20:.1f} MiB plain, {ours / 2**20:.1f} MiB wrapped ({ratio:.1%})"
    )
    assert ratio <= limit, f"{ratio:.1%} of the plain model's bytes (limit {limit:.0%})"


# Whole-model gradient SQNR of one backward below 8 bits (stochastic rounding), CPU bf16
# autocast, measured 2026-11-30 on DeiT-Tiny at batch 8: 4 bits median 19.0 / worst 13.3 dB,
# 2 bits median 1.1 / worst -4.9 dB (fused and explicit attention alike). Floors below those.
# The 2-block cut at batch 2 this test runs gives the same (seed 0, fused / explicit): 4 bits
# 19.7 / 12.7 and 19.8 / 13.0 dB, 2 bits 1.9 / -4.5 and 2.5 / -4.2 dB; over six seeds of
# weights, input and rounding its lowest were 18.6 / 10.9 and 1.8 / -6.0 dB, native and
# emulated bf16 alike.
LOW_BIT_FLOORS = {4: (16.0, 10.0), 2: (-1.0, -8.0)}


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_attn", "explicit_attn"])
def test_deit_tiny_low_bits(fused, bits):
    device = torch.device("cpu")
    plain = _deit(fused, device)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(bits=bits))
    x, y = _inputs(device)
    loss_ref, g_ref = _step(plain, x, y, device, torch.bfloat16)
    torch.manual_seed(0)
    loss, g = _step(wrapped, x, y, device, torch.bfloat16)
    assert_equal(loss, loss_ref, "loss")
    db = sorted((sqnr_db(g_ref[n], g[n]), n) for n in g_ref)
    median = statistics.median(v for v, _ in db)
    floor_median, floor_min = LOW_BIT_FLOORS[bits]
    assert median >= floor_median and db[0][0] >= floor_min, (median, db[:5])
    # What each model keeps beyond its own parameters and the input (both exist anyway; the
    # image, kept by the patch embedding's conv, would weigh more in the cut model than in the
    # full one). Measured 4 / 2 bits: 0.61 / 0.42 of the 8-bit model's with fused attention,
    # 0.52 / 0.28 explicit, at both sizes. (Until issue 11 the 8-bit count skipped the plain
    # model's parameters instead of its copy's, so the copy's weights counted as kept: 0.43 /
    # 0.32 and 0.40 / 0.24 at full size, a looser check than the limits meant.)
    int8 = mesa_lite.wrap(copy.deepcopy(plain))
    kept8, _ = saved_activation_bytes(lambda: int8(x), [*int8.parameters(), x])
    kept, _ = saved_activation_bytes(lambda: wrapped(x), [*wrapped.parameters(), x])
    assert kept < kept8 * {4: 0.7, 2: 0.55}[bits], (kept, kept8)
