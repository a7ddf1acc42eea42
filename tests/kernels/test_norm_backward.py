"""The norms' one-launch backward (kernels/norm_backward.py): kernel against its reference,
against the closed-form gradients on the exact normalized input, and through LayerNorm and
RMSNorm modules against the unfused path and PyTorch's gradients.

The kernel's row means and column sums reduce in another order than the reference's torch
sums, so the two agree to fp32 rounding of those sums (a tolerance), not bit for bit; every
elementwise step is the same fp32 operation.
"""

import copy

import pytest
import torch
from conftest import DEVICES, sqnr_db
from mesa_lite.kernels import group_quant as gq
from mesa_lite.kernels import norm_backward as nb

import mesa_lite
from mesa_lite import Config
from mesa_lite.ops import layer_norm as ln_op

if not nb.HAS_TRITON:
    pytest.skip("needs Triton", allow_module_level=True)

# (bits, group size, shape): groups inside rows, across rows, a partial last group, one row,
# no rows, rows longer than a tile of several rows
CASES = [
    (8, 32, (4, 6, 96)),
    (8, 100, (9, 50)),
    (8, 7, (3, 5, 13)),
    (4, 128, (13, 100)),
    (2, 12, (3, 300)),
    (8, 64, (1, 1000)),
    (4, 6, (0, 24)),
    (8, 128, (2, 2500)),
    (4, 128, (3, nb.MAX_ROW)),
]
# (kind, gradient dtype, input dtype): LayerNorm's center, RMSNorm's, Hugging Face's roundings
FORMS = [
    ("layernorm", torch.float32, torch.float32),
    ("layernorm", torch.bfloat16, torch.bfloat16),
    ("rmsnorm", torch.float16, torch.float16),
    ("hf", torch.float32, torch.bfloat16),
    ("hf", torch.bfloat16, torch.bfloat16),
]
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _kept(shape, kind, bits, group_size, x_dtype, seed=0):
    """(codes, scales, rstd, x_hat exactly) of a norm's input as the op keeps it."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(x_dtype).float()
    mean = x.mean(-1, keepdim=True) if kind == "layernorm" else torch.zeros(*shape[:-1], 1)
    rstd = torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    codes, scales = gq.quantize(x, group_size, bits=bits, normalize=(mean, rstd), use_triton=False)
    return codes, scales, rstd, (x - mean) * rstd


def _args(case, form, weight=True, seed=0):
    bits, group_size, shape = case
    kind, g_dtype, x_dtype = form
    codes, scales, rstd, exact = _kept(shape, kind, bits, group_size, x_dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    grad = torch.randn(shape, generator=g).to(g_dtype)
    w = torch.randn(shape[-1], generator=g) if weight else None
    if kind == "hf":
        w = w.to(g_dtype)
    args = (codes, scales, group_size, bits, grad, rstd, w, x_dtype, shape[-1])
    opts = {"center": kind == "layernorm", "hf": kind == "hf"}
    return args, opts, exact


def _on(device, args, opts, **more):
    """The kernel on ``device`` (the reference's CPU arguments moved there), results on the
    CPU."""
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    out = nb.norm_backward(*moved, **opts, **more, use_triton=True)
    return tuple(None if t is None else t.cpu() for t in out)


def _close(got, want, dtype, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype] * scale,
                               equal_nan=True, msg=lambda m: f"{what}: {m}")  # fmt: skip


# Hugging Face's RMSNorm always has a weight
FORM_WEIGHT = [(f, w) for f in FORMS for w in (True, False) if w or f[0] != "hf"]


def _id(fw):
    (kind, g_dtype, x_dtype), w = fw
    return f"{kind}-{g_dtype}-{x_dtype}-{'w' if w else 'no-w'}".replace("torch.", "")


@pytest.mark.parametrize("form_weight", FORM_WEIGHT, ids=_id)
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}b-g{c[1]}-" + "x".join(map(str, c[2]))
)
def test_kernel_matches_reference(case, form_weight, triton_device):
    form, weight = form_weight
    args, opts, _ = _args(case, form, weight)
    got = _on(triton_device, args, opts)
    want = nb.norm_backward_ref(*args, **opts)
    _close(got[0], want[0], form[2], "dx")
    for what, a, b in (("dweight", got[1], want[1]), ("dbias", got[2], want[2])):
        _close(a, b, torch.float32, what)


@pytest.mark.parametrize("need_x, need_sums", [(True, False), (False, True)])
def test_only_what_is_asked(need_x, need_sums, triton_device):
    args, opts, _ = _args(CASES[0], FORMS[0])
    got = _on(triton_device, args, opts, need_x=need_x, need_sums=need_sums)
    want = nb.norm_backward_ref(*args, **opts)
    assert (got[0] is None) != need_x and (got[1] is None) != need_sums
    if need_x:
        _close(got[0], want[0], torch.float32, "dx")
    else:
        _close(got[1], want[1], torch.float32, "dweight")
        _close(got[2], want[2], torch.float32, "dbias")


@pytest.mark.parametrize("form", FORMS[:3], ids=lambda f: f[0])
def test_reference_is_the_closed_form_on_the_exact_input(form):
    """Against the analytic gradient of the norm on the unquantized ``x_hat``, in fp64: the
    only error left is the codes' (an 8-bit floor)."""
    args, opts, exact = _args((8, 32, (4, 6, 96)), (form[0], torch.float32, torch.float32))
    codes, scales, gs, bits, grad, rstd, w, _, n = args
    dx, dw, db = nb.norm_backward_ref(*args, **opts)
    xh, dy = exact.double(), grad.double()
    g = dy * w.double()
    c2 = g.mean(-1, keepdim=True) if opts["center"] else 0.0
    want = rstd.double() * (g - xh * (g * xh).mean(-1, keepdim=True) - c2)
    assert sqnr_db(want, dx) >= 35.0
    assert sqnr_db((dy * xh).sum((0, 1)), dw) >= 35.0
    torch.testing.assert_close(db.double(), dy.sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_non_finite_gradients_stay_non_finite(triton_device):
    args, opts, _ = _args(CASES[0], FORMS[0])
    grad = args[4].clone()
    grad[1, 2, 3] = float("nan")
    grad[2, 0, 0] = float("inf")
    dx, dw, db = _on(triton_device, (*args[:4], grad, *args[5:]), opts)
    # the row's means take them (inf - inf: NaN, the rest -inf), as in PyTorch's formula
    assert not dx[1, 2].isfinite().any() and not dx[2, 0].isfinite().any()
    assert dx[0].isfinite().all()
    assert dw.isnan().any() and db.isnan()[3] and db.isinf()[0]


def test_bad_input_is_named():
    args, opts, _ = _args(CASES[0], FORMS[0])
    codes, scales, gs, bits, grad, rstd, w, x_dtype, n = args
    with pytest.raises(ValueError, match="rstd per row"):
        nb.norm_backward(codes, scales, gs, bits, grad, rstd[:2], w, x_dtype, n, **opts)
    with pytest.raises(ValueError, match="must split"):
        nb.norm_backward(codes, scales, gs, bits, grad, rstd, w, x_dtype, 97, **opts)
    with pytest.raises(ValueError, match="weight has"):
        nb.norm_backward(codes, scales, gs, bits, grad, rstd, w[:5], x_dtype, n, **opts)


# ---- through the ops: LayerNorm and RMSNorm modules ------------------------------------------


@pytest.fixture(params=["interpreter"] + (["cuda"] if "cuda" in DEVICES else []))
def on(request, monkeypatch):
    """Where the modules run: CPU tensors on the kernel path (Triton's interpreter, as
    test_layouts forces it) or CUDA; the fused backward switched on there by ``_grads``."""
    if request.param == "interpreter":
        from test_layouts import _force_triton

        _force_triton(monkeypatch)
    monkeypatch.setattr(ln_op, "FUSED_BACKWARD", True)
    return torch.device("cpu" if request.param == "interpreter" else "cuda")


@pytest.fixture
def fused(monkeypatch, on):
    """The kernel's calls (the ``center`` of each), counted."""
    del on  # the device set up
    launches = []
    real = nb.norm_backward

    def counted(*a, **k):
        launches.append(k.get("center"))
        return real(*a, **k)

    monkeypatch.setattr(nb, "norm_backward", counted)
    return launches


def _hf_rmsnorm():
    transformers = pytest.importorskip("transformers")
    return transformers.models.llama.modeling_llama.LlamaRMSNorm(96)


MODULES = {
    "layernorm": lambda: torch.nn.LayerNorm(96),
    "layernorm_bf16": lambda: torch.nn.LayerNorm(96).bfloat16(),
    "layernorm_2d": lambda: torch.nn.LayerNorm((7, 96)),
    "layernorm_nobias": lambda: torch.nn.LayerNorm(96, bias=False),
    "layernorm_noaffine": lambda: torch.nn.LayerNorm(96, elementwise_affine=False),
    "rmsnorm": lambda: torch.nn.RMSNorm(96),
    "hf_rmsnorm": _hf_rmsnorm,
}


def _grads(module, x, autocast, switch):
    ln_op.FUSED_BACKWARD = switch
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(torch.linspace(-2, 3, y.numel(), device=x.device).view(y.shape).to(y.dtype))
    grads = [x.grad] + [p.grad for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return grads


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", MODULES)
def test_modules_match_the_unfused_path_and_torch(name, autocast, fused, on):
    torch.manual_seed(0)
    plain = MODULES[name]().to(on)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config())
    dtype = next(plain.parameters(), torch.empty(())).dtype
    x = (torch.randn(4, 7, 96) * 2 + 0.5).to(on, dtype)
    want = _grads(plain, x, autocast, False)
    unfused = _grads(wrapped, x, autocast, False)
    assert not fused
    got = _grads(wrapped, x, autocast, True)
    # a bf16 LayerNorm on the CPU: PyTorch gives rstd in bf16, and the unfused path runs
    runs = not (dtype == torch.bfloat16 and on.type == "cpu" and name.startswith("layernorm"))
    assert len(fused) == runs, "the fused kernel did not run" if runs else fused
    for a, b, c in zip(want, unfused, got, strict=True):
        assert c.dtype == a.dtype and c.shape == a.shape
        assert sqnr_db(a, c) >= 30.0, sqnr_db(a, c)
        # the same codes: only the reductions' order and x's rebuild differ from unfused, by
        # an ulp where they differ (a bf16 ulp is 2**-8 relative: 48 dB were every element
        # off by one; the H100 gave 56.4 dB for the bf16 LayerNorm's input gradient)
        floor = 60.0 if c.dtype == torch.float32 else 45.0
        assert sqnr_db(b, c) >= floor, sqnr_db(b, c)


def test_frozen_weight_and_input_without_grad(fused, on):
    torch.manual_seed(0)
    plain = torch.nn.LayerNorm(96).to(on)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config())
    coeff = torch.linspace(-2, 3, 3 * 96, device=on).view(3, 96)
    for m in (plain, wrapped):
        m.weight.requires_grad_(False)
    x = (torch.randn(3, 96) * 2 + 0.5).to(on)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (plain(x1) * coeff).sum().backward()
    (wrapped(x2) * coeff).sum().backward()
    assert wrapped.weight.grad is None and len(fused) == 1
    assert sqnr_db(x1.grad, x2.grad) >= 30.0
    torch.testing.assert_close(wrapped.bias.grad, plain.bias.grad, rtol=1e-6, atol=1e-6)
    # the input needs no grad: the sums alone
    wrapped.bias.grad = None
    (wrapped(x) * coeff).sum().backward()
    torch.testing.assert_close(wrapped.bias.grad, plain.bias.grad, rtol=1e-6, atol=1e-6)


def test_off_by_default():
    """Until a GPU run has measured it against the unfused path (ops/layer_norm.py)."""
    assert ln_op.FUSED_BACKWARD is False


def test_exact_mode_keeps_torch_s_backward(fused, on):
    plain = torch.nn.LayerNorm(96).to(on)
    exact = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=True))
    x = torch.randn(5, 96, device=on, requires_grad=True)
    exact(x).sum().backward()
    assert not fused, "the exact mode must keep PyTorch's backward"


def test_vit_block_functions_take_it(fused, on):
    """timm's ViT Block through mesa_lite's block-level Functions (norm + attention, norm +
    MLP), whose LayerNorm backward is the same one."""
    from timm.models.vision_transformer import Block

    torch.manual_seed(0)
    plain = Block(96, num_heads=4, qkv_bias=True).to(on)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config())
    x = torch.randn(2, 9, 96).to(on)
    want = _grads(plain, x, False, False)
    unfused = _grads(wrapped, x, False, False)
    got = _grads(wrapped, x, False, True)
    assert len(fused) == 2, fused
    for a, b, c in zip(want, unfused, got, strict=True):
        assert sqnr_db(a, c) >= 30.0 and sqnr_db(b, c) >= 60.0, (sqnr_db(a, c), sqnr_db(b, c))
