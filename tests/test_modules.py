"""Each drop-in module against its torch module: forward bit-exact, gradients exact in the
debug (no compression) mode and within an SQNR floor with int8."""

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_equal, count_calls, saved_activation_bytes, sqnr_db

import mesa_lite
from mesa_lite import Config, QuantSpec

INT8_SQNR_FLOOR_DB = 30.0
# Gradient SQNR floors of one backward (stochastic rounding below 8 bits), measured on these
# modules and inputs: worst over 3 seeds and all autocast modes was 12.6 dB at 4 bits and
# -0.9 dB at 2 bits (3 signed levels per group: one draw is as noisy as the signal itself).
# On the H200 (Triton's GPU random stream) the softmax's 4-bit gradient gave 10.8 dB.
SQNR_FLOOR_DB = {8: INT8_SQNR_FLOOR_DB, 4: 10.0, 2: -3.0}

MODULES = {
    "linear": lambda: nn.Linear(96, 80),
    "linear_nobias": lambda: nn.Linear(96, 33, bias=False),
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "softmax_last": lambda: nn.Softmax(dim=-1),
    "softmax_dim1": lambda: nn.Softmax(dim=1),
    "layernorm": lambda: nn.LayerNorm(96),
    "layernorm_2d": lambda: nn.LayerNorm((7, 96)),
    "layernorm_noaffine": lambda: nn.LayerNorm(96, elementwise_affine=False),
}
AUTOCAST = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _run(module, x, device, autocast):
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        return module(x)


def _pair(name, device, debug_exact, bits=8):
    torch.manual_seed(0)
    ref = MODULES[name]().to(device)
    with torch.no_grad():  # non-trivial affine parameters
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    mod = mesa_lite.wrap(copy.deepcopy(ref), Config(debug_exact=debug_exact, bits=bits))
    assert isinstance(mod, mesa_lite.modules.MesaModule)
    return ref, mod


def _grads(ref, mod, device, autocast):
    torch.manual_seed(1)
    x = torch.randn(4, 7, 96, device=device) * 3
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = _run(ref, x1, device, autocast), _run(mod, x2, device, autocast)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    pairs = [("input", x1.grad, x2.grad)]
    pairs += [
        (n, p1.grad, p2.grad)
        for (n, p1), (_, p2) in zip(ref.named_parameters(), mod.named_parameters(), strict=True)
    ]
    return y1, y2, pairs


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("name", MODULES)
def test_forward_bit_exact_and_debug_grads_equal(name, autocast, device):
    ref, mod = _pair(name, device, debug_exact=True)
    y1, y2, pairs = _grads(ref, mod, device, AUTOCAST[autocast])
    assert_equal(y2, y1, "forward")
    for what, g1, g2 in pairs:
        assert_equal(g2, g1, f"grad of {what}")


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("name", MODULES)
def test_compressed_forward_bit_exact_and_grad_sqnr(name, autocast, bits, device):
    ref, mod = _pair(name, device, debug_exact=False, bits=bits)
    y1, y2, pairs = _grads(ref, mod, device, AUTOCAST[autocast])
    assert_equal(y2, y1, "forward")
    for what, g1, g2 in pairs:
        assert g2.dtype == g1.dtype
        # Linear's input grad (grad @ W) and every bias grad need no saved activation: exact
        if what == "bias" or (name.startswith("linear") and what == "input"):
            assert_equal(g2, g1, f"grad of {what}")
            continue
        db = sqnr_db(g1, g2)
        assert db >= SQNR_FLOOR_DB[bits], f"{name} {bits}-bit grad of {what}: SQNR {db:.1f} dB"
        assert db < float("inf"), f"{name} grad of {what} is exact: nothing was compressed?"


@pytest.mark.parametrize("name", MODULES)
def test_int8_keeps_fewer_bytes(name, device):
    ref, mod = _pair(name, device, debug_exact=False)
    x = torch.randn(4, 7, 96, device=device, requires_grad=True)
    b_ref, _ = saved_activation_bytes(lambda: ref(x), ref.parameters())
    b_mod, _ = saved_activation_bytes(lambda: mod(x), mod.parameters())
    if b_ref:  # softmax keeps its fp32 output; the others their fp32 input
        assert b_mod <= 0.3 * b_ref, f"{name}: kept {b_mod} bytes vs torch's {b_ref}"


@pytest.mark.parametrize("name", MODULES)
def test_plain_op_in_eval_and_no_grad(name, device):
    _, mod = _pair(name, device, debug_exact=False)
    x = torch.randn(2, 7, 96, device=device, requires_grad=True)
    mod.eval()
    y = mod(x)
    assert "mesa_lite" not in type(y.grad_fn).__module__ and "Fn" not in type(y.grad_fn).__name__
    mod.train()
    with torch.no_grad():
        assert mod(x).grad_fn is None
    y = mod(x)
    assert type(y.grad_fn).__name__.endswith("FnBackward"), type(y.grad_fn).__name__
    # nothing needs grad: plain op
    for p in mod.parameters():
        p.requires_grad_(False)
    assert mod(x.detach()).grad_fn is None


# ---- MatMul ---------------------------------------------------------------------------------

MATMUL_SHAPES = {
    "2d": ((33, 64), (64, 17)),
    "batched": ((2, 3, 33, 64), (2, 3, 64, 17)),
    "broadcast_b": ((2, 3, 33, 64), (64, 17)),
    "broadcast_batch": ((2, 1, 33, 64), (1, 3, 64, 17)),
    "broadcast_a": ((33, 64), (2, 3, 64, 17)),
    # torch folds this into an mm whose second operand a.mT is column-major (its backward
    # then computes that gradient transposed: fp32 sums differ in the other order)
    "broadcast_a_small": ((7, 5), (2, 3, 5, 9)),
}


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
@pytest.mark.parametrize("shapes", MATMUL_SHAPES)
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_matmul(shapes, autocast, exact, device):
    torch.manual_seed(0)
    sa, sb = MATMUL_SHAPES[shapes]
    a, b = torch.randn(sa, device=device), torch.randn(sb, device=device)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    mm = mesa_lite.MatMul(QuantSpec(exact=exact))
    ac = AUTOCAST[autocast]
    with torch.autocast(device.type, dtype=ac or torch.float32, enabled=ac is not None):
        y1, y2 = a1 @ b1, mm(a2, b2)
    assert_equal(y2, y1, "forward")
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    for what, g1, g2 in (("a", a1.grad, a2.grad), ("b", b1.grad, b2.grad)):
        if exact and shapes == "broadcast_batch" and ac is not None:
            # Both operands broadcast over batch dims: torch reduces the expanded half-precision
            # product in its own order; we match it to 1 ulp, not bit for bit (documented).
            torch.testing.assert_close(g2, g1, atol=0, rtol=2**-9)
        elif exact:
            assert_equal(g2, g1, f"grad of {what}")
        else:
            db = sqnr_db(g1, g2)
            assert INT8_SQNR_FLOOR_DB <= db < float("inf"), f"grad of {what}: {db:.1f} dB"


@pytest.mark.parametrize(
    "sa, sb",
    [((2, 3, 0), (2, 0, 4)), ((2, 0, 5), (2, 5, 4)), ((2, 3, 5), (2, 5, 0)), ((0, 3, 5), (0, 5, 4)),
     ((3, 0), (2, 0, 4)), ((2, 3, 0), (0, 4)), ((2, 0, 5), (5, 4)), ((0, 5), (2, 5, 4))],
)  # fmt: skip
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_matmul_with_an_empty_dimension_as_torch(sa, sb, exact):
    """A zero-length sequence or batch: the output and gradients are torch's (zeros, or empty)."""
    a, b = torch.randn(sa), torch.randn(sb)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    y1, y2 = a1 @ b1, mesa_lite.MatMul(QuantSpec(exact=exact))(a2, b2)
    assert_equal(y2, y1, "forward")
    y1.sum().backward()
    y2.sum().backward()
    assert_equal(a2.grad, a1.grad, "grad of a")
    assert_equal(b2.grad, b1.grad, "grad of b")


def test_matmul_below_2d_runs_plain_op():
    a, b = torch.randn(5, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    y = mesa_lite.MatMul()(a, b)
    assert_equal(y, a @ b)
    assert "MatMulFn" not in type(y.grad_fn).__name__


@pytest.mark.parametrize("dim", [-1, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_softmax_backward_in_one_pass(dtype, dim, monkeypatch, triton_device):
    """Issue 51: softmax's backward over the last dimension in one pass over its output's codes
    (``kernels/softmax_backward.py``); its reference off CUDA gives the op-by-op form's
    gradient bit for bit, the kernel within ulps of it. Another dim takes the op-by-op form."""
    from mesa_lite.kernels import softmax_backward as sb

    from mesa_lite import quant

    gen = torch.Generator().manual_seed(0)
    s0 = (torch.randn(2, 3, 20, 50, generator=gen) * 3).to(dtype=dtype, device=triton_device)
    grad = torch.randn(2, 3, 20, 50, generator=gen).to(dtype=dtype, device=triton_device)
    spec = QuantSpec()
    calls = count_calls(monkeypatch, sb, "softmax_backward")

    def run(kernel: bool, one_pass: bool = True):
        with monkeypatch.context() as m:
            m.setattr(sb, "use_triton_for", lambda t: kernel)
            if not one_pass:
                m.setattr(quant, "softmax_backward", lambda *a: None)
            s = s0.clone().requires_grad_()
            out = mesa_lite.modules.softmax(s, dim, spec)
            assert_equal(out, torch.softmax(s0, dim), "forward")
            out.backward(grad)
            return s.grad

    per_op = run(False, one_pass=False)
    ref = run(False)
    assert len(calls) == (1 if dim == -1 else 0)
    assert_equal(ref, per_op, "reference against the op-by-op form")
    k = run(True)
    s = s0.clone().requires_grad_()
    torch.softmax(s, dim).backward(grad)
    floor = 120 if dtype == torch.float32 else 45
    assert sqnr_db(per_op, k) >= floor and sqnr_db(s.grad, k) >= INT8_SQNR_FLOOR_DB


def test_softmax_codes_shared_with_next_matmul(device):
    """attn = softmax(s); attn @ v keeps the softmax's uint8 codes, not a second copy."""
    spec = QuantSpec()
    s = torch.randn(2, 3, 50, 50, device=device, requires_grad=True)
    v = torch.randn(2, 3, 50, 16, device=device, requires_grad=True)

    def fwd(share):
        attn = mesa_lite.modules.softmax(s, -1, spec)
        if not share:
            attn = attn * 1  # a different tensor: nothing to share
        return mesa_lite.modules.matmul(attn, v, spec)

    shared, out = saved_activation_bytes(lambda: fwd(True))
    unshared, _ = saved_activation_bytes(lambda: fwd(False))
    n_attn = s.numel()
    assert unshared - shared >= n_attn, (shared, unshared)
    # the shared path's gradients still match the exact ones
    out.backward(torch.ones_like(out))
    g_shared = s.grad.clone()
    s.grad = None
    ref = torch.softmax(s, -1) @ v
    ref.backward(torch.ones_like(ref))
    assert sqnr_db(s.grad, g_shared) >= INT8_SQNR_FLOOR_DB


def test_sharing_survives_hooks_that_keep_aliases():
    """A saved-tensor hook that stores an alias (as offloading or our counters do) must not
    break sharing: the codes outlive the object first saved."""
    spec = QuantSpec()
    s = torch.randn(2, 3, 40, 40, requires_grad=True)
    v = torch.randn(2, 3, 40, 8, requires_grad=True)
    seen = []

    def pack(t):
        seen.append(t.untyped_storage().data_ptr())
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mesa_lite.modules.matmul(mesa_lite.modules.softmax(s, -1, spec), v, spec)
    # softmax keeps (codes, scales); matmul keeps the same two plus v's codes and scales
    assert len(seen) == 6 and len(set(seen)) == 4, seen
    out.sum().backward()


def test_shared_codes_not_reused_after_in_place_change():
    spec = QuantSpec()
    x = torch.randn(10, 10)
    mesa_lite.quant.quantize(x, spec)
    assert mesa_lite.quant.lookup_shared(x, spec) is None, "only producers that opt in share"
    p = mesa_lite.quant.quantize(x, spec)
    mesa_lite.quant.share(x, p)
    assert mesa_lite.quant.lookup_shared(x, spec) is not None
    assert mesa_lite.quant.lookup_shared(x.t(), spec) is None, "another view: other order"
    x.add_(1)
    assert mesa_lite.quant.lookup_shared(x, spec) is None, "stale codes after an in-place change"
    del p
    assert mesa_lite.quant.lookup_shared(x, QuantSpec(group_size=64)) is None


@pytest.mark.parametrize("bits", [4, 2])
def test_low_bit_weight_grad_is_unbiased(bits):
    """Linear's weight gradient is linear in the kept input, so with unbiased (stochastic)
    rounding the mean over draws converges: 32 draws gain ~15 dB (10 log10 32) over one."""
    torch.manual_seed(0)
    ref = nn.Linear(96, 80)
    mod = mesa_lite.wrap(copy.deepcopy(ref), Config(bits=bits))
    x = torch.randn(4, 7, 96) * 3
    g = torch.randn(4, 7, 80)
    ref(x).backward(g)
    draws = []
    for _ in range(32):
        mod.zero_grad()
        mod(x.requires_grad_()).backward(g)
        draws.append(mod.weight.grad.clone())
    single = min(sqnr_db(ref.weight.grad, d) for d in draws)
    mean = sqnr_db(ref.weight.grad, torch.stack(draws).mean(0))
    assert mean >= single + 10, f"{bits}-bit: one draw {single:.1f} dB, mean of 32 {mean:.1f} dB"


def test_stochastic_rounding_module_grads_close():
    torch.manual_seed(0)
    ref = nn.Linear(96, 64)
    mod = mesa_lite.wrap(copy.deepcopy(ref), Config(rounding="stochastic"))
    x = torch.randn(8, 96, requires_grad=True)
    ref(x).sum().backward()
    w_ref = ref.weight.grad.clone()
    mod(x).sum().backward()
    assert sqnr_db(w_ref, mod.weight.grad) >= INT8_SQNR_FLOOR_DB


@pytest.mark.parametrize("name", MODULES)
def test_fp64_is_an_exact_passthrough(name):
    """fp64 training keeps its precision: nothing is compressed, gradients equal torch's."""
    torch.manual_seed(0)
    ref = MODULES[name]().double()
    mod = mesa_lite.wrap(copy.deepcopy(ref))
    x1 = torch.randn(3, 7, 96, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = ref(x1), mod(x2)
    assert_equal(y2, y1, "forward")
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert_equal(x2.grad, x1.grad, "input grad")
    for (n, p1), (_, p2) in zip(ref.named_parameters(), mod.named_parameters(), strict=True):
        assert_equal(p2.grad, p1.grad, n)


@pytest.mark.parametrize("name", MODULES)
def test_zero_size_batch(name, device):
    _, mod = _pair(name, device, debug_exact=False)
    x = torch.randn(0, 7, 96, device=device, requires_grad=True)
    y = mod(x)
    assert y.shape[0] == 0
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_channels_last_and_strided_inputs(name, exact, device):
    """channels_last storage seen as NCHW and moved to (N, W, H, C): a strided, non-contiguous
    input with the features last. Forward bit-exact; gradients equal torch's in the debug
    mode, within the int8 floor compressed."""
    ref, mod = _pair(name, device, debug_exact=exact)
    x = torch.randn(2, 96, 6, 7, device=device).to(memory_format=torch.channels_last)
    x = x.permute(0, 3, 2, 1)  # (2, 7, 6, 96)
    if name == "layernorm_2d":  # normalizes over (7, 96): (2, 6, 7, 96), 7 and 96 swapped in memory
        x = torch.randn(2, 6, 96, 7, device=device).transpose(2, 3)
    assert not x.is_contiguous()
    x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    assert not x2.is_contiguous()
    y1, y2 = ref(x1), mod(x2)
    assert_equal(y2, y1, "forward on a strided input")
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    pairs = [("input", x1.grad, x2.grad)] + [
        (n, p.grad, q.grad)
        for (n, p), q in zip(ref.named_parameters(), mod.parameters(), strict=True)
    ]
    for what, a, b in pairs:
        if exact:
            assert_equal(b, a, f"grad of {what}")
        else:
            assert sqnr_db(a, b) >= INT8_SQNR_FLOOR_DB, f"{name} {what}: {sqnr_db(a, b):.1f} dB"


def test_linear_column_major_input_grad_bit_exact(device):
    """A transposed (column-major) 2-D input: torch's mm backward computes the input gradient
    transposed; the debug-exact mode must match it bit for bit."""
    torch.manual_seed(0)
    ref = nn.Linear(96, 33).to(device)
    mod = mesa_lite.wrap(copy.deepcopy(ref), Config(debug_exact=True))
    x = torch.randn(96, 5, device=device).t()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert x1.stride() == x2.stride() == (1, 5)  # clone keeps the layout
    g = torch.randn(5, 33, device=device)
    ref(x1).backward(g)
    mod(x2).backward(g)
    assert_equal(x2.grad, x1.grad, "input grad")
    assert_equal(mod.weight.grad, ref.weight.grad, "weight grad")
