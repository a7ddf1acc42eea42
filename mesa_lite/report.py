"""``memory_report``: what one forward keeps for backward, per module, plain vs compressed.

Bytes are counted through ``torch.autograd.graph.saved_tensors_hooks``: each storage kept for
backward is counted once, for the innermost module running when it was first saved. Storages
of Parameters are left out (they exist with or without training). This is what a forward keeps
alive until backward; a GPU's peak also holds backward's temporaries, which this does not see.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn as nn

__all__ = ["MemoryReport", "ModuleRow", "memory_report", "saved_bytes", "plain_model"]


@dataclasses.dataclass
class ModuleRow:
    name: str
    kind: str
    plain_bytes: int
    compressed_bytes: int


@dataclasses.dataclass
class MemoryReport:
    """Per-module bytes kept for backward by one forward.

    Attributes:
        rows: one per module that kept anything, in forward order.
        plain_total: bytes kept with every mesa_lite module running as plain torch.
        compressed_total: bytes kept as the model is wrapped.
    """

    rows: list[ModuleRow]
    plain_total: int
    compressed_total: int

    @property
    def ratio(self) -> float:
        """compressed / plain (1.0 when the plain forward keeps nothing)."""
        return self.compressed_total / self.plain_total if self.plain_total else 1.0

    def by_kind(self) -> list[ModuleRow]:
        """Rows summed by module type, largest compressed bytes first."""
        acc: dict[str, ModuleRow] = {}
        for r in self.rows:
            row = acc.setdefault(r.kind, ModuleRow(r.kind, r.kind, 0, 0))
            row.plain_bytes += r.plain_bytes
            row.compressed_bytes += r.compressed_bytes
        return sorted(acc.values(), key=lambda r: -r.compressed_bytes)

    def table(self, by_kind: bool = False, top: int | None = None) -> str:
        """A profiler-style text table (MiB)."""
        rows = self.by_kind() if by_kind else self.rows
        if top is not None:
            rows = sorted(rows, key=lambda r: -r.compressed_bytes)[:top]
        head = "module type" if by_kind else "module"
        width = max([len(head), len("total")] + [len(r.name or "(root)") for r in rows])
        lines = [
            f"{head:<{width}}  {'type':<16} {'plain MiB':>10} {'mesa MiB':>10} {'ratio':>7}",
            "-" * (width + 48),
        ]
        for r in rows:
            ratio = f"{r.compressed_bytes / r.plain_bytes:.2f}" if r.plain_bytes else "-"
            lines.append(
                f"{r.name or '(root)':<{width}}  {r.kind[:16]:<16} {r.plain_bytes / 2**20:>10.2f} "
                f"{r.compressed_bytes / 2**20:>10.2f} {ratio:>7}"
            )
        lines.append("-" * (width + 48))
        lines.append(
            f"{'total':<{width}}  {'':<16} {self.plain_total / 2**20:>10.2f} "
            f"{self.compressed_total / 2**20:>10.2f} {self.ratio:>7.2f}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@contextlib.contextmanager
def plain_model(model: nn.Module) -> Iterator[nn.Module]:
    """Runs every mesa_lite module of ``model`` as plain torch inside the block."""
    from mesa_lite.modules import MesaModule  # report depends on nothing else of mesa_lite

    saved = {m: m.mesa_spec for m in model.modules() if isinstance(m, MesaModule)}
    try:
        for m in saved:
            m.mesa_spec = None
        yield model
    finally:
        for m, spec in saved.items():
            m.mesa_spec = spec


def _attribute(model: nn.Module, fn) -> tuple[dict[str, int], int, object]:
    """Runs ``fn()`` and returns ({module name: bytes first saved inside it}, total, result)."""
    names = {m: n for n, m in model.named_modules()}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []
    seen: dict[int, tuple[str, int]] = {}

    def pre(m, _args):
        stack.append(names[m])

    def post(m, _args, _out):
        stack.pop()

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in skip and key not in seen:
            seen[key] = (stack[-1] if stack else "", st.nbytes())
        # detach: returning a saved output itself would tie it to its own grad_fn, a reference
        # cycle through C++ that Python's GC cannot see, and leak the whole graph
        return t.detach()

    handles = [m.register_forward_pre_hook(pre) for m in names]
    handles += [m.register_forward_hook(post, always_call=True) for m in names]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    finally:
        for h in handles:
            h.remove()
    per: dict[str, int] = {}
    for name, nbytes in seen.values():
        per[name] = per.get(name, 0) + nbytes
    return per, sum(per.values()), out


def saved_bytes(model: nn.Module, *inputs, autocast: torch.dtype | None = None, **kwargs) -> int:
    """Bytes one training-mode forward of ``model`` keeps for backward (Parameters excluded)."""
    _, total, _ = _attribute(model, lambda: _forward(model, inputs, kwargs, autocast))
    return total


def _forward(model, inputs, kwargs, autocast):
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        return model(*inputs, **kwargs)


def memory_report(
    model: nn.Module,
    *example_inputs,
    autocast: torch.dtype | None = None,
    print_table: bool = True,
    **kwargs,
) -> MemoryReport:
    """Runs one training-mode forward plain and one compressed; reports bytes kept per module.

    Args:
        model: a (wrapped) model; it is put in train mode for the two forwards and restored.
        example_inputs: positional inputs of the forward (kwargs are passed on too).
        autocast: run the forwards under ``torch.autocast`` with this dtype.
        print_table: print the per-module table and the summary by module type.

    Returns:
        A MemoryReport (``str(report)`` is the table).
    """
    was_training = model.training
    model.train()
    try:
        with plain_model(model):
            plain, plain_total, out = _attribute(
                model, lambda: _forward(model, example_inputs, kwargs, autocast)
            )
        del out
        comp, comp_total, out = _attribute(
            model, lambda: _forward(model, example_inputs, kwargs, autocast)
        )
        del out
    finally:
        model.train(was_training)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    order = [n for n, _ in model.named_modules() if n in plain or n in comp]
    rows = [ModuleRow(n, kinds[n], plain.get(n, 0), comp.get(n, 0)) for n in order]
    report = MemoryReport(rows, plain_total, comp_total)
    if print_table:
        print(report.table())
        print()
        print(report.table(by_kind=True))
    return report
