"""memory_report: per-module bytes kept for backward, totals checked independently."""

import copy
import gc

import pytest
import torch
import torch.nn as nn
from conftest import saved_activation_bytes

import mesa_lite
from mesa_lite.report import plain_model, saved_bytes


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 256)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def test_totals_match_independent_count(capsys):
    torch.manual_seed(0)
    model = mesa_lite.wrap(nn.Sequential(Block(), Block()))
    x = torch.randn(4, 50, 64)
    report = mesa_lite.memory_report(model, x, print_table=True)
    printed = capsys.readouterr().out
    assert "total" in printed and "0.fc1" in printed and "GELU" in printed
    comp, _ = saved_activation_bytes(lambda: model(x), model.parameters())
    with plain_model(model):
        plain, _ = saved_activation_bytes(lambda: model(x), model.parameters())
    assert report.compressed_total == comp
    assert report.plain_total == plain
    assert sum(r.compressed_bytes for r in report.rows) == comp
    assert sum(r.plain_bytes for r in report.rows) == plain
    assert saved_bytes(model, x) == comp
    # GELU keeps its fp32 input in plain torch: 4*50*256*4 bytes; int8 codes + scales wrapped
    gelu = next(r for r in report.rows if r.name == "0.act")
    assert gelu.plain_bytes == 4 * 50 * 256 * 4
    assert gelu.compressed_bytes == 4 * 50 * 256 + (4 * 50 * 256 // 128) * 4
    by_kind = {r.name: r for r in report.by_kind()}
    assert by_kind["Linear"].plain_bytes == sum(
        r.plain_bytes for r in report.rows if r.kind == "Linear"
    )
    # one copy per tensor: fc1 rebuilds its input from the LayerNorm's codes, fc2 from GELU's
    assert all(r.compressed_bytes == 0 for r in report.rows if r.kind == "Linear")
    # one convention: reduction = plain / compressed, for the totals and for each row
    assert report.reduction == plain / comp
    assert 5.5 < report.reduction < 10
    assert gelu.reduction == gelu.plain_bytes / gelu.compressed_bytes
    assert not hasattr(report, "ratio")
    # the totals lead (issue 53), then the table by module type, then the per-module table
    lines = printed.splitlines()
    assert lines[0] == (
        f"activations kept for backward: {plain / 2**20:.2f} MiB plain, "
        f"{comp / 2**20:.2f} MiB wrapped ({plain / comp:.2f}x less)"
    ), lines[0]
    assert lines.index("by module type:") < lines.index("by module:")
    header = lines[lines.index("by module:") + 1].split()
    assert header[0] == "module" and header[-1] == "reduction" and "ratio" not in printed
    total = next(line for line in printed.splitlines() if line.startswith("total"))
    assert total.split()[-1] == f"{plain / comp:.2f}"
    # no autocast: no weight copies, and no weight-copy columns
    assert report.plain_weight_copy_total == report.compressed_weight_copy_total == 0
    assert "wcopy" not in printed


def test_report_restores_mode_and_specs():
    model = mesa_lite.wrap(Block()).eval()
    specs = [m.mesa_spec for m in mesa_lite.wrapped_modules(model).values()]
    mesa_lite.memory_report(model, torch.randn(2, 3, 64), print_table=False)
    assert not model.training
    assert [m.mesa_spec for m in mesa_lite.wrapped_modules(model).values()] == specs


def test_report_under_autocast():
    model = mesa_lite.wrap(Block())
    r = mesa_lite.memory_report(
        model, torch.randn(2, 30, 64), autocast=torch.bfloat16, print_table=False
    )
    assert r.plain_total > r.compressed_total > 0
    assert "total" in r.table(by_kind=True, top=2)


class Head(nn.Module):
    """Linear layers under bf16 autocast; the last one frozen (its weight cast has no grad_fn)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(256, 64)
        self.frozen = nn.Linear(64, 32).requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.fc2(self.act(self.fc1(x))))


def test_autocast_weight_copies_are_counted_apart(capsys):
    """Under autocast the plain Linear keeps the bf16 cast of its weight: a weight copy, not an
    activation; the reduction is on activations only."""
    torch.manual_seed(0)
    plain = Head()
    model = mesa_lite.wrap(copy.deepcopy(plain))
    x = torch.randn(3, 10, 64, requires_grad=True)  # fc1's input needs grad: its weight is kept
    report = mesa_lite.memory_report(model, x, autocast=torch.bfloat16, print_table=True)
    printed = capsys.readouterr().out
    weights = [plain.fc1.weight, plain.fc2.weight, plain.frozen.weight]
    assert report.plain_weight_copy_total == sum(w.numel() * 2 for w in weights)
    rows = {r.name: r for r in report.rows}
    for name in ("fc1", "fc2", "frozen"):
        assert rows[name].plain_weight_copy_bytes == getattr(plain, name).weight.numel() * 2
    # wrapped Linears keep their weight as the Parameter itself
    assert report.compressed_weight_copy_total == 0
    # activations, counted independently: everything kept except Parameters, less the copies
    n = x.numel() // 64

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)

    everything, _ = saved_activation_bytes(lambda: run(plain), plain.parameters())
    assert report.plain_total == everything - report.plain_weight_copy_total
    # bf16 casts: fc1's input, GELU's input, fc2's input (the frozen layer keeps no input)
    assert report.plain_total == n * (64 + 256 + 256) * 2
    comp, _ = saved_activation_bytes(lambda: run(model), model.parameters())
    assert report.compressed_total == comp
    assert report.reduction == report.plain_total / comp
    assert saved_bytes(model, x, autocast=torch.bfloat16) == comp
    assert saved_bytes(plain, x, autocast=torch.bfloat16) == everything
    assert saved_bytes(plain, x, autocast=torch.bfloat16, weight_copies=False) == (
        report.plain_total
    )
    assert "plain wcopy MiB" in printed and "not in the reduction" in printed


def test_cast_of_an_input_leaf_is_an_activation():
    """A cast of a leaf that is not a Parameter (the input, needing grad) is an activation,
    though its grad_fn is a ToCopyBackward0 of an AccumulateGrad too; even with the shape and
    values of the weight."""
    model = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    x_like_weight = model.weight.detach().clone().requires_grad_()
    for inp in (x, x_like_weight):
        # an unwrapped model: the report says so, and still counts the plain forward
        with pytest.warns(UserWarning, match="has no mesa_lite modules"):
            r = mesa_lite.memory_report(model, inp, autocast=torch.bfloat16, print_table=False)
        assert r.plain_weight_copy_total == 16 * 16 * 2
        assert r.plain_total == inp.numel() * 2


def _live_tensors() -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def test_report_frees_every_graph():
    """The forwards memory_report runs must not leave their graphs alive."""
    model = mesa_lite.wrap(nn.Sequential(Block(), nn.Softmax(-1)))
    x = torch.randn(2, 20, 64)
    mesa_lite.memory_report(model, x, print_table=False)
    before = _live_tensors()
    for _ in range(3):
        mesa_lite.memory_report(model, x, print_table=False)
        saved_bytes(model, x)
    assert _live_tensors() <= before


def test_table_marks_rows_that_keep_nothing_of_their_own():
    """A row that keeps nothing (its input's codes are its producer's) reads "shared", not a
    reduction, and one that keeps under 1% reads ">100"; the table says what both mean, and
    prints neither note when no row needs it."""
    from mesa_lite.report import MemoryReport, ModuleRow

    rows = [ModuleRow("norm", "LayerNorm", 1000, 250), ModuleRow("head", "Linear", 800, 0),
            ModuleRow("big", "Linear", 100_000, 10)]  # fmt: skip
    text = MemoryReport(rows, 101_800, 260).table()
    by_name = {line.split()[0]: line.split() for line in text.splitlines() if line}
    assert by_name["norm"][-1] == "4.00"
    assert by_name["head"][-1] == "shared" and by_name["big"][-1] == ">100"
    assert "shared: keeps nothing of its own" in text and "reduction >100:" in text
    plain_only = MemoryReport(rows[:1], 1000, 250).table()
    assert "shared:" not in plain_only and ">100:" not in plain_only


def test_report_prints_only_when_asked_and_compares_with_the_unwrapped_model(capsys):
    """Plain is the model the user started from: with mesa_lite's checkpointing on, the plain
    column keeps what the unwrapped model keeps (not the checkpointed one's inputs), and the
    report prints nothing unless asked (``print(report)`` gives the table)."""
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Block(), Block())
    x = torch.randn(4, 50, 64)
    unwrapped, _ = saved_activation_bytes(lambda: plain(x), plain.parameters())
    model = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(checkpoint="blocks"))
    capsys.readouterr()
    report = mesa_lite.memory_report(model, x)
    assert capsys.readouterr().out == ""
    assert report.plain_total == unwrapped
    kept, _ = saved_activation_bytes(lambda: model(x), model.parameters())
    assert report.compressed_total == kept < unwrapped / 4
    # one row per checkpointed block (found by review: the plain bytes sat on its layers,
    # each marked "shared", and the block row read 0.00 plain); the last block is not
    # checkpointed ("blocks" leaves it: it would save nothing), its layers have their rows
    units = [n for n, m in model.named_modules() if m.__dict__.get("_mesa_ckpt_spec")]
    assert units == ["0", "1"]
    names = [r.name for r in report.rows]
    assert not [n for n in names if n.startswith(("0.", "1."))], names
    for r in report.rows:
        if r.name in units:
            assert r.plain_bytes > 4 * r.compressed_bytes > 0, r
    print(report)
    out = capsys.readouterr().out
    assert "total" in out, out
    per_module = out[out.index("by module:") :]
    shared = [line.split()[0] for line in per_module.splitlines() if line.endswith(" shared")]
    assert shared == ["2.fc1", "2.fc2"], out  # the wrapped, not checkpointed, block's
    # the checkpointing is back on after the report
    assert saved_activation_bytes(lambda: model(x), model.parameters())[0] == kept


def test_memory_breakdown_prints_as_a_table_in_mib():
    from mesa_lite.breakdown import memory_breakdown

    torch.manual_seed(0)
    model = mesa_lite.wrap(nn.Sequential(Block()))
    x = torch.randn(2, 10, 64)
    bd = memory_breakdown(model, lambda m: m(x).float().pow(2).mean(), None)
    text = str(bd)
    assert "MiB" in text and "parameters" in text and "bytes" not in text
    assert f"{bd.parameters / 2**20:.2f}" in text
    # on a CPU the CUDA-only rows read "-", and the table says why (issue 53)
    dashes = [line for line in text.splitlines() if line.endswith("| - |")]
    assert len(dashes) == 4, text
    assert text.splitlines()[-1].startswith("-: not measured on cpu: the allocator's counters")


def test_report_measures_fused_blocks_as_they_train():
    """A model with a fused gated MLP: the report's compressed column is what the model keeps
    as it trains (module hooks made the fused block give way to its per-op layers, and the
    report showed 2.2x what a wrapped Llama keeps), with the MLP's bytes on the block's row."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_recognize import TinyDecoderLayer

    from mesa_lite.recognize import GatedMlp

    torch.manual_seed(0)
    plain = nn.Sequential(TinyDecoderLayer(64), TinyDecoderLayer(64))
    x = torch.randn(2, 32, 64)
    unwrapped, _ = saved_activation_bytes(lambda: plain(x.requires_grad_()), plain.parameters())
    model = mesa_lite.wrap(copy.deepcopy(plain))
    assert sum(isinstance(m, GatedMlp) for m in model.modules()) == 2
    kept, _ = saved_activation_bytes(lambda: model(x), model.parameters())
    report = mesa_lite.memory_report(model, x)
    assert report.compressed_total == kept
    assert report.plain_total == unwrapped
    rows = {r.name: r for r in report.rows}
    assert rows["0.feed_forward"].compressed_bytes > 0
    inside = [r for n, r in rows.items() if n.startswith("0.feed_forward.")]
    assert inside and all(r.compressed_bytes == 0 < r.plain_bytes for r in inside), inside


def test_report_plain_column_uses_the_models_own_loss():
    """A causal LM called with labels: the plain column runs transformers' own loss (it kept the
    chunked one on, and read 16.7% short of the unwrapped model under bf16)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4)  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 512, (2, 24))
    unwrapped, _ = saved_activation_bytes(
        lambda: plain(input_ids=ids, labels=ids).loss, plain.parameters()
    )
    model = mesa_lite.wrap(copy.deepcopy(plain))
    kept, _ = saved_activation_bytes(lambda: model(input_ids=ids, labels=ids).loss,
                                     model.parameters())  # fmt: skip
    report = mesa_lite.memory_report(model, input_ids=ids, labels=ids)
    assert report.plain_total == unwrapped
    assert report.compressed_total == kept < unwrapped
    # the chunked loss is back on after the report
    assert saved_activation_bytes(lambda: model(input_ids=ids, labels=ids).loss,
                                  model.parameters())[0] == kept  # fmt: skip
