"""``Config(keep_weight_casts=True)`` (issue 51): each projection keeps its weight's autocast
copy from forward to backward, as plain AMP keeps it, instead of casting the parameter again in
backward. The gradients are the same bits either way (the same cast of the same weight); what
changes is what backward casts and what the forward keeps: 2 bytes per weight element whose
input gradient is needed, under bf16 autocast, for each projection call (a weight used twice
keeps two copies)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_equal, saved_activation_bytes
from test_lm_ops import GatedMLP, _two_layer_mlp

import mesa_lite
from mesa_lite.ops import common


def _vit_block():
    from timm.models.vision_transformer import Block

    return Block(32, 4)


def _conv1d_pair():
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    return nn.Sequential(conv1d(48, 32), nn.GELU(), conv1d(32, 48))


# each takes inputs 32 wide: per-op Linear (LinearFn), Conv1D (AddmmFn), and the block
# Functions (NormAttentionFn and NormMlpFn, GatedMlpFn, MlpFn)
MODELS = {
    "linear": lambda: nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32)),
    "conv1d": _conv1d_pair,
    "vit-block": _vit_block,
    "gated-mlp": lambda: GatedMLP(32, 88, bias=True),
    "two-projection-mlp": lambda: _two_layer_mlp("linear", "gelu_tanh", 0.0),
}


def _run(model, x):
    """Forward under CPU bf16 autocast, backward, the gradients; the kept bytes of the forward
    (parameters left out) and the casts to bf16 that backward made."""
    casts = []
    real = common.cast

    def counted(t, dtype):
        casts.append(dtype)
        return real(t, dtype)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    kept, out = saved_activation_bytes(forward, params=list(model.parameters()))
    common.cast, before = counted, common.cast
    try:
        out.float().square().sum().backward()
    finally:
        common.cast = before
    grads = [x.grad] + [p.grad for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    return kept, sum(1 for d in casts if d == torch.bfloat16), grads


@pytest.mark.parametrize("name", list(MODELS))
def test_kept_casts_give_the_same_gradients_and_cost_two_bytes_a_weight(name):
    torch.manual_seed(0)
    plain = MODELS[name]()
    base = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config())
    keeping = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(keep_weight_casts=True))
    x = torch.randn(2, 12, 32, requires_grad=True)
    kept0, casts0, grads0 = _run(base, x)
    kept1, casts1, grads1 = _run(keeping, x)
    for i, (a, b) in enumerate(zip(grads0, grads1, strict=True)):
        assert_equal(b, a, f"gradient {i}")
    # every projection's weight (2-D) needs its input gradient here: a bf16 copy of each kept,
    # one cast fewer in backward for each
    weights = [p for p in plain.parameters() if p.dim() == 2]
    assert kept1 - kept0 == sum(2 * w.numel() for w in weights)
    assert casts0 - casts1 == len(weights), (casts0, casts1)


def test_nothing_kept_without_autocast_or_an_input_gradient():
    """In fp32 there is no copy to keep; a first layer whose input needs no gradient keeps none
    (backward reads the weight only for the input's gradient)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32))
    keeping = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(keep_weight_casts=True))
    base = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config())
    x = torch.randn(4, 32)
    fp32 = [saved_activation_bytes(lambda m=m: m(x), params=list(m.parameters()))[0]
            for m in (base, keeping)]  # fmt: skip
    assert fp32[0] == fp32[1]

    def bf16(m):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(x)

        return saved_activation_bytes(run, params=list(m.parameters()))[0]

    # x needs no gradient: only the second layer's copy is read in backward
    assert bf16(keeping) - bf16(base) == 2 * plain[2].weight.numel()


def test_kept_casts_under_compile_are_the_compiler_s():
    """Compiled, the option keeps nothing itself (the compiler decides what it saves) and the
    gradients are the compiled model's without it."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
    grads = []
    x0 = torch.randn(3, 16)
    for keep in (False, True):
        model = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(keep_weight_casts=keep))
        compiled = mesa_lite.compile(model, fullgraph=True)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
        out.float().sum().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert_equal(b, a)


def test_config_checks_the_option():
    with pytest.raises(TypeError, match="keep_weight_casts must be a bool, got int"):
        mesa_lite.Config(keep_weight_casts=1)
    spec = mesa_lite.Config(keep_weight_casts=True).spec_for("fc", "linear")
    assert spec.keep_weight_casts
    assert (
        mesa_lite.Config(keep_weight_casts=True, checkpoint="blocks")
        .checkpoint_spec()
        .keep_weight_casts
    )


def test_a_weight_used_twice_keeps_a_copy_per_call():
    """The documented cost of sharing: each call's Function keeps its own copy (autocast's
    cache would have shared one cast), with the gradients still those without the option."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    kept, grads = [], []
    for keep in (False, True):
        m = mesa_lite.wrap(copy.deepcopy(lin), mesa_lite.Config(keep_weight_casts=keep))

        def run(m=m):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(m(x))

        n, out = saved_activation_bytes(run, params=list(m.parameters()))
        out.float().sum().backward()
        kept.append(n)
        grads.append([x.grad.clone(), m.weight.grad, m.bias.grad])
        x.grad = None
    assert kept[1] - kept[0] == 2 * 2 * lin.weight.numel()
    for a, b in zip(*grads, strict=True):
        assert_equal(b, a)
