"""Drop-in modules: each subclasses the torch module it replaces and calls its op's functional
form (``mesa_lite/ops/<op>.py``) when training with grad; otherwise it runs the plain torch op.

``wrap`` converts a module in place by switching its class (``from_module``): the object, its
Parameters, buffers, hooks and state_dict keys stay the same; ``to_original`` switches back.
"""

from __future__ import annotations

import copy
import functools
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from mesa_lite.config import QuantSpec
from mesa_lite.ops.activation import _silu_, activation, silu_grad
from mesa_lite.ops.attention import scaled_dot_product_attention, sdpa_backends_enabled
from mesa_lite.ops.avg_pool import adaptive_avg_pool2d, avg_pool2d
from mesa_lite.ops.batch_norm import batch_norm, instance_norm
from mesa_lite.ops.common import check_cpu_bf16, in_functorch_transform, needs_grad
from mesa_lite.ops.conv import conv, same_padding
from mesa_lite.ops.dropout import dropout
from mesa_lite.ops.gelu import gelu
from mesa_lite.ops.group_norm import group_norm
from mesa_lite.ops.hardswish import hardswish
from mesa_lite.ops.layer_norm import layer_norm
from mesa_lite.ops.linear import linear
from mesa_lite.ops.matmul import matmul
from mesa_lite.ops.max_pool import max_pool2d
from mesa_lite.ops.relu import relu
from mesa_lite.ops.rms_norm import rms_forward, rms_norm
from mesa_lite.ops.softmax import softmax

__all__ = [
    "MesaModule",
    "FusedBlock",
    "Linear",
    "GELU",
    "Softmax",
    "LayerNorm",
    "MatMul",
    "Activation",
    "SiLU",
    "Dropout",
    "RMSNorm",
    "matmul",
    "softmax",
    "scaled_dot_product_attention",
]


class MesaModule:
    """Mixin of every mesa_lite module: the spec, the switch between paths, the class swap."""

    mesa_kind: ClassVar[str] = ""
    mesa_spec: QuantSpec | None = None
    # a norm or activation whose output only the next layers of its block read (set by the
    # Hugging Face integration's ``after_wrap``): its codes serve them under torch.compile too
    # (``ops.common.shared_output``)
    mesa_share_traced: bool = False

    def _mesa_active(self, *tensors: torch.Tensor | None) -> bool:
        active = self.mesa_spec is not None and self.training and needs_grad(*tensors)
        if active and tensors[0] is not None:
            check_cpu_bf16(tensors[0])
        return active

    def extra_repr(self) -> str:
        base = super().extra_repr()
        mesa = "mesa=off" if self.mesa_spec is None else f"mesa={self.mesa_spec.describe()}"
        return f"{base}, {mesa}" if base else mesa

    @classmethod
    def from_module(cls, module: nn.Module, spec: QuantSpec) -> nn.Module:
        """Converts ``module`` in place into this class and returns it.

        The module stays an instance of its own class: when this class does not already
        subclass it (a subclass of ``nn.Linear``, timm's ``LayerNorm``), the module takes
        ``converted_class(cls, its class)``. A module with ``torch.nn.utils.parametrize``
        parametrizations keeps them: its class becomes a parametrized class over the new
        one, with the same parametrized attributes.
        """
        orig = base_type(module)
        target = converted_class(cls, orig)
        for key in _STATE:  # what an earlier wrap learned (ops/relu.py) starts over
            module.__dict__.pop(key, None)
        module.__dict__["_mesa_orig_cls"] = orig
        _set_class(module, target)
        module.mesa_spec = spec
        module._mesa_converted()
        return module

    def _mesa_converted(self) -> None:
        """Called once the module is in its converted class (``from_module``, or ``wrap``
        putting a wrapped module back): what a class records then."""

    def to_original(self) -> nn.Module:
        """Converts back in place to the class ``from_module`` found (parametrizations added or
        removed since are kept as they are)."""
        orig = self.__dict__.pop("_mesa_orig_cls", None)
        self.__dict__.pop("mesa_spec", None)
        for key in _STATE:
            self.__dict__.pop(key, None)
        if orig is not None:
            _set_class(self, orig)
        else:  # built as a mesa_lite module: stays one, exact
            self.mesa_spec = None
        return self


# attributes a converted module learns while training (ops/relu.py), dropped by to_original and
# by a new from_module
_STATE = ("_mesa_relu_state", "_mesa_last_offer", "_mesa_unclaimed", "_mesa_proved_attrs")

_GLOBAL_HOOKS = tuple(
    d
    for d in (
        getattr(torch.nn.modules.module, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )
    if d is not None
)


class FusedBlock:
    """Mixin of block classes (a transformer block) whose forward may run block-level
    Functions (``mesa_lite.blocks``) instead of calling its sub-layers one by one.

    ``wrap`` converts a registered block type in place after converting its layers
    (``fuse``); ``unwrap`` converts it back (``unfuse``). The block is not a ``MesaModule``:
    it compresses nothing itself and carries no spec; it takes the spec its wrapped sub-layers
    share, and whenever they differ, or a condition of the fused path fails, it runs its own
    class's forward through the per-op modules.
    """

    @classmethod
    def fuse(cls, module: nn.Module) -> nn.Module:
        orig = base_type(module)
        module.__dict__["_mesa_block_cls"] = orig
        _set_class(module, converted_class(cls, orig))
        return module

    def unfuse(self) -> nn.Module:
        orig = self.__dict__.pop("_mesa_block_cls", None)
        self.__dict__.pop("_mesa_unfused_keys", None)
        if orig is not None:
            _set_class(self, orig)
        return self

    def _mesa_block_active(self, x: torch.Tensor) -> bool:
        """Training with grad on a non-empty floating input, outside torch.func transforms,
        with no global module hooks (they would expect the sub-layers' forwards to run)."""
        if not (self.training and torch.is_grad_enabled() and x.is_floating_point()):
            return False
        if x.numel() == 0:
            return False
        if any(_GLOBAL_HOOKS) or in_functorch_transform():
            return False
        check_cpu_bf16(x)
        return True

    def _mesa_unfused_attention(self, x: torch.Tensor, remember: bool = False) -> bool:
        """Whether inputs like ``x`` (shape, dtype, device, autocast, the SDPA backends
        enabled) were found unsupported by the fused attention half before; ``remember``
        records them."""
        key = (tuple(x.shape), x.dtype, x.device, torch.is_autocast_enabled(x.device.type),
               sdpa_backends_enabled())  # fmt: skip
        keys = self.__dict__.setdefault("_mesa_unfused_keys", set())
        if remember:
            keys.add(key)
        return key in keys


def proof_attrs(m: nn.Module):
    """``(name, value)`` of the attributes of ``m`` a proof (``recognize``) depends on: public,
    not its mode or mesa_lite setting, not a tensor or a module."""
    for k, v in vars(m).items():
        if k.startswith("_") or k in ("training", "mesa_spec"):
            continue
        if not isinstance(v, (torch.Tensor, nn.Module)):
            yield k, v


_PLAIN = (bool, int, float, str, type(None), tuple)
_CONTAINERS = (dict, list, set)
_MISSING = object()

# The fields of held objects (a model config) that proofs read, by the object's id: ``id ->
# (object, {field: value})``, filled while ``recognize``'s proofs run (``record_read``) and
# cleared with its cache (one ``wrap`` walk).
FIELD_READS: dict[int, tuple[object, dict[str, object]]] = {}


def held_object(value) -> bool:
    """An object a module holds whose fields a forward may read (a model config): not a plain
    value, container, tensor, module, class or callable."""
    return not (isinstance(value, (*_PLAIN, *_CONTAINERS, torch.Tensor, nn.Module, type))
                or callable(value))  # fmt: skip


def _value_copy(value):
    """What to compare a value with later: plain values as they are, a container's contents
    copied, anything else by identity."""
    return copy.deepcopy(value) if isinstance(value, _CONTAINERS) else value


def record_read(obj, name: str, value) -> None:
    """Notes that a proof read ``obj.name`` (the first value read is the one assumed)."""
    if name.startswith("_") or callable(value):  # methods: a new object on each read
        return
    FIELD_READS.setdefault(id(obj), (obj, {}))[1].setdefault(name, _value_copy(value))


def _same_value(now, then) -> bool:
    if isinstance(then, _PLAIN):
        return type(now) is type(then) and bool(now == then)
    if isinstance(then, _CONTAINERS):
        return bool(now == then)
    return now is then


class _Fields(tuple):
    """``(field, value)`` pairs a proof read from a held object (``FIELD_READS``)."""

    def same(self, obj) -> bool:
        try:
            return all(_same_value(getattr(obj, k, _MISSING), v) for k, v in self)
        except Exception:  # noqa: BLE001 - a field whose == is not a bool: changed
            return False


def _snapshot(value):
    """What to compare with later, for a value a module holds: a copy of a container's contents
    (a forward may read it, and it may change in place); for a held object (a model config)
    the fields a proof read from it and their values, so that a change to any other
    (``config.use_cache = False`` after wrap, which Hugging Face scripts do) leaves fusion on;
    None for anything else."""
    if isinstance(value, _CONTAINERS):
        return copy.deepcopy(value)
    if held_object(value):
        obj, reads = FIELD_READS.get(id(value), (None, None))
        if obj is value and reads:
            return _Fields(reads.items())
    return None


def _modules_but(module: nn.Module, opaque) -> list[nn.Module]:
    """``module`` and its sub-modules, each once, leaving out every sub-module ``opaque``
    holds true for and everything inside it."""
    out, seen, todo = [], set(), [module]
    while todo:
        m = todo.pop()
        if id(m) in seen or (m is not module and opaque(m)):
            continue
        seen.add(id(m))
        out.append(m)
        todo.extend(reversed(list(m.children())))
    return out


def proved_attrs(module: nn.Module, opaque=None) -> tuple:
    """``(sub-module, name, value, copy)`` for each plain attribute of ``module`` and its
    children that a proof assumed (tensors, modules and private names left out, and a
    dropout's ``p``: the fused path reads it on each call); ``copy``: ``_snapshot``'s.
    ``opaque(sub-module)`` True: a child the proved path calls as the module's own forward
    does (an adapter layer), a black box to the proof: neither its attributes nor those of
    its sub-modules are recorded (PEFT's ``add_adapter`` and merges change them)."""
    mods = module.modules() if opaque is None else _modules_but(module, opaque)
    return tuple((m, k, v, _snapshot(v)) for m in mods for k, v in proof_attrs(m)
                 if not (k == "p" and isinstance(m, nn.Dropout)))  # fmt: skip


def still_proved(m: nn.Module) -> bool:
    """Whether ``m``'s attributes are those its proof ran with (``proved_attrs``): each the
    same object or an equal plain value, a container's contents equal to their copy, the
    fields a proof read from a held object equal to what it read (a microsecond or so per
    attribute a call)."""
    items = m.__dict__.get("_mesa_proved_attrs")
    if items is None:
        return False
    for sub, k, v, contents in items:
        now = sub.__dict__.get(k, _MISSING)
        if now is not v and not (type(now) is type(v) and isinstance(v, _PLAIN) and now == v):
            return False
        if contents is None:
            continue
        if type(contents) is _Fields:
            if not contents.same(v):
                return False
            continue
        try:
            if not bool(v == contents):
                return False
        except Exception:  # noqa: BLE001 - contents whose == is not a bool: changed
            return False
    return True


def plain_modules(*modules) -> bool:
    """In training, with no forward or backward hook of their own and no forward set on the
    instance (debugging or adapter code replacing one layer's forward): a block-level
    Function may run in place of their forwards."""
    for m in modules:
        if not m.training or m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
            return False
        if m._backward_hooks or m._backward_pre_hooks:
            return False
    return True


def base_type(module: nn.Module) -> type:
    """The class of ``module`` under torch's parametrization class, if it has one.

    ``register_parametrization`` gives a module a class of its own, ``Parametrized<Class>``,
    whose only base is the module's class; ``remove_parametrizations`` switches back to it.
    """
    cls = type(module)
    base = cls.__base__
    if parametrize.is_parametrized(module) and cls.__name__ == f"Parametrized{base.__name__}":
        return base
    return cls


_CONVERTED: dict[tuple[type, type], type] = {}


def converted_class(mesa_cls: type, orig: type) -> type:
    """The class a module of class ``orig`` takes when converted to ``mesa_cls``.

    ``mesa_cls`` itself when it already subclasses ``orig``; otherwise a class over both,
    ``(mesa_cls, orig)``, built once per pair and named as ``orig`` (``print(model)`` shows
    the user's class name). Its MRO puts ``mesa_cls``'s forward first and keeps ``orig`` and
    everything ``orig`` defines besides forward; ``isinstance(module, orig)`` still holds.
    Pickling and ``copy.deepcopy`` rebuild it through ``_new_converted`` (the class is not a
    module attribute pickle could find).

    Raises:
        TypeError: the two classes cannot be combined (a layout or MRO conflict).
    """
    if issubclass(mesa_cls, orig):
        return mesa_cls
    key = (mesa_cls, orig)
    cls = _CONVERTED.get(key)
    if cls is None:
        cls = type(
            orig.__name__,
            (mesa_cls, orig),
            {
                "__module__": mesa_cls.__module__,
                "__qualname__": f"{mesa_cls.__qualname__}[{orig.__module__}.{orig.__qualname__}]",
                "__reduce_ex__": _reduce_converted,
                # the chain of classes that rebuilds it (``orig`` may be a converted class)
                "_mesa_classes": (mesa_cls, *vars(orig).get("_mesa_classes", (orig,))),
            },
        )
        _CONVERTED[key] = cls
    return cls


def _reduce_converted(self, protocol):
    # object's own reduction (state, and its errors: torch refuses to pickle parametrized
    # modules) with the class replaced by the pair that rebuilds it
    rv = object.__reduce_ex__(self, protocol)
    return (_new_converted, type(self)._mesa_classes) + tuple(rv[2:])


def _new_converted(*classes: type) -> nn.Module:
    """An empty instance of ``converted_class(classes[0], converted_class(classes[1], ...
    classes[-1]))``, for unpickling and copies."""
    cls = classes[-1]
    for mesa_cls in reversed(classes[:-1]):
        cls = converted_class(mesa_cls, cls)
    return cls.__new__(cls)


def _set_class(module: nn.Module, cls: type) -> None:
    """``module.__class__ = cls``, over a parametrization class if the module has one: a new
    ``Parametrized<cls>`` holding the same parametrized properties (as torch builds one).

    The parametrization class's ``forward`` is not carried over: torch never defines one
    there, and one that is there was put by a base class's ``__init_subclass__`` (Hugging
    Face's ``GradientCheckpointingLayer`` wraps each subclass's forward since transformers
    5.23) around the old class's forward, and would hide ``cls``'s."""
    current = type(module)
    base = base_type(module)
    if base is current:
        module.__class__ = cls
        return
    skip = ("__dict__", "__weakref__", "forward")
    attrs = {k: v for k, v in vars(current).items() if k not in skip}
    module.__class__ = type(f"Parametrized{cls.__name__}", (cls,), attrs)


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``module.weight`` and ``module.bias``, each read once. A forward passes these on and never
    reads the attributes again: a parametrized one is computed on each read (``spectral_norm``
    runs a power iteration and updates its buffers), and torch's own forward reads each once."""
    return module.weight, module.bias


class Linear(MesaModule, nn.Linear):
    """``nn.Linear`` keeping its (autocast-cast) input compressed."""

    mesa_kind = "linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _weight_and_bias(self)
        head = self.__dict__.get("_mesa_head")  # a causal LM's head, fused with its loss
        if head is not None and head.armed:
            deferred = head.defer(x, weight, bias)
            if deferred is not None:
                return deferred
        if not self._mesa_active(x, weight, bias):
            return F.linear(x, weight, bias)
        return linear(x, weight, bias, self.mesa_spec)


class _ConvNd(MesaModule):
    """``nn.Conv1d/2d/3d`` keeping its (autocast-cast) input compressed (``ops/conv.py``):
    any stride, dilation, groups (depthwise too), padding mode and channels-last input.
    ``padding="same"`` that torch pads unevenly runs the plain op."""

    mesa_kind = "conv"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _weight_and_bias(self)
        if not self._mesa_active(x, weight, bias):
            return self._conv_forward(x, weight, bias)
        if x.dim() == len(self.kernel_size) + 1:  # unbatched, as torch runs it: a batch of one
            return self._mesa_conv(x.unsqueeze(0), weight, bias).squeeze(0)
        return self._mesa_conv(x, weight, bias)

    def _mesa_conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """The compressed convolution of a batched ``x`` with the weight and bias ``forward``
        read."""
        nd = len(self.kernel_size)
        padding = self.padding
        if self.padding_mode != "zeros":  # as nn.ConvNd._conv_forward: pad, then no padding
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0,) * nd
        elif padding == "valid":
            padding = (0,) * nd
        elif padding == "same":
            padding = same_padding(self.kernel_size, self.dilation)
            if padding is None:
                return self._conv_forward(x, weight, bias)
        return conv(x, weight, bias, nd, self.stride, padding, self.dilation, self.groups,
                    self.mesa_spec)  # fmt: skip


class Conv1d(_ConvNd, nn.Conv1d):
    """``nn.Conv1d`` keeping its input compressed."""


class Conv2d(_ConvNd, nn.Conv2d):
    """``nn.Conv2d`` keeping its input compressed."""


class Conv3d(_ConvNd, nn.Conv3d):
    """``nn.Conv3d`` keeping its input compressed."""


_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _ConvTransposeNd(MesaModule):
    """``nn.ConvTranspose1d/2d/3d`` keeping its (autocast-cast) input compressed: any stride,
    padding, output padding (or ``output_size``), dilation, groups and channels-last input;
    an unbatched input runs the plain op."""

    mesa_kind = "conv"

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if self.padding_mode != "zeros":  # torch's own error, raised before any read
            return super().forward(x, output_size)
        # nn.ConvTranspose{nd}d.forward, its weight and bias read once for both paths
        nd = len(self.kernel_size)
        output_padding = self._output_padding(
            x, output_size, self.stride, self.padding, self.kernel_size, nd, self.dilation
        )
        weight, bias = _weight_and_bias(self)
        if not self._mesa_active(x, weight, bias) or x.dim() == nd + 1:
            return _CONV_TRANSPOSE[nd](x, weight, bias, self.stride, self.padding, output_padding,
                                       self.groups, self.dilation)  # fmt: skip
        return conv(x, weight, bias, nd, self.stride, self.padding, self.dilation, self.groups,
                    self.mesa_spec, output_padding)  # fmt: skip


class ConvTranspose1d(_ConvTransposeNd, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` keeping its input compressed."""


class ConvTranspose2d(_ConvTransposeNd, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` keeping its input compressed."""


class ConvTranspose3d(_ConvTransposeNd, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` keeping its input compressed."""


class _BatchNormNd(MesaModule):
    """``nn.BatchNorm1d/2d/3d`` in training mode keeping its normalized input compressed
    (``ops/batch_norm.py``); the running statistics and ``num_batches_tracked`` are updated as
    ``nn.BatchNorm``'s own forward updates them. Eval mode (running statistics) runs plain."""

    mesa_kind = "batchnorm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nn.modules.batchnorm._BatchNorm.forward (torch 2.4 to 2.15), the weight and bias read
        # once for both paths
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        # the running statistics: passed to be updated (training, tracked) or used (eval mode)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        weight, bias = _weight_and_bias(self)
        if not self._mesa_active(x, weight, bias):
            batch_stats = self.training or (running_mean is None and running_var is None)
            return F.batch_norm(x, running_mean, running_var, weight, bias, batch_stats, factor,
                                self.eps)  # fmt: skip
        return batch_norm(x, running_mean, running_var, weight, bias, factor, self.eps,
                          self.mesa_spec)  # fmt: skip


class BatchNorm1d(_BatchNormNd, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` keeping its normalized input compressed."""


class BatchNorm2d(_BatchNormNd, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` keeping its normalized input compressed."""


class BatchNorm3d(_BatchNormNd, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` keeping its normalized input compressed."""


class GroupNorm(MesaModule, nn.GroupNorm):
    """``nn.GroupNorm`` keeping its normalized input compressed (``ops/group_norm.py``)."""

    mesa_kind = "groupnorm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _weight_and_bias(self)
        if not self._mesa_active(x, weight, bias):
            return F.group_norm(x, self.num_groups, weight, bias, self.eps)
        return group_norm(x, self.num_groups, weight, bias, self.eps, self.mesa_spec)


class SyncBatchNorm(_BatchNormNd, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` keeping its normalized input compressed where it computes a plain
    batch norm: without an initialized process group (one process). With one, torch's own
    forward runs (its checks, its fall-back for a world of one, and the synchronized
    statistics across processes, whose input is kept uncompressed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return nn.SyncBatchNorm.forward(self, x)
        self._check_non_zero_input_channels(x)
        return _BatchNormNd.forward(self, x)


class _InstanceNormNd(MesaModule):
    """``nn.InstanceNorm1d/2d/3d`` keeping its normalized input compressed when it normalizes
    with the input's statistics (training mode, or no running statistics tracked);
    ``nn.InstanceNorm``'s own forward (checks, unbatched input) calls this
    ``_apply_instance_norm``."""

    mesa_kind = "batchnorm"

    def _apply_instance_norm(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _weight_and_bias(self)
        momentum = self.momentum if self.momentum is not None else 0.0
        if not self._mesa_active(x, weight, bias):  # nn.InstanceNorm's _apply_instance_norm
            return F.instance_norm(x, self.running_mean, self.running_var, weight, bias,
                                   self.training or not self.track_running_stats, momentum,
                                   self.eps)  # fmt: skip
        return instance_norm(x, self.running_mean, self.running_var, weight, bias, momentum,
                             self.eps, self.mesa_spec)  # fmt: skip


class InstanceNorm1d(_InstanceNormNd, nn.InstanceNorm1d):
    """``nn.InstanceNorm1d`` keeping its normalized input compressed."""


class InstanceNorm2d(_InstanceNormNd, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` keeping its normalized input compressed."""


class InstanceNorm3d(_InstanceNormNd, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` keeping its normalized input compressed."""


class MaxPool2d(MesaModule, nn.MaxPool2d):
    """``nn.MaxPool2d`` keeping a byte per output (its window offset) instead of its input and
    int64 indices; with ``return_indices`` it runs plain."""

    mesa_kind = "pool"

    def forward(self, x: torch.Tensor):
        if self.return_indices or not self._mesa_active(x):
            return super().forward(x)
        return max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                          self.ceil_mode)  # fmt: skip


class AvgPool2d(MesaModule, nn.AvgPool2d):
    """``nn.AvgPool2d`` keeping nothing for backward (torch keeps its input)."""

    mesa_kind = "pool"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        return avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                          self.count_include_pad, self.divisor_override)  # fmt: skip


class AdaptiveAvgPool2d(MesaModule, nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` keeping nothing for backward (torch keeps its input unless the
    output is one value per channel)."""

    mesa_kind = "pool"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        return adaptive_avg_pool2d(x, self.output_size)


class ReLU(MesaModule, nn.ReLU):
    """``nn.ReLU`` (in place or not) keeping 1 bit per element instead of its output."""

    mesa_kind = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        return relu(x, self.inplace, module=self, spec=self.mesa_spec)


class Hardtanh(MesaModule, nn.Hardtanh):
    """``nn.Hardtanh`` and ``nn.ReLU6`` (in place or not) keeping 1 bit per element (whether
    the input was strictly inside the range) instead of their input."""

    mesa_kind = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        op = ("hardtanh", self.min_val, self.max_val)
        return relu(x, self.inplace, op, self.mesa_spec.exact)


class Hardswish(MesaModule, nn.Hardswish):
    """``nn.Hardswish`` (MobileNetV3), in place or not, keeping its input in int8 and which
    of its three pieces each element fell on (``ops/hardswish.py``)."""

    mesa_kind = "activation"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        return hardswish(x, self.inplace, self.mesa_spec)


class Hardsigmoid(MesaModule, nn.Hardsigmoid):
    """``nn.Hardsigmoid`` (MobileNetV3's squeeze-excitation gate), in place or not, keeping 1
    bit per element (whether the input was inside (-3, 3)) instead of its input."""

    mesa_kind = "activation"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        return relu(x, self.inplace, ("hardsigmoid",))


class LeakyReLU(MesaModule, nn.LeakyReLU):
    """``nn.LeakyReLU`` (in place or not) keeping 1 bit per element (the input's sign)
    instead of its input."""

    mesa_kind = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        return relu(x, self.inplace, ("leaky", self.negative_slope))


class GELU(MesaModule, nn.GELU):
    """``nn.GELU`` (approximate 'none' or 'tanh') keeping its input compressed."""

    mesa_kind = "gelu"

    @classmethod
    def from_module(cls, module: nn.Module, spec: QuantSpec) -> nn.Module:
        if not hasattr(module, "approximate"):  # timm's own GELU is exact gelu
            module.approximate = "none"
        return super().from_module(module, spec)

    def mesa_formula(self):
        """``(fn, grad_fn)`` as ``Activation.mesa_formula`` gives them (block Functions)."""
        return functools.partial(F.gelu, approximate=self.approximate), self.approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        return gelu(x, self.approximate, self.mesa_spec)


class Softmax(MesaModule, nn.Softmax):
    """``nn.Softmax`` keeping only its output, as uint8 codes."""

    mesa_kind = "softmax"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        dim = self.dim
        if dim is None:  # nn.Softmax's legacy implicit dim
            dim = torch.nn.functional._get_softmax_dim("softmax", x.dim(), 5)
        return softmax(x, dim, self.mesa_spec)


class LayerNorm(MesaModule, nn.LayerNorm):
    """``nn.LayerNorm`` keeping its input compressed plus fp32 mean and rstd."""

    mesa_kind = "layernorm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _weight_and_bias(self)
        shape = tuple(self.normalized_shape)
        if not self._mesa_active(x, weight, bias):
            return F.layer_norm(x, shape, weight, bias, self.eps)
        traced = self.mesa_share_traced
        return layer_norm(x, shape, weight, bias, self.eps, self.mesa_spec, traced)


class MatMul(MesaModule, nn.Module):
    """Batched ``a @ b`` as a module, keeping both operands compressed.

    Args:
        spec: how to compress; None runs the plain op.
    """

    mesa_kind = "matmul"

    def __init__(self, spec: QuantSpec | None = None) -> None:
        super().__init__()
        self.mesa_spec = QuantSpec() if spec is None else spec

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return matmul(a, b, self.mesa_spec if self.training else None)


# activation classes whose forward is GELU, spelled in ops of its own: class -> approximate
# ("none": the erf form, "tanh": the tanh form); the integrations fill it
GELU_FORMS: dict[type, str] = {}


class Activation(MesaModule, nn.Module):
    """An elementwise activation module (``nn.SiLU``, Hugging Face's GELU variants) keeping its
    input compressed: its own forward computes the output (bit for bit), backward
    differentiates that forward at the rebuilt input (``ops/activation.py``). Only for
    modules whose forward is elementwise on one tensor; ``register`` them with this class."""

    mesa_kind = "gelu"

    def mesa_formula(self):
        """``(fn, grad_fn)``: the module's own forward as a function of one tensor, and its
        backward as ``ActivationFn`` takes it: GELU's ``approximate`` for the GELU formulas
        ``GELU_FORMS`` lists, else None (autograd on the formula)."""
        # a partial of a plain function, not the bound ``super().forward``: torch 2.11's Dynamo
        # cannot pass a super() attribute to a Function's apply (a graph break under compile)
        return functools.partial(_activation_forward, self), GELU_FORMS.get(
            self.__dict__.get("_mesa_orig_cls")
        )

    def mesa_inplace_formula(self):
        """The in-place form of the formula, for a module built with ``inplace=True`` (None:
        such a module runs plain)."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x):
            return super().forward(x)
        inplace_fn = None
        if getattr(self, "inplace", False):
            inplace_fn = self.mesa_inplace_formula()
            if inplace_fn is None:
                return super().forward(x)
        fn, grad_fn = self.mesa_formula()
        name, traced = type(self).__name__, self.mesa_share_traced and inplace_fn is None
        return activation(x, fn, self.mesa_spec, grad_fn, name, inplace_fn, traced)


def _activation_forward(module: Activation, x: torch.Tensor) -> torch.Tensor:
    """The forward of the class ``module`` was converted from (``Activation.mesa_formula``)."""
    return super(Activation, module).forward(x)


class SiLU(Activation):
    """SiLU modules (``nn.SiLU``, Hugging Face's ``SiLUActivation``): ``F.silu`` forward and
    its own backward op."""

    mesa_kind = "silu"

    def mesa_formula(self):
        return F.silu, silu_grad

    def mesa_inplace_formula(self):
        return _silu_


def _sigmoid_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # torch's backward reads the output; recomputed from the input, the same values
    return torch.ops.aten.sigmoid_backward(grad, torch.sigmoid(x))


class Sigmoid(Activation):
    """``nn.Sigmoid``: int8 input; backward recomputes the output from it for torch's
    ``sigmoid_backward``."""

    mesa_kind = "activation"

    def mesa_formula(self):
        return torch.sigmoid, _sigmoid_grad


class Dropout(MesaModule, nn.Dropout):
    """``nn.Dropout`` keeping its mask as 1 bit per element (the same draws as PyTorch's)."""

    mesa_kind = "dropout"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesa_spec is None:
            return super().forward(x)
        return dropout(x, self.p, self.training, self.inplace)


def rms_eps(module: nn.Module):
    """A Hugging Face RMSNorm's epsilon: ``variance_epsilon`` (Llama and its copies) or
    ``eps``; None when it has neither."""
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


class RMSNorm(MesaModule, nn.Module):
    """An RMSNorm keeping its normalized input compressed plus fp32 rstd: ``torch.nn.RMSNorm``
    (``F.rms_norm``) and the Hugging Face form (``LlamaRMSNorm`` and its copies: weight
    ``weight``, epsilon ``variance_epsilon`` or ``eps``; see ``ops/rms_norm.py``)."""

    mesa_kind = "rmsnorm"

    def _mesa_converted(self) -> None:
        if not isinstance(self, nn.RMSNorm):  # recognised by proof: what the proof assumed
            self.__dict__["_mesa_proved_attrs"] = proved_attrs(self)

    def _mesa_rms_cfg(self):
        if isinstance(self, nn.RMSNorm):
            return "torch", self.eps, len(self.normalized_shape)
        return "hf", rms_eps(self), 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the module's own forward wherever it is known to run plain before the weight is read
        # (the forward reads it itself). Exact (debug) mode too, as its formula's gradient sums
        # meet the residual stream's in an order only the formula's own graph reproduces.
        spec = self.mesa_spec
        if spec is None or spec.exact or not self.training or not torch.is_grad_enabled():
            return super().forward(x)
        if "_mesa_proved_attrs" in self.__dict__ and not still_proved(self):
            return super().forward(x)  # an attribute its proof read has changed since
        weight = self.weight  # once, as the module's own forward reads it
        form, eps, dims = self._mesa_rms_cfg()
        if not needs_grad(x, weight):  # nothing to differentiate: the plain formula
            if form == "torch":  # nn.RMSNorm.forward
                return F.rms_norm(x, self.normalized_shape, weight, self.eps)
            return rms_forward(x, weight, eps, form, dims)[0]  # the proved HF formula
        return rms_norm(x, weight, eps, form, dims, spec, self.mesa_share_traced)
