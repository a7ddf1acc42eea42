"""Compressed checkpointing (``Config(checkpoint=...)``) against the unwrapped model on the same
inputs, for the cases a plain recompute gets silently wrong: a k/v cache written in forward,
stochastic rounding drawing from torch's generator between dropout masks, outputs recorded by
forward hooks inside a checkpointed block, a second checkpointing turned on after ``wrap``,
and BatchNorm statistics. ``debug_exact`` paths are compared bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F

import mesa_lite
from mesa_lite import Config

tf = pytest.importorskip("transformers")
tf.logging.set_verbosity_error()

VOCAB = 128


def _lm(family: str, seed: int = 0, attn: str = "sdpa", **extra):
    """A 3-layer, 32-wide causal LM of ``family`` in training mode (``use_cache`` left at its
    default, True)."""
    torch.manual_seed(seed)
    small = dict(vocab_size=VOCAB, num_hidden_layers=3, num_attention_heads=2, **extra)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB,
                            **extra)  # fmt: skip
        cls = tf.GPT2LMHeadModel
    elif family == "opt":
        cfg = tf.OPTConfig(hidden_size=32, ffn_dim=64, max_position_embeddings=64,
                           word_embed_proj_dim=32, **small)  # fmt: skip
        cls = tf.OPTForCausalLM
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(hidden_size=32, intermediate_size=64, max_position_embeddings=64,
                               **small)  # fmt: skip
        cls = tf.GPTNeoXForCausalLM
    else:
        names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "mixtral": "Mixtral"}
        if not hasattr(tf, f"{names[family]}Config"):
            pytest.skip(f"transformers {tf.__version__} has no {family}")
        if family == "mistral":
            small["sliding_window"] = 8  # shorter than the sequence: the window is used
        cfg = getattr(tf, f"{names[family]}Config")(
            hidden_size=32, intermediate_size=64, num_key_value_heads=1, **small
        )
        cls = getattr(tf, f"{names[family]}ForCausalLM")
    return cls._from_config(cfg, attn_implementation=attn).train()


def _ids(pad: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[0, :3] = 0  # left padding on the first row
    return ids, mask


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_equal(ref: dict, got: dict) -> None:
    assert ref.keys() == got.keys()
    bad = [n for n in ref if not torch.equal(ref[n], got[n])]
    assert not bad, f"gradients differ from the unwrapped model's: {bad}"


# ---- 4: the k/v cache --------------------------------------------------------------------


def _lm_step(model, ids, mask, seed=5, **kwargs):
    torch.manual_seed(seed)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, **kwargs)
    out.loss.backward()
    return out, _grads(model)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "opt", "gpt_neox"])
def test_attention_checkpointing_with_the_kv_cache_on(family):
    """``checkpoint="attention"`` in training with ``use_cache`` at its default (True): the
    forward writes the cache once, the recompute runs without it; with and without a padding
    mask, gradients equal the unwrapped model's bit for bit (debug_exact) and the returned
    cache holds what the unwrapped model's holds."""
    plain = _lm(family)
    for pad in (False, True):
        ids, mask = _ids(pad)
        wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="attention",
                                                              debug_exact=True))  # fmt: skip
        plain.zero_grad(set_to_none=True)
        out0, g0 = _lm_step(plain, ids, mask)
        out1, g1 = _lm_step(wrapped, ids, mask)
        assert torch.equal(out0.logits, out1.logits)
        _assert_grads_equal(g0, g1)
        c0, c1 = out0.past_key_values, out1.past_key_values
        assert type(c0) is type(c1) and len(c0.layers) == len(c1.layers) == 3
        for i, (a, b) in enumerate(zip(c0.layers, c1.layers, strict=True)):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), (pad, i)


def test_a_cache_holding_tokens_is_refused():
    """Training on top of a filled cache cannot be recomputed without writing the cache again:
    a clear error at forward time, before anything is written."""
    plain = _lm("llama")
    ids, mask = _ids(False)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="attention"))
    with torch.no_grad():
        cache = wrapped(input_ids=ids[:, :4]).past_key_values
    held = [layer.keys.shape for layer in cache.layers]
    with pytest.raises(ValueError, match="already holds 4 tokens.*use_cache=False"):
        wrapped(input_ids=ids[:, 4:], past_key_values=cache)
    assert [layer.keys.shape for layer in cache.layers][1:] == held[1:]
    # use_cache=False trains as before
    out0, g0 = _lm_step(plain, ids, mask, use_cache=False)
    out1, _ = _lm_step(wrapped, ids, mask, use_cache=False)
    assert out1.past_key_values is None and torch.equal(out0.logits, out1.logits)
