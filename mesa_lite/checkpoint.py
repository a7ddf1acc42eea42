"""Compressed checkpointing: a block runs forward once without keeping anything for backward
but a compressed copy of its input, and backward recomputes it from that copy.

``wrap(model, Config(checkpoint=...))`` turns it on for a model's repeated blocks (found by
structure, ``repeated_blocks``), for the attention or MLP part of each block, or for modules
the user names. Each checkpointed module's class gains ``Checkpointed`` (the same class swap
as the layers; ``unwrap`` or a new ``wrap`` takes it off). Its forward goes through
``CheckpointFn``:

- forward: its first positional argument (the block input, the residual stream) quantized as
  ``Config.checkpoint_bits`` says, the RNG states (CPU and the input's device) and the
  autocast state recorded, then the module's own forward under ``no_grad`` (the plain ops:
  outputs bit-identical to plain training, no autograd graph, nothing kept).
- backward: the input rebuilt from its codes, the forward run again with grad under the
  recorded autocast state and RNG states (dropout and drop-path draw the same masks), and
  ``torch.autograd.grad`` of the recomputed outputs against the rebuilt input and the module's
  parameters, which are inputs of the Function: their gradients flow through the outer graph
  (DDP's and FSDP's hooks and ``find_unused_parameters`` see them as in plain training).

Inside the recompute the block's layers run exact (``checkpoint_inner="exact"``: ``wrap``
leaves the layers inside checkpointed modules in their own class), exact but for the norms
(``"norms"``, the default: a LayerNorm's fp32 input is the largest tensor a block keeps, and
the compressed norm is nearly as fast), or compressed (``"compressed"``: the layers are
wrapped as in the normal mode). Only one block's activations are alive at a time, during its
backward.

Other arguments (masks, rotary tables, a cross-attention input) are kept by reference as they
are (they are shared by every block); those that need grad are inputs of the Function too
(exact) so that their gradients flow.

Random numbers: the recompute replays the RNG states recorded after the input's copy, so
dropout and drop path draw the forward's masks. Stochastic rounding (4 and 2 bits) takes its
seeds from mesa_lite's own counter and draws nothing from torch's generators
(``kernels/group_quant``), so the norms or layers compressed inside the recompute do not move
those masks, and the forward's masks are plain training's.

k/v caches: the recompute never writes a cache. A Hugging Face ``GradientCheckpointingLayer``
(``checkpoint="blocks"`` on a decoder) drops its k/v cache arguments and ``use_cache`` as
Hugging Face's own checkpointing does (a one-time warning; the model returns no filled cache
for those layers). Any other checkpointed module given a cache (``checkpoint="attention"``:
Hugging Face passes ``past_key_values`` to each attention, ``use_cache=True`` being the
default in training too) writes it in its forward as usual, and its recompute runs with the
cache arguments replaced by None. That is exact when the cache held nothing for the module's
layers (its ``layer_idx``, and those of modules inside it) before the forward, which is
checked at forward time: a cache holding tokens, a static cache, or a module with no
``layer_idx`` is refused with a ValueError that says to pass ``use_cache=False``. The cache
the forward fills holds the same keys and values as in plain training, computed without grad.
Caches are kept whole through the argument flattening (not rebuilt if exporting code made
them pytree nodes).

Forward hooks: outputs made inside a checkpointed module come from its forward without grad,
so a hook that keeps one (transformers records ``output_attentions=True`` attention maps and
Mixtral's ``output_router_logits=True`` router logits through forward hooks on submodules)
would hand the caller a tensor with no graph, and a loss on it no gradient. Hooks on the
unit itself see the Function's outputs, which carry the graph. When a forward hook of a
module inside the unit, or a global one, would record in this call (mesa_lite's own hooks
never; transformers' recorders only while the current forward collects their output; any
other hook is assumed to), the call runs under ``torch.utils.checkpoint(use_reentrant=False)``
instead, with a one-time warning: exact gradients for everything the hooks kept, the input
kept uncompressed, the recompute without k/v caches and with the running statistics kept
as the forward left them. Calls without such hooks stay compressed.

Running statistics are updated once per step, by the forward, as in plain training: during
the recompute the modules inside the unit that track them in training (BatchNorm of any
dimension, ``SyncBatchNorm``, timm's ``BatchNormAct2d``, an ``InstanceNorm`` with
``track_running_stats=True``) run with ``track_running_stats = False`` (still normalizing
with the batch's statistics; an InstanceNorm's buffers are set aside too, as it passes them
whatever the flag says), and are put back after, also on an error. Other state a
module changes in its forward (a custom moving average, a counter) is changed twice.

A model's own activation checkpointing turned on after ``wrap`` (Hugging Face's
``activation_checkpointing_enable()``, ``gradient_checkpointing_enable()`` before
transformers 5.23, timm's ``set_grad_checkpointing()``) would recompute
each checkpointed module inside its own recompute (three forwards). ``wrap`` refuses a model
whose flag is already on; for one turned on later, ``apply`` records the modules on each
unit's path from the root, the unit and those inside it that carry a ``gradient_checkpointing``
or ``grad_checkpointing`` attribute, and the unit's first forward in training mode raises a
ValueError naming the flag and how to turn it off.

Under ``torch.compile`` the checkpointed call is a graph break (it runs eagerly); inside
torch.func transforms, in eval mode or with grad off the module runs its plain forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import inspect
import logging
import sys

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from mesa_lite import quant
from mesa_lite.config import Config, QuantSpec
from mesa_lite.modules import _set_class, base_type, converted_class
from mesa_lite.ops.common import first_order_only, in_functorch_transform, warn_once

__all__ = ["Checkpointed", "CheckpointFn", "repeated_blocks", "find_units", "apply", "remove"]

logger = logging.getLogger("mesa_lite")

# child names of a block's attention and MLP parts (timm, Hugging Face), in order of preference
ATTENTION_NAMES = ("attn", "self_attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn", "mlp_block")

# Hugging Face's names for a layer's k/v cache arguments
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


# ---- finding the blocks ----------------------------------------------------------------------


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _is_block(m: nn.Module) -> bool:
    """A block holds parameterized children of at least two types (a norm and an attention, a
    convolution and a norm), not one repeated kind of layer (an expert's three projections)."""
    kinds = {type(c) for c in m.children() if _has_params(c)}
    return len(kinds) >= 2


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """A model's repeated blocks, by structure, in ``named_modules`` order.

    Candidates are the children of an ``nn.ModuleList`` or ``nn.Sequential`` of which at least
    two share one class that is a block (``_is_block``): timm's ``blocks``, Hugging Face's
    ``layers``, ``h`` and ``encoder.layer``. Where candidates nest (Swin's and ConvNeXt's
    stages hold their blocks) the innermost are taken.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        kids = [(f"{name}.{k}" if name else k, c) for k, c in m.named_children()]
        counts: dict[type, int] = {}
        for _, c in kids:
            counts[type(c)] = counts.get(type(c), 0) + 1
        for n, c in kids:
            if counts[type(c)] >= 2 and _is_block(c):
                found.append((n, c))
    names = [n for n, _ in found]
    return [(n, c) for n, c in found if not any(o.startswith(n + ".") for o in names)]


def _part(block_name: str, block: nn.Module, names: tuple[str, ...], what: str):
    for n in names:
        child = getattr(block, n, None)
        if isinstance(child, nn.Module) and _has_params(child):
            return f"{block_name}.{n}", child
    raise ValueError(
        f"Config.checkpoint={what!r}: block {block_name!r} ({type(block).__name__}) has no "
        f"{what} child named one of {list(names)}; name the modules to checkpoint instead "
        f"(Config(checkpoint=['{block_name}.<child>', ...]))"
    )


def find_units(model: nn.Module, config: Config) -> list[tuple[str, nn.Module]]:
    """The modules ``config.checkpoint`` selects, in ``named_modules`` order.

    ``"blocks"``, ``"attention"`` and ``"mlp"`` start from ``repeated_blocks``; of those, every
    ``checkpoint_every``-th is taken (the first, then every k-th after it), never the last: its
    backward comes first, right after forward, so recomputing it would cost time and save
    nothing at the peak. Names or globs select exactly the modules they match (then
    ``checkpoint_every`` applies to that list too, and the last is kept); a glob's matches
    that lie inside another of its matches are dropped (``"blocks.*"`` is the blocks).

    Raises:
        ValueError: nothing found, a pattern that matches no module, or units that nest.
    """
    what = config.checkpoint
    if what is None:
        return []
    if isinstance(what, str):
        blocks = repeated_blocks(model)
        if not blocks:
            raise ValueError(
                f"Config.checkpoint={what!r}: found no repeated blocks in "
                f"{type(model).__name__} (an nn.ModuleList or nn.Sequential of two or more "
                "modules of one class, each with parameterized children of two or more "
                "types); name the modules to checkpoint instead, e.g. "
                "Config(checkpoint=['encoder.*'])"
            )
        blocks = blocks[:-1][:: config.checkpoint_every]
        if what == "blocks":
            return blocks
        names = ATTENTION_NAMES if what == "attention" else MLP_NAMES
        return [_part(n, b, names, what) for n, b in blocks]
    modules = list(model.named_modules())
    units = []
    for pattern in what:
        hits = [(n, m) for n, m in modules if n == pattern or fnmatch.fnmatchcase(n, pattern)]
        # a glob's matches inside another of its matches are dropped ("blocks.*" matches
        # "blocks.0.mlp" too)
        hits = [h for h in hits if not inside(h[0], [n for n, _ in hits])]
        if not hits:
            raise ValueError(
                f"Config.checkpoint: {pattern!r} matches no module of the model (names are "
                f"those of model.named_modules(), e.g. {[n for n, _ in modules[1:4]]})"
            )
        units.extend(h for h in hits if h[0] not in {n for n, _ in units})
    order = {n: i for i, (n, _) in enumerate(modules)}
    units.sort(key=lambda u: order[u[0]])
    for n, _ in units:
        inner = [o for o, _ in units if o.startswith(n + ".") or (n == "" and o)]
        if inner:
            raise ValueError(
                f"Config.checkpoint: {inner[0]!r} lies inside {n!r}, also checkpointed; "
                "checkpointed modules must not nest"
            )
    return units[:: config.checkpoint_every]


def inside(name: str, units: list[str]) -> bool:
    """Whether module ``name`` lies strictly inside one of ``units``."""
    return any(name.startswith(u + ".") or (u == "" and name) for u in units)


# ---- the Function ----------------------------------------------------------------------------


class _Call:
    """One checkpointed call: how to run it again and what it recorded."""

    __slots__ = ("module", "run", "leaves", "treespec", "slots", "params", "formats",
                 "autocast", "rng", "out_spec", "out_slots", "out_rest", "no_cache",
                 "device")  # fmt: skip


def _is_cache(x) -> bool:
    return _cache_type(type(x))


@functools.cache
def _cache_type(cls: type) -> bool:
    """A Hugging Face k/v cache class (``transformers.Cache`` or a subclass), known by name
    (transformers is not imported)."""
    return any(k.__name__ == "Cache" for k in cls.__mro__)


def _flatten(tree) -> tuple[list, object]:
    """``tree_flatten`` with Hugging Face caches kept whole as leaves: exporting code may
    register them as pytree nodes, and unflattening would then build a new cache object, so
    that the forward would write into a copy instead of the caller's cache."""
    return tree_flatten(tree, is_leaf=_is_cache)


def _autocast_state(device_type: str) -> tuple:
    """The autocast settings to re-enter in the recompute (as ``torch.utils.checkpoint``)."""
    cache = torch.is_autocast_cache_enabled()
    return tuple(
        (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), cache)
        for dev in dict.fromkeys((device_type, "cpu"))
    )


def _rng_state(device: torch.device) -> tuple:
    if device.type == "cuda":
        return torch.get_rng_state(), device.index, torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), None, None


@contextlib.contextmanager
def _replay(state: _Call):
    """The recorded RNG and autocast states, and grad mode; the caller's RNG states are
    restored after."""
    cpu, index, dev_state = state.rng
    devices = [] if index is None else [index]
    with torch.random.fork_rng(devices=devices, device_type="cuda"), contextlib.ExitStack() as st:
        torch.set_rng_state(cpu)
        if dev_state is not None:
            torch.cuda.set_rng_state(dev_state, index)
        for dev, enabled, dtype, cache in state.autocast:
            st.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=cache))
        st.enter_context(torch.enable_grad())
        yield


def _tracking(module: nn.Module) -> list[nn.Module]:
    """The modules inside ``module`` that update running statistics in this forward."""
    return [
        m for m in module.modules()
        if m.__dict__.get("track_running_stats") is True and m.training
    ]  # fmt: skip


@contextlib.contextmanager
def _running_stats_frozen(module: nn.Module):
    """The recompute must not update running statistics a second time (BatchNorm's mean,
    variance and ``num_batches_tracked``; the forward updated them): the modules inside
    ``module`` that track them in training (``nn.BatchNorm1d/2d/3d``, ``SyncBatchNorm``,
    timm's ``BatchNormAct2d``, an ``InstanceNorm`` with ``track_running_stats=True``) get
    ``track_running_stats = False`` while it runs, which keeps their batch statistics and
    skips the update; an InstanceNorm passes its buffers whatever that flag says, so they are
    set to None too. Everything is put back after, also on an error."""
    tracked = _tracking(module)
    if not tracked:
        yield
        return
    buffers = []
    try:
        for m in tracked:
            m.track_running_stats = False
            if isinstance(m, nn.modules.instancenorm._InstanceNorm):
                buffers.append((m, m.running_mean, m.running_var))
                m.running_mean = m.running_var = None
        yield
    finally:
        for m in tracked:
            m.track_running_stats = True
        for m, mean, var in buffers:
            m.running_mean, m.running_var = mean, var


_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _running_stats_restored(module: nn.Module):
    """For a recompute that must save the very tensors its forward saved
    (``torch.utils.checkpoint`` checks and matches them by count): the tracking modules run as
    in the forward, updating copies of their running-statistic buffers, and get their own
    buffers back after (the same tensor objects, untouched)."""
    kept = []
    try:
        for m in _tracking(module):
            for name in _RUNNING:
                t = m._buffers.get(name)
                if t is not None:
                    kept.append((m, name, t))
                    m._buffers[name] = t.clone()
        yield
    finally:
        for m, name, t in kept:
            m._buffers[name] = t


def _format(t: torch.Tensor):
    """The memory format to give a rebuilt input (channels_last stays channels_last)."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    if fmt is not None and not t.is_contiguous() and t.is_contiguous(memory_format=fmt):
        return fmt
    return None


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _release(out: torch.Tensor, taken: set[int]) -> None:
    """Frees a recomputed output's memory before its backward runs, where nothing can need
    it: an output made by an out-of-place add (the residual add that ends a block; the add
    keeps nothing for backward, and nothing inside the block ran after it), or a view of one;
    only for a module with one output (with several, one may have been saved to make another:
    ``res = res + h; return norm(res), res``).
    Only the graph behind it is used, and one block's output less is alive at the peak."""
    if out is None:
        return
    base = out if out._base is None else out._base
    fn = base.grad_fn
    if base._base is not None or fn is None or fn.name() != "AddBackward0":
        return
    storage = base.untyped_storage()
    if storage.data_ptr() not in taken:
        storage.resize_(0)


class CheckpointFn(torch.autograd.Function):
    """``state.run`` with nothing kept for backward but a copy of each argument in
    ``state.slots``: compressed (the block input) or the tensor itself (other arguments that
    need grad); backward recomputes (see the module docstring).

    ``tensors``: the ``state.slots`` tensors, then the parameters in ``state.params``.
    Returns the run's floating-point outputs (``state.out_slots`` of its flattened output).
    """

    @staticmethod
    def forward(ctx, state: _Call, spec: QuantSpec, *tensors):
        given = tensors[: len(state.slots)]
        kept = [
            quant.quantize(t, spec) if c else t
            for (_, c), t in zip(state.slots, given, strict=True)
        ]
        state.rng = _rng_state(state.device)
        leaves = list(state.leaves)
        for (i, _), t in zip(state.slots, given, strict=True):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, state.treespec)
        flat, state.out_spec = _flatten(state.run(*args, **kwargs))
        state.out_slots = tuple(i for i, t in enumerate(flat) if _differentiable(t))
        state.out_rest = flat  # the caller takes the other leaves and drops this
        quant.save(ctx, *kept)
        ctx.state = state
        return tuple(flat[i] for i in state.out_slots)

    @staticmethod
    @first_order_only
    def backward(ctx, *grads):
        state: _Call = ctx.state
        needs = ctx.needs_input_grad[2:]
        inputs = []
        rows = zip(quant.load(ctx), state.slots, state.formats, needs, strict=False)
        for item, (_, compress), fmt, need in rows:
            t = quant.dequantize(item) if compress else item.detach()
            if fmt is not None:
                t = t.contiguous(memory_format=fmt)
            inputs.append(t.requires_grad_(need))
        leaves = list(state.leaves)
        for (i, _), t in zip(state.slots, inputs, strict=True):
            leaves[i] = t
        for i in state.no_cache:  # the forward wrote the cache; the recompute runs without
            leaves[i] = None
        args, kwargs = tree_unflatten(leaves, state.treespec)
        with _replay(state), _running_stats_frozen(state.module):
            flat, _ = _flatten(state.run(*args, **kwargs))
        outs, gouts = [], []
        for i, g in zip(state.out_slots, grads, strict=True):
            o = flat[i]
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
                outs.append(o)
                gouts.append(g)
        del flat
        taken = {t.untyped_storage().data_ptr() for t in inputs}
        if len(state.out_slots) == 1:  # with several outputs, one may be saved to make another
            _release(outs[0] if outs else None, taken)
        params = state.params
        if params:  # the tensors the recompute used (FSDP2 may gather into new ones)
            now = tuple(p for p in state.module.parameters() if p.requires_grad)
            if len(now) == len(params):
                params = now
        wrt = [t for t, need in zip((*inputs, *params), needs, strict=True) if need]
        got = iter(torch.autograd.grad(outs, wrt, gouts, allow_unused=True) if outs and wrt else ())
        result = [next(got, None) if need else None for need in needs]
        return (None, None, *result)


# ---- the module side -------------------------------------------------------------------------


def _is_hf_layer(module: nn.Module) -> bool:
    return any(k.__name__ == "GradientCheckpointingLayer" for k in type(module).__mro__)


def _drop_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Hugging Face's own rule under gradient checkpointing: no k/v cache in the layer (the
    recompute would write it again), ``use_cache=False``. A cache may come positionally
    (GPT-2's blocks take ``past_key_values`` second)."""
    if getattr(module, "_can_checkpoint_with_cache", False):
        return args, kwargs
    drop = [i for i, a in enumerate(args) if _is_cache(a)]
    names = [k for k, v in kwargs.items() if v is not None and (k in _CACHE_KWARGS or _is_cache(v))]
    if not (drop or names or kwargs.get("use_cache")):
        return args, kwargs
    args = tuple(None if i in drop else a for i, a in enumerate(args))
    kwargs = {k: None if k in names else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    warn_once(
        "checkpoint-cache",
        f"mesa_lite: checkpointed {type(module).__name__} layers run without their k/v cache "
        "in training (as with Hugging Face's gradient checkpointing): the model returns no "
        "filled cache; pass use_cache=False in training to say so",
    )
    return args, kwargs


def _cache_slots(module: nn.Module, leaves: list) -> tuple[int, ...]:
    """The leaves that are k/v caches the forward may write, to be passed as None in the
    recompute; checked empty for the module's layers (see ``_check_empty_cache``). A Hugging
    Face layer that only reads its cache (``_can_checkpoint_with_cache``) keeps it."""
    slots = tuple(i for i, x in enumerate(leaves) if _is_cache(x))
    if not slots or getattr(module, "_can_checkpoint_with_cache", False):
        return ()
    for i in slots:
        _check_empty_cache(module, leaves[i])
    return slots


def _check_empty_cache(module: nn.Module, cache) -> None:
    """The recompute runs without the cache: right only where the cache held nothing for the
    module's layers before its forward (training from scratch, the cache Hugging Face makes
    with ``use_cache=True``). Then attention over the cache is attention over the new keys
    and values alone, as without a cache. A cache holding earlier tokens, or a static one
    (its keys padded to the cache's length), cannot be recomputed without writing it again."""
    name = type(module).__name__
    layers = sorted({
        m.layer_idx for m in module.modules()
        if isinstance(getattr(m, "layer_idx", None), int)
    })  # fmt: skip
    how = (
        "pass use_cache=False (and no past_key_values) to the model in training, or leave "
        "this module out of Config.checkpoint"
    )
    if not layers:
        raise ValueError(
            f"mesa_lite: checkpointed {name} was given a k/v cache ({type(cache).__name__}) "
            "but has no layer_idx, so mesa_lite cannot tell which cache layers its forward "
            f"writes (its recompute in backward must not write them again); {how}"
        )
    per_layer = getattr(cache, "layers", None)
    for i in layers:
        layer = per_layer[i] if per_layer is not None and i < len(per_layer) else cache
        if getattr(layer, "is_compileable", False):
            raise ValueError(
                f"mesa_lite: checkpointed {name} (layer {i}) was given a static k/v cache "
                f"({type(cache).__name__}); its recompute in backward would run without the "
                f"cache, over other key lengths; {how}"
            )
        try:
            held = cache.get_seq_length(i)
        except Exception as e:  # a layer that does not track lengths (linear attention)
            raise ValueError(
                f"mesa_lite: checkpointed {name} (layer {i}) was given a k/v cache "
                f"({type(cache).__name__}) whose length mesa_lite cannot read ({e}); {how}"
            ) from e
        if held:
            raise ValueError(
                f"mesa_lite: checkpointed {name} (layer {i}) was given a k/v cache "
                f"({type(cache).__name__}) that already holds {held} tokens for its layer; "
                "its recompute in backward cannot attend to them without writing the cache a "
                f"second time; {how}"
            )


@functools.cache
def _row_spec(spec: QuantSpec, row: int) -> QuantSpec:
    """``spec`` with groups that do not straddle rows of ``row`` elements: the residual stream
    is not normalized, and a token whose values are larger than its neighbours' would set the
    scale of theirs. The largest divisor of ``row`` up to ``spec.group_size`` that packs
    whole bytes; ``spec`` itself when ``row`` is a multiple of its group size or none fits."""
    if spec.exact or row % spec.group_size == 0:
        return spec
    unit = 8 // spec.bits
    for g in range(min(spec.group_size, row), 0, -1):
        if row % g == 0 and g % unit == 0:
            return dataclasses.replace(spec, group_size=g)
    return spec


@functools.lru_cache(maxsize=256)
def _input_name(cls: type) -> str | None:
    """The name of the block input, the first parameter (after ``self``) of the first
    ``forward`` in ``cls``'s MRO that names one (mesa_lite's wrapper classes take ``*args,
    **kwargs`` and pass them on), where it may be passed by position; else None."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for c in cls.__mro__:
        if c is nn.Module or "forward" not in c.__dict__:
            continue
        try:
            params = list(inspect.signature(c.__dict__["forward"]).parameters.values())[1:]
        except (TypeError, ValueError):
            return None
        if params and params[0].kind in positional:
            return params[0].name
        if not params or params[0].kind != inspect.Parameter.VAR_POSITIONAL:
            return None
    return None


def _input_by_position(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The block input as the first positional argument where the caller passed it by
    keyword (Llama's, Mistral's and Qwen2's decoder layers call ``self_attn(hidden_states=
    ...)``): the same call, so that the input is the one compressed."""
    if args or not kwargs:
        return args, kwargs
    name = _input_name(type(module))
    if name is None or name not in kwargs:
        return args, kwargs
    rest = dict(kwargs)
    return (rest.pop(name),), rest


def _unit_device(tensors, leaves, params) -> torch.device:
    """The device whose RNG and autocast states the recompute replays: the first floating
    input's, else any tensor argument's (a unit fed token ids, such as an embedding), else the
    first parameter's. Recording the CPU's for a unit on CUDA with no floating input would
    let the recompute draw other dropout masks than the forward's."""
    for t in (*tensors, *leaves, *params):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


@torch._disable_dynamo  # torch.compiler.disable, importing Dynamo at the first call only
def _call(module: nn.Module, run, spec: QuantSpec, args: tuple, kwargs: dict):
    args, kwargs = _input_by_position(module, args, kwargs)
    leaves, treespec = _flatten((args, kwargs))
    # the block input, compressed: the first positional argument's tensors (its leaves come
    # first); the other arguments (masks, rotary tables, a cross-attention input) are kept as
    # they are, and those that need grad are inputs of the Function
    n_input = len(_flatten(args[0])[0]) if args else 0
    slots = []
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            if i < n_input:
                slots.append((i, True))
            elif t.requires_grad:
                slots.append((i, False))
    params = tuple(p for p in module.parameters() if p.requires_grad)
    tensors = [leaves[i] for i, _ in slots]
    if not params and not any(t.requires_grad for t in tensors):
        return run(*args, **kwargs)
    state = _Call()
    state.module = module
    state.run = run
    state.slots = tuple(slots)
    state.params = params
    state.treespec = treespec
    state.formats = tuple(_format(t) for t in tensors)
    taken = {i for i, _ in slots}
    state.leaves = tuple(None if i in taken else x for i, x in enumerate(leaves))
    state.no_cache = _cache_slots(module, leaves)
    state.device = _unit_device(tensors, leaves, params)
    state.autocast = _autocast_state(state.device.type)
    if slots and slots[0][1] and tensors[0].dim():
        spec = _row_spec(spec, tensors[0].shape[-1])
    outs = CheckpointFn.apply(state, spec, *tensors, *params)
    flat = state.out_rest
    state.out_rest = None
    for i, o in zip(state.out_slots, outs, strict=True):
        flat[i] = o
    return tree_unflatten(flat, state.out_spec)


# a model's own activation checkpointing: the flags of Hugging Face's and timm's
OTHER_CHECKPOINTING = ("gradient_checkpointing", "grad_checkpointing")


def turn_off_hint(flag: str) -> str:
    """How a user turns a model's own checkpointing ``flag`` off, in the installed
    library's words: transformers 5.23 renamed ``gradient_checkpointing_disable`` to
    ``activation_checkpointing_disable`` (the old name still works, with a FutureWarning)."""
    if flag == "grad_checkpointing":
        return "model.set_grad_checkpointing(False)"  # timm
    tf = sys.modules.get("transformers")
    if hasattr(getattr(tf, "PreTrainedModel", None), "activation_checkpointing_disable"):
        return ("model.activation_checkpointing_disable(), gradient_checkpointing_disable() "
                "before transformers 5.23")  # fmt: skip
    return "model.gradient_checkpointing_disable()"


class _Others:
    """The modules whose own checkpointing flag would run a checkpointed unit again: those on
    its path from the root, itself and those inside it that carry a flag, as ``(name, module,
    flag)``. Kept by reference; a deepcopy maps them to their copies and drops those not
    copied with the unit (a unit copied alone is no longer inside that model)."""

    __slots__ = ("entries",)

    def __init__(self, entries):
        self.entries = tuple(entries)

    def __iter__(self):
        return iter(self.entries)

    def __deepcopy__(self, memo):
        return _Others((n, memo[id(m)], f) for n, m, f in self.entries if id(m) in memo)

    def __reduce__(self):
        return (_Others, (self.entries,))


def _others(model: nn.Module | None, name: str, unit: nn.Module) -> _Others:
    path = [("", model)] if model is not None and name else []
    if model is not None:
        parts = name.split(".") if name else []
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            path.append((prefix, model.get_submodule(prefix)))
    path += list(unit.named_modules(prefix=name))
    return _Others(
        (n, m, flag)
        for n, m in path
        for flag in OTHER_CHECKPOINTING
        if hasattr(m, flag)
    )  # fmt: skip


def _check_other_checkpointing(module: nn.Module) -> None:
    """A second checkpointing turned on after ``wrap`` (``activation_checkpointing_enable()``,
    ``set_grad_checkpointing()``) would recompute the unit inside its own recompute: each
    block's forward three times. Cheap attribute reads of the flags recorded at ``apply``."""
    for name, m, flag in module.__dict__.get("_mesa_ckpt_others", ()):
        if getattr(m, flag, False) is True:
            how = turn_off_hint(flag)
            raise ValueError(
                f"mesa_lite: {name or type(m).__name__}.{flag} is on, but "
                f"{type(module).__name__} is checkpointed by mesa_lite (Config.checkpoint): "
                "both at once would run each checkpointed module's forward three times. Turn "
                f"the model's own checkpointing off ({how}), or wrap again without "
                "Config.checkpoint to use it alone"
            )


# ---- forward hooks inside a checkpointed module ------------------------------------------


def _closure_value(fn, name: str):
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return None
    try:
        return dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=False)).get(name)
    except ValueError:  # an empty cell
        return None


def _hook_records(hook) -> bool:
    """Whether a forward hook may keep the outputs it sees: not mesa_lite's own (the memory
    report's, the loss's); Hugging Face's output recorders (``output_attentions=True``,
    ``output_router_logits=True``, installed once and left in place) only while this forward
    collects their key; any other hook, as far as mesa_lite can tell, may."""
    fn = getattr(hook, "func", hook)  # functools.partial
    owner = getattr(fn, "__module__", None) or ""
    if owner == "mesa_lite" or owner.startswith("mesa_lite."):
        return False
    if owner.startswith("transformers."):
        collector = getattr(sys.modules.get(owner), "_active_collector", None)
        if collector is not None and callable(getattr(collector, "get", None)):
            active = collector.get()
            if not active:
                return False
            key = _closure_value(fn, "key")
            return key is None or key in active
    return True


def _hook_name(hook) -> str:
    fn = getattr(hook, "func", hook)
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _recording_hooks(module: nn.Module) -> list[str]:
    """The forward hooks that would record outputs made inside ``module`` in this call (its
    own hooks see the Function's outputs, which carry the graph): global ones and those of the
    modules inside it."""
    found = [
        f"global {_hook_name(h)}"
        for h in torch.nn.modules.module._global_forward_hooks.values()
        if _hook_records(h)
    ]
    if any(m._forward_hooks for m in module.modules() if m is not module):
        for name, m in module.named_modules():
            if m is not module:
                found += [f"{name}: {_hook_name(h)}" for h in m._forward_hooks.values()
                          if _hook_records(h)]  # fmt: skip
    return found


def _without_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    leaves, spec = _flatten((args, kwargs))
    return tree_unflatten([None if _is_cache(x) else x for x in leaves], spec)


def _torch_checkpoint(module: nn.Module, run, hooks: list[str], args: tuple, kwargs: dict):
    """This call under ``torch.utils.checkpoint(use_reentrant=False)``: the forward builds the
    graph (the hooks record outputs that carry it) and keeps nothing; backward recomputes with
    the same RNG and autocast states, without writing a k/v cache or running statistics again.
    Exact; the input is not compressed."""
    warn_once(
        "checkpoint-hooks",
        f"mesa_lite: forward hooks record outputs made inside checkpointed "
        f"{type(module).__name__} ({hooks[0]}{' and more' if len(hooks) > 1 else ''}; in "
        "Hugging Face models: output_attentions=True, output_router_logits=True): compressed "
        "checkpointing would hand them outputs of a forward run without grad, so calls that "
        "record run under torch.utils.checkpoint(use_reentrant=False) instead: exact "
        "gradients, the block input kept uncompressed",
    )
    drop = bool(_cache_slots(module, _flatten((args, kwargs))[0]))
    calls = []

    def fn(*a, **kw):
        if not calls:  # the forward
            calls.append(None)
            return run(*a, **kw)
        if drop:
            a, kw = _without_caches(a, kw)
        with _running_stats_restored(module):
            return run(*a, **kw)

    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


@torch._disable_dynamo  # torch.compiler.disable, importing Dynamo at the first call only
def _dispatch(module: nn.Module, run, spec: QuantSpec, args: tuple, kwargs: dict):
    # checked here, never traced: Dynamo tracing the flags' reads on the unit's ancestors
    # (modules it is inlining at that moment, reached again through the unit's __dict__)
    # failed with an internal KeyError (checkpoint="mlp" or "attention" on a Hugging Face
    # decoder under torch.compile, torch 2.11 and 2.14)
    _check_other_checkpointing(module)
    hooks = _recording_hooks(module)
    if hooks:
        return _torch_checkpoint(module, run, hooks, args, kwargs)
    return _call(module, run, spec, args, kwargs)


class Checkpointed:
    """Mixin of a checkpointed module's class: its forward runs through ``CheckpointFn`` when
    training with grad (see the module docstring); ``_mesa_ckpt_spec`` holds the setting of
    the copy of its input."""

    def forward(self, *args, **kwargs):
        spec = self.__dict__.get("_mesa_ckpt_spec")
        run = super().forward
        if spec is None or not self.training:
            return run(*args, **kwargs)
        if not torch.is_grad_enabled() or in_functorch_transform():
            # no recompute here: the check only for a clear error in eager mode (a second
            # checkpointing runs under grad, where _dispatch checks)
            if not torch.compiler.is_compiling():
                _check_other_checkpointing(self)
            return run(*args, **kwargs)
        if _is_hf_layer(self):
            args, kwargs = _drop_cache(self, args, kwargs)
        return _dispatch(self, run, spec, args, kwargs)


def apply(
    units: list[tuple[str, nn.Module]], spec: QuantSpec, model: nn.Module | None = None
) -> None:
    """Makes each unit ``Checkpointed`` (its class over the one it has), keeping ``spec``, and
    records the checkpointing flags to check in its forward (``model``: the root the unit
    names are relative to; without it, only the unit's own and its modules')."""
    for name, module in units:
        before = type(module)
        _set_class(module, converted_class(Checkpointed, base_type(module)))
        module.__dict__["_mesa_ckpt_cls"] = before
        module.__dict__["_mesa_ckpt_spec"] = spec
        module.__dict__["_mesa_ckpt_others"] = _others(model, name, module)


def checkpointed(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of each module of ``model`` that mesa_lite checkpoints (``apply``;
    ``report.plain_model`` turns them off for a while by clearing their setting)."""
    return [(n, m) for n, m in model.named_modules()
            if m.__dict__.get("_mesa_ckpt_spec") is not None]  # fmt: skip


def remove(model: nn.Module) -> int:
    """Takes ``Checkpointed`` off every module of ``model``; returns how many."""
    n = 0
    for module in model.modules():
        cls = module.__dict__.pop("_mesa_ckpt_cls", None)
        module.__dict__.pop("_mesa_ckpt_spec", None)
        module.__dict__.pop("_mesa_ckpt_others", None)
        if cls is not None:
            module.__class__ = cls
            n += 1
    return n
