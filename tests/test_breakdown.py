"""memory_breakdown against hand-counted bytes, the activation estimate against the paper's
formula and against measurement, and the llm_memory command line on CPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import mesa_lite
from mesa_lite.breakdown import (
    estimate_activations,
    kept_total,
    korthikanti,
    memory_breakdown,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _chain(device="cpu", width=(16, 32, 8)):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width[0], width[1]), nn.ReLU(), nn.Linear(width[1], width[2])
    ).to(device)


def test_static_bytes_are_the_hand_counted_storages():
    model = _chain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    bd = memory_breakdown(model, lambda m: m(x).sum(), opt, steps=2)
    n_params = 16 * 32 + 32 + 32 * 8 + 8  # 808 fp32 elements in 4 tensors
    assert bd.parameters == 4 * n_params == 3232
    assert bd.gradients == 4 * n_params
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a 0-dim fp32 step counter per tensor
    assert bd.optimizer_state == 2 * 4 * n_params + 4 * 4 == 6480
    assert bd.static == 3232 + 3232 + 6480
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True) ran
    assert len(opt.state) == 4 and int(opt.state[model[0].weight]["step"]) == 2
    # without an optimizer: no state, and the gradients are set to None after the step
    bd = memory_breakdown(model, lambda m: m(x).sum(), steps=1)
    assert (bd.gradients, bd.optimizer_state) == (4 * n_params, 0)


def test_cpu_activations_are_the_unique_saved_storages_plus_the_loss():
    model = _chain()
    x = torch.randn(4, 16)
    bd = memory_breakdown(model, lambda m: m(x).sum())
    # the first Linear keeps x (4x16 fp32); ReLU keeps its output (4x32), which is also the
    # second Linear's input, counted once; the loss is a 0-dim fp32 tensor
    assert bd.activations == bd.saved_for_backward == 4 * 16 * 4 + 4 * 32 * 4 + 4 == 772
    acts, copies = mesa_lite.report.kept_bytes(model, x)
    assert (acts, copies) == (768, 0)
    assert (bd.peak, bd.backward_temporaries, bd.before_forward) == (None, None, None)
    d = bd.to_dict()
    assert d["activations"] == 772 and d["static"] == bd.static and d["device"] == "cpu"
    table = bd.table()
    assert "| activations kept at end of forward | 0.00 |" in table
    assert "| peak (max allocated, optimizer step included) | - |" in table


def test_wrapped_tiny_gpt2_keeps_fewer_activations():
    from mesa_lite.benchmarks import llm_memory

    config = llm_memory.make_config("tiny-gpt2")
    ids, labels = llm_memory.make_inputs(config, 2, 16, "cpu")
    kept = {}
    for mode in ("plain", "int8"):
        model = llm_memory.make_model("tiny-gpt2", mode, config=config)
        bd = memory_breakdown(model, lambda m: m(input_ids=ids, labels=labels).loss, steps=1)
        kept[mode] = bd.activations
    assert 0 < kept["int8"] < kept["plain"], kept


# h 64, 4 heads, 2 layers, s 8, b 2: sbh = 1024, as^2b = 512, bsV = 4096
SBH, AS2B, L = 1024, 512, 2


def _gpt2(**kw):
    return transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=256, **kw)


def test_korthikanti_on_a_hand_worked_example():
    paper = korthikanti(_gpt2(), batch=2, seq=8)
    # per layer 34*s*b*h + 5*a*s^2*b = 34*1024 + 5*512 = 37376
    assert paper == {"korthikanti": 2 * 37376, "simple_12hbsL": 12 * 64 * 2 * 8 * 2}


def test_gpt2_estimate_in_the_papers_setting_is_its_formula_term_by_term():
    """fp16 parameters and activations (no autocast casts), eager attention, dropout."""
    est = estimate_activations(_gpt2(), 2, 8, dtype_bytes=2, param_bytes=2, attention="eager")
    per_layer = {  # the paper's attention block, 11sbh + 5as^2b
        "attn.qkv_input": 2 * SBH,  # the QKV matmul's input
        "attn.qkv": 6 * SBH,  # Q and K for QK^T, V for the product with V
        "attn.softmax": 2 * AS2B,
        "attn.probs_dropout_mask": AS2B,
        "attn.probs": 2 * AS2B,  # the dropout output
        "attn.output": 2 * SBH,  # the output projection's input
        "attn.dropout_mask": SBH,
        "norm.inputs": 4 * SBH,  # two layernorms, 2sbh each
        "mlp.fc_input": 2 * SBH,
        "mlp.proj_input": 8 * SBH,
        "mlp.dropout_mask": SBH,
        # NewGELU keeps pow's input, tanh, 1 + tanh and 0.5x: 4 x 8sbh where the paper's
        # GeLU keeps its input, 8sbh
        "mlp.act": 32 * SBH,
    }
    for term, nbytes in per_layer.items():
        assert est[term] == L * nbytes, term
    attention = sum(v for k, v in est.items() if k.startswith("attn."))
    assert attention == L * (11 * SBH + 5 * AS2B) == 27648
    mlp = sum(v for k, v in est.items() if k.startswith("mlp."))
    assert mlp - L * 24 * SBH == L * 19 * SBH
    assert (
        attention + mlp - L * 24 * SBH + est["norm.inputs"]
        == korthikanti(_gpt2(), 2, 8)["korthikanti"]
    )
    assert "autocast.weight_copies" not in est and "transient.logits_fp32" not in est


def test_hf_terms_under_autocast_with_fp32_parameters():
    est = estimate_activations(_gpt2(), 2, 8)  # bf16 autocast, fp32 params, SDPA
    assert est["norm.inputs"] == L * 2 * 4 * SBH  # the residual stream is fp32
    assert est["attn.logsumexp"] == L * 4 * 4 * 2 * 8 and "attn.softmax" not in est
    assert est["mlp.act"] == L * (4 + 4 + 4 + 2) * 4 * SBH
    assert est["loss.log_softmax"] == est["transient.logits_fp32"] == 4 * 4096
    assert est["transient.logits"] == 2 * 4096
    assert est["autocast.weight_copies"] == 2 * (L * (4 * 64 * 64 + 2 * 64 * 256) + 256 * 64)
    assert est["attn.kv_cache_copies"] == L * 2 * 2 * SBH  # GPT-2's DynamicCache in training
    assert kept_total(est) == sum(est.values()) - 6 * 4096
    bert = transformers.BertConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, vocab_size=256)  # fmt: skip
    est = estimate_activations(bert, 2, 8)  # CrossEntropyLoss on the bf16 logits
    assert (est["loss.log_softmax"], est["loss.nll_input"]) == (2 * 4096, 4 * 4096)
    assert "transient.logits_fp32" not in est
    llama = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=256)  # fmt: skip
    est = estimate_activations(llama, 2, 8)
    assert est["attn.qkv"] == L * 2 * (SBH + 2 * SBH // 2)  # GQA: k and v are half width
    assert est["attn.qkv_input"] == L * 3 * 2 * SBH  # one bf16 cast per projection
    assert est["mlp.fc_output"] == L * 2 * 2 * 2 * 8 * 176  # gate and up
    assert not any("dropout" in k for k in est)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-bert"])
def test_fp32_estimate_matches_the_cpu_count(name):
    """Without autocast or dropout, eager attention: what the CPU forward saves for backward is
    the estimate, to the loss's two 0-dim tensors (the loss and nll_loss's total weight)."""
    from mesa_lite.benchmarks import llm_memory

    config = llm_memory.make_config(name)
    for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob",
                "attention_probs_dropout_prob"):  # fmt: skip
        if hasattr(config, key):
            setattr(config, key, 0.0)
    ids, labels = llm_memory.make_inputs(config, 2, 16, "cpu")
    model = llm_memory.make_model(name, "plain", "eager", config)
    bd = memory_breakdown(model, lambda m: m(input_ids=ids, labels=labels).loss, steps=1)
    est = estimate_activations(config, 2, 16, dtype_bytes=4, attention="eager")
    assert bd.activations - kept_total(est) == 8, est


def test_llm_memory_cli_on_cpu(tmp_path):
    from mesa_lite.benchmarks import llm_memory

    out = tmp_path / "lm"
    argv = "--device cpu --models tiny-gpt2 --modes plain int8 --steps 1 --warmup 0 --dtype fp32"
    argv += " --batch 2 --seq 16"
    rows = llm_memory.run(argv.split() + ["--out", str(out)])
    lines = [json.loads(s) for s in out.with_suffix(".jsonl").read_text().splitlines()]
    assert lines == json.loads(json.dumps(rows))
    plain, int8 = lines
    assert (plain["mode"], int8["mode"]) == ("plain", "int8")
    for r in lines:
        assert "error" not in r and r["peak_mib"] is None and r["step_ms"] > 0
        assert r["static_mib"] == pytest.approx(
            r["parameters_mib"] + r["gradients_mib"] + r["optimizer_mib"]
        )
        assert r["optimizer_mib"] > 2 * r["parameters_mib"] > 0
        assert r["step_ratio"] == pytest.approx(r["step_ms"] / plain["step_ms"])
    assert int8["activation_reduction"] == pytest.approx(plain["kept_mib"] / int8["kept_mib"])
    assert int8["activation_reduction"] > 1
    config = llm_memory.make_config("tiny-gpt2")
    est = estimate_activations(config, 2, 16, dtype_bytes=4)
    assert plain["estimate_mib"] == pytest.approx(kept_total(est) / 2**20)
    md = out.with_suffix(".md").read_text()
    assert "| tiny-gpt2 | int8 | 2 | 16 | fp32 |" in md and "not GPU memory" in md
    assert "| mlp.act |" in md and "| **measured: kept at end of forward** |" in md


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_allocation_agrees_with_the_saved_tensor_count():
    model = _chain("cuda", (1024, 4096, 1024))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(m):  # the input is made in forward, so that both counts include it
        return m(torch.randn(4096, 1024, device="cuda")).sum()

    bd = memory_breakdown(model, step, opt, steps=2)
    n_params = 1024 * 4096 + 4096 + 4096 * 1024 + 1024
    assert bd.parameters == bd.gradients == 4 * n_params
    assert bd.optimizer_state == 2 * 4 * n_params + 4 * 4
    assert bd.peak >= bd.before_forward + bd.activations
    assert bd.before_forward >= 3 * bd.parameters  # with exp_avg, exp_avg_sq; no grads
    assert bd.backward_temporaries > 0
    # x (16 MiB) and the ReLU output (64 MiB) are kept
    assert bd.saved_for_backward == 4096 * 1024 * 4 + 4096 * 4096 * 4 + 4
    assert abs(bd.activations - bd.saved_for_backward) <= 0.1 * bd.saved_for_backward
