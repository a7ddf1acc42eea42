"""Shared codes under torch.compile (issue 52, item 2): the fused attention's output codes
serve Hugging Face's output projection, and the norms and activations inside a Hugging Face
block that ``after_wrap`` marks serve that block's next layers, while Dynamo traces
(``ops.common.shared_output``), as the registry makes them do in eager mode; an in-place change
of such an output is refused, never silently kept stale. Other norm and activation outputs are
not shared under compile (they are changed in place in real code), and in-place ops on them
keep working."""

import copy

import pytest
import torch
import torch.nn as nn
from conftest import sqnr_db, tiny_lm_config

import mesa_lite

tf = pytest.importorskip("transformers")

MODELS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}


def _lm(family: str):
    torch.manual_seed(0)
    cls = getattr(tf, MODELS[family])
    return mesa_lite.wrap(cls._from_config(tiny_lm_config(family), attn_implementation="sdpa"))


def _batch():
    # 2 x 64 tokens: at least 2 x hidden (64), so the causal LMs' head is fused with the loss
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _codes_and_grads(model, batch):
    """The number of distinct int8 code storages saved for backward, and the gradients."""
    model.zero_grad(set_to_none=True)
    seen: set[int] = set()

    def pack(t):
        if t.dtype in (torch.int8, torch.uint8):
            seen.add(t.untyped_storage().data_ptr())
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
    loss.backward()
    names = {n.removeprefix("_orig_mod."): p for n, p in model.named_parameters()}
    return len(seen), {n: p.grad.clone() for n, p in names.items()}


# the code tensors compiled keeps beyond eager's, per 2-layer model: none for GPT-2 and Llama;
# BERT's layer output LayerNorms (the layers' outputs, which transformers returns: not
# marked) are kept again by the next layer's q/k/v and the head's transform, and its
# embeddings' plain nn.Dropout(p=0) returns its input itself in eager mode but a new tensor
# under compile
EXTRA = {"gpt2": 0, "llama": 0, "bert": 4}


@pytest.mark.parametrize("family", MODELS)
def test_compiled_keeps_the_code_tensors_eager_keeps(family):
    """Counted on a 2-layer model (aot_eager, bf16 autocast): compiled keeps eager's code
    tensors plus ``EXTRA`` (before the attention output: 2 more each; before the marked norms
    and activations: 4 more for GPT-2 and Llama, 8 for BERT); the gradients are eager mode's,
    GPT-2's bit for bit (the same codes), the others' within int8's rounding."""
    torch._dynamo.reset()
    batch = _batch()
    eager = _lm(family).train()
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True,
                             dynamic=False)  # fmt: skip
    n_eager, g_eager = _codes_and_grads(eager, batch)
    n_compiled, g_compiled = _codes_and_grads(compiled, batch)
    assert n_compiled == n_eager + EXTRA[family], (n_compiled, n_eager)
    assert g_compiled.keys() == g_eager.keys()
    if family == "gpt2":  # (Llama's grouped k/v heads: torch 2.11 sums their grads otherwise)
        for n, g in g_eager.items():
            assert torch.equal(g, g_compiled[n]), n
    for n, g in g_eager.items():
        if g.norm() > 1e-3 * max(t.norm() for t in g_eager.values()):  # (not ~0 in exact math)
            assert sqnr_db(g, g_compiled[n]) > 30, (n, sqnr_db(g, g_compiled[n]))


class NormThenLinear(nn.Module):
    """A LayerNorm's output changed in place before the Linear that takes it."""

    def __init__(self):
        super().__init__()
        self.fc0, self.norm, self.fc1 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        h = self.norm(self.fc0(x))
        h.mul_(2.0)
        return self.fc1(h)


@pytest.mark.parametrize(
    "case", ["in-place after the norm", "in-place ReLU module", "in-place on the output"]
)
def test_in_place_ops_on_compiled_norm_outputs_work(case):
    """A compiled norm's output can be changed in place (by user code, by mesa_lite's own
    in-place ReLU, by the caller on a model's last output), as in eager mode: the consumer
    keeps its own codes; the gradients are eager mode's within int8."""
    torch._dynamo.reset()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    if case == "in-place ReLU module":
        plain = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(inplace=True),
                              nn.Linear(32, 8))  # fmt: skip
    elif case == "in-place on the output":
        plain = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32))
    else:
        plain = NormThenLinear()
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    compiled = torch.compile(copy.deepcopy(wrapped), backend="aot_eager")
    grads = []
    for model in (plain, wrapped, compiled):
        model.zero_grad(set_to_none=True)
        y = model(x)
        if case == "in-place on the output":
            y.mul_(2.0)
        # a fixed weighting: the sum of a LayerNorm's squared outputs is a constant
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for want, got_eager, got in zip(*grads, strict=True):
        assert sqnr_db(want, got_eager) > 30 and sqnr_db(want, got) > 30


def test_an_in_place_change_of_a_compiled_attention_output_is_refused():
    """Under torch.compile the fused attention's output carries its codes for the output
    projection and is a view autograd refuses to change in place: PyTorch's error, not codes
    of the tensor before the change (eager mode sees the change through the version counter
    and takes it)."""
    from mesa_lite.ops.attention import scaled_dot_product_attention

    spec = mesa_lite.QuantSpec(8, 128, "nearest")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        out = scaled_dot_product_attention(q, k, v, spec=spec)
        out.mul_(2.0)
        return out

    f(q, k, v).sum().backward()  # eager: fine
    torch._dynamo.reset()
    with pytest.raises(Exception, match="modified inplace"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v).sum().backward()


def test_an_in_place_change_of_a_marked_norm_output_is_refused():
    """A forward hook that changes GPT-2's ln_1 output in place (transformers itself never
    does): PyTorch's error under compile, never the codes of the output before the change;
    eager mode takes the change through the version counter, and a hook that returns a new
    tensor works in both."""
    batch = _batch()
    model = _lm("gpt2").train()
    ln_1 = model.transformer.h[0].ln_1
    assert ln_1.mesa_share_traced and not model.transformer.ln_f.mesa_share_traced
    handle = ln_1.register_forward_hook(lambda m, a, out: out.mul_(2.0))
    model(**batch).loss.backward()  # eager: fine
    torch._dynamo.reset()
    with pytest.raises(Exception, match="modified inplace"):
        torch.compile(model, backend="aot_eager")(**batch).loss.backward()
    handle.remove()
    ln_1.register_forward_hook(lambda m, a, out: out * 2.0)
    torch._dynamo.reset()
    torch.compile(model, backend="aot_eager")(**batch).loss.backward()


def test_an_in_place_change_across_a_graph_break_is_refused_or_taken():
    """The same change in a hook with a graph break before it: torch 2.14 hands the next graph
    the protected view (PyTorch's error); torch 2.11 a plain tensor, whose codes the consumer
    then does not take (its own copy: the gradients of the changed output). Never stale."""
    batch = _batch()
    torch.manual_seed(0)
    plain = tf.GPT2LMHeadModel._from_config(tiny_lm_config("gpt2"), attn_implementation="sdpa")
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))

    def hook(module, args, out):
        torch._dynamo.graph_break()
        out.mul_(2.0)

    for m in (plain, wrapped):
        m.transformer.h[0].ln_1.register_forward_hook(hook)
    _, want = _codes_and_grads(plain, batch)
    torch._dynamo.reset()
    try:
        _, got = _codes_and_grads(torch.compile(wrapped, backend="aot_eager"), batch)
    except Exception as e:  # noqa: BLE001 - Dynamo wraps PyTorch's error in its own types
        assert "modified inplace" in str(e), e
        return
    w = "transformer.h.0.attn.c_attn.weight"
    assert sqnr_db(want[w], got[w]) > 30, sqnr_db(want[w], got[w])


def test_a_compiled_bert_s_returned_states_stay_writable():
    """BERT's layer outputs (its output LayerNorms, not marked) are returned to the caller, who
    may change them in place under compile as in eager mode."""
    torch._dynamo.reset()
    model = _lm("bert").train()
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(**_batch(), output_hidden_states=True)
    last = out.hidden_states[-1]
    last.mul_(2.0)
    (out.loss + last.sum()).backward()
    assert all(p.grad is not None for p in model.bert.encoder.parameters())


def test_unwrap_clears_the_marks():
    model = _lm("llama")
    layer = model.model.layers[0]
    assert layer.input_layernorm.mesa_share_traced
    mesa_lite.unwrap(model)
    assert "mesa_share_traced" not in vars(layer.input_layernorm)
