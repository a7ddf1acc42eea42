"""Whole convolutional models with the opt-in kinds (conv, batchnorm, relu) on: timm's and
torchvision's ResNet-18 at 64x64, batch 4, fp32 on the CPU. Measured (2026-12-02, torch
2.14): both keep 45% of the plain model's bytes for backward (the max-pool's int64 indices
and the residual path stay plain), weight gradients at 38.5 dB or better, the rest exact."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_equal, kept_by_both, sqnr_db

import mesa_lite

CNN = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)
EXACT = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS, debug_exact=True)


def _resnet18(source: str):
    torch.manual_seed(0)
    if source == "timm":
        timm = pytest.importorskip("timm")
        return timm.create_model("resnet18", pretrained=False, num_classes=10)
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(weights=None, num_classes=10)


@pytest.mark.parametrize("source", ["timm", "torchvision"])
def test_resnet18_keeps_under_half_with_gradients_within_the_floor(source):
    plain = _resnet18(source).train()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CNN)
    converted = mesa_lite.wrapped_modules(wrapped).values()
    for cls in (mesa_lite.Conv2d, mesa_lite.BatchNorm2d, mesa_lite.ReLU):
        assert any(isinstance(m, cls) for m in converted), cls
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    kept_p, kept_w, out_p, out_w = kept_by_both(plain, wrapped, x)
    assert_equal(out_w, out_p, "logits")
    assert kept_w <= 0.5 * kept_p, (kept_w, kept_p)
    y = torch.arange(4)
    F.cross_entropy(out_p, y).backward()
    F.cross_entropy(out_w, y).backward()
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert sqnr_db(p.grad, q.grad) >= 30, (n, sqnr_db(p.grad, q.grad))
    for (n, a), b in zip(plain.named_buffers(), wrapped.buffers(), strict=True):
        assert_equal(b, a, n)


def test_resnet18_debug_exact_is_bit_for_bit():
    plain = _resnet18("torchvision").train()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), EXACT)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    F.cross_entropy(plain(x), torch.arange(2)).backward()
    F.cross_entropy(wrapped(x), torch.arange(2)).backward()
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert_equal(q.grad, p.grad, n)
