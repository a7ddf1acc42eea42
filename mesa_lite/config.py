"""Configuration: what to compress and how.

``Config`` is the user-facing, frozen description of a whole model's compression;
``QuantSpec`` is what one wrapped layer carries (resolved from the Config for its name and kind).
Both validate their fields on construction and name the bad field in the error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

LAYER_KINDS: tuple[str, ...] = (
    "linear", "gelu", "softmax", "layernorm", "matmul", "attention",
    "silu", "rmsnorm", "dropout", "loss", "conv", "relu", "batchnorm",
    "pool", "se", "groupnorm", "activation",
)  # fmt: skip
# Config.layers' default: every kind but the opt-in ones (convolutional networks' layers, opt-in
# while their step costs more than timm's checkpointing on ResNet-50 on the H200;
# Config(layers=DEFAULT_LAYERS | OPT_IN_KINDS) turns them on)
OPT_IN_KINDS: frozenset[str] = frozenset(
    {"conv", "relu", "batchnorm", "pool", "se", "groupnorm", "activation"}
)
DEFAULT_LAYERS: frozenset[str] = frozenset(LAYER_KINDS) - OPT_IN_KINDS
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
SUPPORTED_BITS: tuple[int, ...] = (8, 4, 2)
# Config.checkpoint's structural modes (mesa_lite.checkpoint.find_units)
CHECKPOINT_MODES = ("blocks", "attention", "mlp")
# Config.checkpoint_inner: the layer kinds wrapped inside checkpointed modules
CHECKPOINT_INNER = {
    "exact": frozenset(),
    "norms": frozenset({"layernorm", "rmsnorm"}),
    "compressed": frozenset(LAYER_KINDS),
}
_OVERRIDE_FIELDS = ("bits", "group_size", "rounding", "enabled")


class FrozenMap(Mapping):
    """An immutable, hashable, picklable mapping (``Config.overrides`` and its entries).

    Equality and hash follow insertion order, as the order of overrides matters (later
    matches win).
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | None = None) -> None:
        object.__setattr__(self, "_items", dict(items or {}))

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __eq__(self, other) -> bool:
        if isinstance(other, FrozenMap):
            return tuple(self._items.items()) == tuple(other._items.items())
        return isinstance(other, Mapping) and self._items == dict(other.items())

    def __setattr__(self, name, value):
        raise AttributeError("FrozenMap is immutable")

    def __reduce__(self):
        return (FrozenMap, (self._items,))

    def __repr__(self) -> str:
        return repr(self._items)


def _check_bits(bits: Any, field: str = "bits") -> None:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{field} must be an int, got {type(bits).__name__} {bits!r}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{field} must be one of {list(SUPPORTED_BITS)}, got {bits}")


def _check_group_size(group_size: Any, field: str = "group_size") -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"{field} must be an int, got {type(group_size).__name__} {group_size!r}")
    if group_size < 1:
        raise ValueError(f"{field} must be a positive int, got {group_size}")


def _check_bool(value: Any, field: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{field} must be a bool, got {type(value).__name__}")


def _check_rounding(rounding: Any, field: str = "rounding") -> None:
    if rounding is None:  # the default: nearest at 8 bits, stochastic below
        return
    if not isinstance(rounding, str):
        raise TypeError(f"{field} must be a str, got {type(rounding).__name__} {rounding!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"{field} must be one of {list(ROUNDINGS)}, got {rounding!r}")


def default_rounding(bits: int) -> str:
    """Nearest rounding at 8 bits; stochastic (unbiased) below, where a biased round hurts."""
    return "nearest" if bits == 8 else "stochastic"


def _check_packing(bits: int, group_size: int, field: str = "group_size") -> None:
    per_byte = 8 // bits
    if group_size % per_byte:
        raise ValueError(
            f"{field} must be a multiple of {per_byte} with bits={bits} ({per_byte} codes per "
            f"byte), got {group_size}"
        )


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one layer compresses what it keeps for backward.

    Attributes:
        bits: code width: 8, 4 or 2.
        group_size: elements per fp32 absmax scale, over the flattened tensor (a multiple of
            8 // bits, so that packed codes never share a byte across groups).
        rounding: "nearest" (round half to even) or "stochastic" (unbiased); None picks
            nearest at 8 bits and stochastic below.
        exact: debug setting: keep exact copies instead of codes, through the same code paths.
            Gradients then equal PyTorch's; nothing is saved in memory.
        keep_weight_casts: keep a projection's autocast copy of its weight from forward to
            backward (``Config.keep_weight_casts``).
    """

    bits: int = 8
    group_size: int = 128
    rounding: str | None = None
    exact: bool = False
    keep_weight_casts: bool = False

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_group_size(self.group_size)
        _check_rounding(self.rounding)
        _check_packing(self.bits, self.group_size)
        if self.rounding is None:
            object.__setattr__(self, "rounding", default_rounding(self.bits))
        _check_bool(self.exact, "exact")
        _check_bool(self.keep_weight_casts, "keep_weight_casts")

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    def describe(self) -> str:
        if self.exact:
            return "exact (debug, no compression)"
        return f"int{self.bits} g{self.group_size} {self.rounding}"


@dataclasses.dataclass(frozen=True)
class Config:
    """What ``wrap`` compresses and how.

    Attributes:
        bits: code width for saved activations: 8, 4 or 2.
        group_size: elements per absmax scale (128 by default; any positive int at 8 bits, a
            multiple of 2 at 4 bits and of 4 at 2 bits).
        rounding: "nearest" or "stochastic"; None (the default) picks nearest at 8 bits and
            stochastic below, per layer.
        layers: which layer kinds to wrap, a subset of ``LAYER_KINDS``; by default
            ``DEFAULT_LAYERS``, every kind but the opt-in ``OPT_IN_KINDS`` (``"conv"``,
            ``"relu"``, ``"batchnorm"``, ``"pool"``, ``"se"``, ``"groupnorm"``,
            ``"activation"``: Hardsigmoid, Sigmoid).
        overrides: per-module settings, ``{name_or_glob: {field: value}}`` with fields
            ``bits``, ``group_size``, ``rounding`` and ``enabled`` (False leaves that module
            exact). Names are those of ``model.named_modules()``; fnmatch globs are allowed.
            A pattern applies to the modules it names and to every module inside them (a
            block's name sets its layers). A pattern that matches no module is an error at
            ``wrap`` time.
        debug_exact: keep exact copies instead of codes (for checking gradients against torch).
        checkpoint: compressed checkpointing (``mesa_lite.checkpoint``): None (off), ``"blocks"``
            (the model's repeated blocks, found by structure), ``"attention"`` or ``"mlp"``
            (that part of each block), or a list of module names / fnmatch globs. A module
            checkpointed runs forward keeping only a compressed copy of its input and is
            recomputed from it in backward.
        checkpoint_every: checkpoint every k-th of the selected modules (the first, then every
            k-th); with the structural modes the last block is never checkpointed.
        checkpoint_bits: code width of the checkpointed modules' input copy; None: ``bits``.
            It uses ``group_size`` and ``rounding`` (None: nearest at 8 bits, stochastic below).
            ``"exact"``: keep the input itself, uncompressed (exact checkpointing, as
            ``torch.utils.checkpoint``, with mesa_lite's recompute and ``checkpoint_inner``).
        checkpoint_inner: what the recompute of a checkpointed module keeps (one module at a
            time): ``"exact"``: its layers stay plain; ``"norms"`` (the default): only its
            LayerNorms and RMSNorms are wrapped (their fp32 inputs are the largest tensors a
            transformer block keeps; the rest stays exact and fast); ``"compressed"``: every
            layer is wrapped as everywhere else.
        keep_logits: Hugging Face causal LMs (GPT-2, Llama, Mistral, Qwen2) compute their
            head and loss as one Function in a training forward with ``labels``, the logits
            never built (``outputs.logits`` is None then); True builds and returns them, with
            the chunked loss.
        keep_weight_casts: eager mode under autocast: each projection (Linear, ``Conv1D`` and
            those inside the block Functions) keeps its weight's low-precision copy from
            forward to backward, as plain AMP does, instead of casting the parameter again in
            backward: a cast launch less per projection in backward, for 2 bytes per weight
            element and projection call held until that backward (plain AMP holds the same
            for a weight used once; a weight used by two calls keeps two copies, where
            autocast's cache keeps one). Off by default: the copies count against the
            activation memory saved. Under torch.compile the compiler decides what it keeps.
    """

    bits: int = 8
    group_size: int = 128
    rounding: str | None = None
    layers: frozenset[str] = DEFAULT_LAYERS
    overrides: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=FrozenMap)
    debug_exact: bool = False
    checkpoint: str | tuple[str, ...] | None = None
    checkpoint_every: int = 1
    checkpoint_bits: int | str | None = None
    checkpoint_inner: str = "norms"
    keep_logits: bool = False
    keep_weight_casts: bool = False

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_group_size(self.group_size)
        _check_rounding(self.rounding)
        _check_packing(self.bits, self.group_size)
        if isinstance(self.layers, str) or not isinstance(
            self.layers, (set, frozenset, list, tuple)
        ):
            raise TypeError(
                f"layers must be a set of layer kinds from {list(LAYER_KINDS)}, "
                f"got {type(self.layers).__name__}"
            )
        unknown = sorted(set(self.layers) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"layers has unknown kinds {unknown}; allowed: {list(LAYER_KINDS)}")
        object.__setattr__(self, "layers", frozenset(self.layers))
        if not isinstance(self.overrides, Mapping):
            raise TypeError(f"overrides must be a mapping, got {type(self.overrides).__name__}")
        frozen = {}
        for name, fields in self.overrides.items():
            if not isinstance(name, str):
                raise TypeError(f"overrides keys must be module names (str), got {name!r}")
            if not isinstance(fields, Mapping):
                raise TypeError(
                    f"overrides[{name!r}] must be a mapping, got {type(fields).__name__}"
                )
            field = f"overrides[{name!r}]"
            bad = sorted(set(fields) - set(_OVERRIDE_FIELDS))
            if bad:
                raise ValueError(
                    f"{field} has unknown fields {bad}; allowed: {list(_OVERRIDE_FIELDS)}"
                )
            if "bits" in fields:
                _check_bits(fields["bits"], f"{field}.bits")
            if "group_size" in fields:
                _check_group_size(fields["group_size"], f"{field}.group_size")
            if "rounding" in fields:
                _check_rounding(fields["rounding"], f"{field}.rounding")
            _check_packing(
                fields.get("bits", self.bits), fields.get("group_size", self.group_size), field
            )
            if "enabled" in fields and not isinstance(fields["enabled"], bool):
                raise TypeError(f"{field}.enabled must be a bool, got {fields['enabled']!r}")
            frozen[name] = FrozenMap(fields)
        object.__setattr__(self, "overrides", FrozenMap(frozen))
        for field in ("debug_exact", "keep_logits", "keep_weight_casts"):
            _check_bool(getattr(self, field), field)
        self._check_checkpoint()

    def _check_checkpoint(self) -> None:
        what = self.checkpoint
        if isinstance(what, str):
            if what not in CHECKPOINT_MODES:
                raise ValueError(
                    f"checkpoint must be one of {list(CHECKPOINT_MODES)}, a list of module "
                    f"names or globs, or None; got {what!r}"
                )
        elif what is not None:
            if not isinstance(what, (list, tuple)) or not all(isinstance(n, str) for n in what):
                raise TypeError(
                    f"checkpoint must be one of {list(CHECKPOINT_MODES)}, a list of module "
                    f"names or globs, or None; got {what!r}"
                )
            if not what:
                raise ValueError("checkpoint: an empty list selects nothing; use None for off")
            object.__setattr__(self, "checkpoint", tuple(what))
        every = self.checkpoint_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every must be a positive int, got {every!r}")
        if self.checkpoint_bits is not None and self.checkpoint_bits != "exact":
            if isinstance(self.checkpoint_bits, str):
                raise ValueError(
                    f'checkpoint_bits must be one of {list(SUPPORTED_BITS)}, "exact" or None, '
                    f"got {self.checkpoint_bits!r}"
                )
            _check_bits(self.checkpoint_bits, "checkpoint_bits")
            _check_packing(self.checkpoint_bits, self.group_size, "group_size")
        if self.checkpoint_inner not in CHECKPOINT_INNER:
            raise ValueError(
                f"checkpoint_inner must be one of {list(CHECKPOINT_INNER)}, "
                f"got {self.checkpoint_inner!r}"
            )

    def checkpoint_spec(self) -> QuantSpec:
        """The setting of a checkpointed module's input copy."""
        if self.checkpoint_bits == "exact":
            return QuantSpec(self.bits, self.group_size, self.rounding, exact=True,
                             keep_weight_casts=self.keep_weight_casts)  # fmt: skip
        bits = self.bits if self.checkpoint_bits is None else self.checkpoint_bits
        return QuantSpec(bits, self.group_size, self.rounding, exact=self.debug_exact,
                         keep_weight_casts=self.keep_weight_casts)  # fmt: skip

    def spec_for(self, name: str, kind: str) -> QuantSpec | None:
        """The spec for module ``name`` of layer kind ``kind``, or None to leave it exact.

        Overrides apply in the order given; later matches win.
        """
        if kind not in self.layers:
            return None
        fields: dict[str, Any] = {
            "bits": self.bits,
            "group_size": self.group_size,
            "rounding": self.rounding,
            "enabled": True,
        }
        for pattern, over in self.overrides.items():
            if override_matches(name, pattern):
                fields.update(over)
        if not fields.pop("enabled"):
            return None
        return QuantSpec(exact=self.debug_exact, keep_weight_casts=self.keep_weight_casts,
                         **fields)  # fmt: skip


def override_matches(name: str, pattern: str) -> bool:
    """Whether an override ``pattern`` (a module name or an fnmatch glob) applies to module
    ``name``: the module it names, or one inside it."""
    import fnmatch

    if name == pattern or name.startswith(pattern + ".") or pattern == "":  # "": the root
        return True
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")
