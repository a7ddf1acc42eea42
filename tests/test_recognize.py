"""Recognition by proof (``mesa_lite.recognize``): modules known by structure are converted to a
formula-based or fused path only when their forward is proved equal to it in training mode, on
random weights in their own dtype, at several magnitudes, drawing the same random numbers.

Each class of module that fooled the eval-mode, init-weight probe before is written here in a
few lines (no transformers needed), and checked against the unwrapped module on the same
inputs: forward bit for bit and ``debug_exact`` gradients bit for bit, whatever ``wrap``
decides. Real Hugging Face modules of each class follow, where the installed transformers has
them."""

import copy
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import HFStyleRMSNorm, assert_equal, graph_nodes, sqnr_db

import mesa_lite
from mesa_lite import Config
from mesa_lite.modules import RMSNorm
from mesa_lite.recognize import GatedMlp, Mlp


def _randomize(model: nn.Module, seed: int = 5) -> nn.Module:
    """Parameters away from their init values (a norm's weight of ones), as after training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.5 + 1.0)
    return model


def _run(model, x, seed=3):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    y = model(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    y.backward(g)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return y, {"input": x.grad, **grads}


def _same_as_plain(plain, x, floor=25.0):
    """Training forward bit for bit and debug_exact gradients bit for bit against ``plain``;
    int8 gradients above ``floor`` dB. Returns the int8-wrapped copy."""
    y0, g0 = _run(plain, x)
    for exact in (True, False):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(debug_exact=exact))
        y1, g1 = _run(wrapped, x)
        assert_equal(y1, y0, f"forward (debug_exact={exact})")
        for n, a in g0.items():
            if exact:
                assert_equal(g1[n], a, f"grad of {n}")
            else:
                assert sqnr_db(a, g1[n]) >= floor, n
    return wrapped


# ---- RMSNorm formulas -------------------------------------------------------------------------


class OlmoStyleRMSNorm(nn.Module):
    """Olmo2's (and NemotronH's, Gemma4's, Moshi's) form: the weight multiplies the fp32
    normalized input, then the cast. Equal to Llama's form when the weight is ones."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_of_another_formula_is_not_taken_for_llamas(dtype, caplog):
    """With bf16 weights of ones both forms agree bit for bit; the proof's random weights
    tell them apart. Llama's form is converted, the other left alone and named."""
    torch.manual_seed(0)
    llama = nn.Sequential(nn.Linear(32, 32), HFStyleRMSNorm(32), nn.Linear(32, 32)).to(dtype)
    olmo = nn.Sequential(nn.Linear(32, 32), OlmoStyleRMSNorm(32), nn.Linear(32, 32)).to(dtype)
    with caplog.at_level(logging.INFO, logger="mesa_lite"):
        wrapped_olmo = mesa_lite.wrap(copy.deepcopy(olmo))
    assert isinstance(mesa_lite.wrap(copy.deepcopy(llama))[1], RMSNorm)
    assert type(wrapped_olmo[1]) is OlmoStyleRMSNorm
    assert "OlmoStyleRMSNorm x1 (not the Hugging Face RMSNorm formula" in caplog.text
    x = torch.randn(3, 7, 32).to(dtype)
    _same_as_plain(_randomize(olmo), x)  # as after training moved the weights


def test_olmo2_model_gradients_exact_after_its_weights_move():
    mods = pytest.importorskip("transformers")
    if not hasattr(mods, "Olmo2Config"):
        pytest.skip("no Olmo2 in this transformers")
    config = mods.Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = _randomize(mods.Olmo2ForCausalLM(config).to(torch.bfloat16)).train()
    wrapped = mesa_lite.wrap(copy.deepcopy(model), Config(debug_exact=True))
    assert not any(isinstance(m, RMSNorm) for m in wrapped.modules())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (model, wrapped):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append((out.logits, {n: p.grad for n, p in m.named_parameters()}))
    assert_equal(outs[1][0], outs[0][0], "logits")
    for n, g in outs[0][1].items():
        assert_equal(outs[1][1][n], g, f"grad of {n}")


# ---- gated MLPs ---------------------------------------------------------------------------------


class Gated(nn.Module):
    """``down(silu(gate(x)) * up(x))`` and the variants that fooled the old probe."""

    def __init__(self, variant="plain", h=16, i=40):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()
        self.variant = variant
        if variant in ("dropout_child", "dropout_between"):
            self.dropout = nn.Dropout(0.1)
        self.limit = 0.5

    def forward(self, x):
        v = self.variant
        gate, up = self.gate_proj(x), self.up_proj(x)
        if v == "clamp":  # DeepseekV4, GLM5Next, Step3p7: swiglu_limit
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        h = self.act_fn(gate) * up
        if v == "dropout_between":  # T5Gemma's MLP
            h = self.dropout(h)
        y = self.down_proj(h)
        if v == "functional_dropout":  # SeedOss: residual_dropout
            y = F.dropout(y, p=0.1, training=self.training)
        if v == "dropout_child":
            y = self.dropout(y)
        return y


@pytest.mark.parametrize(
    "variant", ["functional_dropout", "dropout_child", "dropout_between", "clamp"]
)
def test_gated_mlp_variants_are_not_fused_and_stay_exact(variant):
    """Dropout in training and a clamp that a small init-weight probe never reaches: the
    module keeps its own forward (layers compressed one by one), equal to the plain one."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), Gated(variant))
    wrapped = _same_as_plain(plain, torch.randn(3, 9, 16) * 3)
    assert not isinstance(wrapped[1], GatedMlp)
    assert isinstance(wrapped[1].gate_proj, mesa_lite.modules.Linear)


def test_gated_mlp_with_dropout_is_named_in_the_summary(caplog):
    with caplog.at_level(logging.INFO, logger="mesa_lite"):
        mesa_lite.wrap(Gated("functional_dropout"))
    assert "not fused (their layers run one by one) 1: Gated x1 (not down(act(gate(x)) * " in (
        caplog.text
    )
    assert "draws random numbers in training (dropout)" in caplog.text


class TitanFeedForward(nn.Module):
    """torchtitan's (and many hand-written Llamas') MLP: ``w2(F.silu(w1(x)) * w3(x))``."""

    def __init__(self, h=16, i=40, act=F.silu):
        super().__init__()
        self.w1 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


@pytest.mark.parametrize(
    "act", [F.silu, F.gelu, lambda t: F.gelu(t, approximate="tanh")], ids=["silu", "gelu", "tanh"]
)
def test_gated_mlp_with_other_names_and_a_functional_activation_is_fused(act):
    from mesa_lite.blocks import GatedMlpFn

    torch.manual_seed(0)
    plain = nn.Sequential(HFStyleRMSNorm(16), TitanFeedForward(act=act))
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert isinstance(wrapped[1], GatedMlp)
    assert wrapped[1].__dict__["_mesa_gated"][:3] == ("w1", "w3", "w2")
    calls = []
    apply = GatedMlpFn.apply
    GatedMlpFn.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        _same_as_plain(plain, torch.randn(3, 9, 16) * 2)
    finally:
        GatedMlpFn.apply = apply
    assert calls, "the block Function did not run"


def test_gated_mlp_with_an_unknown_functional_activation_is_not_fused():
    plain = TitanFeedForward(act=torch.tanh)
    wrapped = _same_as_plain(plain, torch.randn(2, 5, 16))
    assert not isinstance(wrapped, GatedMlp)


# ---- two-projection MLPs ----------------------------------------------------------------------


class TwoProj(nn.Module):
    """Starcoder2's MLP: ``F.dropout(c_proj(act(c_fc(x))))``."""

    def __init__(self, p):
        super().__init__()
        self.c_fc = nn.Linear(16, 40)
        self.c_proj = nn.Linear(40, 16)
        self.act = nn.GELU(approximate="tanh")
        self.p = p

    def forward(self, x):
        return F.dropout(self.c_proj(self.act(self.c_fc(x))), p=self.p, training=self.training)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_two_projection_mlp_with_functional_dropout(p):
    """p > 0: not fused (the fused path would drop the dropout); p = 0: fused."""
    torch.manual_seed(0)
    wrapped = _same_as_plain(nn.Sequential(nn.LayerNorm(16), TwoProj(p)), torch.randn(3, 9, 16))
    assert isinstance(wrapped[1], Mlp) == (p == 0.0)


# ---- meta-device construction, and no transformers --------------------------------------------


class TinyDecoderLayer(nn.Module):
    def __init__(self, h=16):
        super().__init__()
        self.attention_norm = HFStyleRMSNorm(h)
        self.wqkv = nn.Linear(h, 3 * h, bias=False)
        self.wo = nn.Linear(h, h, bias=False)
        self.ffn_norm = HFStyleRMSNorm(h)
        self.feed_forward = TitanFeedForward(h)

    def forward(self, x):
        q, k, v = self.wqkv(self.attention_norm(x)).chunk(3, dim=-1)
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.feed_forward(self.ffn_norm(x))


def _classes(model):
    return [type(m).__name__ for m in model.modules()]


def test_meta_device_construction_converts_the_same_modules():
    torch.manual_seed(0)
    real = mesa_lite.wrap(nn.Sequential(TinyDecoderLayer(), TinyDecoderLayer()))
    with torch.device("meta"):
        meta = nn.Sequential(TinyDecoderLayer(), TinyDecoderLayer())
    mesa_lite.wrap(meta)
    assert _classes(meta) == _classes(real)
    assert sum(isinstance(m, GatedMlp) for m in meta.modules()) == 2
    assert sum(isinstance(m, RMSNorm) for m in meta.modules()) == 4
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    x = torch.randn(2, 5, 16)
    (y0, g0), (y1, g1) = _run(real, x), _run(meta, x)
    assert_equal(y1, y0, "forward")
    for n, a in g0.items():
        assert_equal(g1[n], a, f"grad of {n}")


def test_meta_device_llama_converts_the_same_modules():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1)  # fmt: skip
    real = mesa_lite.wrap(transformers.LlamaForCausalLM(config))
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    mesa_lite.wrap(meta)
    assert _classes(meta) == _classes(real)
    assert sum(isinstance(m, GatedMlp) for m in meta.modules()) == 2


def test_recognition_needs_no_transformers():
    """With transformers unimportable, a Llama-style model written in plain torch still has its
    RMSNorms converted and its gated MLPs fused."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["transformers"] = None  # import transformers raises ImportError
        sys.path.insert(0, "tests")
        import torch
        import mesa_lite
        from mesa_lite.modules import RMSNorm
        from mesa_lite.recognize import GatedMlp
        from test_recognize import TinyDecoderLayer
        model = mesa_lite.wrap(torch.nn.Sequential(TinyDecoderLayer(), TinyDecoderLayer()))
        kinds = (GatedMlp, RMSNorm)
        print([sum(isinstance(m, k) for m in model.modules()) for k in kinds])
        """
    )
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[2,", "4]"], out.stdout


# ---- the named Hugging Face modules -------------------------------------------------------------


def _hf(module_path: str, cls: str):
    mod = pytest.importorskip(module_path)
    if not hasattr(mod, cls):
        pytest.skip(f"no {cls} in this transformers")
    return getattr(mod, cls)


def test_seed_oss_mlp_residual_dropout():
    SeedOssMLP = _hf("transformers.models.seed_oss.modeling_seed_oss", "SeedOssMLP")
    from transformers import SeedOssConfig

    config = SeedOssConfig(hidden_size=16, intermediate_size=40, residual_dropout=0.1)
    torch.manual_seed(0)
    wrapped = _same_as_plain(nn.Sequential(nn.Linear(16, 16), SeedOssMLP(config)),
                             torch.randn(3, 9, 16))  # fmt: skip
    assert not isinstance(wrapped[1], GatedMlp)


def test_deepseek_v4_mlp_swiglu_limit():
    DeepseekV4MLP = _hf("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP")
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(hidden_size=16, intermediate_size=40, swiglu_limit=2.0)
    torch.manual_seed(0)
    wrapped = _same_as_plain(nn.Sequential(nn.Linear(16, 16), DeepseekV4MLP(config)),
                             torch.randn(3, 9, 16) * 3)  # fmt: skip
    assert not isinstance(wrapped[1], GatedMlp)


def test_starcoder2_and_prophetnet_feed_forwards_with_dropout():
    Starcoder2MLP = _hf("transformers.models.starcoder2.modeling_starcoder2", "Starcoder2MLP")
    FeedForward = _hf("transformers.models.prophetnet.modeling_prophetnet", "ProphetNetFeedForward")
    from transformers import ProphetNetConfig, Starcoder2Config

    torch.manual_seed(0)
    star = Starcoder2MLP(Starcoder2Config(hidden_size=16, intermediate_size=40,
                                          residual_dropout=0.1))  # fmt: skip
    prophet = FeedForward(ProphetNetConfig(hidden_size=16, activation_dropout=0.1), 40)
    for mlp in (star, prophet):
        wrapped = _same_as_plain(nn.Sequential(nn.Linear(16, 16), mlp), torch.randn(3, 9, 16))
        assert not isinstance(wrapped[1], Mlp), type(mlp).__name__


def test_wrap_again_after_resize_token_embeddings_converts_the_new_head():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    model = mesa_lite.wrap(transformers.LlamaForCausalLM(config))
    model.resize_token_embeddings(80, mean_resizing=False)
    assert type(model.lm_head) is nn.Linear  # built by transformers after wrap: plain
    mesa_lite.wrap(model)
    assert isinstance(model.lm_head, mesa_lite.modules.Linear)
    assert model.lm_head.weight.shape[0] == 80


# ---- found by review: in-place steps, autocast, extra arguments --------------------------------


class InPlaceScale(nn.Module):
    """A layer scale applied in place to the last projection's output (its own Parameter)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 40), nn.GELU(), nn.Linear(40, 16)
        self.gamma = nn.Parameter(torch.full((16,), 0.5))

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))).mul_(self.gamma)


class InPlaceClamp(nn.Module):
    """An in-place clamp between the activation and the second projection: the same objects
    flow from layer to layer, with other values."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 40), nn.GELU(), nn.Linear(40, 16)

    def forward(self, x):
        h = self.act(self.fc1(x))
        h.clamp_(max=0.5)
        return self.fc2(h)


class UpcastGated(Gated):
    """The activation computed in fp32 by the forward itself: equal to the plain formula in
    fp32, not under bf16 autocast."""

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x).float()).to(x.dtype) * self.up_proj(x))


@pytest.mark.parametrize("mlp", [InPlaceScale, InPlaceClamp], ids=lambda c: c.__name__)
def test_mlp_with_an_in_place_step_is_not_fused(mlp):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.LayerNorm(16), mlp())
    wrapped = _same_as_plain(plain, torch.randn(3, 9, 16) * 2)
    assert not isinstance(wrapped[1], Mlp)


def test_gated_mlp_that_upcasts_is_not_fused_and_exact_under_autocast():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), UpcastGated())
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert not isinstance(wrapped[1], GatedMlp)
    x = torch.randn(3, 9, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_equal(wrapped(x), plain(x), "forward under bf16 autocast")


class ResidualRMSNorm(HFStyleRMSNorm):
    def forward(self, x, residual=None):
        return super().forward(x if residual is None else x + residual)


def test_rms_norm_with_another_argument_is_not_converted():
    net = mesa_lite.wrap(nn.Sequential(nn.Linear(8, 8), ResidualRMSNorm(8)))
    assert type(net[1]) is ResidualRMSNorm
    x = torch.randn(2, 8)
    net[1](x, residual=x)  # still callable with it


def test_summary_names_blocks_fused_by_proof(caplog):
    with caplog.at_level(logging.INFO, logger="mesa_lite"):
        mesa_lite.wrap(nn.Sequential(HFStyleRMSNorm(16), TitanFeedForward()))
    assert "fused by proof TitanFeedForward as GatedMlp x1" in caplog.text


# ---- what a proof covers besides the forward (issue 39: backward, side effects, expiry) --------


class StopGradRMSNorm(HFStyleRMSNorm):
    """Llama's RMSNorm with its statistic a constant in backward: the same output bit for bit,
    another gradient."""

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True).detach()
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(dtype)


class RunningRMSNorm(HFStyleRMSNorm):
    """Llama's RMSNorm keeping a running mean of its statistic in a buffer."""

    def __init__(self, n: int):
        super().__init__(n)
        self.register_buffer("running_ms", torch.zeros(()))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        if self.training:
            with torch.no_grad():
                self.running_ms.mul_(0.9).add_(0.1 * variance.mean())
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(dtype)


class StatsRecorder(nn.Module):
    """A parameter-free child that records the mean of what it sees."""

    def __init__(self):
        super().__init__()
        self.seen: list[float] = []

    def forward(self, x):
        self.seen.append(float(x.detach().float().mean()))
        return x


class GatedWith(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with an extra parameter-free child on the product."""

    def __init__(self, extra: nn.Module, h=16, i=40):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.extra = extra

    def forward(self, x):
        return self.down_proj(self.extra(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class ScaledMlp(nn.Module):
    """GPT-2's MLP shape with a plain attribute its forward reads."""

    def __init__(self, h=16, i=40):
        super().__init__()
        self.c_fc = nn.Linear(h, i)
        self.act = nn.GELU()
        self.c_proj = nn.Linear(i, h)
        self.scaled = False

    def forward(self, x):
        h = self.act(self.c_fc(x))
        return self.c_proj(h * 2 if self.scaled else h)


def _norm_model(norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), norm, nn.Linear(32, 32))


def test_rms_norm_with_a_stop_gradient_is_refused(caplog):
    """The forward is Llama's bit for bit; the backward proof refuses it, and the wrapped
    model's gradients stay the module's own (int8 floor, debug_exact bit for bit)."""
    plain = _randomize(_norm_model(StopGradRMSNorm(32)))
    with caplog.at_level(logging.INFO, logger="mesa_lite"):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert type(wrapped[1]) is StopGradRMSNorm
    assert "StopGradRMSNorm x1 (not the Hugging Face RMSNorm formula: computes another " \
           "gradient of input" in caplog.text  # fmt: skip
    _same_as_plain(plain, torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0)))
    # the proof's control: Llama's own form is still converted
    assert isinstance(mesa_lite.wrap(_norm_model(HFStyleRMSNorm(32)))[1], RMSNorm)


def test_rms_norm_writing_a_buffer_is_refused(caplog):
    plain = _norm_model(RunningRMSNorm(32))
    with caplog.at_level(logging.INFO, logger="mesa_lite"):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert type(wrapped[1]) is RunningRMSNorm
    assert "writes its buffer 'running_ms' in forward" in caplog.text
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0))
    for m in (plain, wrapped):
        m(x).sum().backward()
    assert plain[1].running_ms.item() != 0
    assert_equal(wrapped[1].running_ms, plain[1].running_ms, "running statistic")


@pytest.mark.parametrize("extra", ["recorder", "dropout0"])
def test_gated_mlp_calling_a_child_the_fused_path_omits_is_not_fused(extra, caplog):
    """A child the fused path would not call (a statistics recorder; a Dropout at p=0, which a
    later schedule turns on) keeps the module's own forward; the summary says why."""
    child = StatsRecorder() if extra == "recorder" else nn.Dropout(0.0)
    torch.manual_seed(0)
    plain = _randomize(GatedWith(child))
    with caplog.at_level(logging.INFO, logger="mesa_lite"):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert not isinstance(wrapped, GatedMlp)
    assert "calls its child 'extra'" in caplog.text
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(0))
    if extra == "recorder":
        n = len(wrapped.extra.seen)
        wrapped(x).sum().backward()
        assert len(wrapped.extra.seen) == n + 1  # the recorder ran in training
    else:
        for m in (plain, wrapped):
            m.extra.p = 0.5  # a late-dropout schedule
        _same_as_plain(plain, x)


def test_fused_mlp_rechecks_its_proof_on_each_call():
    """A plain attribute changed after wrap (a config switch) makes the fused block run its
    own forward, which reads it; the proof's attributes back, the fused path again."""
    from mesa_lite import blocks

    torch.manual_seed(0)
    plain = _randomize(ScaledMlp())
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    assert isinstance(wrapped, Mlp)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(0))
    calls = []
    original = blocks.MlpFn.apply

    def counting(*args):
        calls.append(1)
        return original(*args)

    blocks.MlpFn.apply = counting
    try:
        wrapped(x).sum().backward()
        assert len(calls) == 1
        for m in (plain, wrapped):
            m.scaled = True
        _same_as_plain(plain, x)
        y = wrapped(x)
        assert len(calls) == 1  # its own forward
        assert_equal(y, plain(x), "forward with the attribute changed")
        wrapped.scaled = False
        wrapped(x).sum().backward()
        assert len(calls) == 2
    finally:
        blocks.MlpFn.apply = original


@pytest.mark.parametrize(
    ("bits", "rounding", "floor"),
    [(4, None, 8.0), (2, None, None), (8, "stochastic", 20.0)],
    ids=["int4", "int2", "int8_stochastic"],
)
def test_mlps_are_fused_at_every_setting(bits, rounding, floor):
    """The proof is of the formula, with the children's compression off: gated and
    two-projection MLPs are fused at 4 and 2 bits and with stochastic rounding too (the proof
    compared two compressed backward passes before, which differ from call to call, so no MLP
    was fused there and a 4-bit model kept more than an 8-bit one). Forward bit for bit,
    gradients above the width's floor against the unwrapped model, fewer bytes than at 8 bits."""
    from conftest import saved_activation_bytes

    torch.manual_seed(0)
    plain = _randomize(nn.Sequential(TinyDecoderLayer(32), TinyDecoderLayer(32)))
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(6))
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), Config(bits=bits, rounding=rounding))
    assert sum(isinstance(m, GatedMlp) for m in wrapped.modules()) == 2
    y0, g0 = _run(plain, x)
    y1, g1 = _run(wrapped, x)
    assert_equal(y1, y0, "forward")
    for n, a in g0.items():  # (2 bits through two random layers: no floor worth the name)
        assert floor is None or sqnr_db(a, g1[n]) >= floor, (n, sqnr_db(a, g1[n]))
    if bits < 8:  # the fused MLP alone keeps its codes at the width asked for
        mlp = TitanFeedForward(128, 256)
        h = torch.randn(4, 32, 128).requires_grad_()
        kept = []
        for cfg in (Config(bits=bits), Config()):
            m = mesa_lite.wrap(nn.Sequential(copy.deepcopy(mlp)), cfg)
            assert isinstance(m[0], GatedMlp)
            kept.append(saved_activation_bytes(lambda m=m: m(h), list(m.parameters()))[0])
        assert kept[0] < (bits / 8 + 0.1) * kept[1], kept
    two = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Dropout(0.0))
    mlp = mesa_lite.wrap(nn.Sequential(two), Config(bits=bits, rounding=rounding))
    assert isinstance(mlp[0], Mlp), type(mlp[0])


class _MlpConfig:
    """A model config as Hugging Face models hold one (``self.config``)."""

    def __init__(self):
        self.hidden_act = "silu"
        self.use_cache = True
        self.gate_scale = 1.0


class ConfigGatedMlp(nn.Module):
    """A gated MLP whose forward reads a dict it holds and a field of the config it holds."""

    def __init__(self, config, h=16, i=40):
        super().__init__()
        self.config = config
        self.acts = {"act": "silu"}
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        act = F.silu if self.acts["act"] == "silu" else F.gelu
        h = act(self.gate_proj(x)) * self.up_proj(x)
        if self.config.gate_scale != 1.0:
            h = h * self.config.gate_scale
        return self.down_proj(h)


class ScaledRMSNorm(nn.Module):
    """Llama's RMSNorm with a plain attribute its forward reads (1.0: the Llama formula)."""

    def __init__(self, n=16, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps
        self.scale = 1.0

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * (h * self.scale).to(x.dtype)


def test_what_a_proof_read_is_checked_again_on_each_call():
    """A dict a fused MLP's forward reads, changed in place, a field of the config it holds
    that its forward reads, or a plain attribute of an RMSNorm recognised by proof, changed
    after wrap: the module runs its own forward, which reads it (each ran the proved formula
    and differed from the unwrapped model before); put back, the fused or formula path runs
    again. Re-wrapping keeps the check. A config field the forward does not read (use_cache,
    as scripts set after loading) leaves the fusion on, and the config stays itself."""
    torch.manual_seed(0)
    plain = _randomize(nn.Sequential(ConfigGatedMlp(_MlpConfig()), ScaledRMSNorm()))
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(0))
    graph = lambda m: graph_nodes(m(x.clone().requires_grad_()))  # noqa: E731
    fused = {"GatedMlpFnBackward", "RMSNormFnBackward"}

    def change(m, kind, back=False):
        if kind == "dict":
            m[0].acts["act"] = "silu" if back else "gelu"
        elif kind == "config":
            m[0].config.gate_scale = 1.0 if back else 2.0
        else:
            m[1].scale = 1.0 if back else 2.0

    for rewrap in (False, True):
        wrapped = mesa_lite.wrap(copy.deepcopy(plain))
        if rewrap:
            wrapped = mesa_lite.wrap(wrapped, Config(group_size=64))
        assert isinstance(wrapped[0], GatedMlp) and isinstance(wrapped[1], RMSNorm)
        assert "__getattribute__" not in vars(_MlpConfig)  # the proof's recorder removed
        wrapped[0].config.use_cache = False
        assert fused <= graph(wrapped), graph(wrapped)
        for kind in ("dict", "config", "attribute"):
            for m in (plain, wrapped):
                change(m, kind)
            (y0, g0), (y1, g1) = _run(plain, x), _run(wrapped, x)
            assert_equal(y1, y0, f"forward with the {kind} changed")
            for n, a in g0.items():
                assert sqnr_db(a, g1[n]) >= 20.0, n  # per-op layers, 8 bits
            left = graph(wrapped)
            assert ("RMSNormFnBackward" in left) == (kind != "attribute"), (kind, left)
            assert ("GatedMlpFnBackward" in left) == (kind == "attribute"), (kind, left)
            for m in (plain, wrapped):
                change(m, kind, back=True)
            assert fused <= graph(wrapped), (kind, graph(wrapped))
        assert_equal(wrapped(x), plain(x), "forward, the proof's values back")


class _SharedAdapter(nn.Module):
    """An adapter layer (a ``base_layer`` Linear plus a low-rank update) whose down-projection
    ``a`` is one module shared with another adapter."""

    def __init__(self, base, a):
        super().__init__()
        self.base_layer, self.a, self.b = base, a, nn.Linear(4, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.b(self.a(x))


class _AdaptedGatedMlp(nn.Module):
    def __init__(self):
        super().__init__()
        a = nn.Linear(64, 4, bias=False)
        self.gate_proj = _SharedAdapter(nn.Linear(64, 128), a)
        self.up_proj = _SharedAdapter(nn.Linear(64, 128), a)
        self.down_proj, self.act_fn = nn.Linear(128, 64), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_a_sub_module_shared_by_two_children_keeps_its_tensors():
    """The probes swap every parameter for a random one and must put each back, also one
    reached under two names (review of issue 52: the second name restored the probe's
    tensor, so wrap replaced a trainable weight by random values); the MLP, recognised,
    runs the product path with the plain model's gradients within the floor."""
    torch.manual_seed(0)
    plain = nn.Sequential(_AdaptedGatedMlp())
    model = copy.deepcopy(plain)
    before = [(n, p, p.detach().clone()) for n, p in model.named_parameters()]
    mesa_lite.wrap(model)
    assert isinstance(model[0], GatedMlp)
    for (n, p, values), (n2, q) in zip(before, model.named_parameters(), strict=True):
        assert n == n2 and q is p and torch.equal(q, values), n
    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(1))
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    for (n, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert sqnr_db(p.grad, q.grad) >= 30, n


@pytest.mark.parametrize("exact", [False, True], ids=["int8", "debug_exact"])
def test_a_silu_mlp_takes_silus_kernels(exact, monkeypatch):
    """An MLP proved as ``Mlp`` with a SiLU rebuilds SiLU's output (fc2's input) and computes
    SiLU's backward in the dequantize kernel's SiLU epilogues, as GELU's; the gradients are
    plain's within the int8 floor, and bit for bit in debug_exact (review of issue 51)."""
    from mesa_lite.kernels import group_quant as gq

    kinds = []
    dequantize = gq.dequantize

    def spy(*args, epilogue=None, **kwargs):
        kinds.append(epilogue[0] if epilogue else "plain")
        return dequantize(*args, epilogue=epilogue, **kwargs)

    monkeypatch.setattr(gq, "dequantize", spy)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 64))
    model = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(debug_exact=exact))
    assert isinstance(model, Mlp)
    x = torch.randn(8, 10, 64, generator=torch.Generator().manual_seed(1))
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    if not exact:
        assert sorted(kinds) == ["plain", "silu", "silu_backward"], kinds
    for (n, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        if exact:
            assert_equal(q.grad, p.grad, n)
        else:
            assert sqnr_db(p.grad, q.grad) >= 30, n
