"""Hugging Face causal LMs with their head and loss fused (issue 52, item 1): in a training
forward with labels no tensor of tokens x vocab exists, forward or backward, and the logits
come back as None; everywhere else (eval, no labels, no grad, ``Config(keep_logits=True)``) the
logits are built and bit-identical to the plain model's. Tiny configs of each family on the
CPU; the loss and gradients against the plain model's are in test_transformers.py."""

import copy
import functools
import logging

import pytest
import torch
from conftest import assert_equal, sqnr_db, tiny_lm_config
from torch.utils._python_dispatch import TorchDispatchMode

import mesa_lite
from mesa_lite import Config
from mesa_lite.ops import linear_cross_entropy as lce

tf = pytest.importorskip("transformers")
tf.logging.set_verbosity_error()

# 160 tokens, at least 2 x hidden (64): fused; no other tensor 320 wide
VOCAB, SEQ, BATCH = 320, 40, 4
CAUSAL = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
          "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # fmt: skip


@functools.cache
def _built(family: str):
    torch.manual_seed(0)
    config = tiny_lm_config(family, vocab=VOCAB)
    return getattr(tf, CAUSAL[family])._from_config(config, attn_implementation="sdpa").train()


def _model(family, config=None):
    model = copy.deepcopy(_built(family))
    return model if config is False else mesa_lite.wrap(model, config)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 8 :] = 0  # the second sequence right-padded, its padding ignored
    labels = ids.clone()
    labels[1, SEQ - 8 :] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _LogitsRows(TorchDispatchMode):
    """The most rows of any tensor produced whose last dimension is the vocabulary (weights
    and their gradients, vocab x hidden, left out)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.rows = hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB:
                if t.shape[0] != self.hidden:
                    self.rows = max(self.rows, t.numel() // VOCAB)
        return out


@pytest.mark.parametrize("family", list(CAUSAL))
def test_no_logits_are_built_in_training_with_labels(family, monkeypatch):
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 16 * VOCAB)  # 16 tokens a chunk: 4 chunks
    batch = _batch()
    fused, kept = _model(family), _model(family, Config(keep_logits=True))
    hidden = fused.config.hidden_size if family != "gpt2" else fused.config.n_embd
    with torch.autocast("cpu", dtype=torch.bfloat16), _LogitsRows(hidden) as seen:
        out = fused(**batch)
        out.loss.backward()
    assert out.logits is None and "logits" not in out and out.loss.ndim == 0
    assert 0 < seen.rows <= 16, seen.rows
    with torch.autocast("cpu", dtype=torch.bfloat16), _LogitsRows(hidden) as full:
        out_kept = kept(**batch)
        out_kept.loss.backward()
    assert full.rows >= BATCH * SEQ and out_kept.logits.shape == (BATCH, SEQ, VOCAB)
    # the same loss (fp32 sums in another order); the head's input kept exact, not as codes
    torch.testing.assert_close(out.loss, out_kept.loss, rtol=1e-5, atol=0)
    for (n, a), b in zip(kept.named_parameters(), fused.parameters(), strict=True):
        assert sqnr_db(a.grad, b.grad) > 25, n


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logits_are_plain_wherever_they_are_built(family):
    """Eval mode, no labels, no grad, keep_logits: the logits are built, bit for bit."""
    batch = _batch()
    plain, fused = _model(family, False), _model(family)
    kept = _model(family, Config(keep_logits=True))
    assert_equal(kept(**batch).logits, plain(**batch).logits, "keep_logits")
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    assert_equal(fused(**no_labels).logits, plain(**no_labels).logits, "no labels")
    with torch.no_grad():
        assert_equal(fused(**batch).logits, plain(**batch).logits, "no grad")
    plain.eval(), fused.eval()
    out, ref = fused(**batch), plain(**batch)
    assert_equal(out.logits, ref.logits, "eval")
    assert_equal(out.loss, ref.loss, "eval loss")  # transformers' own loss in eval mode


def test_num_items_in_batch_and_the_tuple_output():
    plain, fused = _model("llama", False), _model("llama")
    batch = _batch()
    items = torch.tensor(40)
    losses = [m(**batch, num_items_in_batch=items).loss for m in (plain, fused)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    out = fused(**batch, num_items_in_batch=items, return_dict=False)
    assert isinstance(out, tuple) and out[1] is None
    torch.testing.assert_close(out[0], losses[0], rtol=1e-5, atol=0)


def test_compiled_fullgraph_matches_eager():
    batch = _batch()
    eager, compiled_model = _model("llama"), _model("llama")
    # dynamic=False, as mesa_lite.compile passes: another test in the process that compiled
    # Llama's forward on other sizes would otherwise make this trace's sizes symbolic (the
    # attention's backend choice needs concrete ones; GUIDE, "Compiled mode"); failed so on
    # the H100 run of 2026-12-05
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True, dynamic=False)
    for m in (eager, compiled):
        out = m(**batch)
        assert out.logits is None
        out.loss.backward()
        m.__dict__["_loss_value"] = out.loss.detach()
    torch.testing.assert_close(compiled.__dict__["_loss_value"], eager.__dict__["_loss_value"],
                               rtol=1e-6, atol=0)  # fmt: skip
    for (n, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_wrap_says_which_heads_it_fused(caplog):
    class MyLM(tf.LlamaForCausalLM):  # a forward of its own: not one mesa_lite checked
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with caplog.at_level(logging.INFO, logger="mesa_lite"):
        mesa_lite.wrap(_model("llama", False))
    assert "the loss fused with its head (logits None in training with labels)" in caplog.text
    caplog.clear()
    mine = MyLM._from_config(tiny_lm_config("llama", vocab=VOCAB), attn_implementation="sdpa")
    with caplog.at_level(logging.INFO, logger="mesa_lite"):
        mesa_lite.wrap(mine.train())
    assert "the loss not fused with its head (MyLM has a forward of its own)" in caplog.text
    assert mine(**_batch()).logits.shape == (BATCH, SEQ, VOCAB)


def test_bad_labels_and_a_vocab_mismatch_get_clear_errors():
    fused = _model("llama")
    batch = _batch()
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        fused(**{**batch, "labels": batch["labels"].float()})
    with pytest.raises(ValueError, match="do not match"):
        fused(**{**batch, "labels": batch["labels"][:, :-1]})
    with pytest.raises(
        ValueError, match="head has 320 outputs but the loss was given vocab_size=300"
    ):
        fused.config.vocab_size = 300
        fused(**batch)


@pytest.mark.parametrize("family, inner", [("gpt2", "transformer"), ("llama", "model")])
def test_gradients_equal_the_plain_models_with_only_the_head_wrapped(family, inner):
    """The decoder left exact: the fused head's loss and every gradient (GPT-2's tied
    embedding too) are the plain model's within fp32 rounding."""
    plain = _model(family, False)
    fused = _model(family, Config(overrides={inner: {"enabled": False}}))
    batch = _batch()
    outs = []
    for m in (plain, fused):
        out = m(**batch)
        out.loss.backward()
        outs.append(out)
    assert outs[1].logits is None
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-6, atol=0)
    for (n, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=n)


def test_what_the_head_does_not_own_is_honoured():
    """A forward hook on the lm_head (it could change the logits), a head replaced after wrap
    (PEFT's LoRA around it), fewer tokens than 2 x hidden (the fused Function's fp32 weight
    gradient would outweigh the logits): the head builds its logits, the loss as plain's."""
    batch = _batch()
    plain, fused = _model("llama", False), _model("llama")
    for m in (plain, fused):
        m.lm_head.register_forward_hook(lambda mod, args, out: out / 2)
    out, ref = fused(**batch), plain(**batch)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)

    class Adapter(torch.nn.Module):  # a head wrapped after mesa_lite.wrap, as LoRA wraps it
        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self.delta = torch.nn.Linear(base.in_features, base.out_features, bias=False)

        def forward(self, x):
            return self.base_layer(x) + self.delta(x)

    fused = _model("llama")
    fused.lm_head = Adapter(fused.lm_head)
    out = fused(**batch)
    out.loss.backward()
    assert out.logits.shape == (BATCH, SEQ, VOCAB) and fused.lm_head.delta.weight.grad is not None
    short = {k: v[:1, :20] for k, v in batch.items()}  # 20 tokens, under 2 x 64
    assert _model("llama")(**short).logits.shape == (1, 20, VOCAB)


def test_a_second_head_call_or_a_change_before_backward_is_an_error():
    import warnings

    fused = _model("llama")
    batch = _batch()
    seen = []
    fused.model.register_forward_hook(lambda m, a, out: seen.append(fused.lm_head(out[0])))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="lm_head was called more than once"):
            fused(**batch)
    assert seen[0].shape[-1] == 0  # the auxiliary call got the placeholder
    assert not [w for w in caught if "always_call" in str(w.message)], caught
    fused = _model("llama")
    loss = fused(**batch).loss
    with torch.no_grad():
        fused.lm_head.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
