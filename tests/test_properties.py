"""Randomised tests (hypothesis) of each module: shapes, dtypes, group sizes and scales from
1e-30 to 1e30, with outliers.

For every draw: the forward equals torch's bit for bit, and the gradients stay within a bound
derived from the quantizer's own (each kept element off by at most half a step, the step
being its group's absmax / qmax), not a fixed tolerance:
  Linear     dW = g^T x:                        |dW' - dW| <= |g|^T d
  GELU       dx = g gelu'(x):                   |dx' - dx| <= |g| max|gelu''| d
  Softmax    dx = y (g - sum(g y)):             |dx' - dx| <= d (|g| + |s|) + (y + d) sum(|g| d)
  LayerNorm  x_hat kept: the same kind of bound through its backward formula (see the test)
  MatMul     grad_a = g b^T, grad_b = a^T g:    each within |g| times the other's half steps
  attention  error 20 dB below each gradient's natural scale (no closed elementwise form)
with d the per-element half step of what is kept, plus fp32 rounding terms. Non-finite inputs
(inf, NaN at random places) give non-finite gradients exactly when torch's do.
"""

import copy
import math
import os

import pytest
import torch
import torch.nn as nn
from conftest import assert_equal
from mesa_lite.kernels import group_quant as gq

import mesa_lite
from mesa_lite import Config, QuantSpec

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(
    max_examples=int(os.environ.get("MESA_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
GELU2_MAX = {"none": 0.7979, "tanh": 0.80}  # max |gelu''| (at 0: 2 phi(0)); tanh form alike


# per dtype: (exponent range of the typical size, rounding unit)
DTYPES = {
    torch.float32: ((-30, 30), 2.0**-24),
    torch.bfloat16: ((-30, 30), 2.0**-8),
    torch.float16: ((-4, 0), 2.0**-11),  # with 1e4 outliers still below fp16's 65504
}


@st.composite
def inputs(draw, last_min=1, dtypes=tuple(DTYPES), max_exp=None):
    """(x, seed, group_size): a tensor of 1-3 batch dims whose typical size is 10^e and whose
    outliers are up to 10^4 larger, in one of ``dtypes``."""
    dtype = draw(st.sampled_from(dtypes))
    low, high = DTYPES[dtype][0] if max_exp is None else (-max_exp, max_exp)
    batch = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    last = draw(st.integers(last_min, 150))
    e = draw(st.integers(low, high))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, last, generator=g, dtype=torch.float64)
    n_out = draw(st.integers(0, 3))
    if n_out:
        idx = torch.randint(0, x.numel(), (n_out,), generator=g)
        x.view(-1)[idx] *= 10.0 ** draw(st.integers(1, 4))
    x = (x * 10.0**e).to(dtype)
    group = draw(st.sampled_from([32, 64, 128, 256]))
    return x, seed, group


def _half_step(t: torch.Tensor, group: int, signed: bool) -> torch.Tensor:
    """Per element, in fp64: half the quantization step of its group (logical order) plus the
    rounding of the dequantized value to ``t``'s dtype."""
    flat = t.detach().float().contiguous().view(-1)
    _, scales = gq.quantize_ref(flat, group, signed=signed)
    step = scales.repeat_interleave(group)[: flat.numel()].view(t.shape).double()
    # a subnormal scale carries an absolute error of half a subnormal step, times the code
    qmax = gq.qrange(signed, 8)[1]
    return (
        0.5 * step * (1 + 1e-5)
        + qmax * 2.0**-149
        + 2 * t.detach().double().abs() * DTYPES[t.dtype][1]
    )


def _assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    """|got - ref| <= bound where torch's gradient is finite; non-finite where it is not (torch
    itself overflows, e.g. the tanh GELU's x**3 above 1e13)."""
    bad = ~torch.isfinite(ref)
    assert not torch.isfinite(got[bad]).any(), "finite where torch's gradient is not"
    err = (got.double() - ref.double()).abs()[~bad]
    # plus two of the dtype's smallest subnormal steps: results that small round absolutely
    info = torch.finfo(ref.dtype)
    bound = bound.expand(ref.shape)[~bad] + 2 * info.tiny * info.eps
    assert (err <= bound).all(), float((err - bound).max())


def _run(ref, x, group, g_seed):
    ref = ref.to(x.dtype)
    mod = mesa_lite.wrap(copy.deepcopy(ref), Config(group_size=group))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), mod(x2)
    assert_equal(y2, y1, "forward")
    g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(g_seed + 1)).to(y1.dtype)
    y1.backward(g)
    y2.backward(g)
    return ref, mod, y1, g, x1.grad, x2.grad


def _tol(dtype) -> float:
    """Relative slack for the two gradient computations' own rounding."""
    return 1e-5 if dtype == torch.float32 else 8 * DTYPES[dtype][1]


@SETTINGS
@given(data=inputs(), out_features=st.integers(1, 40))
def test_linear_weight_grad_within_quantization_bound(data, out_features):
    x, seed, group = data
    torch.manual_seed(seed)
    ref, mod, _, g, gx1, gx2 = _run(nn.Linear(x.shape[-1], out_features), x, group, seed)
    assert_equal(gx2, gx1, "input grad (needs no saved activation)")
    assert_equal(mod.bias.grad, ref.bias.grad, "bias grad")
    g2, x2 = g.reshape(-1, g.shape[-1]).double(), x.reshape(-1, x.shape[-1]).double()
    d = _half_step(x, group, signed=True).reshape(x2.shape)
    bound = g2.abs().t() @ d + _tol(x.dtype) * (g2.abs().t() @ x2.abs())
    _assert_within(mod.weight.grad, ref.weight.grad, bound)


@SETTINGS
@given(data=inputs(), approximate=st.sampled_from(["none", "tanh"]))
def test_gelu_grad_within_quantization_bound(data, approximate):
    x, seed, group = data
    # torch's tanh-GELU backward squares x in fp32 and returns NaN above |x| ~ 1.8e19; a
    # quantized input half a step past that point turns torch's finite gradient into NaN
    # (documented in RELIABILITY.md)
    hypothesis.assume(approximate == "none" or x.abs().max() < 1e18)
    _, _, _, g, gx1, gx2 = _run(nn.GELU(approximate=approximate), x, group, seed)
    d = _half_step(x, group, signed=True)
    gd = g.double().abs()
    _assert_within(gx2, gx1, gd * GELU2_MAX[approximate] * d + _tol(x.dtype) * 1.2 * gd)


@SETTINGS
@given(data=inputs())
def test_softmax_grad_within_quantization_bound(data):
    x, seed, group = data
    _, _, y1, g, gx1, gx2 = _run(nn.Softmax(dim=-1), x, group, seed)
    y, gd = y1.detach().double(), g.double()
    d = _half_step(y1, group, signed=False)
    s = (gd * y).sum(-1, keepdim=True)
    bound = d * (gd.abs() + s.abs()) + (y + d) * (gd.abs() * d).sum(-1, keepdim=True)
    _assert_within(gx2, gx1, bound + _tol(x.dtype) * (y * (gd.abs() + s.abs())))


@SETTINGS
@given(data=inputs(last_min=2), affine=st.booleans())
@example(  # fp32 variance overflows to inf: torch's rstd is 0 and its gradient 0, not NaN
    data=(
        torch.tensor([[1.5e19, -2.9e18, -2.2e19, 5.7e18, -1.1e19, -1.4e19, 4e18, 8.4e18]]),
        0,
        32,
    ),
    affine=False,
)
def test_layernorm_grads_within_quantization_bound(data, affine):
    """LayerNorm keeps x_hat = (x - mean) * rstd (fp32) and rebuilds x from it; with d the
    half step of x_hat (plus the rounding of that rebuild), m = mean(g w x_hat) and
    M = mean(|g w| d) per row:  |dx' - dx| <= rstd (d |m| + |x_hat| M + d M),
    |dW' - dW| <= sum over rows of |g| d."""
    x, seed, group = data
    torch.manual_seed(seed)
    ln = nn.LayerNorm(x.shape[-1], elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.add_(torch.randn_like(ln.weight) * 0.1)
            ln.bias.add_(torch.randn_like(ln.bias) * 0.1)
    ref, mod, _, g, gx1, gx2 = _run(ln, x, group, seed)
    _, mean, rstd = torch.native_layer_norm(x, ln.normalized_shape, None, None, ln.eps)
    if not (torch.isfinite(rstd).all() and torch.isfinite(gx1).all()):
        assert not torch.isfinite(gx2).all()  # torch's statistics overflowed (|x| ~ 1e20)
        return
    x_hat = (x.float() - mean) * rstd
    mean, rstd, xh = mean.double(), rstd.double(), x_hat.double()
    unit = DTYPES[x.dtype][1]
    # the rebuilt x = x_hat / rstd + mean, rounded in fp32 and then to x's dtype
    d = _half_step(x_hat, group, signed=True) + (mean.abs() * rstd + xh.abs()) * 2.0**-22
    d = d + 2 * x.double().abs() * rstd * unit
    gw = g.double() * (ref.weight.double() if affine else 1.0)
    m = (gw * xh).mean(-1, keepdim=True)
    big_m = (gw.abs() * d).mean(-1, keepdim=True)
    tol = _tol(x.dtype) * rstd * (gw.abs() + gw.mean(-1, keepdim=True).abs() + xh.abs() * m.abs())
    _assert_within(gx2, gx1, rstd * (d * m.abs() + xh.abs() * big_m + d * big_m) + tol)
    if affine:
        g2 = g.double().abs().reshape(-1, x.shape[-1])
        bound = (g2 * d.reshape(g2.shape)).sum(0) + _tol(x.dtype) * (
            g2 * xh.abs().reshape(g2.shape)
        ).sum(0)
        _assert_within(mod.weight.grad, ref.weight.grad, bound)
        assert_equal(mod.bias.grad, ref.bias.grad, "bias grad")


_SPECIALS = [math.inf, -math.inf, math.nan]


@SETTINGS
@given(
    data=inputs(dtypes=(torch.float32,), max_exp=5),
    where=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from(_SPECIALS)), min_size=1, max_size=3
    ),  # fmt: skip
    name=st.sampled_from(["linear", "gelu", "softmax", "layernorm"]),
)
def test_non_finite_inputs_give_non_finite_grads_as_torch(data, where, name):
    x, seed, group = data
    for pos, value in where:
        x.view(-1)[pos % x.numel()] = value
    torch.manual_seed(seed)
    ref = {
        "linear": lambda: nn.Linear(x.shape[-1], 8),
        "gelu": nn.GELU,
        "softmax": lambda: nn.Softmax(-1),
        "layernorm": lambda: nn.LayerNorm(x.shape[-1]),
    }[name]()
    mod = mesa_lite.wrap(copy.deepcopy(ref), Config(group_size=group))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), mod(x2)
    assert_equal(y2, y1, "forward")
    g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(seed + 1))
    y1.backward(g)
    y2.backward(g)
    finite_ref = torch.isfinite(x1.grad).all() and all(
        torch.isfinite(p.grad).all() for p in ref.parameters()
    )
    finite_mod = torch.isfinite(x2.grad).all() and all(
        torch.isfinite(p.grad).all() for p in mod.parameters()
    )
    assert bool(finite_mod) == bool(finite_ref), (finite_ref, finite_mod)


@SETTINGS
@given(
    a_data=inputs(dtypes=(torch.float32,)),
    inner_cols=st.integers(1, 40),
    b_exp=st.integers(-30, 30),
)
def test_matmul_grads_within_quantization_bound(a_data, inner_cols, b_exp):
    """a @ b with both kept: grad_a = g b^T and grad_b = a^T g, each off by at most the half
    steps of the other operand, multiplied through |g|."""
    a, seed, group = a_data
    gen = torch.Generator().manual_seed(seed + 2)
    b = torch.randn(a.shape[-1], inner_cols, generator=gen, dtype=torch.float64)
    b = (b * 10.0**b_exp).float()
    spec = QuantSpec(group_size=group)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    y1, y2 = torch.matmul(a1, b1), mesa_lite.modules.matmul(a2, b2, spec)
    assert type(y2.grad_fn).__name__ == "MatMulFnBackward"
    assert_equal(y2, y1, "forward")
    g = torch.randn(y1.shape, generator=gen)
    y1.backward(g)
    y2.backward(g)
    gd = g.double().abs()
    da, db = _half_step(a, group, signed=True), _half_step(b, group, signed=True)
    bound_a = gd @ db.t() + 1e-5 * (gd @ b.double().abs().t())
    _assert_within(a2.grad, a1.grad, bound_a)
    g2, a2d, da2 = gd.reshape(-1, inner_cols), a.double().abs(), da
    bound_b = da2.reshape(-1, a.shape[-1]).t() @ g2 + 1e-5 * (a2d.reshape(-1, a.shape[-1]).t() @ g2)
    _assert_within(b2.grad, b1.grad, bound_b)


@SETTINGS
@given(
    shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 40)),
    head_dim=st.sampled_from([8, 16, 32, 64]),
    qk_exp=st.floats(-2, 0.0),
    v_exp=st.integers(-20, 20),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_attention_forward_exact_and_grads_close(shape, head_dim, qk_exp, v_exp, causal, seed):
    """Fused attention (CPU flash): forward bit-exact for any scales; each gradient's error at
    least 20 dB below its natural scale, the size it would have without the cancellation in
    dS = P (dP - D) (q, k kept at 8 bits, v and the output too). q and k entries are drawn up
    to size 1 (logits of standard deviation up to 1); an 8-bit error in q or k moves a logit by
    about |q|max |k| sqrt(d) scale / 254, which grows with larger logits (RELIABILITY.md)."""
    batch, heads, n = shape
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, n, head_dim, generator=gen) * 10**qk_exp for _ in range(2))
    v = torch.randn(batch, heads, n, head_dim, generator=gen) * 10.0**v_exp
    ins1 = [t.clone().requires_grad_() for t in (q, k, v)]
    ins2 = [t.clone().requires_grad_() for t in (q, k, v)]
    y1 = torch.nn.functional.scaled_dot_product_attention(*ins1, is_causal=causal)
    y2 = mesa_lite.modules.scaled_dot_product_attention(*ins2, is_causal=causal, spec=QuantSpec())
    assert type(y2.grad_fn).__name__ == "SDPAFnBackward"
    assert_equal(y2, y1, "forward")
    g = torch.randn(y1.shape, generator=gen)
    y1.backward(g)
    y2.backward(g)
    qd, kd, vd, gd = q.double(), k.double(), v.double(), g.double()
    scale = head_dim**-0.5
    logits = qd @ kd.transpose(-1, -2) * scale
    if causal:
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    p = logits.softmax(-1)
    dp = gd @ vd.transpose(-1, -2)
    big_d = (gd * (p @ vd)).sum(-1, keepdim=True)
    w = p * (dp.abs() + big_d.abs())
    natural = {
        "q": scale * w @ kd.abs(),
        "k": scale * w.transpose(-1, -2) @ qd.abs(),
        "v": p.transpose(-1, -2) @ gd.abs(),
    }
    for what, a, b in zip("qkv", ins1, ins2, strict=True):
        err = (a.grad.double() - b.grad.double()).norm()
        assert err <= 0.1 * natural[what].norm() + 1e-30, what
