"""Parametrized weights (``torch.nn.utils.parametrize``): a parametrized attribute is computed
on each read, and some parametrizations change state when computed (``spectral_norm`` runs a
power iteration and updates its ``_u``/``_v`` buffers), so every wrapped module reads each
parameter exactly as often per forward as the torch module it replaces. Checked with a counting
parametrization on every module kind the wrap converts, in every path (compressed, debug_exact,
eval mode, no grad, unbatched input, the plain fall-backs), and on an SN-GAN generator trained
wrapped and plain."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import HFStyleRMSNorm, assert_equal
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm

import mesa_lite
from mesa_lite.modules import MesaModule

LAYERS = mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS
CONFIGS = {
    "int8": mesa_lite.Config(layers=LAYERS),
    "debug_exact": mesa_lite.Config(layers=LAYERS, debug_exact=True),
}
# train: training mode with grad (the compressed path); eval: eval mode; no_grad: training mode
# under torch.no_grad; frozen: training mode with grad on, but neither the input nor the
# parameters need it. All but train run the plain torch op inside the wrapped forward.
MODES = ["train", "eval", "no_grad", "frozen"]

# name: (module factory, input shape); every module kind with parameters that ``wrap``
# converts, batched and unbatched where torch accepts both, and the forms that take a
# different path inside the wrapped forward (padding modes, uneven "same" padding)
CASES = {
    "linear": (lambda: nn.Linear(6, 5), (3, 6)),
    "linear-3d": (lambda: nn.Linear(6, 5), (2, 3, 6)),
    "linear-unbatched": (lambda: nn.Linear(6, 5), (6,)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 9)),
    "conv1d-unbatched": (lambda: nn.Conv1d(3, 4, 3, padding=1), (3, 9)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 7, 7)),
    "conv2d-unbatched": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (3, 7, 7)),
    "conv2d-reflect": (
        lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
        (2, 3, 6, 6),
    ),
    "conv2d-reflect-unbatched": (
        lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
        (3, 6, 6),
    ),
    "conv2d-same-uneven": (lambda: nn.Conv2d(3, 4, 4, padding="same"), (2, 3, 6, 6)),
    "conv2d-same-uneven-unbatched": (lambda: nn.Conv2d(3, 4, 4, padding="same"), (3, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), (1, 2, 4, 5, 4)),
    "conv3d-unbatched": (lambda: nn.Conv3d(2, 3, 3, padding=1), (2, 4, 5, 4)),
    "convtranspose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (2, 3, 5)),
    "convtranspose1d-unbatched": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (3, 5)),
    "convtranspose2d": (
        lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
        (2, 3, 4, 4),
    ),
    "convtranspose2d-unbatched": (
        lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
        (3, 4, 4),
    ),
    "convtranspose3d": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (1, 2, 3, 2, 3)),
    "convtranspose3d-unbatched": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (2, 3, 2, 3)),
    "batchnorm1d-2d": (lambda: nn.BatchNorm1d(3), (4, 3)),
    "batchnorm1d-3d": (lambda: nn.BatchNorm1d(3), (4, 3, 5)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(3), (2, 3, 4, 4)),
    "batchnorm2d-cumulative": (lambda: nn.BatchNorm2d(3, momentum=None), (2, 3, 4, 4)),
    "batchnorm2d-untracked": (
        lambda: nn.BatchNorm2d(3, track_running_stats=False),
        (2, 3, 4, 4),
    ),
    "batchnorm3d": (lambda: nn.BatchNorm3d(2), (2, 2, 3, 3, 3)),
    "syncbatchnorm": (lambda: nn.SyncBatchNorm(3), (2, 3, 4, 4)),
    "instancenorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), (2, 3, 6)),
    "instancenorm1d-unbatched": (lambda: nn.InstanceNorm1d(3, affine=True), (3, 6)),
    "instancenorm2d-tracked": (
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
        (2, 3, 4, 4),
    ),
    "instancenorm2d-unbatched": (lambda: nn.InstanceNorm2d(3, affine=True), (3, 4, 4)),
    "instancenorm3d": (lambda: nn.InstanceNorm3d(2, affine=True), (2, 2, 3, 3, 3)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (2, 4, 3, 3)),
    "groupnorm-2d": (lambda: nn.GroupNorm(2, 4), (3, 4)),
    "layernorm": (lambda: nn.LayerNorm(6), (2, 3, 6)),
    "layernorm-unbatched": (lambda: nn.LayerNorm(6), (6,)),
    "rmsnorm-hf": (lambda: HFStyleRMSNorm(6), (2, 3, 6)),
}
if hasattr(nn, "RMSNorm"):
    CASES["rmsnorm"] = (lambda: nn.RMSNorm(6), (2, 3, 6))
    CASES["rmsnorm-unbatched"] = (lambda: nn.RMSNorm((2, 6)), (2, 6))


class _Count(nn.Module):
    """The identity parametrization, counting how often the attribute is computed (read)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return t


def _counted(module: nn.Module) -> nn.Module:
    """``module`` with a ``_Count`` on each of its own parameters."""
    for name, _ in list(module.named_parameters(recurse=False)):
        parametrize.register_parametrization(module, name, _Count())
    assert parametrize.is_parametrized(module)
    return module


def _counts(module: nn.Module) -> dict[str, int]:
    return {name: plist[0].n for name, plist in module.parametrizations.items()}


def _pair(factory, cfg):
    """A torch module and its wrapped copy (the same initial values), each with a counting
    parametrization on every parameter, registered after the wrap (which may run the module's
    forward to recognise it)."""
    torch.manual_seed(0)
    plain = factory()
    with torch.no_grad():  # non-trivial affine parameters
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), cfg)
    assert isinstance(wrapped, MesaModule), f"{type(plain).__name__} is not converted"
    return _counted(plain), _counted(wrapped)


def _forward_counts(module: nn.Module, x: torch.Tensor, mode: str):
    """``module(x)`` (and its backward where there is one) in ``mode``: (output, how often
    each parameter was read)."""
    module.train(mode != "eval")
    x = x.clone().requires_grad_(mode not in ("no_grad", "frozen"))
    if mode == "frozen":
        for p in module.parameters():
            p.requires_grad_(False)
    before = _counts(module)
    with torch.set_grad_enabled(mode != "no_grad"):
        out = module(x)
        if out.requires_grad:
            (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    after = _counts(module)
    return out, {k: after[k] - before[k] for k in after}


def _assert_reads_alike(plain: nn.Module, wrapped: nn.Module, shape, mode: str) -> None:
    """The same forward (and backward) of both: each parameter read as often, the same output."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out_p, reads_p = _forward_counts(plain, x, mode)
    out_w, reads_w = _forward_counts(wrapped, x, mode)
    assert reads_p and min(reads_p.values()) >= 1, f"torch read no parameter: {reads_p}"
    assert reads_w == reads_p, f"reads per forward, wrapped {reads_w} != torch {reads_p}"
    assert_equal(out_w, out_p, "forward")


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_each_parameter_read_as_often_as_torch_reads_it(name, cfg, mode):
    factory, shape = CASES[name]
    plain, wrapped = _pair(factory, CONFIGS[cfg])
    _assert_reads_alike(plain, wrapped, shape, mode)


@pytest.mark.parametrize("mode", MODES)
def test_parametrization_registered_before_wrap_is_read_as_torch_reads_it(mode):
    """A module parametrized first and wrapped after (the usual order: ``spectral_norm`` in the
    model's constructor) reads its parameters as often as torch's."""
    torch.manual_seed(0)
    plain = _counted(nn.ConvTranspose2d(3, 4, 3, stride=2))
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), CONFIGS["debug_exact"])
    assert isinstance(wrapped, mesa_lite.modules.ConvTranspose2d)
    _assert_reads_alike(plain, wrapped, (2, 3, 4, 4), mode)


# ---- spectral_norm: an SN-GAN generator ----------------------------------------------------


def _generator() -> nn.Module:
    """A small SN-GAN style generator (z of shape (N, 8, 1, 1) to (N, 3, 8, 8)): transposed
    convolutions with spectral_norm on their weights, batch norm, ReLU."""
    torch.manual_seed(0)  # the same weights and power-iteration vectors on each call
    return nn.Sequential(
        spectral_norm(nn.ConvTranspose2d(8, 6, 4)),  # 1x1 -> 4x4
        nn.BatchNorm2d(6),
        nn.ReLU(),
        spectral_norm(nn.ConvTranspose2d(6, 4, 4, stride=2, padding=1)),  # 4x4 -> 8x8
        nn.BatchNorm2d(4),
        nn.ReLU(),
        spectral_norm(nn.Conv2d(4, 3, 3, padding=1)),
        nn.Tanh(),
    )


def _assert_same_state(wrapped: nn.Module, plain: nn.Module, what: str) -> None:
    """Every state_dict entry equal: the parametrizations' ``original``, spectral_norm's
    ``_u`` and ``_v``, the running statistics."""
    got, want = wrapped.state_dict(), plain.state_dict()
    assert got.keys() == want.keys()
    assert any(k.endswith("weight.0._u") for k in want), "no spectral_norm buffers"
    for k in want:
        assert_equal(got[k], want[k], f"{what}: {k}")


def _step(model, opt, z, target) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    out = model(z)
    (out - target).square().mean().backward()
    opt.step()
    return out.detach()


def test_spectral_norm_generator_trains_as_torch_in_debug_exact():
    plain = _generator()
    wrapped = mesa_lite.wrap(_generator(), CONFIGS["debug_exact"])
    assert isinstance(wrapped[0], mesa_lite.modules.ConvTranspose2d)
    assert isinstance(wrapped[3], mesa_lite.modules.ConvTranspose2d)
    assert isinstance(wrapped[6], mesa_lite.modules.Conv2d)
    assert isinstance(wrapped[1], mesa_lite.modules.BatchNorm2d)
    _assert_same_state(wrapped, plain, "init")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, wrapped)]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        z = torch.randn(4, 8, 1, 1, generator=g)
        target = torch.rand(4, 3, 8, 8, generator=g) * 2 - 1
        out_p = _step(plain, opts[0], z, target)
        out_w = _step(wrapped, opts[1], z, target)
        assert_equal(out_w, out_p, f"step {step} forward")
        _assert_same_state(wrapped, plain, f"after step {step}")
    # the power iterations ran: spectral_norm's vectors are not the ones it started with
    key = "0.parametrizations.weight.0._u"
    assert not torch.equal(plain.state_dict()[key], _generator().state_dict()[key])


def test_spectral_norm_generator_forward_compressed():
    """Compressed (int8) the gradients differ from torch's, but each forward is torch's bit
    for bit, and spectral_norm's vectors take the same power iteration."""
    plain = _generator()
    wrapped = mesa_lite.wrap(_generator(), CONFIGS["int8"])
    z = torch.randn(4, 8, 1, 1, generator=torch.Generator().manual_seed(1))
    assert_equal(wrapped(z), plain(z), "forward")
    _assert_same_state(wrapped, plain, "after one forward")


# ---- the integrations' modules ----------------------------------------------------------------


def _timm_batchnorm_act():
    return pytest.importorskip("timm.layers").BatchNormAct2d(3), (2, 3, 4, 4)


def _hf_conv1d():
    return pytest.importorskip("transformers.pytorch_utils").Conv1D(5, 6), (2, 3, 6)


# name: factory of (module, input shape)
INTEGRATIONS = {"timm-batchnormact2d": _timm_batchnorm_act, "hf-conv1d": _hf_conv1d}


def _integration_params():
    for name in INTEGRATIONS:
        for cfg in CONFIGS:
            for mode in MODES:
                yield pytest.param(name, cfg, mode, id=f"{name}-{cfg}-{mode}")


@pytest.mark.parametrize(("name", "cfg", "mode"), list(_integration_params()))
def test_integration_modules_read_each_parameter_as_torch_reads_it(name, cfg, mode):
    module, shape = INTEGRATIONS[name]()
    plain, wrapped = _pair(lambda: module, CONFIGS[cfg])
    _assert_reads_alike(plain, wrapped, shape, mode)
