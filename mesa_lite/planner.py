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
    ``ckpt4``   the same from a 4-bit copy;
    ``ckpt``    exact checkpointing: the block keeps its input as it is and is recomputed
                exactly (``Config(checkpoint_bits="exact", checkpoint_inner="exact")``).

The predicted peak is the larger of the training peak and the optimizer step's peak. The
training peak is the largest, over the blocks in backward order (last block first), of what
is alive while block ``i``'s backward runs: ``static + outside + temporaries + kept(0..i) +
transient(i)``. Its terms: parameters, gradients and optimizer state (on CUDA also the other
tensors allocated when the step starts, such as its inputs); what the model keeps outside
its blocks; what backward adds to the kept bytes, split in a fixed part (``temporaries``)
and a part per policy (``transient``); and the bytes kept by blocks ``0..i`` (the later ones
were freed by their backward). A block's bytes are measured with its policy on every block;
next to a block under another policy it also keeps what it had shared with it
(``PolicyCost``, ``_boundary``: a ResNet block's ReLU output is the next block's input; each
tensor passed between blocks apart), and in a plan of more than one policy what it shared
with a block further back (``_extra``). What is kept outside the blocks is taken at its
largest before them and after them apart (a stem's ReLU depends on the first block's policy,
a head on the last's). Upper bounds: CPU tests hold ResNet, ConvNeXt and Swin mixes within
8% of the kept bytes, never below. On CUDA ``temporaries`` and ``transient`` come from the
measured training peak of each policy on every block (where the last block's backward runs:
backward's temporaries and a checkpointed block's recompute, less the gradients not yet
allocated then, so ``temporaries`` may be negative). The gradients an earlier block's
backward finds allocated are taken as offset by the temporaries of the loss and head freed
by then: on the H200 this model predicted DeiT-S and DeiT-B plans' measured peaks within
0.5%. On other devices ``temporaries`` is 0 and a checkpointed block's transient its plain
bytes (its recompute, an upper bound). The predicted step time is ``other_seconds +
sum(seconds)``. The choice minimizes the time under the budget by a dynamic program over the
blocks in order (and the policy of the block before), on time counted in units of 1/16384 of
the slowest choice's (``_unit``) and bytes counted exactly: the predicted peak never exceeds
the budget, a plan is found whenever one fits (so a larger budget never loses one), and it
is the fastest up to that rounding of time (less than one unit per block). One Config holds
one checkpoint width, so plans with ``ckpt8``, ``ckpt4`` and ``ckpt`` are solved apart and
the fastest is kept.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import numbers
import re
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from mesa_lite.config import Config

POLICIES: tuple[str, ...] = ("plain", "int8", "int4", "ckpt8", "ckpt4", "ckpt")
# checkpointing policies -> Config.checkpoint_bits
_WIDTHS = {"ckpt8": 8, "ckpt4": 4, "ckpt": "exact"}
_UNITS = 16384  # time resolution of the choice: the slowest choice's time in this many units
# A memory-only measurement (``measure(..., timed=0)``) times nothing: each policy's block
# time is then its DeiT-S step ratio against plain on the H200 (fp16, batch 128:
# benchmarks/results/checkpoint_pareto_gpu_repeats.jsonl; int4 from deit_memory_gpu.jsonl),
# a ranking for the choice, not this model's seconds.
PROXY_STEP_RATIOS = {"plain": 1.0, "int8": 1.37, "ckpt": 1.70, "ckpt8": 1.95, "ckpt4": 2.05,
                     "int4": 2.21}  # fmt: skip


class PlanError(ValueError):
    """No choice of policies fits the budget; the message names the terms."""


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    """One block under one policy: ``kept`` bytes kept for backward, ``seconds`` of forward
    and backward, ``transient`` bytes alive in addition while its backward runs.

    Measured with the policy on every block, a tensor two blocks keep is counted once, in
    the first one's ``kept`` (a ResNet block keeps its in-place ReLU's output, which the next
    block's convolutions keep too, or the codes they reuse). With another policy on the block
    before, that sharing may not hold. Left out of ``kept``, what the block keeps that an
    earlier block kept first: ``borrowed`` from the block just before, ``borrowed_far`` from
    one further back (a tensor every block reads, such as rotary tables or an encoder's
    output). ``raw_in[k]``: the bytes of the previous block's ``k``-th output tensor that
    this block keeps as they are (its input); ``raw_out[k]``: those of its own ``k``-th
    output tensor that it keeps as they are (an int: one tensor). See ``_extra``."""

    kept: int
    seconds: float
    transient: int = 0
    borrowed: int = 0
    raw_in: tuple[int, ...] = ()
    raw_out: tuple[int, ...] = ()
    borrowed_far: int = 0

    def __post_init__(self) -> None:
        for name in ("raw_in", "raw_out"):  # an int is one tensor; JSON gives lists
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, int) else tuple(value))
        if (
            min(
                self.kept,
                self.transient,
                self.borrowed,
                self.borrowed_far,
                *self.raw_in,
                *self.raw_out,
            )
            < 0
            or not 0 <= self.seconds < math.inf
        ):
            raise ValueError(
                f"PolicyCost needs non-negative bytes and finite non-negative seconds, got {self}"
            )
        if sum(self.raw_in) > self.kept + self.borrowed:
            raise ValueError(f"PolicyCost: raw_in is part of kept + borrowed, got {self}")


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What the planner chooses from.

    Attributes:
        blocks: the repeated blocks' module names, in order.
        costs: policy -> one ``PolicyCost`` per block (a policy left out is not a choice).
        static: bytes of parameters, gradients and optimizer state (measured on CUDA: also
            the other tensors allocated when the step starts, such as its inputs).
        outside: bytes the model keeps for backward outside its blocks.
        temporaries: backward's net temporaries (bytes; may be negative: see the module
            docstring).
        optimizer_peak: the optimizer step's peak (bytes; 0: not measured).

        other_seconds: the step time outside the blocks (optimizer, head, loss).
        leaves: the blocks that are modules without children (see ``to_config``).
        timed: False for a memory-only measurement (``measure(..., timed=0)``): the
            seconds are ``PROXY_STEP_RATIOS``' ranking, and a plan predicts no step time.
        base: the Config the policies were measured on (``measure`` records its ``base``,
            ``Config()`` when none is given), which ``choose`` writes the plan on; None
            (measurements made otherwise): ``choose`` takes any base.
    """

    blocks: tuple[str, ...]
    costs: Mapping[str, Sequence[PolicyCost]]
    static: int
    outside: int = 0
    temporaries: int = 0
    optimizer_peak: int = 0
    other_seconds: float = 0.0
    leaves: tuple[str, ...] = ()
    base: Config | None = None
    timed: bool = True

    def __post_init__(self) -> None:
        if self.base is not None and not isinstance(self.base, Config):
            raise TypeError(f"Measurements.base must be a Config or None, got {self.base!r}")
        if not self.blocks:
            raise ValueError("Measurements needs at least one block")
        twice = sorted({n for n in self.blocks if self.blocks.count(n) > 1})
        if twice:
            raise ValueError(f"Measurements: blocks named more than once: {twice}")
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
        if min(self.static, self.outside, self.optimizer_peak) < 0:
            raise ValueError("static, outside and optimizer_peak must be non-negative bytes")
        if _fixed(self) < 0:
            raise ValueError("static + outside + temporaries must be non-negative bytes")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A choice of policies and its prediction.

    Attributes:
        blocks: the block names; ``policies`` one policy per block.
        peak: predicted peak bytes; ``seconds``: predicted step time (None: measured for
            memory only, ``measure(..., timed=0)``).
        terms: the training peak's terms, bytes: static, outside, temporaries, ``kept`` (by
            the blocks still holding their bytes when the peak is reached, from the first
            to the block whose backward runs then) and ``transient`` (that block's); and the
            optimizer step's peak (``optimizer_step``).
        where: where the predicted peak is, ``"backward"`` or ``"optimizer step"``.
        saved: the bytes all blocks keep for backward at the end of forward.
        config: the ``Config`` that applies the plan (pass it to ``wrap``).
    """

    blocks: tuple[str, ...]
    policies: tuple[str, ...]
    peak: int
    seconds: float | None
    terms: Mapping[str, int]
    config: Config
    where: str = "backward"
    saved: int = 0

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
        size = _size_in(self.peak)  # one unit for every line: the peak's
        step = ("step not timed (memory only)" if self.seconds is None
                else f"step {self.seconds * 1e3:.1f} ms")  # fmt: skip
        lines = [f"plan: peak {size(self.peak)} (in the {self.where}), {step}"]
        lines += [f"  {k}: {size(v)}" for k, v in self.terms.items()]
        counts = {p: self.policies.count(p) for p in POLICIES if p in self.policies}
        lines.append("  blocks: " + ", ".join(f"{p} x{n}" for p, n in counts.items()))
        return "\n".join(lines)


def _size(n: int) -> str:
    return _size_in(n)(n)


def _size_in(largest: int) -> Callable[[int], str]:
    """Formats bytes in the unit that suits ``largest`` (GiB, MiB or bytes)."""
    if abs(largest) >= 2**30:
        return lambda n: f"{n / 2**30:.2f} GiB"
    if abs(largest) >= 2**20:
        return lambda n: f"{n / 2**20:.1f} MiB"
    return lambda n: f"{n:,} bytes"


def _fixed(m: Measurements) -> int:
    return m.static + m.outside + m.temporaries


def _boundary(m: Measurements, prev: str, p: str, i: int) -> int:
    """The bytes block ``i`` under ``p`` keeps beyond its ``kept`` after block ``i - 1`` under
    ``prev`` (0 for the same policy: measured so). What the block borrowed it now keeps itself
    (an upper bound: a ReLU whose codes the next convolution no longer reuses keeps its bit
    instead), less each of the previous block's output tensors that both keep as it is."""
    if prev == p:
        return 0
    c = m.costs[p][i]
    both = zip(m.costs[prev][i - 1].raw_out, c.raw_in, strict=False)  # per tensor passed
    return c.borrowed - sum(min(out, kept) for out, kept in both)


def _extra(m: Measurements, state, p: str, i: int):
    """Block ``i`` under ``p`` after the blocks before it, whose state is ``(policy of the
    last, whether all had one policy)`` (None before the first block): the new state and
    the bytes the block keeps beyond its ``kept``: ``_boundary``'s, and unless every block
    so far has one policy (as measured) what it borrowed from a block further back (an
    upper bound: that block may share its policy)."""
    if state is None:
        return (p, True), 0
    prev, uniform = state
    uniform = uniform and prev == p
    far = 0 if uniform else m.costs[p][i].borrowed_far
    return (p, uniform), _boundary(m, prev, p, i) + far


def _kept(m: Measurements, choice: Sequence[str]) -> list[int]:
    """The bytes each block keeps under ``choice``, its neighbours' policies counted."""
    out, state = [], None
    for i, p in enumerate(choice):
        state, extra = _extra(m, state, p, i)
        out.append(m.costs[p][i].kept + extra)
    return out


def _peak_terms(m: Measurements, choice: Sequence[str]) -> dict[str, int]:
    """The training peak of ``choice`` and its terms: the largest over the blocks, in
    backward order, of what is alive while block ``i``'s backward runs (the fixed terms, the
    bytes kept by blocks ``0..i`` and block ``i``'s transient)."""
    best, prefix = None, 0
    for i, (p, kept) in enumerate(zip(choice, _kept(m, choice), strict=True)):
        c = m.costs[p][i]
        prefix += kept
        if best is None or prefix + c.transient > best[0] + best[1]:
            best = (prefix, c.transient)
    return {"static": m.static, "outside": m.outside, "temporaries": m.temporaries,
            "kept": best[0], "transient": best[1]}  # fmt: skip


def _unit(m: Measurements) -> float:
    """The seconds of one unit of ``_solve``'s time axis: 1/16384 of the slowest choice's
    block time (the slowest policy on every block)."""
    slowest = sum(max(m.costs[p][i].seconds for p in m.costs) for i in range(len(m.blocks)))
    return slowest / _UNITS if slowest > 0 else 1.0


def _solve(m: Measurements, budget: int, allowed: tuple[str, ...]):
    """The fastest choice among ``allowed`` whose training peak (``_peak_terms``) is at most
    ``budget``: (seconds, policies) or None. A dynamic program over the blocks in order with
    time in units of ``_unit(m)`` (each block's time rounded to the nearest unit) and bytes
    exact: ``table[k, t]`` is the fewest bytes the blocks so far keep in ``t`` units of time
    with policy ``k`` on the last of them (what the next block keeps depends on it:
    ``_boundary``), and a policy is allowed at block ``i`` only where those bytes, its own
    and its transient fit. So a choice is found whenever one fits (exactly, and at every
    larger budget), and it is the fastest up to the rounding of time (less than one unit
    per block)."""
    room = budget - _fixed(m)
    if room < 0:
        return None
    unit = _unit(m)
    n = len(m.blocks)
    steps = [[round(m.costs[p][i].seconds / unit) for p in allowed] for i in range(n)]
    size = sum(max(s) for s in steps) + 1
    inf = math.inf
    # the states of ``_extra``: a policy on the last block, all blocks so far under it or not
    states = [(p, u) for u in (False, True) for p in allowed]
    table = torch.full((1, size), inf, dtype=torch.float64)  # no block before the first
    table[0, 0] = 0.0
    before: list = [None]
    back = []
    for i in range(n):
        rows, args = [], []
        for p, u in states:
            c, t = m.costs[p][i], steps[i][allowed.index(p)]
            # the states before from which block i under p reaches (p, u), and its bytes
            came = [(j, e) for j, state in enumerate(before)
                    for to, e in [_extra(m, state, p, i)] if to == (p, u)]  # fmt: skip
            row = torch.full((size,), inf, dtype=torch.float64)
            arg = torch.zeros((size,), dtype=torch.long)
            if came:
                index = torch.tensor([j for j, _ in came])
                extra = torch.tensor([e for _, e in came], dtype=torch.float64)
                kept = table[index, : size - t] + (c.kept + extra)[:, None]
                kept[kept + c.transient > room] = inf
                low, at = kept.min(0)
                row[t:], arg[t:] = low, index[at]
            rows.append(row)
            args.append(arg)
        table = torch.stack(rows)
        back.append(torch.stack(args))
        before = states
    best = table.min(0).values
    finite = torch.isfinite(best).nonzero()
    if len(finite) == 0:
        return None
    t, choice = int(finite[0]), []
    r = int(torch.isfinite(table[:, t]).nonzero()[0])
    for i in range(n - 1, -1, -1):
        p = states[r][0]
        choice.append(p)
        r, t = int(back[i][r, t]), t - steps[i][allowed.index(p)]
    choice.reverse()
    return sum(m.costs[p][i].seconds for i, p in enumerate(choice)), tuple(choice)


def _widths(m: Measurements) -> list[tuple[str, ...]]:
    """The policy sets solved apart: one checkpoint width each (one Config holds one)."""
    policies = tuple(p for p in POLICIES if p in m.costs)
    return [tuple(p for p in policies if p not in _WIDTHS or p == w)
            for w in [w for w in _WIDTHS if w in policies] or [None]]  # fmt: skip


def _best(m: Measurements, budget: int):
    """The fastest choice over the widths under ``budget``: (seconds, policies) or None."""
    found = [f for allowed in _widths(m) if (f := _solve(m, budget, allowed)) is not None]
    return min(found, key=lambda f: f[0]) if found else None


def _fits(m: Measurements, budget: int, allowed: tuple[str, ...]) -> bool:
    """Whether some choice among ``allowed`` has a training peak of at most ``budget``:
    ``_solve`` without its time axis (the fewest bytes kept so far, per state of
    ``_extra``)."""
    room = budget - _fixed(m)
    best: dict = {None: 0}  # state (see ``_extra``) -> the fewest bytes kept
    for i in range(len(m.blocks)):
        now: dict = {}
        for state, b in best.items():
            for p in allowed:
                c = m.costs[p][i]
                to, extra = _extra(m, state, p, i)
                kept = b + c.kept + extra
                if kept + c.transient <= room and kept < now.get(to, math.inf):
                    now[to] = kept
        if not now:
            return False
        best = now
    return True


def smallest_budget(m: Measurements) -> int:
    """The smallest budget (bytes, to 1/10,000 of it) for which ``choose`` finds a plan."""

    def fits(budget):
        return budget >= m.optimizer_peak and any(_fits(m, budget, a) for a in _widths(m))

    lo = max(_fixed(m), m.optimizer_peak) - 1
    hi = max(lo + 1, 1)
    while not fits(hi):
        hi *= 2
    while hi - lo > max(1, hi // 10_000):
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def smallest_peak(m: Measurements) -> int:
    """The smallest predicted peak of a plan ``choose`` finds (bytes): the plan at
    ``smallest_budget``."""
    _, choice = _best(m, smallest_budget(m))
    return max(sum(_peak_terms(m, choice).values()), m.optimizer_peak)


def _escape(name: str) -> str:
    """``name`` as an fnmatch pattern that matches it alone (Config's overrides and
    checkpoint names are globs: a block named ``layers[0]`` would otherwise be a class)."""
    return re.sub(r"([*?[])", r"[\1]", name)


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
    said; exact checkpointing (``ckpt``) also runs the recompute exact
    (``checkpoint_inner="exact"``).
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
            ckpt.append(_escape(name))
            widths.add(_WIDTHS[p])
            continue
        pattern = _escape(name)
        for key in (pattern,) if name in leaf else (pattern, f"{pattern}.*"):
            # popped and put last: a later override of the base must not win over the plan
            overrides[key] = {**overrides.pop(key, {}), **fields}
    if len(widths) > 1:
        raise ValueError(
            "one Config checkpoints at one width: only one of ckpt8, ckpt4 and ckpt in a plan"
        )
    width = widths.pop() if widths else base.checkpoint_bits
    return dataclasses.replace(
        base,
        overrides=overrides,
        checkpoint=tuple(ckpt) if ckpt else None,
        checkpoint_every=1,
        checkpoint_bits=width,
        checkpoint_inner="exact" if width == "exact" else base.checkpoint_inner,
    )


def plain_peak(m: Measurements) -> int:
    """The predicted peak with every block ``plain`` (bytes): what a fractional budget is a
    fraction of."""
    if "plain" not in m.costs:
        raise ValueError("plain_peak: the measurements have no 'plain' policy")
    terms = _peak_terms(m, ["plain"] * len(m.blocks))
    return max(sum(terms.values()), m.optimizer_peak)


def _budget_bytes(m: Measurements, budget) -> int:
    """``budget`` in bytes: an integer is bytes; a real number in (0, 1] a fraction of
    ``plain_peak``; a larger one with no fractional part bytes (numpy's scalars too)."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(
            f"budget must be bytes (an int) or a fraction of the plain peak (a float in "
            f"(0, 1]), got {budget!r}"
        )
    if not isinstance(budget, numbers.Integral):
        budget = float(budget)
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"budget must be a positive number, got {budget!r}")
        if budget <= 1:
            return int(budget * plain_peak(m))
        if budget != int(budget):
            raise ValueError(
                f"budget {budget!r}: a float above 1 must be whole bytes (fractions of the "
                "plain peak are at most 1.0)"
            )
        return int(budget)
    budget = int(budget)
    if budget <= 0:
        raise ValueError(f"budget must be positive bytes, got {budget}")
    if budget == 1:
        raise ValueError(
            "budget 1 (an int) would be 1 byte: pass 1.0 for the whole plain peak (a float is "
            "a fraction of it)"
        )
    return budget


def _even_groups_only(policies: tuple[str, ...], base: Config | None, caller: str):
    """``policies`` less the 4-bit ones when ``base``'s group size is odd (4-bit codes pack
    two per byte), with a warning naming them."""
    size = (base or Config()).group_size
    odd = [p for p in policies if p.endswith("4")] if size % 2 else []
    if odd:
        warnings.warn(
            f"mesa_lite.planner.{caller}: {odd} left out: 4-bit codes need an even group size, "
            f"and the base Config's is {size}",
            stacklevel=3,
        )
    return tuple(p for p in policies if p not in odd)


def choose(m: Measurements, budget: int | float, base: Config | None = None) -> Plan:
    """The fastest per-block policies whose predicted peak is at most ``budget``; plain on
    every block wherever that fits (with ``plain`` measured), whatever the timings say.

    Args:
        m: the measurements (``measure``).
        budget: bytes (an int), or a fraction of the all-plain predicted peak (a float in
            (0, 1], ``plain_peak(m)``; needs ``plain`` measured).
        base: the Config the plan's overrides and checkpointing are written on; by default
            the one ``m`` was measured on (``m.base``). Another than that is refused: the
            bytes and times were measured with its layer kinds, bits and group size.

    Raises:
        PlanError: when no choice fits; the message names the terms (static memory alone
            above the budget, the optimizer step's peak, or the smallest budget a plan fits).
    """
    if base is None:
        base = m.base
    elif m.base is not None and base != m.base:
        raise ValueError(
            "choose: base differs from the Config the measurements were taken on "
            f"(measured on {m.base!r}, asked for {base!r}); measure again with this base, "
            "or leave base out to plan on the measured one"
        )
    budget = _budget_bytes(m, budget)
    usable = _even_groups_only(tuple(m.costs), base, "choose")
    if len(usable) < len(m.costs):
        m = dataclasses.replace(m, costs={p: m.costs[p] for p in usable})
    if budget < _fixed(m):
        raise PlanError(
            f"budget {_size(budget)} is below the memory no activation policy changes: "
            f"{_size(_fixed(m))} (parameters, gradients and optimizer state {_size(m.static)}, "
            f"activations outside the blocks {_size(m.outside)}, backward's net temporaries "
            f"{_size(m.temporaries)})"
        )
    if budget < m.optimizer_peak:
        raise PlanError(
            f"budget {_size(budget)} is below the optimizer step's peak "
            f"{_size(m.optimizer_peak)}, which no activation policy changes (parameters, "
            f"gradients and optimizer state {_size(m.static)}, and the step's temporaries)"
        )
    found = _best(m, budget)
    if found is not None and "plain" in m.costs:
        # where plain on every block fits, it is the plan: no policy does less work than
        # plain, so one that timed faster timed in noise (a loaded machine)
        if plain_peak(m) <= budget:
            found = (sum(c.seconds for c in m.costs["plain"]), ("plain",) * len(m.blocks))
    if found is None:
        floor = smallest_budget(m)
        raise PlanError(
            f"budget {_size(budget)} is below every choice of policies: the smallest budget "
            f"a plan fits is {_size(floor)} (fixed terms {_size(_fixed(m))}, the rest the "
            "blocks' smallest kept bytes and the recompute of a checkpointed block"
            + (f"; the optimizer step's peak {_size(m.optimizer_peak)}" if m.optimizer_peak
               else "") + ")"
        )  # fmt: skip
    seconds, choice = found
    terms = _peak_terms(m, choice)
    training = sum(terms.values())
    return Plan(
        blocks=tuple(m.blocks),
        policies=choice,
        peak=max(training, m.optimizer_peak),
        seconds=m.other_seconds + seconds if m.timed else None,
        terms={**terms, "optimizer_step": m.optimizer_peak},
        config=to_config(m.blocks, choice, base, m.leaves),
        where="backward" if training >= m.optimizer_peak else "optimizer step",
        saved=sum(_kept(m, choice)),
    )


# timing: the relative spread of a policy's step times (interquartile range over median)
# above which ``measure`` times up to ``_MORE`` times as many steps, and warns if it stays
NOISE = 0.10
_MORE = 4


def relative_spread(times) -> float:
    """The interquartile range of ``times`` over their median (0 below 3 values): how noisy
    step timings are, against ``NOISE``."""
    if len(times) < 3:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(times)


def _progress(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr (off when stderr is not a terminal, or tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the bench and test extras
        enabled = False
    if not enabled:
        return contextlib.nullcontext(_NoBar())
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=None)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


def _step_seconds(model, step_fn, optimizer, steps: int, device, bar=None) -> tuple[float, float]:
    """(median seconds, relative spread) of ``steps`` synchronized training steps, or of up to
    ``_MORE`` times as many while the spread is above ``NOISE``; each step ticks ``bar``."""
    from mesa_lite.breakdown import train_step

    times: list[float] = []
    spread = lambda: relative_spread(times)  # noqa: E731
    while not times or (spread() > NOISE and len(times) < steps * _MORE):
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            train_step(model, step_fn, optimizer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            if bar is not None:
                bar.update()
    return statistics.median(times), spread()


@dataclasses.dataclass
class _Step:
    """One measured training step (bytes): kept per block and outside them, the static memory,
    and on CUDA the training peak and the optimizer step's peak (0 on other devices); per
    block also ``borrowed``, ``borrowed_far``, ``raw_in`` and ``raw_out`` (see
    ``PolicyCost``)."""

    per_block: dict
    outside: int
    static: int
    training_peak: int = 0
    optimizer_peak: int = 0
    borrowed: dict = dataclasses.field(default_factory=dict)
    borrowed_far: dict = dataclasses.field(default_factory=dict)
    raw_in: dict = dataclasses.field(default_factory=dict)
    raw_out: dict = dataclasses.field(default_factory=dict)
    outside_after: int = 0  # the part of ``outside`` kept after the first block began


def _kept_by_block(model, step_fn, optimizer, blocks: Sequence[str], device, exclude: int = 0):
    """One training step; the unique storages saved for backward during its forward, split
    by the block whose forward saved them first (``None``: outside the blocks), and per block
    what it saved that an earlier block had saved first, and which of its input and output
    tensors (those passed from one block to the next) it saved as they are. On CUDA the peaks
    and the static memory are ``torch.cuda`` allocator counts less ``exclude`` bytes (tensors
    allocated now that the planned run will not have: the model ``measure`` copied)."""
    from torch.utils._pytree import tree_leaves

    from mesa_lite.breakdown import _finish, _storages

    params = _storages(model.parameters(), {})
    owner: dict[int, str | None] = {}
    savers: dict[int, set[str]] = {}
    sizes: dict[int, int] = {}
    ins: dict[str, set[int]] = {}
    outs: dict[str, list[int]] = {}
    current: list[str | None] = [None]
    started = [False]  # a block's forward has begun: what is kept outside now comes after them
    after: set[int] = set()
    hooks = []
    modules = dict(model.named_modules())

    def enter(name):
        def hook(module, args, kwargs):
            ins[name] = set(_storages(tree_leaves((args, kwargs)), {}))
            started[0] = True
            current.append(name)

        return hook

    def leave(name):
        def hook(module, args, out):
            outs[name] = list(_storages(tree_leaves(out), {}))  # in the outputs' order
            current.pop()  # a forward hook that returns a value would replace the output

        return hook

    for name in blocks:
        hooks.append(modules[name].register_forward_pre_hook(enter(name), with_kwargs=True))
        hooks.append(modules[name].register_forward_hook(leave(name)))

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params:
            if ptr not in sizes:
                sizes[ptr] = st.nbytes()
                owner[ptr] = current[-1]
                if current[-1] is None and started[0]:
                    after.add(ptr)
            if current[-1] is not None:
                savers.setdefault(ptr, set()).add(current[-1])
        return t.detach()

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step_fn(model)
    finally:
        for h in hooks:
            h.remove()
    loss.backward()
    del loss
    grads = sum(_storages((p.grad for p in model.parameters()), {}).values())
    step = _Step({n: 0 for n in blocks}, 0, sum(params.values()) + grads)
    if cuda:
        torch.cuda.synchronize(device)
        step.training_peak = torch.cuda.max_memory_allocated(device) - exclude
        step.static = before - exclude + grads
        torch.cuda.reset_peak_memory_stats(device)
    _finish(model, optimizer, True)
    if cuda:
        torch.cuda.synchronize(device)
        step.optimizer_peak = torch.cuda.max_memory_allocated(device) - exclude
    else:
        state = _storages((t for st in (optimizer.state.values() if optimizer else ())
                           for t in st.values()), params)  # fmt: skip
        step.static += sum(state.values())
    for ptr, n in owner.items():
        if n is None:
            step.outside += sizes[ptr]
            step.outside_after += sizes[ptr] if ptr in after else 0
        else:
            step.per_block[n] += sizes[ptr]
    step.borrowed = {n: 0 for n in blocks}
    step.borrowed_far = {n: 0 for n in blocks}
    previous = dict(zip(blocks[1:], blocks[:-1], strict=True))
    for ptr, names in savers.items():
        for n in names - {owner[ptr]}:
            if owner[ptr] is None:  # first kept outside the blocks: counted there
                continue
            if owner[ptr] == previous.get(n):
                step.borrowed[n] += sizes[ptr]
            else:  # first kept by a block further back
                step.borrowed_far[n] += sizes[ptr]
    step.raw_in = {n: () for n in blocks}
    step.raw_out = {n: () for n in blocks}
    for before, n in zip(blocks[:-1], blocks[1:], strict=True):
        # per output tensor of a block that the next one reads: which side keeps it as it is
        passed = outs.get(before, [])
        raw_out, raw_in = [0] * len(passed), [0] * len(passed)
        for k, ptr in enumerate(passed):
            if ptr not in ins.get(n, ()) or owner.get(ptr) is None:
                continue  # not passed to it, not kept, or first kept outside the blocks
            raw_out[k] = sizes[ptr] if before in savers[ptr] else 0
            raw_in[k] = sizes[ptr] if n in savers[ptr] else 0
        step.raw_out[before], step.raw_in[n] = tuple(raw_out), tuple(raw_in)
    return step


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
    sync: bool = True,
    progress: bool = True,
) -> Measurements:
    """Measures ``model``'s training step under each policy applied to every repeated block.

    Each policy runs on a deep copy of ``model`` wrapped with ``to_config(blocks, [policy] *
    n, base)`` (the layers outside the blocks wrapped by ``base`` in every run, so they keep
    the same): ``warmup`` steps (the first one's saved tensors counted too: each block's kept
    bytes are the larger of the first step's and the measured step's, so that a prediction
    bounds the first step of a freshly wrapped model, whose ReLUs have not yet learned that
    the next layer reuses their codes), one step whose forward's saved tensors are counted per block
    (and, on CUDA, the allocator's peaks of training and of the optimizer step, less the bytes
    of ``model`` itself, which the planned run will not hold twice), then ``timed``
    synchronized steps (up to ``_MORE`` times as many while their interquartile range is
    above ``NOISE`` of their median; a warning names the policies whose times stay that
    noisy; the spread is judged from 3 steps on, so ``timed`` below 3 takes the times as
    they come), whose median divided among the blocks is each block's time (every policy's
    at least plain's, with plain measured: each does plain's work and more, so a faster time
    is noise) (the rest of the step is then shared
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
        warmup: untimed training steps first, at least 1 with an optimizer.
        timed: timed steps per policy (3 or more for the noise check); 0 measures memory
            only, in seconds rather than minutes: no step is timed, the choice ranks the
            policies by ``PROXY_STEP_RATIOS`` and a plan predicts its peak but no step time.
        sync: under torch.distributed, return rank 0's measurements on every rank
            (``broadcast``), so that every rank plans the same.
        progress: a progress bar on stderr (tqdm, when installed and stderr is a terminal)
            whose description states the steps to run: each policy's ``warmup`` steps, one
            counted step and ``timed`` steps (more while the times are noisy).

    On CUDA each policy's transient is what its measured training peak holds beyond static,
    outside and kept bytes, less the smallest such excess over the policies (the fixed
    ``temporaries`` term), so that one policy on every block predicts the peak it measured.
    Elsewhere the transient memory of a checkpointed block (its recompute during backward) is
    taken as the block's bytes under ``plain``, an upper bound, and the others' as 0; measure
    ``plain`` with the checkpointing policies.
    """
    from mesa_lite.breakdown import train_step
    from mesa_lite.checkpoint import repeated_blocks
    from mesa_lite.wrap import quietly, wrap

    if blocks is None:
        blocks = tuple(n for n, _ in repeated_blocks(model))
    blocks = tuple(blocks)
    twice = sorted({n for n in blocks if blocks.count(n) > 1})
    if twice:
        raise ValueError(f"measure: blocks named more than once: {twice}")
    if not blocks:
        raise ValueError(f"measure: found no repeated blocks in {type(model).__name__}; "
                         "name them with blocks=[...]")  # fmt: skip
    policies = tuple(policies)
    if not policies:
        raise ValueError(f"measure: policies must name some of {list(POLICIES)}")
    policies = _even_groups_only(policies, base, "measure")
    if any(p.startswith("ckpt") for p in policies) and "plain" not in policies:
        raise ValueError("measure: the checkpointing policies need 'plain' measured too")
    modules = dict(model.named_modules())
    missing = [n for n in blocks if n not in modules]
    if missing:
        raise ValueError(f"measure: blocks {missing} are not modules of the model")
    leaves = tuple(n for n in blocks if not any(True for _ in modules[n].children()))
    if isinstance(timed, bool) or not isinstance(timed, int) or timed < 0:
        raise ValueError(
            f"measure: timed must be a non-negative int (steps timed; 0: memory only), got "
            f"{timed!r}"
        )
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"measure: warmup must be a non-negative int, got {warmup!r}")
    if optimizer_fn is not None and warmup < 1:
        raise ValueError("measure: warmup must be at least 1 with an optimizer (its state is "
                         "allocated by the first step)")  # fmt: skip
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError(f"measure: {type(model).__name__} has no parameters to train")
    device = first.device
    # the model given stays allocated while its copies run; the planned run will not have it
    exclude = 0
    if device.type == "cuda":
        from mesa_lite.breakdown import _storages

        exclude = sum(_storages((*model.parameters(), *model.buffers()), {}).values())
    steps: dict[str, _Step] = {}
    firsts: dict[str, _Step] = {}
    seconds, spreads = {}, {}
    per = warmup + 1 + timed if warmup else 1 + timed
    desc = f"planner.measure: {len(policies)} policies x {per} steps" + (
        " (memory only)" if not timed else ""
    )
    with _progress(len(policies) * per, desc, progress) as bar:
        for p in policies:
            bar.set_postfix_str(p)
            m = copy.deepcopy(model).train()  # a training step's costs, whatever mode it was in
            with quietly():  # the user's wrap says what it did, not these copies
                wrap(m, to_config(blocks, [p] * len(blocks), base, leaves))
            opt = optimizer_fn(m.parameters()) if optimizer_fn is not None else None
            # the first step, counted too: a ReLU learns only in its first backward that the
            # next convolution reuses its codes, so a freshly wrapped model keeps more then
            firsts[p] = _kept_by_block(m, step_fn, opt, blocks, device, exclude)
            bar.update()
            for _ in range(warmup - 1):
                train_step(m, step_fn, opt)
                bar.update()
            steps[p] = _kept_by_block(m, step_fn, opt, blocks, device, exclude) if warmup else \
                firsts[p]  # fmt: skip
            if warmup:
                bar.update()
            if timed:
                step, spreads[p] = _step_seconds(m, step_fn, opt, timed, device, bar)
            else:  # memory only: the ranking, not seconds
                step, spreads[p] = PROXY_STEP_RATIOS[p], 0.0
            seconds[p] = step / len(blocks)
            del m, opt
            gc.collect()
    noisy = {p: v for p, v in spreads.items() if v > NOISE}
    if noisy:
        warnings.warn(
            "mesa_lite.planner.measure: step times varied beyond "
            f"{NOISE:.0%} (interquartile range over median) for "
            + ", ".join(f"{p} {v:.0%}" for p, v in noisy.items())
            + f" after up to {timed * _MORE} steps: the plans' time ranking may be off (a "
            "loaded machine?); measure on an idle one or with more timed steps",
            stacklevel=2,
        )
    if "plain" in seconds:
        # every policy does plain's work and more (quantizing, or the forward twice): never
        # faster than plain (a timing that says otherwise is noise)
        for p in seconds:
            seconds[p] = max(seconds[p], seconds["plain"])
    static = max(s.static for s in steps.values())
    temporaries = 0
    transient = {p: 0 for p in policies}
    if device.type == "cuda":
        # each policy's measured training peak less static, its outside and kept: what
        # backward adds (its temporaries, a checkpointed block's recompute, less the gradients
        # not yet allocated at the peak); the smallest is the fixed term, the rest each
        # policy's transient, so that one policy on every block predicts its measured peak
        # (more by what ``outside`` holds beyond its own)
        extra = {p: s.training_peak - static - s.outside - sum(s.per_block.values())
                 for p, s in steps.items()}  # fmt: skip
        temporaries = min(extra.values())
        transient = {p: e - temporaries for p, e in extra.items()}
    # every step bounded, the first included: each block's kept bytes and the bytes outside
    # at the larger of the first and the measured step's (the transients above stay the
    # measured step's)
    for p, first in firsts.items():
        s = steps[p]
        steps[p] = dataclasses.replace(
            s, per_block={n: max(s.per_block[n], first.per_block[n]) for n in blocks},
            outside=max(s.outside, first.outside),
            outside_after=max(s.outside_after, first.outside_after),
        )  # fmt: skip
    # what is kept outside the blocks before them depends on the first block's policy (a
    # stem ReLU keeps the codes its convolutions reuse), after them on the last's: each part
    # at its largest, as a mix may have both
    outside = max(s.outside - s.outside_after for s in steps.values()) + max(
        s.outside_after for s in steps.values()
    )
    costs = {
        p: tuple(
            PolicyCost(
                steps[p].per_block[n],
                seconds[p],
                # without allocator counts, a recompute's upper bound: the plain bytes
                transient[p]
                if device.type == "cuda" or p not in _WIDTHS
                else steps["plain"].per_block[n],
                steps[p].borrowed[n],
                steps[p].raw_in[n],
                steps[p].raw_out[n],
                steps[p].borrowed_far[n],
            )  # fmt: skip
            for n in blocks
        )
        for p in policies
    }
    found = Measurements(blocks=blocks, costs=costs, static=static, outside=outside,
                         temporaries=temporaries,
                         optimizer_peak=max(s.optimizer_peak for s in steps.values()),
                         other_seconds=0.0, leaves=leaves,
                         base=base if base is not None else Config(),
                         timed=bool(timed))  # fmt: skip
    return broadcast(found) if sync else found


def broadcast(m: Measurements, src: int = 0) -> Measurements:
    """Rank ``src``'s measurements on every rank of the default process group (``m`` itself
    when torch.distributed is not initialized or has one process): the ranks of a DDP or
    FSDP run then choose the same plan (``choose`` is deterministic given them), whatever
    their own timings said."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return m
    box = [m]
    dist.broadcast_object_list(box, src=src)
    return box[0]
