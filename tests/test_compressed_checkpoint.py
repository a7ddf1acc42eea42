"""Compressed checkpointing (``Config(checkpoint=...)``, ``mesa_lite.checkpoint``): forward
bit-identical to plain training, gradients equal to plain's in ``debug_exact`` (dropout and
drop-path masks replayed) and within SQNR floors compressed, what is kept, the selection of
blocks, and composition (GradScaler, compile, torch.func, frozen parts, retain_graph,
pickling, re-wrap, Hugging Face layers, convolutional blocks in channels_last).
DDP and FSDP2 are in ``test_distributed.py``."""

import copy
import dataclasses
import functools
import pickle
import statistics

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICES, saved_activation_bytes, sqnr_db
from torch.nn.utils import parametrize

import mesa_lite
from mesa_lite import Config
from mesa_lite.checkpoint import Checkpointed, find_units, repeated_blocks
from mesa_lite.ops import common

timm = pytest.importorskip("timm")

POLICIES = {
    "blocks": "blocks",
    "mlp": "mlp",
    "attention": "attention",
    "names": ["blocks.0", "blocks.2"],
}
# 8-bit gradient SQNR of the 4-block ViT below against plain training, median over parameters
# and worst (measured on CPU, fp32 and bf16 autocast, blocks and MLPs, exact and compressed
# inside, 2026-12-01: median 45-54 dB, worst 36-43 dB; norms inside likewise)
MEDIAN_FLOOR_DB, WORST_FLOOR_DB = 40.0, 30.0


def vit(seed=0, drop=0.1, depth=4):
    """A 4-block timm ViT on 32x32 images with dropout and drop-path on (RNG in every block)."""
    torch.manual_seed(seed)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=64, depth=depth, num_heads=2, num_classes=10,
        drop_rate=drop, proj_drop_rate=drop, attn_drop_rate=drop, drop_path_rate=drop,
    ).train()  # fmt: skip


def batch(n=4, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    return x.to(device), torch.randint(0, 10, (n,), generator=g).to(device)


def step(model, x, y, autocast=None, seed=7):
    torch.manual_seed(seed)
    if x.is_cuda:
        torch.cuda.manual_seed(seed)
    with torch.autocast(x.device.type, dtype=autocast or torch.float32, enabled=bool(autocast)):
        out = model(x)
        loss = F.cross_entropy(out, y)
    loss.backward()
    grads = {
        n.replace("_orig_mod.", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return out.detach(), grads


def sqnrs(ref, got):
    return [sqnr_db(ref[n], got[n]) for n in ref]


def _autocast(device):
    return torch.float16 if device.type == "cuda" else torch.bfloat16


@pytest.mark.parametrize("inner", ["exact", "norms", "compressed"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_forward_bit_identical_and_debug_exact_grads_equal(policy, inner, device):
    """Dropout and drop-path draw the same masks in the recompute: in debug_exact the
    gradients are plain training's bit for bit."""
    x, y = batch(device=device)
    plain = vit().to(device)
    wrapped = mesa_lite.wrap(
        copy.deepcopy(plain), Config(checkpoint=POLICIES[policy], checkpoint_inner=inner,
                                     debug_exact=True)
    )  # fmt: skip
    assert any(isinstance(m, Checkpointed) for m in wrapped.modules())
    for autocast in (None, _autocast(device)):
        out0, g0 = step(plain, x, y, autocast)
        out1, g1 = step(wrapped, x, y, autocast)
        assert torch.equal(out0, out1), "forward differs"
        for n in g0:
            assert torch.equal(g0[n], g1[n]), f"{n}: grads differ from plain"
        plain.zero_grad(), wrapped.zero_grad()


@pytest.mark.parametrize("inner", ["exact", "norms", "compressed"])
@pytest.mark.parametrize("policy", ["blocks", "mlp"])
def test_int8_gradients_within_floor(policy, inner, device):
    x, y = batch(n=8, device=device)
    plain = vit(drop=0.0).to(device)
    wrapped = mesa_lite.wrap(
        copy.deepcopy(plain), Config(checkpoint=policy, checkpoint_inner=inner)
    )
    for autocast in (None, _autocast(device)):
        out0, g0 = step(plain, x, y, autocast)
        out1, g1 = step(wrapped, x, y, autocast)
        assert torch.equal(out0, out1)
        dbs = sqnrs(g0, g1)
        assert statistics.median(dbs) >= MEDIAN_FLOOR_DB, statistics.median(dbs)
        assert min(dbs) >= WORST_FLOOR_DB, min(dbs)
        assert statistics.median(dbs) < float("inf"), "nothing compressed"
        plain.zero_grad(), wrapped.zero_grad()


def test_four_bit_input_within_its_floor():
    """A 4-bit block input (stochastic rounding) costs accuracy of one backward: noisier than
    8 bits, above its own floor (median measured 31 dB on this model)."""
    x, y = batch(n=8)
    plain = vit(drop=0.0)
    _, g0 = step(plain, x, y)
    medians = {}
    for bits in (8, 4):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="blocks",
                                                              checkpoint_bits=bits))  # fmt: skip
        _, g1 = step(wrapped, x, y)
        medians[bits] = statistics.median(sqnrs(g0, g1))
    assert 25.0 <= medians[4] < medians[8] - 10, medians


def test_exact_checkpointing_keeps_the_input_itself_and_matches_plain(caplog):
    """checkpoint_bits="exact" with checkpoint_inner="exact": the blocks keep their input
    tensors as they are (what torch.utils.checkpoint keeps) and the gradients are plain
    training's bit for bit (the layers outside them in debug_exact)."""
    x, y = batch(n=8)
    plain = vit(drop=0.0)
    out0, g0 = step(plain, x, y)
    cfg = Config(checkpoint="blocks", checkpoint_bits="exact", checkpoint_inner="exact")
    with caplog.at_level("INFO", logger="mesa_lite"):
        # debug_exact: the layers outside the checkpointed blocks keep exact copies too
        exact = mesa_lite.wrap(copy.deepcopy(plain), dataclasses.replace(cfg, debug_exact=True))
    assert "keeping their input exactly, exact inside" in caplog.text
    out1, g1 = step(exact, x, y)
    assert torch.equal(out0, out1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)
    kept = {}
    for name, c in {"plain": None, "exact": cfg, "int8": Config(checkpoint="blocks")}.items():
        model = copy.deepcopy(plain)
        if c is not None:
            mesa_lite.wrap(model, c)
        kept[name], _ = saved_activation_bytes(lambda m=model: m(x), list(model.parameters()))
    # three checkpointed fp32 inputs of 8 x 17 x 64 instead of their int8 codes and scales
    block_input = 8 * 17 * 64
    assert kept["exact"] - kept["int8"] == 3 * (4 * block_input - block_input - block_input // 16)
    assert kept["exact"] < kept["plain"] / 2
    with pytest.raises(ValueError, match=r"checkpoint_bits must be one of \[8, 4, 2\], \"exact\""):
        Config(checkpoint="blocks", checkpoint_bits="fp16")


def test_kept_for_backward_is_the_compressed_block_inputs():
    """A checkpointed block keeps its input's int8 codes and fp32 scales, nothing else; the
    last block (not checkpointed) keeps its compressed activations."""
    x, _ = batch(n=8)
    plain = vit(drop=0.0)
    kept = {}
    for name, cfg in {"plain": None, "int8": Config(), "ckpt": Config(checkpoint="blocks"),
                      "ckpt4": Config(checkpoint="blocks", checkpoint_bits=4)}.items():  # fmt: skip
        model = copy.deepcopy(plain)
        if cfg is not None:
            mesa_lite.wrap(model, cfg)
        kept[name], _ = saved_activation_bytes(lambda m=model: m(x), list(model.parameters()))
    assert kept["ckpt"] < kept["int8"] / 2 < kept["plain"] / 4
    # three checkpointed inputs of 8 x 17 tokens x 64: 8704 codes + 136 fp32 scales each
    # (groups of 64, one per token: groups do not straddle tokens)
    block_input = 8 * 17 * 64
    ckpt_inputs = 3 * (block_input + 4 * block_input // 64)
    last = kept["ckpt"] - ckpt_inputs
    assert 0 < last < kept["int8"] / 2, (kept, ckpt_inputs)  # last block, embedding, head
    assert kept["ckpt"] - kept["ckpt4"] == 3 * block_input // 2


def test_which_modules_are_checkpointed(caplog):
    model = vit(depth=6)
    assert [n for n, _ in repeated_blocks(model)] == [f"blocks.{i}" for i in range(6)]
    units = lambda **kw: [n for n, _ in find_units(model, Config(**kw))]  # noqa: E731
    assert units(checkpoint="blocks") == [f"blocks.{i}" for i in range(5)]  # not the last
    assert units(checkpoint="blocks", checkpoint_every=2) == ["blocks.0", "blocks.2", "blocks.4"]
    assert units(checkpoint="mlp", checkpoint_every=3) == ["blocks.0.mlp", "blocks.3.mlp"]
    assert units(checkpoint="attention")[-1] == "blocks.4.attn"
    assert units(checkpoint=["blocks.5", "blocks.1"]) == ["blocks.1", "blocks.5"]
    assert units(checkpoint=["blocks.*"]) == [f"blocks.{i}" for i in range(6)]
    with caplog.at_level("INFO", logger="mesa_lite"):
        mesa_lite.wrap(model, Config(checkpoint="blocks"))
    assert "checkpointed 5 modules (Block 5) keeping their input at int8 g128 nearest, " \
        "norms inside" in caplog.text  # fmt: skip
    # norms inside (the default): in checkpointed blocks only the norms are wrapped
    for inner, fc1_wrapped, norm_wrapped in (("norms", False, True), ("exact", False, False),
                                              ("compressed", True, True)):  # fmt: skip
        mesa_lite.wrap(model, Config(checkpoint="blocks", checkpoint_inner=inner))
        assert isinstance(model.blocks[0].mlp.fc1, mesa_lite.Linear) == fc1_wrapped
        assert isinstance(model.blocks[0].norm2, mesa_lite.LayerNorm) == norm_wrapped
        assert isinstance(model.blocks[5].mlp.fc1, mesa_lite.Linear)  # the last block


def test_blocks_found_by_structure_in_other_models():
    """Swin's and ConvNeXt's stages hold their blocks: the blocks are taken, not the stages;
    ResNet's stages are Sequentials of bottlenecks."""
    swin = timm.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4,
                             embed_dim=24, depths=(2, 2), num_heads=(2, 2))  # fmt: skip
    names = [n for n, _ in repeated_blocks(swin)]
    assert names == ["layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0",
                     "layers.1.blocks.1"]  # fmt: skip
    cnx = timm.create_model("convnext_atto")
    assert all(".blocks." in n for n, _ in repeated_blocks(cnx))
    rn = timm.create_model("resnet18")
    assert [n for n, _ in repeated_blocks(rn)][:2] == ["layer1.0", "layer1.1"]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        Config(checkpoint="everything")
    with pytest.raises(TypeError, match="checkpoint must be"):
        Config(checkpoint=3)
    with pytest.raises(ValueError, match="empty list"):
        Config(checkpoint=[])
    with pytest.raises(ValueError, match="checkpoint_every must be a positive int"):
        Config(checkpoint="blocks", checkpoint_every=0)
    with pytest.raises(ValueError, match="checkpoint_bits must be one of"):
        Config(checkpoint="blocks", checkpoint_bits=3)
    with pytest.raises(ValueError, match="checkpoint_inner must be"):
        Config(checkpoint="blocks", checkpoint_inner="both")
    model = vit()
    with pytest.raises(ValueError, match="'nope' matches no module"):
        mesa_lite.wrap(model, Config(checkpoint=["nope"]))
    with pytest.raises(ValueError, match="must not nest"):
        mesa_lite.wrap(model, Config(checkpoint=["blocks.0", "blocks.0.mlp"]))
    with pytest.raises(ValueError, match="found no repeated blocks"):
        mesa_lite.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4)), Config(checkpoint="blocks"))
    mlp_only = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                         torch.nn.LayerNorm(4))
                                     for _ in range(3)])  # fmt: skip
    with pytest.raises(ValueError, match="has no attention child"):
        mesa_lite.wrap(mlp_only, Config(checkpoint="attention"))
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match="set_grad_checkpointing"):
        mesa_lite.wrap(model, Config(checkpoint="blocks"))


def test_rewrap_unwrap_pickle_and_deepcopy():
    model = mesa_lite.wrap(vit(), Config(checkpoint="blocks", checkpoint_inner="compressed"))
    x, y = batch()
    ref, g = step(copy.deepcopy(model), x, y)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert isinstance(clone.blocks[0], Checkpointed)
        out, g2 = step(clone, x, y)
        assert torch.equal(out, ref) and all(torch.equal(g[n], g2[n]) for n in g)
    mesa_lite.wrap(model)  # a new config without checkpoint takes it off
    assert not any(isinstance(m, Checkpointed) for m in model.modules())
    mesa_lite.wrap(model, Config(checkpoint="blocks"))
    mesa_lite.unwrap(model)
    assert type(model.blocks[0]) is timm.models.vision_transformer.Block
    assert not mesa_lite.wrapped_modules(model)


def test_grad_scaler_sees_non_finite_gradients():
    """An inf in the block input stays inf through the compressed copy: the recomputed
    gradients are non-finite and GradScaler skips the step, as in plain training."""
    x, y = batch()
    x[0, 0, 0, 0] = float("inf")
    for cfg in (None, Config(checkpoint="blocks"), Config(checkpoint="blocks", bits=4,
                                                          checkpoint_inner="compressed")):  # fmt: skip
        model = vit(drop=0.0)
        if cfg is not None:
            mesa_lite.wrap(model, cfg)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0**7  # the step was skipped and the scale backed off
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_frozen_parts_retain_graph_and_no_grad():
    x, y = batch()
    plain = vit(drop=0.0)
    for p in [*plain.patch_embed.parameters(), plain.pos_embed, plain.cls_token,
              *plain.blocks[1].parameters()]:  # fmt: skip
        p.requires_grad_(False)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="blocks",
                                                          debug_exact=True))  # fmt: skip
    _, g0 = step(plain, x, y)
    _, g1 = step(wrapped, x, y)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    # backward twice through one graph
    wrapped.zero_grad()
    loss = F.cross_entropy(wrapped(x), y)
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in wrapped.named_parameters() if p.grad is not None}
    loss.backward()
    for n, p in wrapped.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, 2 * once[n]), n
    # eval mode and no_grad: the plain forward, nothing kept
    with torch.no_grad():
        assert torch.equal(wrapped.eval()(x), plain.eval()(x))


def test_double_backward_raises():
    model = mesa_lite.wrap(vit(drop=0.0), Config(checkpoint=["blocks.*"], debug_exact=True))
    x = batch()[0].requires_grad_()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(model(x).square().sum(), x, create_graph=True)


def test_torch_func_and_compile():
    x, y = batch()
    plain = vit(drop=0.0)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="blocks",
                                                          debug_exact=True))  # fmt: skip
    # torch.func: the plain forward runs (exact)
    params = dict(wrapped.named_parameters())
    grads = torch.func.grad(
        lambda p: F.cross_entropy(torch.func.functional_call(wrapped, p, (x,)), y)
    )(params)
    _, g0 = step(plain, x, y)
    for n in g0:
        torch.testing.assert_close(grads[n], g0[n])
    # compile: the checkpointed calls are graph breaks; results as eager
    compiled = torch.compile(copy.deepcopy(wrapped), backend="aot_eager")
    plain.zero_grad()
    out0, g0 = step(plain, x, y, seed=3)
    out1, g1 = step(compiled, x, y, seed=3)
    torch.testing.assert_close(out1, out0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n])


def test_convolutional_blocks_in_channels_last():
    """ResNet's bottlenecks, channels_last: the rebuilt input keeps the memory format, the
    gradients equal plain's in debug_exact and pass the floor at 8 bits."""
    torch.manual_seed(0)
    plain = (
        timm.create_model("resnet18", num_classes=10).train().to(memory_format=torch.channels_last)
    )
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.tensor([1, 2])
    _, g0 = step(plain, x, y)
    for exact in (True, False):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="blocks",
                                                              debug_exact=exact))  # fmt: skip
        wrapped.zero_grad()
        _, g1 = step(wrapped, x, y)
        if exact:
            for n in g0:
                torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6)
        else:
            assert statistics.median(sqnrs(g0, g1)) >= MEDIAN_FLOOR_DB


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU")
def test_peak_memory_lower_than_plain_and_compression_on_gpu():
    """On the GPU: the peak of a training step is below compression alone and plain."""
    x, y = batch(n=64, device="cuda")
    peaks = {}
    for name, cfg in {"plain": None, "int8": Config(), "ckpt": Config(checkpoint="blocks")}.items():
        model = vit(drop=0.0, depth=8).cuda()
        if cfg is not None:
            mesa_lite.wrap(model, cfg)
        step(model, x, y, torch.float16)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model, x, y, torch.float16)
        peaks[name] = torch.cuda.max_memory_allocated() - base
        del model
    assert peaks["ckpt"] < peaks["int8"] < peaks["plain"], peaks


def _hf_model(family: str):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=256)
        return tf.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").train()
    if family == "bert":
        cfg = tf.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, vocab_size=256)  # fmt: skip
        return tf.BertForMaskedLM._from_config(cfg, attn_implementation="sdpa").train()
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    return tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()


def _hf_step(model, ids, seed=5):
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_hugging_face_layers(family):
    """Decoder and encoder layers found by structure (``transformer.h``, ``model.layers``,
    ``bert.encoder.layer``); dropout on (GPT-2's and BERT's defaults): loss and logits
    bit-identical, debug_exact gradients equal, 8 bits within the floor; the k/v cache is
    dropped as Hugging Face's checkpointing drops it."""
    plain = _hf_model(family)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    out0, g0 = _hf_step(plain, ids)
    units = [n for n, _ in find_units(plain, Config(checkpoint="blocks"))]
    assert len(units) == 2 and all(n.split(".")[-2] in ("h", "layers", "layer") for n in units)
    for exact in (True, False):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="blocks",
                                                              debug_exact=exact))  # fmt: skip
        common._WARNED.discard("checkpoint-cache")
        with pytest.warns(UserWarning, match="k/v cache") if family == "gpt2" else _nothing():
            out1, g1 = _hf_step(wrapped, ids)
        assert torch.equal(out0.loss, out1.loss) and torch.equal(out0.logits, out1.logits)
        assert g0.keys() == g1.keys()
        if exact:
            for n in g0:
                assert torch.equal(g0[n], g1[n]), n
        else:  # measured: median 39.6-44.4 dB (wrap without checkpointing: 40.0-44.3 dB)
            dbs = sqnrs(g0, g1)
            assert statistics.median(dbs) >= 35.0, statistics.median(dbs)
    plain.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        mesa_lite.wrap(plain, Config(checkpoint="blocks"))


class _WrapsForward(nn.Module):
    """A base class wrapping each subclass's forward in ``__init_subclass__``, as Hugging
    Face's ``GradientCheckpointingLayer`` does since transformers 5.23."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        inner = cls.forward

        @functools.wraps(inner)
        def forward(self, *args, **kwargs):
            return inner(self, *args, **kwargs)

        cls.forward = forward


def _scaled_block(base: type) -> type:
    class Block(base):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

        def forward(self, x):
            return x + self.fc(self.norm(x)) * self.scale

    return Block


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("base", ["wraps_forward", "hugging_face"])
def test_parametrized_block_with_subclass_hook_is_checkpointed(base):
    """A block whose own parameter is parametrized, of a class whose base wraps each
    subclass's forward (transformers 5.23's ``GradientCheckpointingLayer``): the forward
    of the parametrization class torch built is not carried onto the checkpointed class,
    so the block runs through ``CheckpointFn`` (it did not: checkpointing was silently
    off) with the plain block's gradients in ``debug_exact``; unwrap restores it."""
    if base == "hugging_face":
        pytest.importorskip("transformers")
        from transformers.modeling_layers import GradientCheckpointingLayer as cls
    else:
        cls = _WrapsForward
    torch.manual_seed(0)
    plain = nn.Sequential(*(_scaled_block(cls)() for _ in range(2)))
    for block in plain:
        parametrize.register_parametrization(block, "scale", _Double())
    wrapped = mesa_lite.wrap(copy.deepcopy(plain),
                             Config(checkpoint=["0", "1"], debug_exact=True))  # fmt: skip
    assert all(isinstance(b, Checkpointed) and parametrize.is_parametrized(b) for b in wrapped)
    x = torch.randn(2, 3, 16)
    outs, grads = [], []
    for model in (plain, wrapped):
        out = model(x)
        out.square().sum().backward()
        outs.append(out)
        grads.append([p.grad for p in model.parameters()])
    assert "CheckpointFn" in type(outs[1].grad_fn).__name__
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    mesa_lite.unwrap(wrapped)
    assert all(type(b) is type(p) for b, p in zip(wrapped, plain, strict=True))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
