"""CUDA-graphed training for static-shape loops, built on PyTorch's own
``torch.cuda.make_graphed_callables``.

A wrapped (or plain) model's forward and backward each replay as one CUDA graph: the host
launches two graphs a step instead of hundreds of kernels, which is where an eager step of a
small model spends its time. The loss, the optimizer and the GradScaler stay outside, as usual::

    model = mesa_lite.wrap(model).cuda().train()
    model = mesa_lite.graphed(model, (images,), autocast=torch.float16)
    for images, labels in loader:                   # same shapes every step
        with torch.autocast("cuda", torch.float16):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)

What capture cannot replay is refused before capture, with the reason: hooks on any module,
global module hooks and tensor hooks on parameters (they would run at capture only, or
twice), stochastic rounding (its seed is drawn on the host per call), a model outside training
mode, parameters or sample inputs off the GPU, buffers that require grad, a model inside
DistributedDataParallel or FSDP, and a forward that replaces a buffer. What capture would
change is put back: the warm-up and capture passes update BatchNorm's running statistics,
which are restored after (also when capture fails). Dropout draws through PyTorch's
graph-safe generator, so each replay draws new masks. Gradients accumulate as in eager mode
(``_fresh_grads``).

A call the graphs cannot serve runs the model's own forward (``fallback="eager"``, the
default, with one warning per reason) or raises (``fallback="error"``): inputs of another
shape, dtype, device or ``requires_grad`` than the sample (the last partial batch of
an epoch), keyword arguments, another autocast state than the capture's, a parameter whose
``requires_grad`` changed, a parameter or buffer replaced or moved since capture, layers
wrapped again, a second call before the first one's backward. Evaluation mode and ``no_grad``
run the model's own forward without a warning.

The outputs a graphed call returns are the graph's static buffers: the next call overwrites
them, so clone what must outlive a step. A deep or pickled copy of a graphed model comes out
ungraphed; the graph's memory pool is held until ``ungraph``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn

_KEY = "_mesa_graphed"
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@dataclasses.dataclass
class GraphInfo:
    """What ``graphed`` captured: the inputs' signature, the graphed forward, the eager one,
    the memory pool and the policy for calls the graphs cannot serve."""

    signature: tuple
    requires_grad: tuple
    graphed_forward: Callable
    eager_forward: Callable
    own_forward: Callable | None
    pool: tuple
    fallback: str
    autocast: torch.dtype | None
    replays: int = 0
    eager_calls: int = 0
    warned: set = dataclasses.field(default_factory=set)
    storage: tuple = ()
    specs: tuple = ()
    pending: bool = False  # a replay whose backward has not run yet
    pending_output: Callable = lambda: None  # that replay's output's autograd node, weakly

    def __deepcopy__(self, memo):  # a copy of the model is not graphed
        return None

    def __reduce__(self):
        return _none, ()


def _none():
    return None


def _same(value):
    return value


def _signature(args) -> tuple:
    # no strides: each call's input is copied into the graph's own input buffer (a private
    # clone of the sample, so never the caller's memory), whatever its layout
    return tuple(
        (tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor)
        else type(a)
        for a in args
    )  # fmt: skip


def _describe(sig) -> str:
    parts = []
    for s in sig:
        if isinstance(s, tuple):
            shape, dtype, device, rg = s
            parts.append(f"{list(shape)} {str(dtype).replace('torch.', '')} on {device}"
                         + (" requiring grad" if rg else ""))  # fmt: skip
        else:
            parts.append(s.__name__)
    return "(" + ", ".join(parts) + ")"


def _refusal(model: nn.Module, sample_args: tuple, autocast) -> str | None:
    """Why ``model`` cannot be captured with ``sample_args``; None when it can."""
    from torch.nn.modules import module as module_globals

    if isinstance(model, nn.parallel.DistributedDataParallel) or any(
        type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in model.modules()
    ):
        return ("a model inside DistributedDataParallel or FSDP is not supported (their "
                "communication hooks run per step on the host); graph a single-GPU "
                "model")  # fmt: skip
    if model.__dict__.get(_KEY) is not None:
        return "the model is graphed already (mesa_lite.ungraph(model) first)"
    if not model.training:
        return "the model is in evaluation mode: capture records a training step (model.train())"
    if autocast not in (None, torch.float16, torch.bfloat16):
        return f"autocast must be None, torch.float16 or torch.bfloat16, got {autocast!r}"
    for kind in ("forward", "forward_pre", "backward", "backward_pre"):
        if getattr(module_globals, f"_global_{kind}_hooks", None):
            return (f"a global module {kind} hook is registered "
                    f"(nn.modules.module.register_module_{kind}_hook): it would run at capture "
                    "only, never on replay")  # fmt: skip
    for name, m in model.named_modules():
        for attr in _HOOKS:
            if getattr(m, attr, None):
                kind = attr.strip("_").replace("_", " ").removesuffix("s")
                what = f"module {name!r} ({type(m).__name__})" if name else "the model"
                return (f"{what} has a {kind} registered: it would run at capture only, never "
                        "on replay (remove it before graphing)")  # fmt: skip
        for pname, p in m.named_parameters(recurse=False):
            if getattr(p, "_backward_hooks", None):
                return (f"parameter {(name + '.' if name else '') + pname!r} has a tensor hook "
                        "(register_hook): inside the graph and again after it, it would apply "
                        "twice")  # fmt: skip
        for bname, b in m.named_buffers(recurse=False):
            if b.requires_grad:
                return (f"buffer {(name + '.' if name else '') + bname!r} requires grad: only "
                        "parameters may be trained through a graph")  # fmt: skip
        spec = getattr(m, "mesa_spec", None)
        if spec is not None and getattr(spec, "rounding", None) == "stochastic":
            return (f"module {name!r} rounds stochastically: its seed is drawn on the host "
                    "per call, and a graph would replay one seed (use "
                    "rounding='nearest')")  # fmt: skip
    for i, a in enumerate(sample_args):
        if not isinstance(a, torch.Tensor):
            return f"sample argument {i} is a {type(a).__name__}: only tensors can be captured"
    if not torch.cuda.is_available():
        return "CUDA graphs need a CUDA device, and none is available"
    for i, a in enumerate(sample_args):
        if not a.is_cuda:
            return f"sample argument {i} is on {a.device}, not on the GPU"
    for name, p in model.named_parameters():
        if not p.is_cuda:
            return f"parameter {name!r} is on {p.device}, not on the GPU (model.cuda() first)"
    for name, b in model.named_buffers():
        if not b.is_cuda:
            return f"buffer {name!r} is on {b.device}, not on the GPU (model.cuda() first)"
    return None


def graphed(
    model: nn.Module,
    sample_args,
    *,
    autocast: torch.dtype | None = None,
    warmup: int = 3,
    fallback: str = "eager",
) -> nn.Module:
    """Captures ``model``'s training forward and backward as CUDA graphs
    (``torch.cuda.make_graphed_callables``) and returns the same module, whose ``model(*args)``
    then replays them.

    Args:
        model: a module on the GPU in training mode, wrapped by ``mesa_lite.wrap`` or plain.
        sample_args: a tensor or a tuple of tensors with the shapes, dtypes and
            ``requires_grad`` of every training call's arguments (real data is best: the
            warm-up passes run on it).
        autocast: the autocast dtype the forward is captured under (torch.float16 or
            torch.bfloat16; None: none). The captured graph keeps it whatever the caller's
            autocast state; autocast's weight cache is off during capture, as PyTorch requires.
        warmup: forward and backward passes before capture (Triton's kernels compile there).
        fallback: ``"eager"`` (a call the graphs cannot serve runs the model's own forward,
            with a warning the first time for each reason) or ``"error"`` (it raises).

    Returns ``model`` itself: parameters, buffers and state_dict keys are unchanged; what the
    warm-up and capture did to the buffers (BatchNorm statistics) is undone. Raises
    ValueError naming the problem when the model cannot be captured (see the module's
    docstring).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"mesa_lite.graphed: expected an nn.Module, got {type(model).__name__}")
    if fallback not in ("eager", "error"):
        raise ValueError(
            f"mesa_lite.graphed: fallback must be 'eager' or 'error', got {fallback!r}"
        )
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"mesa_lite.graphed: warmup must be a positive int, got {warmup!r}")
    args = tuple(sample_args) if isinstance(sample_args, (tuple, list)) else (sample_args,)
    why = _refusal(model, args, autocast)
    if why is not None:
        raise ValueError(f"mesa_lite.graphed: {why}")
    own = model.__dict__.get("forward")  # a forward set on the instance, kept for ungraph
    eager = own if own is not None else types.MethodType(type(model).forward, model)
    # the sample becomes the graph's static input (PyTorch copies each call's input into it):
    # a copy, so that the caller's tensor is not overwritten by later calls
    args = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
    with torch.no_grad():
        buffers = [(b, b.clone()) for b in model.buffers()]
    buffer_ids = [id(b) for b in model.buffers()]
    pool = torch.cuda.graph_pool_handle()
    amp = torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None,
                         cache_enabled=False)  # fmt: skip
    try:
        with torch.cuda.device(args[0].device if args else next(model.parameters()).device), amp:
            torch.cuda.make_graphed_callables(
                model, args, num_warmup_iters=warmup, allow_unused_input=True, pool=pool
            )
    finally:
        replay = model.__dict__.pop("forward", None)
        if own is not None:
            model.forward = own
        with torch.no_grad():  # warm-up and capture ran BatchNorm's statistics forward: undone
            for b, saved in buffers:
                b.copy_(saved)
    if [id(b) for b in model.buffers()] != buffer_ids:
        raise ValueError(
            "mesa_lite.graphed: the forward replaces a buffer (self.name = tensor) instead of "
            "updating it in place: a replay would keep the graph's copy and never update it"
        )
    params = tuple(model.parameters())
    info = GraphInfo(
        signature=_signature(args),
        requires_grad=tuple(p.requires_grad for p in params),
        graphed_forward=replay,
        eager_forward=eager,
        own_forward=own,
        pool=tuple(pool),
        fallback=fallback,
        autocast=autocast,
    )
    info.storage = _storage(model)
    info.specs = _specs(model)
    model.__dict__[_KEY] = info
    model.forward = GraphedForward(model)
    return model


def _fresh_grads(info: GraphInfo, grad_inputs, grad_outputs):
    """A post-hook on a replay's backward node: PyTorch's graphed backward returns the graph's
    own gradient buffers, which autograd would keep as ``p.grad`` where it is None, so the
    next replay would overwrite them (and accumulation over micro-batches or
    ``zero_grad(set_to_none=False)`` would add them twice). Autograd gets copies instead, made
    in one fused launch; the pending backward is marked done."""
    info.pending = False
    given = [g for g in grad_inputs if g is not None]
    if not given:
        return None
    copies = iter(torch._foreach_mul(given, 1.0))
    return tuple(None if g is None else next(copies) for g in grad_inputs)


def _storage(model: nn.Module) -> tuple:
    """What the graphs read: each parameter's and buffer's object and memory."""
    return tuple((id(t), t.data_ptr(), t.dtype) for t in (*model.parameters(), *model.buffers()))


def _specs(model: nn.Module) -> tuple:
    return tuple(getattr(m, "mesa_spec", None) for m in model.modules())


def _autocast_state() -> tuple:
    enabled = torch.is_autocast_enabled("cuda")
    return (enabled, torch.get_autocast_dtype("cuda") if enabled else None)


class GraphedForward:
    """The forward ``graphed`` sets on the model: replays the graphs when a call matches the
    capture, else runs the model's own forward (or raises, ``fallback="error"``). A copy of
    the model (``copy.deepcopy``: a timm model EMA) or a pickled one comes out ungraphed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __deepcopy__(self, memo):
        info = self.model.__dict__.get(_KEY)
        if info is not None and info.own_forward is not None:  # the forward it had before
            return copy.deepcopy(info.own_forward, memo)
        return _Ungraphed(memo.get(id(self.model), self.model))

    def __reduce__(self):
        info = self.model.__dict__.get(_KEY)
        if info is not None and info.own_forward is not None:
            return _same, (info.own_forward,)
        return _Ungraphed, (self.model,)

    def _why_not(self, info: GraphInfo, call_args, kwargs) -> str | None:
        model = self.model
        if kwargs:
            return f"keyword arguments ({', '.join(kwargs)}) are not captured"
        sig = _signature(call_args)
        if sig != info.signature:
            return (f"inputs {_describe(sig)} differ from the captured "
                    f"{_describe(info.signature)}")  # fmt: skip
        if _autocast_state() != ((info.autocast is not None), info.autocast):
            return (f"the call's autocast state differs from the capture's (autocast="
                    f"{info.autocast}): the graph would replay the capture's")  # fmt: skip
        if tuple(p.requires_grad for p in model.parameters()) != info.requires_grad:
            return "a parameter's requires_grad changed since capture (graph again)"
        if _storage(model) != info.storage:
            return ("a parameter or buffer was replaced or moved since capture (.to(), .half(), "
                    "load_state_dict(assign=True), p.data = ...): graph again")  # fmt: skip
        if _specs(model) != info.specs:
            return "the model was wrapped again or unwrapped since capture: graph again"
        if info.pending and info.pending_output() is not None:
            return ("the previous graphed call's backward has not run: its saved activations "
                    "are the graph's, which a second replay would overwrite")  # fmt: skip
        return None

    def __call__(self, *call_args, **kwargs):
        model = self.model
        info = model.__dict__[_KEY]
        if not (model.training and torch.is_grad_enabled()):
            # evaluation or no_grad: the eager forward, as PyTorch's graphed callables do
            info.eager_calls += 1
            return info.eager_forward(*call_args, **kwargs)
        why = self._why_not(info, call_args, kwargs)
        if why is None:
            info.replays += 1
            out = info.graphed_forward(*call_args)
            # the replay's backward node: its hook copies the gradients out of the graph's
            # buffers; pending until it runs, or until the node is gone (a step dropped
            # before its backward)
            nodes = [getattr(t, "grad_fn", None) for t in torch.utils._pytree.tree_leaves(out)]
            node = next((n for n in nodes if n is not None), None)
            if node is not None:
                node.register_hook(functools.partial(_fresh_grads, info))
                info.pending_output = weakref.ref(node)
                info.pending = True
            return out
        if info.fallback == "error":
            raise ValueError(f"mesa_lite.graphed: {why}")
        if why not in info.warned:
            info.warned.add(why)
            warnings.warn(f"mesa_lite.graphed: {why}; this call runs eagerly", stacklevel=2)
        info.eager_calls += 1
        return info.eager_forward(*call_args, **kwargs)


class _Ungraphed:
    """The forward of a copy of a graphed model: the model class's own."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        return type(self.model).forward(self.model, *args, **kwargs)


def graph_info(model: nn.Module) -> GraphInfo | None:
    """What ``graphed`` captured for ``model`` (replay and eager counts included); None when
    it is not graphed."""
    return model.__dict__.get(_KEY)


def ungraph(model: nn.Module) -> nn.Module:
    """Undoes ``graphed``: the model's own forward again, the graphs and their memory pool
    released once nothing else refers to them. Returns the model."""
    info = model.__dict__.pop(_KEY, None)
    if info is None:
        if isinstance(model.__dict__.get("forward"), _Ungraphed):  # a copy of a graphed model
            del model.__dict__["forward"]
        return model
    model.__dict__.pop("forward", None)
    if info.own_forward is not None:
        model.forward = info.own_forward
    return model


def graph_memory(model: nn.Module) -> dict[str, int]:
    """Bytes of the graphed model's private memory pool, from the allocator's snapshot:
    ``reserved`` (its segments: what the graphs' replays may use, held whether or not a tensor
    lives there now) and ``allocated`` (blocks holding tensors now: the static inputs, outputs
    and gradients). ``torch.cuda.max_memory_allocated`` counts only the latter between
    replays, so a graphed step's true peak is at least the peak allocated outside the pool
    plus ``reserved``."""
    info = graph_info(model)
    if info is None:
        raise ValueError("mesa_lite.graph_memory: the model is not graphed (mesa_lite.graphed)")
    reserved = allocated = 0
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if tuple(seg.get("segment_pool_id", ())) == info.pool:
            reserved += seg["total_size"]
            allocated += seg["allocated_size"]
    return {"reserved": reserved, "allocated": allocated}
