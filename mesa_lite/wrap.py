"""The model walk: ``wrap`` converts supported layers in place, ``unwrap`` converts them back.

``wrap`` logs one summary line through ``logging.getLogger("mesa_lite")``: what it converted,
per layer kind and setting, what the user left exact ("left exact by config": kinds outside
``Config.layers``, ``overrides`` with ``enabled=False``, ``filter_fn`` returning False), and the
supported-looking modules it skipped, with the reason (a subclass with its own forward, a
module an ``accepts`` predicate rejects, such as timm's LayerNorm on its fast-norm path).

The line is at INFO level when nothing was skipped that the user did not ask to skip, at
WARNING level otherwise, and when modules of the opt-in kinds (convolutions, batch norms, ...)
that the config leaves out hold most of the model's parameters (a CNN wrapped with the
default layers: the line names the option that compresses them). While the program has not
configured logging (no handler on the root logger nor on ``mesa_lite``'s), ``wrap`` prints
the line on stderr itself, on rank 0 only under torchrun (``RANK``), so that a first wrap
says what it did; ``logging.getLogger("mesa_lite").setLevel(logging.WARNING)`` keeps only
the warnings, ``logging.disable`` silences it. Once logging is configured
(``logging.basicConfig(...)``, a handler of one's own), the line is a record like any
library's: the program's levels and handlers decide (an INFO line needs INFO enabled).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections import Counter
from collections.abc import Callable

import torch.nn as nn

from mesa_lite import checkpoint as _ckpt
from mesa_lite import recognize
from mesa_lite._cli import print_rank0
from mesa_lite.config import (
    CHECKPOINT_INNER,
    LAYER_KINDS,
    OPT_IN_KINDS,
    Config,
    QuantSpec,
    override_matches,
)
from mesa_lite.modules import (
    GELU,
    AdaptiveAvgPool2d,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Dropout,
    FusedBlock,
    GroupNorm,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    LeakyReLU,
    Linear,
    MaxPool2d,
    MesaModule,
    ReLU,
    RMSNorm,
    Sigmoid,
    SiLU,
    Softmax,
    SyncBatchNorm,
    base_type,
    converted_class,
)

__all__ = ["wrap", "unwrap", "register", "wrapped_modules"]

logger = logging.getLogger("mesa_lite")


def _say(level: int, line: str) -> None:
    """``line`` as a record of ``mesa_lite``'s logger once logging is configured, else on
    stderr (rank 0 only; a warning marked ``WARNING:``), unless the logger's own level or
    ``logging.disable`` holds it back."""
    if logging.getLogger().handlers or logger.handlers:
        logger.log(level, line)
    elif level >= (logger.level or logging.INFO) and level > logging.root.manager.disable:
        print_rank0(f"WARNING: {line}" if level >= logging.WARNING else line)


@dataclasses.dataclass(frozen=True)
class _Entry:
    mesa_cls: type
    kind: str
    accepts: Callable[[nn.Module], bool] | None = None
    reason: str | None = None
    # False: the module is left alone and not counted (a Dropout with p == 0 does nothing)
    applies: Callable[[nn.Module], bool] | None = None


def _keeps_conv_forward(base: type) -> Callable[[nn.Module], bool]:
    """Whether a convolution keeps ``base``'s ``_conv_forward`` (the compressed path replaces
    that hook, which weight-standardized convolutions override instead of ``forward``)."""
    return lambda m: type(m)._conv_forward is base._conv_forward


# By type; a subclass of a registered type is converted when it keeps that type's forward
# (``_lookup``), as it then computes the same thing.
_REGISTRY: dict[type, _Entry] = {
    nn.Linear: _Entry(Linear, "linear"),
    nn.GELU: _Entry(GELU, "gelu"),
    nn.Softmax: _Entry(Softmax, "softmax"),
    nn.LayerNorm: _Entry(LayerNorm, "layernorm"),
    nn.SiLU: _Entry(SiLU, "silu"),
    nn.Dropout: _Entry(Dropout, "dropout", applies=lambda m: 0 < m.p < 1),
    # opt-in kinds (config.OPT_IN_KINDS): converted only when Config.layers names them
    **{
        t: _Entry(c, "conv", _keeps_conv_forward(t), "subclass with its own _conv_forward")
        for t, c in ((nn.Conv1d, Conv1d), (nn.Conv2d, Conv2d), (nn.Conv3d, Conv3d))
    },
    nn.ConvTranspose1d: _Entry(ConvTranspose1d, "conv"),
    nn.ConvTranspose2d: _Entry(ConvTranspose2d, "conv"),
    nn.ConvTranspose3d: _Entry(ConvTranspose3d, "conv"),
    nn.ReLU: _Entry(ReLU, "relu"),
    nn.ReLU6: _Entry(Hardtanh, "relu"),
    nn.Hardtanh: _Entry(Hardtanh, "relu"),
    nn.LeakyReLU: _Entry(LeakyReLU, "relu"),
    nn.BatchNorm1d: _Entry(BatchNorm1d, "batchnorm"),
    nn.BatchNorm2d: _Entry(BatchNorm2d, "batchnorm"),
    nn.BatchNorm3d: _Entry(BatchNorm3d, "batchnorm"),
    nn.SyncBatchNorm: _Entry(SyncBatchNorm, "batchnorm"),
    nn.InstanceNorm1d: _Entry(InstanceNorm1d, "batchnorm"),
    nn.InstanceNorm2d: _Entry(InstanceNorm2d, "batchnorm"),
    nn.InstanceNorm3d: _Entry(InstanceNorm3d, "batchnorm"),
    nn.MaxPool2d: _Entry(MaxPool2d, "pool"),
    nn.AvgPool2d: _Entry(AvgPool2d, "pool"),
    nn.AdaptiveAvgPool2d: _Entry(AdaptiveAvgPool2d, "pool"),
    nn.GroupNorm: _Entry(GroupNorm, "groupnorm"),
    nn.Hardswish: _Entry(Hardswish, "activation"),
    nn.Hardsigmoid: _Entry(Hardsigmoid, "activation"),
    nn.Sigmoid: _Entry(Sigmoid, "activation"),
}
if hasattr(nn, "RMSNorm"):
    _REGISTRY[nn.RMSNorm] = _Entry(RMSNorm, "rmsnorm")


# Subclasses that keep their base's forward but whose owner never calls it: converting them would
# change nothing, and the summary would claim coverage that is not there.
_NOT_CALLED: dict[type, str] = {}
_ndq = getattr(nn.modules.linear, "NonDynamicallyQuantizableLinear", None)
if _ndq is not None:
    _NOT_CALLED[_ndq] = "nn.MultiheadAttention's out_proj: its weight is used, not its forward"


def register(
    orig_type: type,
    mesa_cls: type,
    kind: str,
    accepts: Callable[[nn.Module], bool] | None = None,
    reason: str | None = None,
) -> None:
    """Maps ``orig_type`` to a mesa_lite class for ``wrap``.

    Subclasses of ``orig_type`` are converted too when neither they nor any class between them
    and ``orig_type`` override ``forward``; the others are skipped and named in ``wrap``'s log.
    Register a subclass explicitly when its own forward computes the same thing.

    Args:
        orig_type: the module type to convert.
        mesa_cls: a MesaModule subclass of a compatible torch module.
        kind: its layer kind (one of ``config.LAYER_KINDS``), for ``Config.layers``.
        accepts: optional predicate; modules it rejects are left alone (and reported).
        reason: what a module ``accepts`` rejects has, for ``wrap``'s log (e.g.
            ``"fast-norm path on"``); the predicate's name by default.
    """
    if not (isinstance(mesa_cls, type) and issubclass(mesa_cls, MesaModule)):
        raise TypeError(f"mesa_cls must be a MesaModule subclass, got {mesa_cls!r}")
    _REGISTRY[orig_type] = _Entry(mesa_cls, kind, accepts, reason)


# Types known by structure rather than by name (RMSNorms proved equal to their formula,
# transformers' attention classes): (matches(module), mesa_lite class, kind, accepts or None,
# why accepts rejects); ``accepts`` may return the reason itself instead of False
_STRUCTURAL: list[tuple] = list(recognize.structural())

# Block types whose halves may run as block-level Functions when their layers are wrapped
# alike (``modules.FusedBlock``); exactly these types (a subclass may compute otherwise)
_BLOCKS: dict[type, type] = {}

# The integrations loaded so far: name -> module (``_load_integrations``)
_INTEGRATIONS: dict = {}


def _load_integrations() -> None:
    """Loads the timm and transformers integrations once their library is in use: a model
    with their classes means the user imported them, so a model without them (or a first
    ``wrap`` of a plain ``nn.Sequential``) does not pay for importing them (1.7 s). An entry
    the user registered for one of their classes first is kept."""
    import importlib
    import sys

    for name in ("timm", "transformers"):
        if name in _INTEGRATIONS or name not in sys.modules:
            continue
        integration = importlib.import_module(f"mesa_lite.integrations.{name}")
        _INTEGRATIONS[name] = integration
        for args in integration.registrations():
            if args[0] not in _REGISTRY:
                register(*args)
        if name == "timm":
            _BLOCKS.update(integration.block_registrations())
        else:
            _STRUCTURAL.extend(integration.structural())


# and blocks recognised by proof (``mesa_lite.recognize``): module -> FusedBlock class, the
# reason a candidate was refused, or None
_BLOCK_MATCHERS: list[Callable] = list(recognize.block_matchers())


def _fused_class(module: nn.Module) -> type | str | None:
    fused = _BLOCKS.get(base_type(module))
    if fused is not None:
        return fused
    for match in _BLOCK_MATCHERS:
        fused = match(module)
        if fused is not None:
            return fused
    return None


def _fuse_blocks(model: nn.Module) -> tuple[Counter[str], Counter[tuple[str, str]]]:
    """Converts the registered and recognised blocks of ``model`` that hold a converted layer
    (unfused first, so that wrapping again starts afresh); returns the blocks fused by proof
    (class name -> count) and the candidates refused (``(class name, why)`` -> count)."""
    fused_by_proof: Counter[str] = Counter()
    refused: Counter[tuple[str, str]] = Counter()
    for module in model.modules():
        if isinstance(module, FusedBlock):
            module.unfuse()
        if not any(isinstance(m, MesaModule) for m in module.modules()):
            continue
        fused = _fused_class(module)
        if isinstance(fused, str):
            refused[(type(module).__name__, fused)] += 1
        elif fused is not None:
            name = f"{type(module).__name__} as {fused.__name__}"
            fused.fuse(module)
            if base_type(module) not in _BLOCKS and recognize.fused_layers_converted(module):
                fused_by_proof[name] += 1
    return fused_by_proof, refused


def wrapped_modules(model: nn.Module) -> dict[str, MesaModule]:
    """The mesa_lite modules of ``model`` by name.

    Args:
        model: any module.

    Returns:
        ``{name: module}`` for every mesa_lite module in ``model.named_modules()`` order, with
        the names ``named_modules`` gives (``""`` for the root): the modules ``wrap`` converted
        and the mesa_lite modules built directly. Each carries its setting in ``mesa_spec``
        (None: exact).

    Example::

        >>> model = mesa_lite.wrap(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.ReLU()))
        >>> {n: m.mesa_spec.describe() for n, m in mesa_lite.wrapped_modules(model).items()}
        {'0': 'int8 g128 nearest', '1': 'int8 g128 nearest'}
    """
    return {n: m for n, m in model.named_modules() if isinstance(m, MesaModule)}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What ``wrap`` does with one module in its original class."""

    kind: str
    entry: _Entry | None = None  # set: convert with ``spec``
    spec: QuantSpec | None = None
    skip: str | None = None  # set: skipped for this reason (the user did not ask for it)
    opt_out: bool = False  # an opt-in kind the config does not name (counted for the summary)


def _lookup(cls: type, module: nn.Module) -> tuple[type, _Entry] | None:
    """The nearest registered class in ``cls``'s MRO and its entry, or for a module known by
    structure, its own class and an entry."""
    for k in cls.__mro__:
        entry = _REGISTRY.get(k)
        if entry is not None:
            return k, entry
    for matches, mesa_cls, kind, accepts, reason in _STRUCTURAL:
        if matches(module):
            return cls, _Entry(mesa_cls, kind, accepts, reason)
    return None


def _plan(
    name: str,
    module: nn.Module,
    config: Config,
    filter_fn: Callable[[str, nn.Module], bool] | None,
) -> _Plan | None:
    """None for a module wrap has nothing to do with; else convert, exact by config, or skip."""
    cls = base_type(module)
    found = _lookup(cls, module)
    if found is None:
        return None
    registered, entry = found
    if entry.applies is not None and not entry.applies(module):
        return None
    if entry.kind in OPT_IN_KINDS and entry.kind not in config.layers:
        return _Plan(entry.kind, opt_out=True)  # not wrap's business but for its summary
    spec = config.spec_for(name, entry.kind)
    if spec is None or (filter_fn is not None and not filter_fn(name, module)):
        return _Plan(entry.kind)  # left exact by config
    if cls in _NOT_CALLED:
        return _Plan(entry.kind, skip=_NOT_CALLED[cls])
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(False)):
        # a lazy module turns into its base class on its first call, under a running forward
        return _Plan(entry.kind, skip="lazy parameters not initialized: wrap after a first call")
    if cls.forward is not registered.forward:
        owner = next(k for k in cls.__mro__ if "forward" in vars(k))
        why = f"subclass of {registered.__name__} with its own forward"
        if owner is not cls:
            why = f"subclass of {registered.__name__}; {owner.__name__} overrides forward"
        return _Plan(entry.kind, skip=why)
    ok = True if entry.accepts is None else entry.accepts(module)
    if ok is not True:
        why = ok if isinstance(ok, str) else entry.reason
        why = why or f"rejected by {getattr(entry.accepts, '__qualname__', 'accepts')}"
        return _Plan(entry.kind, skip=why)
    try:
        converted_class(entry.mesa_cls, cls)
    except TypeError as e:
        return _Plan(entry.kind, skip=f"cannot combine with {entry.mesa_cls.__name__}: {e}")
    return _Plan(entry.kind, entry, spec)


def wrap(
    model: nn.Module,
    config: Config | None = None,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Converts the supported layers of ``model`` in place to keep compressed activations.

    Parameters, buffers, hooks and state_dict keys stay as they are (each module keeps its
    identity; only its class changes, and the module stays an instance of its own class).
    A subclass of a supported type is converted when it keeps that type's ``forward``; one
    with its own ``forward`` is skipped and reported.

    On a model already wrapped, ``wrap`` applies ``config`` anew: the result equals
    ``wrap(unwrap(model), config, filter_fn)``, with the same module objects (modules the new
    config excludes go back to their own class, the others carry the new setting). Wrapping
    twice with the same config changes nothing. mesa_lite modules built directly (not
    converted by ``wrap``) keep their own setting.

    Logs one summary line through ``logging.getLogger("mesa_lite")`` (INFO, or WARNING when a
    supported-looking module was skipped for a reason other than ``config``/``filter_fn``, or
    when opt-in kinds the config leaves out hold most of the parameters),
    e.g. ``mesa_lite.wrap: converted 5 modules of Net (linear 3, layernorm 1, gelu 1) at
    int8 g128 nearest; skipped 2: LayerNorm2d x2 (subclass of LayerNorm with its own
    forward)``, printed on stderr unless logging is configured (this module's docstring).

    Args:
        model: any module; the root itself is converted if it is a supported layer.
        config: what to compress and how; ``Config()`` by default.
        filter_fn: optional ``(name, module) -> bool``; False leaves that module exact. It sees
            each module in its own class (a wrapped one is switched back while it decides).

    Returns:
        ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap: model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError(f"wrap: config must be a mesa_lite.Config, got {type(config).__name__}")
    recognize.reset()
    try:
        return _wrap(model, config, filter_fn)
    finally:
        recognize.reset()


def _wrap(model, config, filter_fn):
    _load_integrations()
    modules = list(model.named_modules())
    names = [n for n, _ in modules]
    for pattern in config.overrides:
        if not any(override_matches(n, pattern) for n in names):
            raise ValueError(
                f"Config.overrides: {pattern!r} matches no module of the model "
                f"(names are those of model.named_modules(), e.g. {names[1:4]})"
            )
    _ckpt.remove(model)
    units = _ckpt.find_units(model, config)
    if units:
        _check_no_other_checkpointing(model)
    unit_names = [n for n, _ in units]
    user_filter = filter_fn
    inner = CHECKPOINT_INNER[config.checkpoint_inner]
    if units and inner != CHECKPOINT_INNER["compressed"]:
        # inside checkpointed modules only the kinds ``checkpoint_inner`` names are wrapped;
        # the others stay plain (their recompute keeps exact activations)
        def filter_fn(name, module, _user=user_filter):
            if _ckpt.inside(name, unit_names):
                found = _lookup(base_type(module), module)
                if found is None or found[1].kind not in inner:
                    return False
            return _user is None or _user(name, module)

    converted: Counter[str] = Counter()
    specs: Counter[str] = Counter()
    exact: Counter[str] = Counter()
    skipped: Counter[tuple[str, str]] = Counter()
    opt_out: Counter[str] = Counter()  # modules of opt-in kinds the config leaves out
    opt_out_params = 0
    built = before = changed = back = 0
    for name, module in modules:
        prev = prev_base = None
        if isinstance(module, MesaModule):
            if "_mesa_orig_cls" not in module.__dict__:
                built += 1  # built as a mesa_lite module: its own setting
                continue
            # decide as on the unwrapped module, and put it back as it was if nothing changes
            before += 1
            prev = (type(module), module.mesa_spec, module.__dict__["_mesa_orig_cls"])
            prev_base = base_type(module)
            module.to_original()
        try:
            plan = _plan(name, module, config, filter_fn)
        except BaseException:
            if prev is not None:
                _restore(module, *prev)
            raise
        if plan is None or plan.entry is None:
            if plan is not None and plan.opt_out:
                opt_out[plan.kind] += 1
                opt_out_params += _numel(module.parameters(recurse=False))
            elif plan is not None and plan.skip is None:
                exact[plan.kind] += 1
            elif plan is not None:
                skipped[(base_type(module).__name__, plan.skip)] += 1
            back += prev is not None  # a wrapped module the new config excludes: stays exact
            continue
        target = converted_class(plan.entry.mesa_cls, base_type(module))
        if prev is not None and prev_base is target:
            same = prev[1] == plan.spec
            _restore(module, prev[0], prev[1] if same else plan.spec, prev[2])
            changed += not same
        else:
            plan.entry.mesa_cls.from_module(module, plan.spec)
            changed += prev is not None
        converted[plan.kind] += 1
        specs[plan.spec.describe()] += 1
    if not converted and not built and not exact:
        warnings.warn(
            f"mesa_lite.wrap: {type(model).__name__} has no supported layers (compresses "
            f"{', '.join(k for k in LAYER_KINDS if k not in OPT_IN_KINDS)}; opt-in: "
            f"{', '.join(sorted(OPT_IN_KINDS))}; mesa_lite.supported_layers() lists them); "
            "returned unchanged",
            stacklevel=2,
        )
    by_proof, not_fused = _fuse_blocks(model)
    _ckpt.apply(units, config.checkpoint_spec(), model)
    hf = _INTEGRATIONS.get("transformers")
    losses, losses_exact, heads = hf.after_wrap(model, config, user_filter) if hf else ([], 0, [])
    for spec in losses:
        converted["loss"] += 1
        specs[spec.describe()] += 1
    if losses_exact:
        exact["loss"] += losses_exact
    line = _summary(
        type(model).__name__, converted, specs, exact, skipped, built, (before, changed, back)
    )
    if heads:
        line += "; the loss " + ", ".join(heads)
    if by_proof:
        line += "; fused by proof " + ", ".join(f"{t} x{c}" for t, c in by_proof.most_common())
    if not_fused:
        parts = [f"{t} x{c} ({why})" for (t, why), c in not_fused.most_common()]
        line += f"; not fused (their layers run one by one) {sum(not_fused.values())}: "
        line += ", ".join(parts)
    if units:
        kinds = Counter(type(m).__name__ for _, m in units)
        line += (
            f"; checkpointed {len(units)} modules ({_kinds(kinds)}) keeping their input "
            + (
                "exactly"
                if config.checkpoint_bits == "exact"
                else f"at {config.checkpoint_spec().describe()}"
            )
            + f", {config.checkpoint_inner} inside"
        )
    total = _numel(model.parameters())
    bulk_plain = bool(opt_out) and opt_out_params * 2 > total
    if bulk_plain:
        line += (
            f"; left plain {sum(opt_out.values())} modules of the opt-in kinds "
            f"({_kinds(opt_out)}) holding {100 * opt_out_params / total:.0f}% of the "
            "parameters: Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS) "
            "compresses them too"
        )
    if not _QUIET:
        _say(logging.WARNING if skipped or bulk_plain else logging.INFO, line)
    return model


_QUIET: list[bool] = []  # non-empty inside quietly()


@contextlib.contextmanager
def quietly():
    """``wrap`` logs no summary line inside the block: for a library's own copies of a model
    (the planner wraps one per policy it measures), not the user's wrap."""
    _QUIET.append(True)
    try:
        yield
    finally:
        _QUIET.pop()


def _numel(params) -> int:
    """Elements of ``params`` (a lazy module's uninitialized ones count 0)."""
    return sum(0 if isinstance(p, nn.parameter.UninitializedParameter) else p.numel()
               for p in params)  # fmt: skip


def _check_no_other_checkpointing(model: nn.Module) -> None:
    """Config.checkpoint replaces a model's own activation checkpointing; both at once would
    recompute every block twice."""
    for name, m in model.named_modules():
        for flag in _ckpt.OTHER_CHECKPOINTING:
            if getattr(m, flag, False) is True:
                raise ValueError(
                    f"wrap: Config.checkpoint replaces the model's own activation "
                    f"checkpointing, which is on ({name or type(m).__name__}.{flag}); turn it "
                    f"off first ({_ckpt.turn_off_hint(flag)})"
                )


def _restore(module: nn.Module, cls: type, spec: QuantSpec, orig: type) -> None:
    """Puts a module ``to_original`` switched back into its converted class and setting."""
    module.__class__ = cls
    module.__dict__["_mesa_orig_cls"] = orig
    module.mesa_spec = spec
    module._mesa_converted()


def _kinds(counts: Counter[str]) -> str:
    """``linear 24, gelu 12``: most first, ties in ``LAYER_KINDS`` order."""
    order = {k: i for i, k in enumerate(LAYER_KINDS)}
    items = sorted(counts.items(), key=lambda kv: (-kv[1], order.get(kv[0], len(order)), kv[0]))
    return ", ".join(f"{k} {n}" for k, n in items)


def _summary(
    model_name: str,
    converted: Counter[str],
    specs: Counter[str],
    exact: Counter[str],
    skipped: Counter[tuple[str, str]],
    built: int,
    rewrap: tuple[int, int, int],
) -> str:
    n = sum(converted.values())
    line = f"mesa_lite.wrap: converted {n} module{'' if n == 1 else 's'} of {model_name}"
    if n:
        line += f" ({_kinds(converted)}) at "
        if len(specs) == 1:
            line += next(iter(specs))
        else:
            line += ", ".join(f"{s} x{c}" for s, c in specs.most_common())
    before, changed, back = rewrap
    if before:
        line += (
            f"; re-wrap: {before} converted before, {changed} given a new setting, "
            f"{back} back to their own class"
        )
    if exact:
        line += f"; left exact by config {sum(exact.values())} ({_kinds(exact)})"
    if built:
        line += f"; {built} built as mesa_lite modules keep their own setting"
    if skipped:
        parts = [f"{t} x{c} ({why})" for (t, why), c in skipped.most_common()]
        line += f"; skipped {sum(skipped.values())}: " + ", ".join(parts)
    return line


def supported_layers() -> list[str]:
    """The layer classes ``wrap`` converts, by import path (torch's and timm's share names
    such as GELU), with those of timm and transformers once they are imported; layers
    recognised by structure (RMSNorms, MLPs and attention proved equal to mesa_lite's
    formulas) are not listed."""

    def path(t: type) -> str:
        if getattr(nn, t.__name__, None) is t:
            return f"torch.nn.{t.__name__}"
        return f"{t.__module__}.{t.__qualname__}"

    _load_integrations()
    return sorted({path(t) for t in _REGISTRY})


def unwrap(model: nn.Module) -> nn.Module:
    """Converts every mesa_lite module of ``model`` back to its original class, in place."""
    _load_integrations()
    _ckpt.remove(model)
    for _, module in list(model.named_modules()):
        if isinstance(module, MesaModule):
            module.to_original()
        if isinstance(module, FusedBlock):
            module.unfuse()
    if "transformers" in _INTEGRATIONS:
        _INTEGRATIONS["transformers"].after_unwrap(model)
    return model
