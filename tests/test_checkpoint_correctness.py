"""Compressed checkpointing (``Config(checkpoint=...)``) against the unwrapped model on the same
inputs, for the cases a plain recompute gets silently wrong: a k/v cache written in forward,
stochastic rounding drawing from torch's generator between dropout masks, outputs recorded by
forward hooks inside a checkpointed block, a second checkpointing turned on after ``wrap``,
and BatchNorm statistics. ``debug_exact`` paths are compared bit for bit."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_equal, sqnr_db

import mesa_lite
from mesa_lite import Config
from mesa_lite.checkpoint import Checkpointed

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


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2"])
def test_attention_input_passed_by_keyword_is_compressed(family):
    """Llama's, Mistral's and Qwen2's decoder layers call ``self_attn(hidden_states=...)``
    by keyword; the checkpointed attention's input is still the one compressed: 8-bit
    checkpointing keeps about a quarter of the fp32 input's bytes that exact checkpointing
    keeps (before, those families kept the fp32 input whatever checkpoint_bits said)."""
    from mesa_lite.report import kept_bytes

    plain = _lm(family)
    ids, mask = _ids(False)
    kept = {}
    for bits in (8, "exact"):
        model = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="attention",
                                                            checkpoint_bits=bits))  # fmt: skip
        kept[bits] = kept_bytes(model, input_ids=ids, attention_mask=mask, labels=ids,
                                use_cache=False)[0]  # fmt: skip
    units = 2  # of 3 layers: the last one is never checkpointed
    fp32_input = ids.numel() * 32 * 4
    assert kept["exact"] - kept[8] >= units * 0.7 * fp32_input, kept


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


# ---- 5: stochastic rounding and the dropout masks of the recompute -------------------------


def test_stochastic_rounding_leaves_torch_generators_alone():
    """Stochastic rounding's seeds come from mesa_lite's own counter: quantizing (kernel and
    reference) and a 4-bit training step of a model without dropout leave torch's generator
    states as they were."""
    from mesa_lite.kernels import group_quant as gq

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    model = mesa_lite.wrap(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                               torch.nn.Linear(32, 4)), Config(bits=2))  # fmt: skip
    before = torch.get_rng_state()
    cuda_before = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    for device in devices:
        # Triton on CPU tensors only in its interpreter (machines without a GPU)
        kernels = (True, False) if device == "cuda" or not torch.cuda.is_available() else (False,)
        for use_triton in kernels:
            gq.quantize(x.to(device), 64, stochastic=True, use_triton=use_triton, bits=4)
    model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert torch.equal(torch.get_rng_state(), before)
    if cuda_before is not None:
        assert torch.equal(torch.cuda.get_rng_state(), cuda_before)


def _vit(seed=0, drop=0.2):
    """A 3-block, 32-wide timm ViT on 16x16 images with dropout (explicit attention, so that
    attention dropout is an nn.Dropout too) and drop path."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=5,
        drop_rate=drop, proj_drop_rate=drop, attn_drop_rate=drop, drop_path_rate=drop,
    )  # fmt: skip
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model.train()


def _images(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 5, (n,), generator=g)


def _vit_step(model, x, y, seed=7):
    torch.manual_seed(seed)
    out = model(x)
    F.cross_entropy(out, y).backward()
    return out.detach(), _grads(model)


def test_recompute_draws_the_forward_dropout_masks_with_stochastic_rounding(monkeypatch):
    """At 4 bits (stochastic rounding) the norms inside a checkpointed block are quantized in
    its recompute; those draws must not move torch's generator between the dropout calls:
    each dropout of the recompute drops the elements its forward dropped (before: 8 of 8
    masks differed)."""
    x, y = _images()
    model = mesa_lite.wrap(_vit(), Config(bits=4, checkpoint="blocks"))  # norms inside
    dropped = []  # the inner (plain) dropouts' masks, in call order
    plain_dropout = F.dropout

    def recording(t, p=0.5, training=True, inplace=False):
        out = plain_dropout(t, p, training, inplace)
        if training and p > 0:
            dropped.append((out == 0) & (t != 0))
        return out

    monkeypatch.setattr(torch.nn.functional, "dropout", recording)
    torch.manual_seed(7)
    loss = F.cross_entropy(model(x), y)
    forward = list(dropped)
    dropped.clear()
    loss.backward()
    # blocks 0 and 1 are checkpointed (not the last), four dropouts each; the recompute runs
    # block 1, then block 0
    assert len(forward) == len(dropped) == 8
    per_block = [forward[:4], forward[4:]]
    recomputed = [dropped[4:], dropped[:4]]
    same = [torch.equal(a, b) for f, r in zip(per_block, recomputed, strict=True)
            for a, b in zip(f, r, strict=True)]  # fmt: skip
    assert all(same), f"{same.count(False)} of 8 dropout masks differ in the recompute"


@pytest.mark.parametrize("inner", ["exact", "norms", "compressed"])
def test_four_bit_checkpointing_with_dropout_against_plain(inner):
    """With dropout and drop path on, 4 bits (stochastic rounding) checkpointed: the forward
    equals the unwrapped model's bit for bit (the rounding draws nothing from torch's
    generator, so every mask is plain training's; before: the block inputs' copies moved it),
    and the gradients are nearly as close to plain's as with nearest rounding (median over
    the parameters, measured over 5 seeds of this model: 17.7-23.3 dB stochastic, 22.0-25.3
    nearest; before: below 0 dB, the masks were not plain training's)."""
    x, y = _images()
    plain = _vit()
    out0, g0 = _vit_step(plain, x, y)
    medians = {}
    for rounding in ("stochastic", "nearest"):
        model = mesa_lite.wrap(copy.deepcopy(plain), Config(
            bits=4, rounding=rounding, checkpoint="blocks", checkpoint_inner=inner))  # fmt: skip
        out1, g1 = _vit_step(model, x, y)
        assert torch.equal(out0, out1), f"{rounding}: forward differs from plain"
        dbs = sorted(sqnr_db(g0[n], g1[n]) for n in g0)
        medians[rounding] = dbs[len(dbs) // 2]
    assert medians["stochastic"] >= 14.0, medians
    assert medians["stochastic"] >= medians["nearest"] - 8.0, medians


# ---- 6: outputs recorded by forward hooks inside a checkpointed module ----------------------


def _counting_torch_checkpoint(monkeypatch) -> list:
    """Counts the calls that fall back to torch.utils.checkpoint."""
    calls, plain = [], torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(None)
        return plain(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    return calls


@pytest.mark.parametrize("policy", ["blocks", "attention"])
def test_attention_maps_recorded_inside_a_checkpointed_block_keep_their_graph(policy, monkeypatch):
    """``output_attentions=True``: transformers records the attention maps with forward hooks
    on the attention modules. Inside a checkpointed block those calls run under
    torch.utils.checkpoint (a one-time warning), so a loss on the maps gets plain training's
    gradients (debug_exact: bit for bit; before: the maps came from the no-grad forward and
    their loss had no gradient); with checkpoint="attention" the hook sits on the unit itself
    and sees the Function's outputs. Without output_attentions the same model, its hooks still
    installed, runs compressed checkpointing."""
    plain = _lm("llama", attn="eager")
    ids, mask = _ids(True)
    model = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint=policy, debug_exact=True))
    calls = _counting_torch_checkpoint(monkeypatch)
    grads = []
    for m in (plain, model):
        torch.manual_seed(5)
        out = m(input_ids=ids, attention_mask=mask, labels=ids, output_attentions=True)
        assert len(out.attentions) == 3
        (out.loss + sum(a.square().sum() for a in out.attentions)).backward()
        grads.append(_grads(m))
    _assert_grads_equal(*grads)
    assert len(calls) == (2 if policy == "blocks" else 0)
    calls.clear()
    plain.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    _, g0 = _lm_step(plain, ids, mask)
    _, g1 = _lm_step(model, ids, mask)
    _assert_grads_equal(g0, g1)
    assert not calls, "compressed checkpointing not used once the hooks are off"


@pytest.mark.parametrize("policy", ["blocks", "mlp"])
def test_mixtral_router_logits_auxiliary_loss_exact(policy):
    """``output_router_logits=True``: Mixtral's router logits, recorded by a hook on each
    router inside the checkpointed block (or MoE MLP), carry their graph, so the auxiliary
    load-balancing loss gives plain training's gradients (debug_exact, bit for bit)."""
    plain = _lm("mixtral", attn="eager", num_local_experts=4, router_aux_loss_coef=1.0)
    ids, mask = _ids(False)
    model = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint=policy, debug_exact=True))
    outs, grads = [], []
    for m in (plain, model):
        out, g = _lm_step(m, ids, mask, output_router_logits=True)
        outs.append(out)
        grads.append(g)
    assert torch.equal(outs[0].aux_loss, outs[1].aux_loss) and outs[0].aux_loss > 0
    _assert_grads_equal(*grads)


def test_user_hooks_inside_a_checkpointed_attention_with_the_cache():
    """A user's forward hook keeping a projection's output inside a checkpointed attention
    (with the k/v cache on): the call runs under torch.utils.checkpoint, its recompute
    without the cache; a loss on the kept outputs gets plain's gradients and the cache holds
    plain's keys and values."""
    plain = _lm("llama")
    ids, mask = _ids(True)
    model = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint="attention",
                                                        debug_exact=True))  # fmt: skip
    results = []
    for m in (plain, model):
        kept = []

        def keep(mod, args, out, kept=kept):
            kept.append(out)

        handles = [layer.self_attn.q_proj.register_forward_hook(keep) for layer in m.model.layers]
        torch.manual_seed(5)
        out = m(input_ids=ids, attention_mask=mask, labels=ids)
        (out.loss + sum(q.square().mean() for q in kept)).backward()
        for h in handles:
            h.remove()
        results.append((out.past_key_values, _grads(m)))
    _assert_grads_equal(results[0][1], results[1][1])
    for a, b in zip(results[0][0].layers, results[1][0].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


# ---- 8: running statistics -----------------------------------------------------------------


class _ConvBlock(torch.nn.Module):
    """conv -> BatchNorm (+ ReLU, timm's BatchNormAct2d when timm is there) -> conv ->
    BatchNorm, residual add, ReLU, then an InstanceNorm that tracks running statistics."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        try:
            from timm.layers import BatchNormAct2d

            self.bn1 = BatchNormAct2d(c)
        except ImportError:
            self.bn1 = torch.nn.Sequential(torch.nn.BatchNorm2d(c), torch.nn.ReLU())
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)
        self.inorm = torch.nn.InstanceNorm2d(c, affine=True, track_running_stats=True)

    def forward(self, x):
        return self.inorm(F.relu(x + self.bn2(self.conv2(self.bn1(self.conv1(x))))))


def _cnn(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), *[_ConvBlock(8) for _ in range(3)],
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5),
    ).train()  # fmt: skip


def _stats(model) -> dict:
    return {n: b.clone() for n, b in model.named_buffers()}


def test_running_statistics_updated_once_per_step():
    """A checkpointed block's BatchNorms (torch's and timm's) and tracking InstanceNorm update
    their running statistics in the forward only: after two SGD steps, running means,
    variances and num_batches_tracked equal plain training's, as do gradients (debug_exact)
    and eval-mode outputs; likewise where a forward hook inside a block makes its calls fall
    back to torch.utils.checkpoint. Compressed (8 bits), the first step's statistics are
    plain's too (the forward is exact)."""
    x, y = _images()
    plain = _cnn()
    for exact, hooked in ((True, False), (True, True), (False, False)):
        ref, model = copy.deepcopy(plain), mesa_lite.wrap(
            copy.deepcopy(plain), Config(checkpoint="blocks", debug_exact=exact))  # fmt: skip
        assert [isinstance(b, Checkpointed) for b in model[1:4]] == [True, True, False]
        if hooked:
            model[1].conv2.register_forward_hook(lambda m, args, out: None)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
        for step in range(2 if exact else 1):
            grads = []
            for m, opt in zip((ref, model), opts, strict=True):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(m(x[step::2]), y[step::2]).backward()
                grads.append(_grads(m))
                opt.step()
            if exact:
                _assert_grads_equal(*grads)
            s0, s1 = _stats(ref), _stats(model)
            bad = [n for n in s0 if not torch.equal(s0[n], s1[n])]
            assert not bad, f"step {step}: running statistics differ: {bad}"
        assert int(model[1].bn2.num_batches_tracked) == (2 if exact else 1)
        if exact:
            with torch.no_grad():
                assert torch.equal(ref.eval()(x), model.eval()(x))


# ---- 7: a second checkpointing turned on after wrap -----------------------------------------


@pytest.mark.parametrize("policy,name", [("blocks", "activation"), ("attention", "activation"),
                                         ("blocks", "gradient")])  # fmt: skip
def test_hugging_face_checkpointing_turned_on_after_wrap_is_refused(policy, name):
    """``activation_checkpointing_enable()`` (transformers 5.23's name) or the older
    ``gradient_checkpointing_enable()`` after ``wrap(..., Config(checkpoint=...))`` would
    run each block three times: the first training forward raises, naming the flag and how to
    turn it off in the installed version's words; off again, training runs (and a deepcopy
    checks its own flags)."""
    plain = _lm("llama")
    ids, mask = _ids(False)
    model = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint=policy, debug_exact=True))
    new = hasattr(model, "activation_checkpointing_enable")
    if name == "activation" and not new:
        pytest.skip("transformers before 5.23 has only gradient_checkpointing_enable")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name, from 5.23
        getattr(model, f"{name}_checkpointing_enable")()
    hint = r"activation_checkpointing_disable\(\)" if new else r"gradient_checkpointing_disable\(\)"
    with pytest.raises(ValueError, match=r"gradient_checkpointing is on.*" + hint):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():
        model.eval()(input_ids=ids)  # evaluation does not checkpoint: no error
    model.train()
    clone = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(model, f"{name}_checkpointing_disable")()
    with pytest.raises(ValueError, match="gradient_checkpointing is on"):
        clone(input_ids=ids, labels=ids)
    _, g0 = _lm_step(plain, ids, mask)
    _, g1 = _lm_step(model, ids, mask)
    _assert_grads_equal(g0, g1)


@pytest.mark.parametrize("exact", [False, True], ids=["int8", "debug_exact"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("policy", ["mlp", "attention", "blocks"])
def test_compiled_checkpointing_of_a_decoders_parts(family, policy, exact):
    """torch.compile of a decoder checkpointed by parts: each unit's call is a graph break,
    the rest compiled; gradients as the same wrapped model's in eager mode, and (debug_exact)
    as the unwrapped model's. At int8, ``"mlp"`` and ``"attention"`` failed inside Dynamo (an
    internal KeyError) while it traced the check for a second checkpointing; that check now
    runs outside the graph and still refuses Hugging Face's checkpointing turned on after
    compile."""
    plain = _lm(family)
    ids, mask = _ids(True)
    model = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint=policy, debug_exact=exact))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    out0, g0 = _lm_step(plain if exact else eager, ids, mask)
    out1, _ = _lm_step(compiled, ids, mask)
    g1 = _grads(model)  # the compiled wrapper's names have a prefix
    torch.testing.assert_close(out1.loss, out0.loss, rtol=1e-6, atol=0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing is on"):
        compiled(input_ids=ids, attention_mask=mask, labels=ids)


def test_a_unit_fed_token_ids_replays_its_own_devices_rng():
    """The device whose RNG state the recompute replays: the first floating input's, else
    any tensor argument's (token ids into a checkpointed embedding), else the first
    parameter's; before, a unit with no floating input always recorded the CPU's, so on CUDA
    its dropout masks in the recompute would differ from the forward's."""
    from mesa_lite.checkpoint import _unit_device

    ids = torch.zeros(2, 3, dtype=torch.long, device="meta")
    weight = nn.Parameter(torch.zeros(4, device="meta"))
    hidden = torch.zeros(2, device="meta")
    assert _unit_device([], [None, ids, 0.5], [weight]) == torch.device("meta")
    assert _unit_device([], [None], [weight]) == torch.device("meta")
    assert _unit_device([hidden], [ids], []) == torch.device("meta")
    assert _unit_device([], [None, 1], []) == torch.device("cpu")
    # on the CPU: a checkpointed embedding with dropout, gradients as the unwrapped model's
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(16, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    model = mesa_lite.wrap(copy.deepcopy(plain), Config(checkpoint=["0", "1"], debug_exact=True))
    tokens = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(2))
    grads = []
    for m in (plain, model):
        torch.manual_seed(7)
        m(tokens).square().mean().backward()
        grads.append(_grads(m))
    _assert_grads_equal(*grads)


def test_timm_checkpointing_turned_on_after_wrap_is_refused():
    x, y = _images()
    model = mesa_lite.wrap(_vit(), Config(checkpoint="blocks"))
    model.set_grad_checkpointing()
    with pytest.raises(ValueError, match=r"grad_checkpointing is on.*"
                                         r"set_grad_checkpointing\(False\)"):  # fmt: skip
        model(x)
    model.set_grad_checkpointing(False)
    F.cross_entropy(model(x), y).backward()


# ---- found by review: a unit with several outputs ----------------------------------------------


class _AddNormBlock(nn.Module):
    """Ends like a fused add-norm: returns the residual sum and its norm; the sum is saved by
    the norm, so the recompute must not free it."""

    def __init__(self, w=16):
        super().__init__()
        self.ln, self.fc, self.ln2 = nn.LayerNorm(w), nn.Linear(w, w), nn.LayerNorm(w)

    def forward(self, x, res):
        res = res + self.fc(self.ln(x))
        return self.ln2(res), res


class _AddNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_AddNormBlock() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        res = torch.zeros_like(x)
        for b in self.blocks:
            x, res = b(x, res)
        return self.head(x + res).sum()


def test_unit_with_several_outputs_keeps_what_its_backward_needs():
    torch.manual_seed(0)
    plain = _AddNormNet()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=True,
                             checkpoint=["blocks.0", "blocks.1"]))  # fmt: skip
    x = torch.randn(2, 5, 16)
    plain(x).backward()
    wrapped(x).backward()
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert_equal(q.grad, p.grad, f"grad of {n}")
