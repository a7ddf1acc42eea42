"""The model walk: ``wrap`` converts supported layers in place, ``unwrap`` converts them back."""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable

import torch.nn as nn

from mesa_lite.config import Config
from mesa_lite.integrations import timm as _timm
from mesa_lite.modules import GELU, LayerNorm, Linear, MesaModule, Softmax, base_type

__all__ = ["wrap", "unwrap", "register", "wrapped_modules"]


@dataclasses.dataclass(frozen=True)
class _Entry:
    mesa_cls: type
    kind: str
    accepts: Callable[[nn.Module], bool] | None = None


# Exact types only: a subclass may compute something else in its forward.
_REGISTRY: dict[type, _Entry] = {
    nn.Linear: _Entry(Linear, "linear"),
    nn.GELU: _Entry(GELU, "gelu"),
    nn.Softmax: _Entry(Softmax, "softmax"),
    nn.LayerNorm: _Entry(LayerNorm, "layernorm"),
}


def register(
    orig_type: type,
    mesa_cls: type,
    kind: str,
    accepts: Callable[[nn.Module], bool] | None = None,
) -> None:
    """Maps ``orig_type`` (exact type) to a mesa_lite class for ``wrap``.

    Args:
        orig_type: the module type to convert.
        mesa_cls: a MesaModule subclass of a compatible torch module.
        kind: its layer kind (one of ``config.LAYER_KINDS``), for ``Config.layers``.
        accepts: optional predicate; modules it rejects are left alone.
    """
    if not (isinstance(mesa_cls, type) and issubclass(mesa_cls, MesaModule)):
        raise TypeError(f"mesa_cls must be a MesaModule subclass, got {mesa_cls!r}")
    _REGISTRY[orig_type] = _Entry(mesa_cls, kind, accepts)


for _args in _timm.registrations():
    register(*_args)


def wrapped_modules(model: nn.Module) -> dict[str, MesaModule]:
    """The converted modules of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MesaModule)}


def wrap(
    model: nn.Module,
    config: Config | None = None,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Converts the supported layers of ``model`` in place to keep compressed activations.

    Parameters, buffers, hooks and state_dict keys stay as they are (each module keeps its
    identity; only its class changes). Modules already converted are left as they are, so
    wrapping twice changes nothing; ``unwrap`` first to apply another config.

    Args:
        model: any module; the root itself is converted if it is a supported layer.
        config: what to compress and how; ``Config()`` by default.
        filter_fn: optional ``(name, module) -> bool``; False leaves that module exact.

    Returns:
        ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap: model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError(f"wrap: config must be a mesa_lite.Config, got {type(config).__name__}")
    modules = list(model.named_modules())
    names = [n for n, _ in modules]
    for pattern in config.overrides:
        if not any(n == pattern or fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(
                f"Config.overrides: {pattern!r} matches no module of the model "
                f"(names are those of model.named_modules(), e.g. {names[1:4]})"
            )
    converted = already = 0
    for name, module in modules:
        if isinstance(module, MesaModule):
            already += 1
            continue
        entry = _REGISTRY.get(base_type(module))
        if entry is None or (entry.accepts is not None and not entry.accepts(module)):
            continue
        spec = config.spec_for(name, entry.kind)
        if spec is None or (filter_fn is not None and not filter_fn(name, module)):
            continue
        entry.mesa_cls.from_module(module, spec)
        converted += 1
    if converted == 0 and already == 0:
        warnings.warn(
            f"mesa_lite.wrap: {type(model).__name__} has no supported layers "
            f"(supported: {sorted(t.__name__ for t in _REGISTRY)}); it is returned unchanged",
            stacklevel=2,
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Converts every mesa_lite module of ``model`` back to its original class, in place."""
    for _, module in list(model.named_modules()):
        if isinstance(module, MesaModule):
            module.to_original()
    return model
