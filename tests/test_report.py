"""memory_report: per-module bytes kept for backward, totals checked independently."""

import gc

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
    report = mesa_lite.memory_report(model, x)
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
    assert 0.1 < report.ratio < 0.18


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
