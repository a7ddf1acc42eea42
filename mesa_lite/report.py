"""``memory_report``: what one forward keeps for backward, per module, plain vs compressed.

Bytes are counted through ``torch.autograd.graph.saved_tensors_hooks``: each storage kept for
backward is counted once, for the innermost module running when it was first saved. Storages
of Parameters are left out (they exist with or without training). Casts of Parameters kept for
backward (under autocast, e.g. the bf16 copy of a Linear weight) are counted apart from the
activations, as weight copies: they do not grow with the batch, and counted as activations they
made a small batch's reduction look many times better than the activations' own. This is what
a forward keeps alive until backward; a GPU's peak also holds backward's temporaries, which
this does not see.

One convention throughout: reduction = plain / compressed (2.0: half the bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import torch
import torch.nn as nn

__all__ = ["MemoryReport", "ModuleRow", "kept_bytes", "memory_report", "saved_bytes", "plain_model"]


def _reduction(plain: int, compressed: int) -> float:
    """plain / compressed: 1.0 when neither keeps anything, inf when only plain does."""
    if compressed:
        return plain / compressed
    return float("inf") if plain else 1.0


@dataclasses.dataclass
class ModuleRow:
    """Bytes one module kept for backward (first saved while it was the innermost running).

    Attributes:
        name: the module's name in ``model.named_modules()`` (``""`` for the root), or its type
            name in ``MemoryReport.by_kind``.
        kind: the module's type name.
        plain_bytes: activations kept with every mesa_lite module running as plain torch.
        compressed_bytes: activations kept as the model is wrapped.
        plain_weight_copy_bytes: autocast's low-precision copies of Parameters kept, plain.
        compressed_weight_copy_bytes: the same, as the model is wrapped.
    """

    name: str
    kind: str
    plain_bytes: int
    compressed_bytes: int
    plain_weight_copy_bytes: int = 0
    compressed_weight_copy_bytes: int = 0

    @property
    def reduction(self) -> float:
        """plain_bytes / compressed_bytes (inf when the wrapped module keeps nothing)."""
        return _reduction(self.plain_bytes, self.compressed_bytes)


@dataclasses.dataclass
class MemoryReport:
    """Per-module bytes kept for backward by one forward.

    Activations and weight copies are counted apart. A weight copy is a saved tensor that is
    a cast of a Parameter: under autocast the plain ops keep the low-precision cast of their
    weights (e.g. the bf16 copy of a Linear weight), which is neither an activation nor a
    Parameter storage and does not grow with the batch. Reductions are on activations only.

    Attributes:
        rows: one per module that kept anything, in forward order.
        plain_total: activation bytes kept with every mesa_lite module running as plain torch.
        compressed_total: activation bytes kept as the model is wrapped.
        plain_weight_copy_total: weight-copy bytes kept, plain.
        compressed_weight_copy_total: weight-copy bytes kept, wrapped.
    """

    rows: list[ModuleRow]
    plain_total: int
    compressed_total: int
    plain_weight_copy_total: int = 0
    compressed_weight_copy_total: int = 0

    @property
    def reduction(self) -> float:
        """plain_total / compressed_total: how many times fewer activation bytes are kept
        (1.0 when the plain forward keeps nothing, inf when only it keeps something)."""
        return _reduction(self.plain_total, self.compressed_total)

    def by_kind(self) -> list[ModuleRow]:
        """Rows summed by module type, largest compressed bytes first."""
        acc: dict[str, ModuleRow] = {}
        for r in self.rows:
            row = acc.setdefault(r.kind, ModuleRow(r.kind, r.kind, 0, 0))
            row.plain_bytes += r.plain_bytes
            row.compressed_bytes += r.compressed_bytes
            row.plain_weight_copy_bytes += r.plain_weight_copy_bytes
            row.compressed_weight_copy_bytes += r.compressed_weight_copy_bytes
        return sorted(acc.values(), key=lambda r: -r.compressed_bytes)

    def table(self, by_kind: bool = False, top: int | None = None) -> str:
        """A profiler-style text table (MiB); "reduction" is plain / mesa, activations only.

        Weight-copy columns appear when either forward kept weight copies.
        """
        rows = self.by_kind() if by_kind else self.rows
        if top is not None:
            rows = sorted(rows, key=lambda r: -r.compressed_bytes)[:top]
        copies = bool(self.plain_weight_copy_total or self.compressed_weight_copy_total)
        head = "module type" if by_kind else "module"
        width = max([len(head), len("total")] + [len(r.name or "(root)") for r in rows])
        kind_width = 0 if by_kind else max([len("type")] + [len(r.kind) for r in rows])
        cols = f"{'plain MiB':>10} {'mesa MiB':>10} {'reduction':>9}"
        if copies:
            cols += f" {'plain wcopy MiB':>15} {'mesa wcopy MiB':>14}"
        rule = "-" * (width + 2 + (kind_width + 1 if kind_width else 0) + len(cols))

        marks: set[str] = set()

        def line(r: ModuleRow) -> str:
            plain, comp = r.plain_bytes, r.compressed_bytes
            if not (plain or comp):
                red = "-"
            elif comp == 0:  # its input's codes are kept (and counted) by its producer
                red = "shared"
            elif comp * 100 < plain:
                red = ">100"
            else:
                red = f"{r.reduction:.2f}"
            marks.add(red)
            kind = f"{r.kind:<{kind_width}} " if kind_width else ""
            text = f"{r.name:<{width}}  {kind}{plain / 2**20:>10.2f} {comp / 2**20:>10.2f} {red:>9}"
            if copies:
                text += (
                    f" {r.plain_weight_copy_bytes / 2**20:>15.2f}"
                    f" {r.compressed_weight_copy_bytes / 2**20:>14.2f}"
                )
            return text

        type_head = f"{'type':<{kind_width}} " if kind_width else ""
        lines = [f"{head:<{width}}  {type_head}{cols}", rule]
        lines += [line(dataclasses.replace(r, name=r.name or "(root)")) for r in rows]
        lines.append(rule)
        total = ModuleRow(
            "total", "", self.plain_total, self.compressed_total,
            self.plain_weight_copy_total, self.compressed_weight_copy_total,
        )  # fmt: skip
        lines.append(line(total))
        if "shared" in marks:
            lines.append(
                "shared: keeps nothing of its own; it reuses the codes of its input that the "
                "layer producing it keeps (counted there)"
            )
        if ">100" in marks:
            lines.append("reduction >100: keeps less than 1% of what the plain layer keeps")
        if copies:
            lines.append(
                "wcopy: autocast's low-precision casts of Parameters kept for backward; "
                "not in the reduction"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        """The totals in two lines: activations plain and wrapped with the reduction, and the
        autocast weight copies where there are any."""
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        lines = [
            f"activations kept for backward: {mib(self.plain_total)} plain, "
            f"{mib(self.compressed_total)} wrapped ({self.reduction:.2f}x less)"
        ]
        if self.plain_weight_copy_total or self.compressed_weight_copy_total:
            lines.append(
                f"autocast weight copies kept: {mib(self.plain_weight_copy_total)} plain, "
                f"{mib(self.compressed_weight_copy_total)} wrapped (not in the reduction)"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        """The summary, the table by module type, then the per-module table."""
        parts = [self.summary(), "by module type:\n" + self.table(by_kind=True)]
        return "\n\n".join([*parts, "by module:\n" + self.table()])


@contextlib.contextmanager
def plain_model(model: nn.Module) -> Iterator[nn.Module]:
    """Runs ``model`` as the unwrapped model would run inside the block: every mesa_lite
    module as plain torch, the language models' own loss instead of the chunked one, and
    checkpointing by ``Config(checkpoint=...)`` or a plan off (fused blocks then run their own
    forward, as their layers' settings are gone)."""
    from mesa_lite.checkpoint import checkpointed  # imported when used, as the modules are
    from mesa_lite.modules import MesaModule

    # a mesa_lite module, or the loss wrap set on a language model (integrations/transformers)
    saved = {m: m.mesa_spec for m in model.modules() if isinstance(m, MesaModule)}
    losses = [m.__dict__["_mesa_loss"] for m in model.modules() if "_mesa_loss" in m.__dict__]
    saved.update((loss, loss.mesa_spec) for loss in losses)
    ckpt = {m: m.__dict__["_mesa_ckpt_spec"] for _, m in checkpointed(model)}
    try:
        for m in saved:
            m.mesa_spec = None
        for m in ckpt:
            m.__dict__["_mesa_ckpt_spec"] = None
        yield model
    finally:
        for m, spec in saved.items():
            m.mesa_spec = spec
        for m, spec in ckpt.items():
            m.__dict__["_mesa_ckpt_spec"] = spec


def _weight_copy_test(model: nn.Module):
    """A predicate: is a saved tensor (or the tensor it views) a cast of one of ``model``'s
    Parameters?

    A cast of a Parameter that requires grad is recognized by its grad_fn: a
    ``ToCopyBackward0`` whose one input is that Parameter's ``AccumulateGrad``. A cast with no
    grad_fn (of a frozen Parameter, or saved by a compiled graph) is recognized by shape,
    device and values: equal to ``p.to(t.dtype)`` for a Parameter ``p`` of another dtype (so a
    saved tensor that does not need grad and equals such a cast bit for bit would be taken
    for one).
    """
    params = list(model.parameters())
    storages = {p.untyped_storage().data_ptr() for p in params}
    floating = [p for p in params if p.is_floating_point()]

    def is_copy(t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is not None:
            if fn.name() != "ToCopyBackward0" or len(fn.next_functions) != 1:
                return False
            var = getattr(fn.next_functions[0][0], "variable", None)
            return var is not None and var.untyped_storage().data_ptr() in storages
        if base.requires_grad or not base.is_floating_point():
            return False
        return any(
            p.shape == base.shape
            and p.device == base.device
            and p.dtype != base.dtype
            and _cast_equal(p, base)
            for p in floating
        )

    return is_copy


def _cast_equal(p: torch.Tensor, t: torch.Tensor) -> bool:
    """``p.to(t.dtype)`` equals ``t``; the first elements first, as many frozen weights (a LoRA
    model's) share one shape."""
    head = min(t.numel(), 64)
    p, flat = p.detach(), t.reshape(-1)
    if not torch.equal(p.reshape(-1)[:head].to(t.dtype), flat[:head]):
        return False
    return torch.equal(p.to(t.dtype), t)


@contextlib.contextmanager
def _module_stack(model: nn.Module, stack: list[str]) -> Iterator[None]:
    """While inside, ``stack`` holds the names of ``model``'s modules being called, innermost
    last. Tracked through ``nn.Module.__call__``, not hooks: a module hook would make a fused
    block give way to its per-op layers (``modules.plain_modules``), so the report would
    measure another path than the model trains with."""
    names = {m: n for n, m in model.named_modules()}
    call = nn.Module.__call__

    def tracked(self, *args, **kwargs):
        name = names.get(self)
        if name is None:
            return call(self, *args, **kwargs)
        stack.append(name)
        try:
            return call(self, *args, **kwargs)
        finally:
            stack.pop()

    nn.Module.__call__ = tracked
    try:
        yield
    finally:
        nn.Module.__call__ = call


def _attribute(
    model: nn.Module, fn, per_module: bool = True
) -> tuple[dict[str, list[int]], int, int, object]:
    """Runs ``fn()`` and returns ({module name: [activation bytes, weight-copy bytes] first
    saved inside it}, activation total, weight-copy total, result).

    ``per_module``: attribute bytes to the innermost module being called (``_module_stack``;
    a fused block's bytes to the block); False counts under the root's name. Either way the
    model runs as it does untouched."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    is_copy = _weight_copy_test(model)
    stack: list[str] = []
    seen: dict[int, tuple[str, int, bool]] = {}

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in skip and key not in seen:
            seen[key] = (stack[-1] if stack else "", st.nbytes(), is_copy(t))
        # detach: returning a saved output itself would tie it to its own grad_fn, a reference
        # cycle through C++ that Python's GC cannot see, and leak the whole graph
        return t.detach()

    tracking = _module_stack(model, stack) if per_module else contextlib.nullcontext()
    with tracking, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    per: dict[str, list[int]] = {}
    for name, nbytes, copy in seen.values():
        per.setdefault(name, [0, 0])[copy] += nbytes
    acts = sum(v[0] for v in per.values())
    copies = sum(v[1] for v in per.values())
    return per, acts, copies, out


def saved_bytes(
    model: nn.Module,
    *inputs,
    autocast: torch.dtype | None = None,
    weight_copies: bool = True,
    **kwargs,
) -> int:
    """Bytes one training-mode forward of ``model`` keeps for backward (Parameters excluded).

    Args:
        model: the model, run as it is (wrapped or not).
        inputs: positional inputs of the forward (kwargs are passed on too).
        autocast: run the forward under ``torch.autocast`` with this dtype.
        weight_copies: count autocast's low-precision copies of Parameters kept for backward
            (what the forward keeps alive); False counts activations only, as
            ``MemoryReport.compressed_total`` does.

    Returns:
        Bytes of the unique storages kept.
    """
    acts, copies = kept_bytes(model, *inputs, autocast=autocast, **kwargs)
    return acts + copies if weight_copies else acts


def kept_bytes(
    model: nn.Module, *inputs, autocast: torch.dtype | None = None, **kwargs
) -> tuple[int, int]:
    """(activations, autocast weight copies): the two parts of ``saved_bytes``, from one
    training-mode forward."""
    run = lambda: _forward(model, inputs, kwargs, autocast)  # noqa: E731
    _, acts, copies, _ = _attribute(model, run, per_module=False)
    return acts, copies


def _forward(model, inputs, kwargs, autocast):
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        return model(*inputs, **kwargs)


def memory_report(
    model: nn.Module,
    *example_inputs,
    autocast: torch.dtype | None = None,
    print_table: bool = False,
    **kwargs,
) -> MemoryReport:
    """Runs one training-mode forward plain and one compressed; reports bytes kept per module.

    Plain is the model as the unwrapped one runs: no compression, no checkpointing by mesa_lite
    (``Config(checkpoint=...)`` or a plan), so the reduction is against the model the user
    started from. A checkpointed module is one row: what its layers keep plain against its
    input copy.

    Activations and autocast's weight copies (low-precision casts of Parameters kept for
    backward) are reported apart; ``MemoryReport.reduction`` is plain / compressed on
    activations.

    Args:
        model: a (wrapped) model; it is put in train mode for the two forwards and restored.
        example_inputs: positional inputs of the forward (kwargs are passed on too).
        autocast: run the forwards under ``torch.autocast`` with this dtype.
        print_table: also print the report (``print(report)``: the totals, the table by
            module type, then the per-module table).

    Returns:
        A MemoryReport (``str(report)``: the totals, then the tables).

    Warns:
        UserWarning: the model has no mesa_lite module (call ``mesa_lite.wrap`` first): both
        forwards are then plain and every reduction is 1.
    """
    from mesa_lite.checkpoint import checkpointed, inside
    from mesa_lite.modules import MesaModule

    units = [n for n, _ in checkpointed(model)]
    if not units and not any(isinstance(m, MesaModule) and m.mesa_spec is not None
                             for m in model.modules()):  # fmt: skip
        warnings.warn(
            f"mesa_lite.memory_report: {type(model).__name__} has no mesa_lite modules, so "
            "its compressed and plain columns are the same; wrap it first "
            "(mesa_lite.wrap(model))",
            stacklevel=2,
        )
    was_training = model.training
    model.train()
    try:
        with plain_model(model):
            plain, plain_total, plain_copies, out = _attribute(
                model, lambda: _forward(model, example_inputs, kwargs, autocast)
            )
        del out
        comp, comp_total, comp_copies, out = _attribute(
            model, lambda: _forward(model, example_inputs, kwargs, autocast)
        )
        del out
    finally:
        model.train(was_training)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    # a module checkpointed by mesa_lite keeps only its input copy, on its own row: the bytes
    # its layers keep in the plain forward are counted on that row too (one row per unit)
    for table in (plain, comp):
        for unit in units:
            row = table.setdefault(unit, [0, 0])
            for n in [n for n in table if inside(n, [unit])]:
                row[0] += table[n][0]
                row[1] += table[n][1]
                del table[n]
    order = [n for n, _ in model.named_modules() if n in plain or n in comp]
    rows = []
    for n in order:
        p, c = plain.get(n, [0, 0]), comp.get(n, [0, 0])
        rows.append(ModuleRow(n, kinds[n], p[0], c[0], p[1], c[1]))
    report = MemoryReport(rows, plain_total, comp_total, plain_copies, comp_copies)
    if print_table:
        print(report)
    return report
