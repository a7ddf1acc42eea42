"""Compiled training of every family, per-parameter gradients against the eager *unwrapped*
model: the test that torch 2.11's zero gradients (a Function returning a tensor two traced ops
produced, pytorch/pytorch#180642) would have failed, on whichever torch CI runs it with.

Each case wraps a copy of a tiny model, compiles it with ``mesa_lite.compile(...,
fullgraph=True)`` (the ``aot_eager`` backend: Dynamo and AOTAutograd as Inductor sees them,
without generating code; one case runs Inductor's CPU backend) and takes one training step in
fp32 on the CPU, with the model's own loss (``labels=``) and with a loss computed outside it.
Every parameter's gradient must be within the family's SQNR floor of the eager plain model's
(parameters whose exact gradient is ~0, such as a key projection's bias under softmax, have no
defined SQNR and are left out), and none may be missing.

The floor is 24 dB: a zeroed gradient is 0 dB, and the same families trained under
Inductor on the H200 (bf16, larger configs) had their worst parameter at 25.0-42.6 dB
(``benchmarks/results/compile_check_gpu.md``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import sqnr_db, tiny_lm_config, tiny_vit
from test_compile import tiny_swin

import mesa_lite

FLOOR_DB = 24.0  # a zeroed gradient is 0 dB


def _worst(ref: torch.nn.Module, got: torch.nn.Module) -> tuple[float, str]:
    grads = {n: p.grad for n, p in ref.named_parameters()}
    scale = max(g.norm().item() for g in grads.values() if g is not None)
    worst, where = float("inf"), ""
    for (n, p), (m, q) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        assert n == m
        if p.grad is None:
            assert q.grad is None, n
            continue
        assert q.grad is not None, f"{n}: no gradient under compile"
        if p.grad.norm().item() < 1e-4 * scale:  # ~0 in exact arithmetic: no SQNR defined
            continue
        db = sqnr_db(p.grad, q.grad)
        if db < worst:
            worst, where = db, n
    return worst, where


# ---- vision -----------------------------------------------------------------------------------


def _convnext():
    import timm

    torch.manual_seed(0)
    return timm.models.convnext.ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 16, 16), num_classes=5)


def _resnet():
    import timm

    torch.manual_seed(0)
    return timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=5)


VISION = {
    "vit": (lambda: tiny_vit(True), 16, mesa_lite.Config()),
    "swin": (tiny_swin, 28, mesa_lite.Config()),
    "convnext": (_convnext, 32, mesa_lite.Config()),
    "resnet": (
        _resnet,
        32,
        mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS),
    ),
}


@pytest.mark.parametrize("name", list(VISION))
def test_compiled_vision_model_gradients_match_plain(name):
    build, size, config = VISION[name]
    torch._dynamo.reset()
    plain = build().train()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), config)
    compiled = mesa_lite.compile(wrapped, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, size, size, generator=g)
    y = torch.randint(0, 5, (4,), generator=g)
    F.cross_entropy(plain(x), y).backward()
    F.cross_entropy(compiled(x), y).backward()
    worst, where = _worst(plain, wrapped)
    assert FLOOR_DB <= worst, f"{name} {where}: {worst:.1f} dB"


# ---- language models --------------------------------------------------------------------------

VOCAB, SEQ, BATCH = 256, 32, 2
LM = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "bert": "BertForMaskedLM",
}


def _lm(family: str, dropout: float = 0.0):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    cfg = tiny_lm_config(family, dropout, vocab=VOCAB)
    torch.manual_seed(0)
    return getattr(tf, LM[family])._from_config(cfg, attn_implementation="sdpa").train()


def _lm_loss(model, ids, own_loss: bool, seed: int):
    torch.manual_seed(seed)  # the same dropout draws in both models
    if own_loss:
        return model(input_ids=ids, labels=ids).loss
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


LM_CASES = [
    ("gpt2", 0.0, True), ("gpt2", 0.0, False), ("gpt2", 0.1, True),
    ("llama", 0.0, True), ("llama", 0.0, False), ("qwen2", 0.0, True),
    ("bert", 0.0, True), ("bert", 0.0, False),
]  # fmt: skip


@pytest.mark.parametrize(
    "family, dropout, own_loss",
    LM_CASES,
    ids=[f"{f}-{'dropout' if d else 'nodropout'}-{'labels' if o else 'outside'}"
         for f, d, o in LM_CASES],
)  # fmt: skip
def test_compiled_language_model_gradients_match_plain(family, dropout, own_loss):
    torch._dynamo.reset()
    plain = _lm(family, dropout)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    compiled = mesa_lite.compile(wrapped, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    loss_p = _lm_loss(plain, ids, own_loss, seed=1)
    loss_c = _lm_loss(compiled, ids, own_loss, seed=1)
    assert torch.allclose(loss_c, loss_p, rtol=1e-5, atol=0), (loss_c, loss_p)
    loss_p.backward()
    loss_c.backward()
    worst, where = _worst(plain, wrapped)
    assert FLOOR_DB <= worst, f"{family} {where}: {worst:.1f} dB"


def test_inductor_compiled_gpt2_with_dropout_trains_like_plain():
    """Inductor's CPU backend on GPT-2 with dropout on (the 1-bit masks packed from bool
    tensors; torch 2.11's Inductor could not lower the Triton path's bool-to-uint8 view, so
    traced code runs the references): three steps of SGD, the loss falling as eager plain's
    does, within 3% of it after them (Inductor draws its own dropout masks)."""
    torch._dynamo.reset()
    plain = _lm("gpt2", 0.1)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    runs = {"plain": (plain, plain), "mesa": (mesa_lite.compile(wrapped), wrapped)}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    losses = {}
    for key, (model, module) in runs.items():
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        seen = []
        for step in range(3):
            loss = _lm_loss(model, ids, True, seed=step)
            seen.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[key] = seen
    assert losses["mesa"][-1] < losses["mesa"][0] - 0.05, losses
    assert abs(losses["mesa"][-1] - losses["plain"][-1]) < 0.03 * losses["plain"][-1], losses


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_language_model_over_several_sequence_lengths(family):
    """A new sequence length recompiles (torch.compile would otherwise retrace with symbolic
    sizes, on which the attention's backend choice failed under fullgraph); the gradients at
    each length stay within the floor of the plain model's."""
    torch._dynamo.reset()
    plain = _lm(family)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    compiled = mesa_lite.compile(wrapped, backend="aot_eager", fullgraph=True)
    for seq in (SEQ, SEQ + 8, SEQ + 16):
        plain.zero_grad(set_to_none=True)
        wrapped.zero_grad(set_to_none=True)
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seq))
        _lm_loss(plain, ids, True, seed=1).backward()
        _lm_loss(compiled, ids, True, seed=1).backward()
        worst, where = _worst(plain, wrapped)
        assert FLOOR_DB <= worst, f"{family} seq {seq} {where}: {worst:.1f} dB"
