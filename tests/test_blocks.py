"""Block-level Functions (``mesa_lite.blocks``) on timm's vision-transformer Block: each half
one autograd Function, forward bit-exact, gradients exact in the debug mode and within the
SQNR floor compressed, no more kept than the per-op path, and the per-op path wherever a
condition of the fused one fails (hooks, dropout, masks, mixed settings, eval, torch.func)."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_equal, graph_nodes, saved_activation_bytes, sqnr_db

import mesa_lite
from mesa_lite import Config
from mesa_lite.modules import FusedBlock

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import Block, VisionTransformer  # noqa: E402

AUTOCAST = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# Gradient SQNR floors (dB) of the whole tiny model's parameters, compressed against exact;
# measured worst over 5 seeds of these cases (fp32 and bf16 on CPU): 8 bits 41.4, 4 bits 14.9
FLOORS = {8: 35.0, 4: 11.0}


def _vit(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    return VisionTransformer(**{**args, **kw})


def _x(device, n=3):
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(device)


def _step(model, x, autocast):
    """Output and parameter gradients of one forward + backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    dev = x.device.type
    with torch.autocast(dev, dtype=autocast or torch.float32, enabled=autocast is not None):
        out = model(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device=x.device)).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


_nodes = graph_nodes


def _unfused(model):
    for m in model.modules():
        if isinstance(m, FusedBlock):
            m.unfuse()
    return model


FUSED = {"NormAttentionFnBackward", "NormMlpFnBackward"}


def _plain_and_fused(plain, config, device, autocast):
    """(output, grads) of ``plain`` and of its wrapped copy, which must take the fused path."""
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), config)
    x = _x(device)
    ref_out, ref = _step(plain, x, autocast)
    out, got = _step(wrapped, x, autocast)
    assert FUSED <= _nodes(out)
    assert_equal(out, ref_out, "output")
    assert got.keys() == ref.keys()
    return ref, got


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
def test_debug_exact_block_path_equals_pytorch_bit_for_bit(autocast, device):
    if device.type == "cpu" and autocast == "fp16":
        pytest.skip("fp16 autocast on CPU: covered on the GPU")
    plain = _vit(drop_path_rate=0.0).to(device)
    ref, got = _plain_and_fused(plain, Config(debug_exact=True), device, AUTOCAST[autocast])
    for n in ref:
        assert_equal(got[n], ref[n], n)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("autocast", ["fp32", "bf16"])
def test_compressed_block_path_forward_exact_grads_within_floor(bits, autocast, device):
    plain = _vit(init_values=0.1).to(device)  # with LayerScale
    ref, got = _plain_and_fused(plain, Config(bits=bits), device, AUTOCAST[autocast])
    worst = min(sqnr_db(ref[n], got[n]) for n in ref)
    assert worst > FLOORS[bits], worst


@pytest.mark.parametrize("bits", [8, 4])
def test_block_path_keeps_no_more_than_the_per_op_path(bits, device):
    """Same codes as the per-op path (the qkv output once, the attention output once for
    attention and projection, the normalized inputs, the GELU input), in two nodes a block."""
    model = mesa_lite.wrap(_vit(depth=1).to(device), Config(bits=bits)).train()
    x = _x(device, n=4)
    params = list(model.parameters())
    fused, out_f = saved_activation_bytes(lambda: model(x), params)
    per_op, out_p = saved_activation_bytes(lambda: _unfused(model)(x), params)
    assert FUSED <= _nodes(out_f) and not FUSED & _nodes(out_p)
    assert_equal(out_f, out_p, "output")
    assert 0 < fused <= per_op, (fused, per_op)
    plain, _ = saved_activation_bytes(lambda: mesa_lite.unwrap(model)(x), params)
    assert fused * 2 < plain, (fused, plain)


@pytest.mark.parametrize(
    "frozen",
    ["norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2", "weights", "all", "bias"],
)
def test_frozen_parameters_give_pytorchs_gradients(frozen, device):
    """Frozen subsets of a block's parameters (fine-tuning, BitFit): the Functions compute
    and keep only what the trainable ones need, and the gradients equal PyTorch's."""
    plain = _vit().to(device)

    def freeze(model):
        for name, p in model.blocks.named_parameters():
            hit = {
                "weights": name.endswith("weight"),
                "all": True,
                "bias": not name.endswith("bias"),
            }.get(frozen, f".{frozen}." in f".{name}")
            if hit:
                p.requires_grad_(False)
        return model

    freeze(plain)
    wrapped = freeze(mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=True)))
    x = _x(device)
    ref_out, ref = _step(plain, x, torch.bfloat16 if device.type == "cpu" else torch.float16)
    out, got = _step(wrapped, x, torch.bfloat16 if device.type == "cpu" else torch.float16)
    assert FUSED <= _nodes(out)
    assert got.keys() == ref.keys()
    for n in ref:
        assert_equal(got[n], ref[n], n)


def test_frozen_block_with_input_needing_grad_keeps_less():
    """A frozen block (its input needs grad: trainable layers before it) keeps only what the
    input's gradient needs: no copy for any weight's gradient is missed or added."""
    model = mesa_lite.wrap(_vit(depth=1)).train()
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    x = _x(torch.device("cpu"))
    trainable, _ = saved_activation_bytes(lambda: mesa_lite.wrap(_vit(depth=1)).train()(x))
    frozen, out = saved_activation_bytes(lambda: model(x))
    assert FUSED <= _nodes(out)
    assert frozen <= trainable


def test_causal_block_equals_pytorch(device):
    plain = _vit().to(device)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=True)).train()
    h = torch.randn(2, 7, 32, device=device, requires_grad=True)
    outs, grads = [], []
    for m in (plain.blocks[0], wrapped.blocks[0]):
        m.train()
        out = m(h, is_causal=True)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [h, *m.parameters()]))
    assert FUSED <= _nodes(outs[1])
    assert_equal(outs[1], outs[0], "output")
    for a, b in zip(grads[1], grads[0], strict=True):
        assert_equal(a, b)


def _fallback_cases():
    def hook(model):
        calls = []
        model.blocks[0].mlp.fc1.register_forward_hook(lambda *a: calls.append(1))
        return lambda: len(calls) == 1

    def dropout(model):
        model.blocks[0].mlp.drop1.p = 0.1
        return None

    def mixed(model):
        return None

    def explicit(model):
        model.blocks[0].attn.fused_attn = False
        return None

    def attn_eval(model):
        model.blocks[0].attn.eval()
        return None

    def instance_forward(model):  # a forward set on the instance (debugging, adapters)
        fc1 = model.blocks[0].mlp.fc1
        orig = fc1.forward
        fc1.forward = lambda x: orig(x) * 2
        return None

    return {"hook": hook, "dropout": dropout, "explicit-attention": explicit, "eval-attn": attn_eval,
            "mixed-settings": mixed, "instance-forward": instance_forward}  # fmt: skip


@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_blocks_that_cannot_fuse_run_the_per_op_path(case):
    """Whatever the fused path cannot honour (a hook on a sub-layer, dropout, explicit
    attention, a sub-layer in eval, sub-layers with different settings) runs the block's own
    forward: the per-op modules, with PyTorch's gradients in the debug mode."""
    plain = _vit(drop_rate=0.0)
    over = {"blocks.0.mlp.fc2": {"bits": 4}} if case == "mixed-settings" else {}
    config = Config(overrides=over) if over else Config(debug_exact=True)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), config)
    check = _fallback_cases()[case](wrapped)
    _fallback_cases()[case](plain)
    x = _x(torch.device("cpu"))
    if case == "dropout":
        torch.manual_seed(5)
    out, got = _step(wrapped, x, None)
    names = _nodes(out)
    assert "NormMlpFnBackward" in names  # block 1 still fused
    assert "LinearFnBackward" in names  # block 0 per-op
    if check is not None:
        assert check()
    if case != "mixed-settings":
        if case == "dropout":
            torch.manual_seed(5)
        ref_out, ref = _step(plain, x, None)
        assert_equal(out, ref_out)
        for n in ref:
            assert_equal(got[n], ref[n], n)


def test_attention_mask_eval_and_no_grad_run_plain_paths():
    plain = _vit()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=True)).train()
    h = torch.randn(2, 5, 32, requires_grad=True)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out = wrapped.blocks[0](h, attn_mask=mask)
    assert not FUSED & _nodes(out)
    assert_equal(out, plain.train().blocks[0](h, attn_mask=mask))
    with torch.no_grad():
        assert_equal(wrapped.blocks[0](h), plain.blocks[0](h))
    wrapped.eval()
    assert_equal(wrapped(_x(torch.device("cpu"))), plain.eval()(_x(torch.device("cpu"))))


def test_in_place_on_block_output_and_torch_func():
    wrapped = mesa_lite.wrap(_vit()).train()
    blk = wrapped.blocks[0]
    h = torch.randn(2, 5, 32, requires_grad=True)
    out = blk.mlp.fc2.weight.new_zeros(()) + blk(h)
    out.mul_(2)
    out.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
    # torch.func: the block runs its own forward, the layers plain (exact), with a warning
    params = dict(blk.named_parameters())
    mesa_lite.ops.common._WARNED.discard("functorch")  # warned once a process
    with pytest.warns(UserWarning, match="torch.func"):
        g = torch.func.grad(lambda p: torch.func.functional_call(blk, p, (h,)).sum())(params)
    unwrapped = mesa_lite.unwrap(copy.deepcopy(wrapped)).train().blocks[0]
    ref = torch.func.grad(lambda p: torch.func.functional_call(unwrapped, p, (h,)).sum())(params)
    for n in ref:
        assert_equal(g[n], ref[n], n)


def test_wrap_unwrap_pickle_and_rewrap_keep_block_classes_and_state():
    plain = _vit()
    keys = list(plain.state_dict())
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    blk = wrapped.blocks[0]
    assert isinstance(blk, FusedBlock) and isinstance(blk, Block)
    assert type(blk).__name__ == "Block"
    assert list(wrapped.state_dict()) == keys
    assert blk not in mesa_lite.wrapped_modules(wrapped).values()
    clone = pickle.loads(pickle.dumps(wrapped))
    x = _x(torch.device("cpu"))
    out_a, grads_a = _step(wrapped, x, None)
    out_b, grads_b = _step(clone, x, None)
    assert isinstance(clone.blocks[0], FusedBlock) and FUSED <= _nodes(out_b)
    assert_equal(out_b, out_a)
    for n in grads_a:
        assert_equal(grads_b[n], grads_a[n], n)
    # wrapping again, with the layers of a block left exact: the block stays convertible
    # and runs per-op; unwrap restores the exact classes
    mesa_lite.wrap(wrapped, Config(layers={"linear"}))
    out, _ = _step(wrapped, x, None)
    assert not FUSED & _nodes(out)
    mesa_lite.unwrap(wrapped)
    assert [type(m) for m in wrapped.modules()] == [type(m) for m in plain.modules()]
    assert not any("_mesa" in k for m in wrapped.modules() for k in vars(m))


def test_block_gradients_through_loss_and_optimizer_track_pytorch():
    """A few AdamW steps: the fused compressed model follows the plain one closely."""
    plain = _vit(drop_path_rate=0.1)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    x, y = _x(torch.device("cpu"), n=8), torch.arange(8) % 5
    losses = []
    for model in (plain, wrapped):
        torch.manual_seed(3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        run = []
        for _ in range(5):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    for a, b in zip(*losses, strict=True):
        assert abs(a - b) < 2e-3 * max(1.0, abs(a)), losses


def _swin(seed=0):
    torch.manual_seed(seed)
    return timm.create_model(
        "swin_tiny_patch4_window7_224", img_size=28, patch_size=2, depths=(1, 1),
        num_heads=(2, 4), embed_dim=16, window_size=7, num_classes=5, drop_path_rate=0.0,
    )  # fmt: skip


def _convnext(seed=0):
    torch.manual_seed(seed)
    return timm.create_model(
        "convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 16, 16), num_classes=5, conv_mlp=False,
        drop_path_rate=0.0,
    )  # fmt: skip


FAMILIES = {"swin": (_swin, 28), "convnext": (_convnext, 32)}


@pytest.mark.parametrize("autocast", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_swin_and_convnext_mlp_halves_fused_exact_and_compressed(family, autocast, device):
    """Swin's and ConvNeXt's norm -> Mlp as one NormMlpFn: debug_exact gradients equal
    PyTorch's bit for bit, int8 within the floor, no more kept than their per-op path."""
    make, size = FAMILIES[family]
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1)).to(device)
    ac = AUTOCAST[autocast]
    plain = make().to(device)
    ref_out, ref = _step(plain, x, ac)
    exact = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=True))
    out, got = _step(exact, x, ac)
    assert "NormMlpFnBackward" in _nodes(out)
    assert_equal(out, ref_out, "output")
    for n in ref:
        assert_equal(got[n], ref[n], n)
    int8 = mesa_lite.wrap(copy.deepcopy(plain))
    out, got = _step(int8, x, ac)
    assert_equal(out, ref_out, "output")
    worst = min(sqnr_db(ref[n], got[n]) for n in ref)
    assert worst > 33.0, worst  # measured worst over 3 seeds: Swin 40.5 dB, ConvNeXt 38.4
    params = list(int8.parameters())
    fused, _ = saved_activation_bytes(lambda: int8(x), params)
    per_op, _ = saved_activation_bytes(lambda: _unfused(int8)(x), params)
    assert fused <= per_op, (fused, per_op)


def test_sdpa_backend_restrictions_and_empty_batches():
    """sdpa_kernel(MATH) runs attention plain (PyTorch's math path) without switching the
    fused half off for later calls; an empty batch runs the per-op path, as PyTorch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain = _vit()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=True))
    x = _x(torch.device("cpu"))
    with sdpa_kernel([SDPBackend.MATH]):
        out, got = _step(wrapped, x, None)
        ref_out, ref = _step(plain, x, None)
    assert "NormAttentionFnBackward" not in _nodes(out)
    assert_equal(out, ref_out)
    for n in ref:
        assert_equal(got[n], ref[n], n)
    out, _ = _step(wrapped, x, None)
    assert FUSED <= _nodes(out)
    empty = torch.zeros(0, 3, 16, 16)
    assert wrapped(empty).shape == plain(empty).shape == (0, 5)
    h = torch.zeros(0, 17, 32, requires_grad=True)
    assert wrapped.blocks[0](h).shape == (0, 17, 32)


@pytest.mark.parametrize("exact", [True, False], ids=["debug_exact", "int8"])
def test_timm_layer_norm_2d_is_converted(exact):
    """timm's LayerNorm2d (ConvNeXt atto's stem and downsampling layers) was skipped as "a
    subclass with its own forward": it is a LayerNorm over the channels of an NCHW tensor,
    converted now. Forward bit for bit on ConvNeXt atto, gradients PyTorch's in debug_exact and
    above the floor at 8 bits; the norm alone keeps an int8 copy of its input."""
    import timm
    from timm.layers import LayerNorm2d

    torch.manual_seed(0)
    plain = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    n2d = sum(type(m) is LayerNorm2d for m in plain.modules())
    model = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=exact))
    converted = [m for m in model.modules() if isinstance(m, LayerNorm2d)]
    assert n2d == len(converted) > 0
    assert all(m.mesa_spec is not None for m in converted)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    a, b = plain(x), model(x)
    assert_equal(b, a, "forward")
    a.square().sum().backward()
    b.square().sum().backward()
    for (n, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        if exact:
            assert_equal(q.grad, p.grad, n)
        else:
            assert sqnr_db(p.grad, q.grad) >= 25.0, n
    norm = LayerNorm2d(64)
    wrapped = mesa_lite.wrap(torch.nn.Sequential(copy.deepcopy(norm)))
    h = torch.randn(4, 64, 8, 8, requires_grad=True)
    kept, y = saved_activation_bytes(lambda: wrapped(h), list(wrapped.parameters()))
    assert_equal(y, norm(h), "LayerNorm2d forward")
    assert kept < h.numel() * 1.2 + 2 * 4 * 8 * 8 * 4, kept  # int8 codes, scales, mean, rstd
