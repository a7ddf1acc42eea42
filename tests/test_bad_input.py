"""Bad and extreme input through the wrapped modules: integer tensors behave as in torch,
1e30 and -1e30, denormals, and fp16 overflow under autocast."""

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_equal, sqnr_db
from mesa_lite.kernels import group_quant

import mesa_lite
from mesa_lite.modules import matmul, softmax

MODULES = {
    "linear": lambda: nn.Linear(64, 16),
    "gelu": nn.GELU,
    "softmax": lambda: nn.Softmax(-1),
    "layernorm": lambda: nn.LayerNorm(64),
}


def _pair(name, device="cpu"):
    torch.manual_seed(0)
    ref = MODULES[name]().to(device)
    return ref, mesa_lite.wrap(copy.deepcopy(ref))


def _grads(ref, mod, x, g=None, autocast=None):
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dev = x.device.type
    with torch.autocast(dev, dtype=autocast or torch.float32, enabled=autocast is not None):
        y1, y2 = ref(x1), mod(x2)
    if g is None:
        g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(1)).to(y1)
    y1.backward(g)
    y2.backward(g)
    pairs = [("input", x1.grad, x2.grad)] + [
        (n, p.grad, q.grad)
        for (n, p), q in zip(ref.named_parameters(), mod.parameters(), strict=True)
    ]
    return y1, y2, pairs


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_inputs_behave_as_in_torch(name, dtype, device):
    """Integer tensors never reach the compressed path: torch's own result or error."""
    ref, mod = _pair(name, device)
    x = torch.randint(0, 3, (2, 5, 64)).to(device, dtype)
    try:
        expected = ref(x)
    except Exception as e:  # noqa: BLE001 - whatever torch raises, the wrapped module must too
        with pytest.raises(type(e)) as info:
            mod(x)
        assert str(info.value) == str(e)
    else:
        assert_equal(mod(x), expected, "integer input")


def test_integer_matmul_and_softmax_functions_as_torch():
    a, b = torch.randint(-3, 3, (2, 4, 5)), torch.randint(-3, 3, (2, 5, 3))
    assert_equal(matmul(a, b, mesa_lite.QuantSpec()), torch.matmul(a, b), "int matmul")
    with pytest.raises(RuntimeError):
        softmax(a, -1, mesa_lite.QuantSpec())


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("scale", [1e30, -1e30, 1e-40], ids=["1e30", "-1e30", "denormal"])
def test_extreme_magnitudes_fp32(name, scale, device):
    """fp32 inputs of size 1e30 (-1e30: all negative) and of denormal size: forward bit-exact,
    gradients non-finite exactly where torch's are (LayerNorm's variance overflows at 1e30 in
    torch itself) and otherwise within the int8 SQNR floor. At 1e30 GELU's derivative is a
    step (0 or 1): there the gradient must be exact wherever the input is more than one
    quantization step from zero (nearer ones read as 0, derivative 0.5)."""
    ref, mod = _pair(name, device)
    r = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0))
    x = (r * scale if scale > 0 else r.abs() * scale).to(device)
    y1, y2, pairs = _grads(ref, mod, x)
    assert_equal(y2, y1, "forward")
    for what, a, b in pairs:
        assert torch.isfinite(a).all() == torch.isfinite(b).all(), what
        if not torch.isfinite(a).all():
            continue
        if name == "gelu" and abs(scale) > 1:
            _, scales = group_quant.quantize_ref(x.reshape(-1).cpu(), 128)
            step = scales.repeat_interleave(128).view(x.shape).to(device)
            far = x.abs() > step
            assert far.float().mean() > 0.95
            assert_equal(b[far], a[far], "GELU input grad away from zero")
            continue
        if a.abs().max() == 0:
            assert b.abs().max() == 0, what
            continue
        assert sqnr_db(a, b) >= 30.0, f"{name} {what} at {scale:g}: {sqnr_db(a, b):.1f} dB"


def test_denormal_groups_flush_to_zero_through_linear():
    """Documented: a group whose absmax is below qmax * 2**-149 (~1.8e-43) keeps zeros."""
    ref, mod = _pair("linear")
    x = torch.full((2, 64), 1e-44)
    _, _, pairs = _grads(ref, mod, x)
    grads = dict((w, (a, b)) for w, a, b in pairs)
    a, b = grads["weight"]
    assert a.abs().max() > 0 and (b == 0).all()


@pytest.mark.parametrize("name", MODULES)
def test_fp16_overflow_under_autocast_stays_non_finite(name, device):
    """1e30 in an fp32 tensor overflows to inf in autocast's fp16 cast: the gradients are
    non-finite exactly when torch's are (GradScaler then skips the step)."""
    ref, mod = _pair(name, device)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    x[0, 3, 5] = 1e30
    x = x.to(device)
    # small output gradients: a finite stand-in for the inf would give finite fp16 gradients
    y_shape = ref(x).shape
    g = 1e-3 * torch.randn(y_shape, generator=torch.Generator().manual_seed(1)).half().to(device)
    _, _, pairs = _grads(ref, mod, x, g=g, autocast=torch.float16)
    finite_ref = all(torch.isfinite(a).all() for _, a, _ in pairs)
    finite_mod = all(torch.isfinite(b).all() for _, _, b in pairs)
    assert finite_ref == finite_mod
    if name == "linear":
        assert not finite_ref  # the weight gradient sees the inf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
def test_bf16_on_a_cpu_that_emulates_it_is_said_once(monkeypatch, dtype, fused):
    """Training in bf16 or fp16 on a CPU without native bf16 warns once (torch emulates both,
    many times slower than fp32), for a model of single layers and one whose layers are one
    fused block; fp32 training and a CPU with native bf16 say nothing."""
    import warnings

    from mesa_lite.ops import common

    layers = [torch.nn.Linear(8, 8), torch.nn.GELU()] + ([torch.nn.Linear(8, 8)] if fused else [])
    model = mesa_lite.wrap(torch.nn.Sequential(*layers))
    from mesa_lite.modules import FusedBlock

    # recognised as one block (a Sequential MLP, proved) or single layers
    assert any(isinstance(m, FusedBlock) for m in model.modules()) == fused
    x = torch.randn(2, 8)
    for native in (True, False):
        monkeypatch.setattr(common, "cpu_has_native_bf16", lambda native=native: native)
        common._WARNED.discard("cpu-bf16")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).sum().backward()  # fp32: nothing to say
            for _ in range(2):
                with torch.autocast("cpu", dtype):
                    model(x).float().sum().backward()
        said = [w for w in caught if "without native bf16" in str(w.message)]
        assert len(said) == (0 if native else 1), [str(w.message) for w in caught]
    common._WARNED.discard("cpu-bf16")


def test_the_bf16_check_adds_no_guard_to_compiled_graphs():
    """Found by review: the check read mesa_lite's warned set while torch.compile traced, so
    a later warning of any kind recompiled every compiled graph."""
    from mesa_lite.ops import common

    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    model = mesa_lite.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8)
    compiled(x).sum().backward()
    common._WARNED.add("some-other-warning")
    try:
        compiled(x).sum().backward()
    finally:
        common._WARNED.discard("some-other-warning")
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
