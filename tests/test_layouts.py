"""The forward is PyTorch's bit for bit whatever the input's layout (issue 41).

Every kind ``wrap`` converts (the default ones and the opt-in ones) runs on the same values in
several memory layouts: contiguous, a transposed view, a permuted view, channels-last, a batch
expanded from one (a zero stride), and a slice with a storage offset; in fp32, under bf16
autocast with an fp32 input, and with a bf16 input under autocast; in training mode with grad.
A layout can choose another kernel (``at::matmul`` folds a batch into one mm or runs a bmm;
a copy changes the summation order), so the wrapped module must take the path the plain one
takes. Each wrapped module's output is compared with a deep copy of the plain module's.
"""

import copy

import pytest
import torch
import torch.nn as nn
from conftest import DEVICES, assert_equal

import mesa_lite

CONFIG = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)


def _timm_attention(fused: bool):
    timm = pytest.importorskip("timm")
    m = timm.models.vision_transformer.Attention(32, num_heads=4, qkv_bias=True)
    m.fused_attn = fused
    return m


# name: (module factory, input shape); every kind wrap converts, default and opt-in
MODULES = {
    # wide enough that a bmm and a folded mm sum in another order on the CPU (LeViT's qkv)
    "linear": (lambda: nn.Linear(128, 64), (2, 49, 128)),
    "linear-2d": (lambda: nn.Linear(128, 64), (49, 128)),
    "linear-no-bias": (lambda: nn.Linear(128, 64, bias=False), (2, 49, 128)),
    "gelu": (nn.GELU, (3, 5, 32)),
    "gelu-tanh": (lambda: nn.GELU("tanh"), (3, 5, 32)),
    "silu": (nn.SiLU, (3, 5, 32)),
    "softmax": (lambda: nn.Softmax(-1), (3, 5, 32)),
    "layernorm": (lambda: nn.LayerNorm(32), (3, 5, 32)),
    "rmsnorm": (lambda: nn.RMSNorm(32), (3, 5, 32)),
    "dropout": (lambda: nn.Dropout(0.25), (3, 5, 32)),
    "attention-fused": (lambda: _timm_attention(True), (3, 5, 32)),
    "attention-explicit": (lambda: _timm_attention(False), (3, 5, 32)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), (3, 4, 9)),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, padding=1), (3, 4, 7, 6)),
    "conv2d-strided": (lambda: nn.Conv2d(4, 6, 3, stride=2), (3, 4, 7, 6)),
    "conv2d-depthwise": (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4), (3, 4, 7, 6)),
    "conv3d": (lambda: nn.Conv3d(4, 6, 3, padding=1), (2, 4, 5, 4, 3)),
    "convtranspose2d": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2), (3, 4, 5, 6)),
    "batchnorm1d": (lambda: nn.BatchNorm1d(4), (3, 4, 9)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(4), (3, 4, 7, 6)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (3, 4, 7, 6)),
    "instancenorm2d": (lambda: nn.InstanceNorm2d(4, affine=True), (3, 4, 7, 6)),
    "relu": (nn.ReLU, (3, 4, 7, 6)),
    "relu6": (nn.ReLU6, (3, 4, 7, 6)),
    "leaky-relu": (lambda: nn.LeakyReLU(0.1), (3, 4, 7, 6)),
    "hardswish": (nn.Hardswish, (3, 4, 7, 6)),
    "hardsigmoid": (nn.Hardsigmoid, (3, 4, 7, 6)),
    "sigmoid": (nn.Sigmoid, (3, 4, 7, 6)),
    "maxpool2d": (lambda: nn.MaxPool2d(2), (3, 4, 7, 6)),
    "avgpool2d": (lambda: nn.AvgPool2d(2), (3, 4, 7, 6)),
    "adaptive-avgpool2d": (lambda: nn.AdaptiveAvgPool2d(1), (3, 4, 7, 6)),
}


def _layout(base: torch.Tensor, layout: str) -> torch.Tensor:
    """``base``'s values in ``layout`` (None where it does not apply to its rank)."""
    d = base.dim()
    if layout == "contiguous":
        return base.clone()
    if layout == "transposed":  # the last two dims swapped in memory (LeViT's qkv input)
        return base.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "permuted":  # every dim in reverse order in memory
        rev = tuple(range(d - 1, -1, -1))
        return base.permute(rev).contiguous().permute(rev)
    if layout == "channels_last":
        if d == 4:
            return base.contiguous(memory_format=torch.channels_last)
        if d == 5:
            return base.contiguous(memory_format=torch.channels_last_3d)
        return None
    if layout == "expanded":  # a batch of copies of one sample: stride 0 on the batch dim
        return base[:1].expand(base.shape)
    if layout == "offset":  # a slice of a wider tensor: a storage offset and a longer row
        wide = torch.zeros(*base.shape[:-1], base.shape[-1] + 3, dtype=base.dtype)
        wide[..., 2 : 2 + base.shape[-1]] = base
        return wide[..., 2 : 2 + base.shape[-1]]
    raise ValueError(layout)


LAYOUTS = ["contiguous", "transposed", "permuted", "channels_last", "expanded", "offset"]
PRECISIONS = ["fp32", "bf16-autocast", "bf16-input"]


def _run(module, x, precision, device):
    torch.manual_seed(7)  # dropout draws the same mask in both
    x = x.to(device).requires_grad_()
    with torch.autocast(device.type, torch.bfloat16, enabled=precision != "fp32"):
        return module(x)


def _force_triton(monkeypatch):
    """The Triton kernels for CPU tensors too (in Triton's interpreter, which the suite turns
    on without a GPU): the path CUDA tensors take."""
    import mesa_lite.kernels.bits
    import mesa_lite.kernels.group_quant
    import mesa_lite.kernels.launch

    import mesa_lite.quant

    launch = mesa_lite.kernels.launch
    if not launch.HAS_TRITON or not launch.INTERPRETING:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")

    def force(t):
        return not torch.compiler.is_compiling()

    for module, name in ((launch, "use_triton"), (mesa_lite.quant, "use_triton"),
                         (mesa_lite.kernels.bits, "use_triton_for"),
                         (mesa_lite.kernels.group_quant, "use_triton_for")):  # fmt: skip
        monkeypatch.setattr(module, name, force)


# "triton": the CUDA path's kernels on CPU tensors (the CPU runs the references otherwise)
PATHS = [("cpu", "default"), ("cpu", "triton")] + (
    [("cuda", "default")] if "cuda" in DEVICES else []
)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("device, path", PATHS, ids=[f"{d}-{p}" for d, p in PATHS])
def test_forward_is_torch_s_for_every_layout(name, layout, precision, device, path, monkeypatch):
    if path == "triton":
        _force_triton(monkeypatch)
    device = torch.device(device)
    factory, shape = MODULES[name]
    torch.manual_seed(0)
    plain = factory().to(device).train()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CONFIG)
    assert mesa_lite.wrapped_modules(wrapped), f"{name}: nothing converted"
    g = torch.Generator().manual_seed(1)
    base = torch.randn(shape, generator=g)
    if precision == "bf16-input":
        base = base.bfloat16()
    x = _layout(base, layout)
    if x is None:
        pytest.skip(f"{layout} needs a 4-D or 5-D input")
    assert torch.equal(x, base[:1].expand(base.shape) if layout == "expanded" else base)
    want = _run(plain, x, precision, device)
    got = _run(wrapped, x, precision, device)
    assert_equal(got, want, f"{name}, {layout}, {precision}")
