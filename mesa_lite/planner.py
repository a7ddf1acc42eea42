"""Choosing, per repeated block, how it keeps its activations so that a training step fits a
memory budget at the least step time: ``measure`` runs a model's real training steps under
each policy, ``choose`` picks per block and predicts the peak and step time, and its
``Config`` applies the choice.

Policies, per block:
    ``plain``   the block's layers stay as they are (exact, fastest, most memory);
    ``int8``    its layers keep 8-bit codes (``wrap``'s default);
    ``int4``    its layers keep 4-bit codes;
    ``ckpt8``   compressed checkpointing: the block keeps an int8 copy of its input only and is
                recomputed from it in backward (``Config.checkpoint``);
    ``ckpt4``   the same from a 4-bit copy.

The predicted peak is ``static + outside + temporaries + sum(kept) + max(transient)``:
parameters, gradients and optimizer state; what the model keeps outside its blocks; the
largest temporaries of backward; each block's kept bytes under its policy; and the largest
extra memory alive while one block's backward runs (a checkpointed block's recompute). The
predicted step time is ``other_seconds + sum(seconds)``. The choice minimizes the time under
the budget exactly, as a multiple-choice knapsack over memory counted in units of at most
1/4096 of the budget, each block's bytes rounded up (so the predicted peak never exceeds the
budget); one Config holds one checkpoint width, so plans with ``ckpt8`` and with ``ckpt4``
are solved apart and the faster is kept.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from mesa_lite.config import Config

POLICIES: tuple[str, ...] = ("plain", "int8", "int4", "ckpt8", "ckpt4")
_UNITS = 4096  # memory resolution of the choice: the budget in at most this many units


class PlanError(ValueError):
    """No choice of policies fits the budget; the message names the terms."""


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    """One block under one policy: ``kept`` bytes kept for backward, ``seconds`` of forward
    and backward, ``transient`` bytes alive in addition while its backward runs."""

    kept: int
    seconds: float
    transient: int = 0

    def __post_init__(self) -> None:
        if self.kept < 0 or self.transient < 0 or not self.seconds >= 0:
            raise ValueError(f"PolicyCost needs non-negative bytes and seconds, got {self}")


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What the planner chooses from.

    Attributes:
        blocks: the repeated blocks' module names, in order.
        costs: policy -> one ``PolicyCost`` per block (a policy left out is not a choice).
        static: bytes of parameters, gradients and optimizer state.
        outside: bytes the model keeps for backward outside its blocks.
        temporaries: the largest temporaries of a backward (bytes).
        other_seconds: the step time outside the blocks (optimizer, head, loss).
        leaves: the blocks that are modules without children (see ``to_config``).
    """

    blocks: tuple[str, ...]
    costs: Mapping[str, Sequence[PolicyCost]]
    static: int
    outside: int = 0
    temporaries: int = 0
    other_seconds: float = 0.0
    leaves: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("Measurements needs at least one block")
        unknown = sorted(set(self.costs) - set(POLICIES))
        if unknown:
            raise ValueError(f"unknown policies {unknown}; known: {list(POLICIES)}")
        if not self.costs:
            raise ValueError("Measurements needs the costs of at least one policy")
        for policy, per_block in self.costs.items():
            if len(per_block) != len(self.blocks):
                raise ValueError(
                    f"costs[{policy!r}] has {len(per_block)} entries for {len(self.blocks)} blocks"
                )
        if min(self.static, self.outside, self.temporaries) < 0:
            raise ValueError("static, outside and temporaries must be non-negative bytes")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A choice of policies and its prediction.

    Attributes:
        blocks: the block names; ``policies`` one policy per block.
        peak: predicted peak bytes; ``seconds``: predicted step time.
        terms: the peak's terms (static, outside, temporaries, kept, transient), bytes.
        config: the ``Config`` that applies the plan (pass it to ``wrap``).
    """

    blocks: tuple[str, ...]
    policies: tuple[str, ...]
    peak: int
    seconds: float
    terms: Mapping[str, int]
    config: Config

    def config_kwargs(self) -> dict:
        """``config`` as plain data (JSON-serializable) for ``Config(**kwargs)``: save it and
        wrap with it next time without planning again. Every field that differs from
        ``Config()``'s is there."""
        default = Config()
        out: dict = {}
        for f in dataclasses.fields(Config):
            value = getattr(self.config, f.name)
            if value == getattr(default, f.name):
                continue
            if isinstance(value, frozenset):
                value = sorted(value)
            elif isinstance(value, Mapping):
                value = {k: dict(v) for k, v in value.items()}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def __str__(self) -> str:
        lines = [f"plan: peak {_size(self.peak)}, step {self.seconds * 1e3:.1f} ms"]
        lines += [f"  {k}: {_size(v)}" for k, v in self.terms.items()]
        counts = {p: self.policies.count(p) for p in POLICIES if p in self.policies}
        lines.append("  blocks: " + ", ".join(f"{p} x{n}" for p, n in counts.items()))
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _fixed(m: Measurements) -> int:
    return m.static + m.outside + m.temporaries


def smallest_peak(m: Measurements) -> int:
    """The smallest predicted peak any choice of policies reaches (bytes)."""
    best = None
    for cap in sorted({c.transient for cs in m.costs.values() for c in cs}):
        kept = 0
        for i in range(len(m.blocks)):
            fits = [cs[i].kept for cs in m.costs.values() if cs[i].transient <= cap]
            if not fits:
                break
            kept += min(fits)
        else:
            peak = _fixed(m) + kept + cap
            best = peak if best is None else min(best, peak)
    return best


def _solve(m: Measurements, budget: int, allowed: tuple[str, ...]):
    """The fastest choice among ``allowed`` under ``budget``: (seconds, policies, kept,
    transient) or None."""
    unit = max(1, math.ceil(budget / _UNITS))
    best = None
    caps = sorted({c.transient for p in allowed for c in m.costs[p]})
    for cap in caps:  # the largest transient allowed: the peak's last term
        room = budget - _fixed(m) - cap
        if room < 0:
            continue
        slots = room // unit
        # table[u] = (seconds, choices) with at most u units used, over the blocks so far
        table: list[tuple[float, tuple[str, ...]] | None] = [(0.0, ())] * (slots + 1)
        for i in range(len(m.blocks)):
            nxt: list[tuple[float, tuple[str, ...]] | None] = [None] * (slots + 1)
            for p in allowed:
                c = m.costs[p][i]
                if c.transient > cap:
                    continue
                need = math.ceil(c.kept / unit)
                for u in range(need, slots + 1):
                    prev = table[u - need]
                    if prev is None:
                        continue
                    t = prev[0] + c.seconds
                    cur = nxt[u]
                    if cur is None or t < cur[0]:
                        nxt[u] = (t, (*prev[1], p))
            # at most u units: carry the best of fewer units forward
            for u in range(1, slots + 1):
                a, b = nxt[u - 1], nxt[u]
                if a is not None and (b is None or a[0] < b[0]):
                    nxt[u] = a
            table = nxt
        found = table[slots]
        if found is None:
            continue
        seconds, choice = found
        kept = sum(m.costs[p][i].kept for i, p in enumerate(choice))
        transient = max(m.costs[p][i].transient for i, p in enumerate(choice))
        if best is None or seconds < best[0]:
            best = (seconds, choice, kept, transient)
    return best


def to_config(
    blocks: Sequence[str],
    policies: Sequence[str],
    base: Config | None = None,
    leaves: Sequence[str] = (),
):
    """The ``Config`` that applies ``policies`` (one per block) on top of ``base``.

    Each block gets an override for itself and, unless it is one of ``leaves`` (modules with
    no children), for everything inside it (``"<name>.*"``): ``enabled`` False for ``plain``,
    ``bits`` for ``int8`` and ``int4`` (merged into an override of ``base`` with the same
    key). The checkpointed blocks are named in ``checkpoint``, at their one width, every one
    of them (``checkpoint_every`` 1): the plan decides what is checkpointed, whatever ``base``
    said.
    """
    base = Config() if base is None else base
    overrides = {k: dict(v) for k, v in base.overrides.items()}
    leaf = set(leaves)
    ckpt, widths = [], set()
    for name, p in zip(blocks, policies, strict=True):
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; known: {list(POLICIES)}")
        fields = {"plain": {"enabled": False}, "int4": {"bits": 4}, "int8": {"bits": 8}}.get(p)
        if fields is None:
            ckpt.append(name)
            widths.add(int(p[4:]))
            continue
        for key in (name,) if name in leaf else (name, f"{name}.*"):
            overrides[key] = {**overrides.get(key, {}), **fields}
    if len(widths) > 1:
        raise ValueError("one Config checkpoints at one width: ckpt8 and ckpt4 together")
    return dataclasses.replace(
        base,
        overrides=overrides,
        checkpoint=tuple(ckpt) if ckpt else None,
        checkpoint_every=1,
        checkpoint_bits=widths.pop() if widths else base.checkpoint_bits,
    )


def choose(m: Measurements, budget: int, base: Config | None = None) -> Plan:
    """The fastest per-block policies whose predicted peak is at most ``budget`` bytes.

    Raises:
        PlanError: when no choice fits; the message names the terms (static memory alone
            above the budget, or the smallest peak any choice reaches).
    """
    if budget < _fixed(m):
        raise PlanError(
            f"budget {_size(budget)} is below the memory no activation policy changes: "
            f"{_size(_fixed(m))} (parameters, gradients and optimizer state {_size(m.static)}, "
            f"activations outside the blocks {_size(m.outside)}, backward temporaries "
            f"{_size(m.temporaries)})"
        )
    policies = tuple(p for p in POLICIES if p in m.costs)
    candidates = []
    for width in ("ckpt8", "ckpt4"):
        allowed = tuple(p for p in policies if not p.startswith("ckpt") or p == width)
        found = _solve(m, budget, allowed)
        if found is not None:
            candidates.append(found)
    if not candidates:
        floor = smallest_peak(m)
        # the choice counts memory in units of budget / 4096, each block's bytes rounded up
        need = floor + len(m.blocks) * math.ceil(budget / _UNITS)
        raise PlanError(
            f"budget {_size(budget)} is below every choice of policies: the smallest "
            f"predicted peak is {_size(floor)} (fixed terms {_size(_fixed(m))}, the rest the "
            "blocks' smallest kept bytes and the recompute of a checkpointed block); with "
            f"memory counted in 1/{_UNITS} of the budget, plan for at least {_size(need)}"
        )
    seconds, choice, kept, transient = min(candidates, key=lambda c: c[0])
    terms = {"static": m.static, "outside": m.outside, "temporaries": m.temporaries,
             "kept": kept, "transient": transient}  # fmt: skip
    return Plan(
        blocks=tuple(m.blocks),
        policies=choice,
        peak=sum(terms.values()),
        seconds=m.other_seconds + seconds,
        terms=terms,
        config=to_config(m.blocks, choice, base, m.leaves),
    )


def _step_seconds(model, step_fn, optimizer, steps: int, device) -> float:
    """Median seconds of ``steps`` synchronized training steps."""
    from mesa_lite.breakdown import train_step

    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        train_step(model, step_fn, optimizer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _kept_by_block(model, step_fn, optimizer, blocks: Sequence[str], device):
    """One training step; the unique storages saved for backward during its forward, split
    by the block whose forward saved them (``None``: outside the blocks); on CUDA also the
    memory backward adds on top of what forward left allocated, less the gradients."""
    from mesa_lite.breakdown import _finish, _storages

    params = _storages(model.parameters(), {})
    owner: dict[int, str | None] = {}
    sizes: dict[int, int] = {}
    current: list[str | None] = [None]
    hooks = []
    modules = dict(model.named_modules())

    def enter(name):
        def hook(module, args):
            current.append(name)

        return hook

    def leave(module, args, out):
        current.pop()  # a forward hook that returns a value would replace the output

    for name in blocks:
        hooks.append(modules[name].register_forward_pre_hook(enter(name)))
        hooks.append(modules[name].register_forward_hook(leave))

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in sizes:
            sizes[st.data_ptr()] = st.nbytes()
            owner[st.data_ptr()] = current[-1]
        return t.detach()

    cuda = device.type == "cuda"
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step_fn(model)
    finally:
        for h in hooks:
            h.remove()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        after_forward = torch.cuda.memory_allocated(device)
    loss.backward()
    temporaries = 0
    if cuda:
        grads = sum(_storages((p.grad for p in model.parameters()), {}).values())
        temporaries = max(0, torch.cuda.max_memory_allocated(device) - after_forward - grads)
    static = sum(params.values()) + sum(
        _storages((p.grad for p in model.parameters()), {}).values()
    )
    _finish(model, optimizer, True)
    state = _storages((t for st in (optimizer.state.values() if optimizer else ())
                       for t in st.values()), params)  # fmt: skip
    static += sum(state.values())
    per_block = {n: 0 for n in blocks}
    outside = 0
    for ptr, n in owner.items():
        if n is None:
            outside += sizes[ptr]
        else:
            per_block[n] += sizes[ptr]
    return per_block, outside, static, temporaries


def measure(
    model: torch.nn.Module,
    step_fn: Callable[[torch.nn.Module], torch.Tensor],
    optimizer_fn: Callable | None = None,
    *,
    policies: Sequence[str] = POLICIES,
    base: Config | None = None,
    blocks: Sequence[str] | None = None,
    warmup: int = 1,
    timed: int = 3,
) -> Measurements:
    """Measures ``model``'s training step under each policy applied to every repeated block.

    Each policy runs on a deep copy of ``model`` wrapped with ``to_config(blocks, [policy] *
    n, base)`` (the layers outside the blocks wrapped by ``base`` in every run, so they keep
    the same): ``warmup`` steps, one step whose forward's saved tensors are counted per block
    (and, on CUDA, backward's temporaries), then ``timed`` synchronized steps, whose median
    divided among the blocks is each block's time (the rest of the step is then shared
    evenly, so a plan's predicted time is exact for one policy on every block and a mix of
    those in between).

    Args:
        model: the model as ``wrap`` would take it (not wrapped), on its device.
        step_fn: ``step_fn(model) -> loss``, the forward with its inputs, autocast and loss.
        optimizer_fn: ``optimizer_fn(parameters) -> optimizer`` (its state counts as static
            memory); None: no optimizer.
        policies: which of ``POLICIES`` to measure.
        base: the Config the plan builds on (bits, group size, layer kinds).
        blocks: the block names; by default the model's repeated blocks
            (``mesa_lite.checkpoint.repeated_blocks``).

    The transient memory of a checkpointed block (its recompute during backward) is taken
    as the block's bytes under ``plain``, an upper bound; measure ``plain`` with the
    checkpointing policies.
    """
    from mesa_lite.breakdown import train_step
    from mesa_lite.checkpoint import repeated_blocks
    from mesa_lite.wrap import wrap

    if blocks is None:
        blocks = tuple(n for n, _ in repeated_blocks(model))
    blocks = tuple(blocks)
    if not blocks:
        raise ValueError(f"measure: found no repeated blocks in {type(model).__name__}; "
                         "name them with blocks=[...]")  # fmt: skip
    policies = tuple(policies)
    if not policies:
        raise ValueError(f"measure: policies must name some of {list(POLICIES)}")
    odd = [p for p in policies if p.endswith("4") and (base or Config()).group_size % 2]
    if odd:
        warnings.warn(
            f"mesa_lite.planner.measure: {odd} skipped: 4-bit codes need an even group size, "
            f"and the base Config's is {(base or Config()).group_size}",
            stacklevel=2,
        )
        policies = tuple(p for p in policies if p not in odd)
    if any(p.startswith("ckpt") for p in policies) and "plain" not in policies:
        raise ValueError("measure: the checkpointing policies need 'plain' measured too")
    modules = dict(model.named_modules())
    missing = [n for n in blocks if n not in modules]
    if missing:
        raise ValueError(f"measure: blocks {missing} are not modules of the model")
    leaves = tuple(n for n in blocks if not any(True for _ in modules[n].children()))
    device = next(model.parameters()).device
    kept, seconds, outs, statics, temps = {}, {}, [], [], []
    for p in policies:
        m = copy.deepcopy(model).train()  # a training step's costs, whatever mode it was in
        wrap(m, to_config(blocks, [p] * len(blocks), base, leaves))
        opt = optimizer_fn(m.parameters()) if optimizer_fn is not None else None
        for _ in range(warmup):
            train_step(m, step_fn, opt)
        per_block, outside, static, temporaries = _kept_by_block(m, step_fn, opt, blocks, device)
        kept[p] = per_block
        outs.append(outside)
        statics.append(static)
        temps.append(temporaries)
        seconds[p] = _step_seconds(m, step_fn, opt, timed, device) / len(blocks)
        del m, opt
    costs = {
        p: tuple(
            PolicyCost(kept[p][n], seconds[p], kept["plain"][n] if p.startswith("ckpt") else 0)
            for n in blocks
        )
        for p in policies
    }
    return Measurements(blocks=blocks, costs=costs, static=max(statics), outside=max(outs),
                        temporaries=max(temps), other_seconds=0.0, leaves=leaves)  # fmt: skip
