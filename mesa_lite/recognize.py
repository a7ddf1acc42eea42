"""Recognition by proof: modules ``wrap`` does not know by type, converted to a formula-based
or fused path only when their own forward is proved to compute what that path computes.

Candidates are found by structure, with no dependence on any other library:

- an RMSNorm: a leaf module whose class name ends in ``RMSNorm``, with a 1-D ``weight`` and a
  float ``variance_epsilon`` or ``eps`` (Hugging Face's ``LlamaRMSNorm`` and its copies,
  litgpt's, nanoGPT-style code), converted to ``modules.RMSNorm``;
- a gated MLP: three linear projections (any names: ``gate_proj``/``up_proj``/``down_proj``,
  torchtitan's ``w1``/``w3``/``w2``) and an activation child or none (the activation called as
  a function: SiLU, GELU, tanh-GELU), parameter-free children besides; it runs as one
  ``blocks.GatedMlpFn`` (``GatedMlp``);
- a two-projection MLP: ``dropout(proj2(act(proj1(x))))`` with ``nn.Linear`` projections or a
  registered kind (transformers' ``Conv1D``), run as one ``blocks.MlpFn`` (``Mlp``).

The proof (``prove``) runs the module's own forward and the fused path on probe inputs and
asks for the same output bit for bit and the same random draws, under the conditions the
module meets in training, not those of a freshly built model in eval mode:

- training mode (dropout and other training-only steps run);
- random parameters (and floating buffers) in the module's own dtypes: a weight of ones
  hides where a formula casts (``(w * x_fp32).to(dtype)`` against ``w * x.to(dtype)``);
- inputs at magnitudes 1e-3, 1 and 1e3, in fp32, bf16 and the parameters' dtype, so that
  clamps (``swiglu_limit``) and epsilons are reached;
- the same CPU RNG state before each: a forward that draws random numbers the fused path does
  not draw (``F.dropout`` in the forward, an ``nn.Dropout`` child the fused path omits) fails.

A proof covers more than the forward's values:

- the backward: on the fp32 probe input, with a random upstream gradient, the gradients of the
  input and of every parameter through the module's own forward and through the path proved
  agree to fp32 rounding (an RMSNorm whose statistic is a constant in backward gives Llama's
  output bit for bit and another gradient);
- side effects: the module's forward writes none of its buffers and changes none of the plain
  attributes of it or its children (a running statistic the fused path would never update),
  and calls no child the fused path does not call (a recorder of activation statistics, an
  ``nn.Dropout(p=0)`` that a later schedule turns on);
- the attributes it was proved with: a fused block compares the plain attributes of it and
  its children with those of the proof on every call (a dropout's ``p`` excepted: the fused
  path reads it) and runs its own forward when they changed.

Probes run on the CPU with tensors of their own put in place of the module's parameters and
buffers (``torch.nn.utils.stateless``): the module's values are untouched, and a model built
on the meta device is recognised as the same model built on a real one. Results are cached
for one ``wrap`` call by the module's class, parameter shapes and dtypes and the plain
attributes of it and its children (layers of one model are proved once).

A candidate that fails keeps its own forward (its sub-layers still compressed one by one);
``wrap``'s summary names it and why.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mesa_lite import blocks
from mesa_lite.modules import (
    FIELD_READS,
    GELU,
    Activation,
    Dropout,
    FusedBlock,
    Linear,
    MesaModule,
    RMSNorm,
    held_object,
    plain_modules,
    proof_attrs,
    proved_attrs,
    record_read,
    rms_eps,
    still_proved,
)
from mesa_lite.ops.activation import backward_for, silu_grad
from mesa_lite.ops.common import autocast_dtype

__all__ = [
    "prove",
    "rms_norm_refusal",
    "structural",
    "block_matchers",
    "register_projection",
    "GatedMlp",
    "Mlp",
    "reset",
]

_SCALES = (1.0, 1e-3, 1e3)


# ---- the proof ------------------------------------------------------------------------------


def _random_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """CPU tensors for every parameter and buffer of ``module``: floating ones drawn at random
    (uniform in [-2, 2), cheaper than normal draws for a large layer) in their own dtype (tied
    tensors stay tied), others copied (zeros on the meta device)."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    for name, t in named:
        if t is None:
            continue
        if id(t) not in made:
            if t.is_floating_point():
                v = torch.empty(t.shape).uniform_(-2.0, 2.0, generator=g).to(t.dtype)
                v.requires_grad_(isinstance(t, nn.Parameter))
            elif t.is_meta:
                v = torch.zeros(t.shape, dtype=t.dtype)
            else:
                v = t.detach().cpu().clone()
            made[id(t)] = v
        state[name] = made[id(t)]
    return state


_PROBE_RNG = torch.Generator().manual_seed(1234).get_state()


@contextlib.contextmanager
def _reading_fields(module: nn.Module):
    """Records (``record_read``) each field read from the objects ``module`` and its children
    hold (a model config) while the block runs: a ``__getattribute__`` on each such object's
    class that calls the class's own and notes the read, so the object stays itself (its type,
    truth value, ``in`` and ``len`` unchanged); each class's own restored after. An object of a
    built-in type (whose class cannot be patched) is not recorded."""
    held = {id(v): v for m in module.modules() for _, v in proof_attrs(m) if held_object(v)}
    patched = {}
    for cls in {type(v) for v in held.values()}:
        own = cls.__dict__.get("__getattribute__", _UNSET)
        original = cls.__getattribute__

        def reading(self, name, _original=original):
            value = _original(self, name)
            if id(self) in held:
                record_read(self, name, value)
            return value

        try:
            cls.__getattribute__ = reading
        except TypeError:  # a built-in or extension type
            continue
        patched[cls] = own
    try:
        yield
    finally:
        for cls, own in patched.items():
            if own is _UNSET:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = own


_UNSET = object()


@contextlib.contextmanager
def _tensors_restored(module: nn.Module):
    """Puts back every parameter and buffer of ``module`` and its sub-modules, each the object
    it was, on exit. ``_reparametrize_module`` alone does not for a sub-module reached under
    two names (PEFT's VeRA shares its projections across layers, an adapter may share one
    low-rank layer between gate and up): the second name restores the probe's tensor."""
    saved = [(d, dict(d)) for m in module.modules() for d in (m._parameters, m._buffers)]
    try:
        yield
    finally:
        for d, items in saved:
            d.clear()
            d.update(items)


@contextlib.contextmanager
def _probing(module: nn.Module):
    """``module`` in training mode with random CPU parameters, no grad, no autocast, the CPU
    RNG forked (the caller's state comes back), its mesa_lite sub-modules running plain
    (``report.plain_model``: a proof is of the formula, whatever the setting; compressed
    children at 4 bits or with stochastic rounding differ from call to call); every
    sub-module's mode restored after."""
    from torch.nn.utils.stateless import _reparametrize_module

    from mesa_lite.report import plain_model

    modes = {m: m.training for m in module.modules()}
    try:
        for m in modes:
            m.training = True
        with contextlib.ExitStack() as st:
            st.enter_context(plain_model(module))
            st.enter_context(torch.random.fork_rng(devices=[]))
            st.enter_context(torch.no_grad())
            st.enter_context(torch.autocast("cpu", enabled=False))
            st.enter_context(_tensors_restored(module))
            st.enter_context(_reparametrize_module(module, _random_state(module)))
            st.enter_context(_reading_fields(module))
            yield
    finally:
        for m, training in modes.items():  # each as it was (train() would set them all)
            m.training = training


def _same(a, b) -> bool:
    """Equal dtype, shape and values (NaN equal to NaN: an overflow at 1e3 in both)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _inputs(width: int, dtypes) -> list[tuple[str, torch.Tensor]]:
    """One probe tensor per dtype: ``(2, 3, width)`` normal draws at each of ``_SCALES``,
    stacked on the first dimension (rows are independent in the formulas proved)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, width, generator=g)
    x = torch.cat([base * s for s in _SCALES])
    return [(str(d).replace("torch.", ""), x.to(d)) for d in dict.fromkeys(dtypes)]


def _where(w: torch.Tensor, g: torch.Tensor) -> str:
    """The magnitude of the first probe rows where ``w`` and ``g`` differ."""
    if w.shape != g.shape or w.dim() == 0 or w.shape[0] != 2 * len(_SCALES):
        return "" if w.dtype == g.dtype else f" (output {g.dtype}, not {w.dtype})"
    for i, s in enumerate(_SCALES):
        if not _same(w[2 * i : 2 * i + 2], g[2 * i : 2 * i + 2]):
            return f" of magnitude {s:g}"
    return ""


def _conditions(module: nn.Module, width: int, dtypes) -> list[tuple[str, torch.Tensor, bool]]:
    """``(label, input, under autocast)``: each probe input without autocast, and where the
    module has fp32 parameters the fp32 input under bf16 autocast too (mixed-precision
    training: a forward that upcasts an activation itself computes otherwise there)."""
    base = _inputs(width, dtypes)
    out = [(label, x, False) for label, x in base]
    if any(p.dtype == torch.float32 for p in module.parameters()):
        amp = [(f"{label} under bf16 autocast", x, True) for label, x in base]
        out += [c for c in amp if "float32" in c[0]]
    return out


def _snapshot(module: nn.Module) -> tuple[dict, dict]:
    """The buffers (object and version) and the plain attributes of ``module`` and its
    children, by name."""
    buffers = {n: (b, b._version) for n, b in module.named_buffers() if b is not None}
    attrs = {n: _plain_attrs(m) for n, m in module.named_modules()}
    return buffers, attrs


def _side_effect(module: nn.Module, before: tuple[dict, dict]) -> str | None:
    """What ``module``'s forward changed since ``before`` (``_snapshot``), or None."""
    buffers, attrs = before
    now = {n: b for n, b in module.named_buffers() if b is not None}
    for name, (b, version) in buffers.items():
        if now.get(name) is not b or b._version != version:
            return f"writes its buffer {name!r} in forward (a side effect the fused path lacks)"
    for name, m in module.named_modules():
        if _plain_attrs(m) != attrs.get(name):
            what = f"its child {name!r}" if name else "itself"
            return f"changes attributes of {what} in forward (a side effect the fused path lacks)"
    return None


def _grads(fn, x: torch.Tensor, params: list[torch.Tensor]):
    """``fn(x)`` and the gradients of ``x`` and ``params`` under a fixed random upstream
    gradient (None where a tensor gets none)."""
    x = x.detach().requires_grad_()
    torch.set_rng_state(_PROBE_RNG)
    with torch.enable_grad():
        out = fn(x)
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return None
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
        return torch.autograd.grad(out, [x, *params], g, allow_unused=True)


def _backward_differs(module: nn.Module, want, got, x: torch.Tensor) -> str | None:
    """Why the gradients of ``want`` and ``got`` on ``x`` differ beyond fp32 rounding (relative
    error 1e-5 in any tensor's gradient), or None."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    gw, gg = _grads(want, x, params), _grads(got, x, params)
    if gw is None or gg is None:
        return None if gw is None and gg is None else "one path gives no gradient"
    for name, a, b in zip(["input", *(n for n, _ in named)], gw, gg, strict=True):
        if a is None or b is None:
            if (a is None) != (b is None):
                return f"the gradient of {name} is {'missing' if b is None else 'extra'}"
            continue
        err = (a.double() - b.double()).norm()
        if not bool(err <= 1e-5 * a.double().norm()) and not _same(a, b):
            return f"computes another gradient of {name} (fp32 probe, random upstream gradient)"
    return None


@contextlib.contextmanager
def _called_children(module: nn.Module):
    """The names of ``module``'s children called while inside (forward pre-hooks)."""
    called: set[str] = set()
    handles = [m.register_forward_pre_hook(lambda m, a, n=n: called.add(n))
               for n, m in module.named_children()]  # fmt: skip
    try:
        yield called
    finally:
        for h in handles:
            h.remove()


def prove(
    module: nn.Module,
    want: Callable[[torch.Tensor], torch.Tensor],
    got: Callable[[torch.Tensor], torch.Tensor],
    width: int,
    dtypes,
    calls: set[str] | None = None,
) -> str | None:
    """Whether ``got(x)`` computes ``want(x)`` for ``module``: None when, for probe inputs of
    ``width`` features in each of ``dtypes`` at each magnitude (and under bf16 autocast where
    the module has fp32 parameters), both give the same output bit for bit and leave the CPU
    RNG in the same state from the same start, with ``module`` in training mode on random
    parameters, their gradients agree on the fp32 input, and ``want`` has no side effect and
    calls no child outside ``calls`` (None: any) (see the module docstring); else why not.

    ``want`` and ``got`` read the module's parameters when called (the probe's are in place).
    """
    try:
        with _probing(module):
            for label, x, amp in _conditions(module, width, dtypes):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    before = _snapshot(module)
                    torch.set_rng_state(_PROBE_RNG)
                    with _called_children(module) as called:
                        w = want(x)
                    after_want = torch.get_rng_state()
                    why = _side_effect(module, before)
                    if why is not None:
                        return why
                    extra = sorted(called - calls) if calls is not None else []
                    if extra:
                        child = getattr(module, extra[0])
                        return (f"calls its child {extra[0]!r} ({type(child).__name__}), which "
                                "the fused path does not")  # fmt: skip
                    torch.set_rng_state(_PROBE_RNG)
                    g = got(x)
                if not torch.equal(after_want, torch.get_rng_state()):
                    return "draws random numbers in training (dropout) that the fused path does not"
                if not _same(w, g):
                    where = _where(w, g) if isinstance(w, torch.Tensor) else ""
                    return f"computes otherwise in training, random weights, {label} input{where}"
                if x.dtype == torch.float32 and not amp:
                    why = _backward_differs(module, want, got, x)
                    if why is not None:
                        return why
    except Exception as e:  # noqa: BLE001 - a forward that fails on a probe is not the formula
        return f"its forward fails on a probe input ({type(e).__name__}: {e})"
    return None


# results for one ``wrap`` call, by ``_key``
_CACHE: dict[tuple, object] = {}


def reset() -> None:
    """Forgets the cached proofs and the fields they read (``wrap`` calls it before and after
    its walk)."""
    _CACHE.clear()
    FIELD_READS.clear()


def _plain_attrs(m: nn.Module) -> tuple:
    # shared objects (a model config) by identity: the same for every layer
    return tuple((k, v if isinstance(v, (bool, int, float, str, type(None))) else id(v))
                 for k, v in sorted(proof_attrs(m), key=lambda kv: kv[0]))  # fmt: skip


def _key(what: str, module: nn.Module) -> tuple:
    """What a proof depends on: the classes, forwards set on instances, parameter and buffer
    shapes and dtypes, and plain attributes of the module and its children."""
    parts = [what]
    for name, m in module.named_modules():
        parts.append((name, type(m), m.__dict__.get("forward"), _plain_attrs(m)))
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        parts.append((name, tuple(t.shape), t.dtype))
    return tuple(parts)


def _cached(what: str, module: nn.Module, run: Callable[[], object]):
    try:
        key = _key(what, module)
        hash(key)
    except TypeError:  # an unhashable attribute: prove this one on its own
        return run()
    if key not in _CACHE:
        _CACHE[key] = run()
    return _CACHE[key]


# ---- RMSNorm --------------------------------------------------------------------------------


def _rms_candidate(module: nn.Module) -> bool:
    if isinstance(module, nn.RMSNorm) or not type(module).__name__.endswith("RMSNorm"):
        return False
    weight = getattr(module, "weight", None)
    ok = isinstance(weight, torch.Tensor) and weight.dim() == 1
    ok = ok and isinstance(rms_eps(module), float) and len(list(module.children())) == 0
    return ok and _takes_one_tensor(type(module).forward)


def _takes_one_tensor(forward) -> bool:
    """A forward of one argument besides ``self`` (``modules.RMSNorm`` takes no other: a norm
    with an optional residual argument would fail when called with it)."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def rms_norm_refusal(module: nn.Module) -> str | None:
    """None when ``module``'s forward is the Hugging Face RMSNorm formula
    (``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``, ``modules.RMSNorm``);
    else why not."""
    from mesa_lite.ops.rms_norm import rms_forward

    def run():
        eps = rms_eps(module)
        dtypes = (torch.float32, torch.bfloat16, module.weight.dtype)
        return prove(
            module,
            lambda x: type(module).forward(module, x),
            lambda x: rms_forward(x, module.weight, eps, "hf", 1)[0],
            module.weight.shape[-1],
            dtypes,
        )

    why = _cached("rms", module, run)
    return None if why is None else f"not the Hugging Face RMSNorm formula: {why}"


def _rms_accepts(module: nn.Module) -> bool | str:
    why = rms_norm_refusal(module)
    return True if why is None else why


def structural() -> list[tuple]:
    """(matches(module), mesa_lite class, kind, accepts(module) -> True or why not, None) for
    module types ``wrap`` does not know by name."""
    return [(_rms_candidate, RMSNorm, "rmsnorm", _rms_accepts, None)]


# ---- blocks: shared helpers -----------------------------------------------------------------

# the projection types an MLP may be built of (original type -> mesa_lite class), and which
# compute ``x @ W^T + b`` (``nn.Linear``) or ``addmm(b, x, W)`` (transformers' Conv1D)
_PROJECTIONS: dict[type, type] = {nn.Linear: Linear}
_ADDMM: set[type] = set()


def register_projection(orig: type, mesa_cls: type, addmm: bool) -> None:
    """Lets MLPs built of ``orig`` projections (converted to ``mesa_cls``) be recognised."""
    _PROJECTIONS[orig] = mesa_cls
    if addmm:
        _ADDMM.add(orig)


def _is_projection(m: nn.Module) -> bool:
    return isinstance(m, tuple(_PROJECTIONS))


def _in_width(m: nn.Module) -> int:
    if _adapted_linear(m):
        m = m.base_layer
    return m.in_features if isinstance(m, nn.Linear) else m.weight.shape[0]


def _adapted_linear(m: nn.Module) -> bool:
    """An adapter layer around a linear projection: a module (not itself an ``nn.Linear``)
    whose ``base_layer`` is one, wrapped or not (PEFT's LoRA ``Linear`` and its other tuner
    layers). A gated MLP built of them runs its projections as their own modules
    (``GatedMlp``'s product path)."""
    return not isinstance(m, nn.Linear) and isinstance(getattr(m, "base_layer", None), nn.Linear)


def _gated_projection(m: nn.Module) -> bool:
    return type(m) is nn.Linear or isinstance(m, Linear) or _adapted_linear(m)


def _is_activation(m: nn.Module) -> bool:
    return isinstance(m, (Activation, GELU))


def _own_tensors(m: nn.Module) -> bool:
    """Parameters or buffers of the module itself, not of its children."""
    own = itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False))
    return next(own, None) is not None


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


@contextlib.contextmanager
def _recording(kids: dict[str, nn.Module]):
    """Forward hooks recording ``(name, args, output)`` of each child's calls."""
    calls: list[tuple] = []
    handles = []
    for name, m in kids.items():
        hook = lambda m, args, out, name=name: calls.append((name, args, out))  # noqa: E731
        handles.append(m.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


# ---- gated MLP ------------------------------------------------------------------------------

# activations a gated MLP may call as functions: name -> (formula, backward for GatedMlpFn)
_ACT_FUNCTIONS = {
    "silu": (F.silu, silu_grad),
    "gelu": (F.gelu, "none"),
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), "tanh"),
}


def _gated_candidate(module: nn.Module):
    """(projection names, activation child name or None) of a module made of three linear
    projections, at most one activation child and parameter-free children; else None."""
    if isinstance(module, (FusedBlock, MesaModule)) or _own_tensors(module):
        return None
    kids = dict(module.named_children())
    projs = [n for n, m in kids.items() if _gated_projection(m)]
    acts = [n for n, m in kids.items() if _is_activation(m) and n not in projs]
    rest = [m for n, m in kids.items() if n not in projs and n not in acts]
    if len(projs) != 3 or len(acts) > 1 or any(_has_params(m) for m in rest):
        return None
    if any(isinstance(kids[n], MesaModule) and "_mesa_orig_cls" not in kids[n].__dict__
           for n in projs):  # fmt: skip
        return None  # built as mesa_lite modules: their own settings
    return projs, (acts[0] if acts else None)


def _weight_of(m: nn.Module) -> torch.Tensor:
    """A projection's weight: an adapter layer's is its base layer's."""
    return (m.base_layer if _adapted_linear(m) else m).weight


def _gated_roles(module: nn.Module, projs, act) -> list[tuple[str, str, str, str, bool]]:
    """Candidate ``(gate, up, down, act, up_first)`` from following one probe call: gate and
    up take the module's input, down the rest; with an activation child, gate is the
    projection whose output it takes; without one, each order with each known activation
    function. ``up_first``: the forward calls up before gate (the path that runs the
    projections as modules calls them in the same order: their dropouts draw in turn)."""
    kids = {n: getattr(module, n) for n in (*projs, *([act] if act else []))}
    x = _inputs(_in_width(kids[projs[0]]), (_weight_of(kids[projs[0]]).dtype,))[0][1]
    with _probing(module), _recording(kids) as calls:
        type(module).forward(module, x)
    takes_x = [n for n, args, _ in calls if n in projs and args and args[0] is x]
    down = [n for n in projs if n not in takes_x]
    if len(takes_x) != 2 or len(down) != 1:
        return []
    if act is not None:
        outs = {n: out for n, _, out in calls}
        act_in = [args[0] for n, args, _ in calls if n == act and args]
        gate = [n for n in takes_x if act_in and act_in[0] is outs.get(n)]
        if len(gate) != 1:
            return []
        up = next(n for n in takes_x if n != gate[0])
        return [(gate[0], up, down[0], act, takes_x[0] == up)]
    first, second = takes_x
    return [(g, u, down[0], f, g == second) for f in _ACT_FUNCTIONS
            for g, u in ((first, second), (second, first))]  # fmt: skip


def _gate_and_up(gate: nn.Module, up: nn.Module, x: torch.Tensor, up_first: bool):
    """``(gate(x), up(x))``, called in the module's own order (their dropouts draw in turn)."""
    if up_first:
        u = up(x)
        return gate(x), u
    g = gate(x)
    return g, up(x)


def _gated_formula(module: nn.Module, roles) -> Callable[[torch.Tensor], torch.Tensor]:
    gate, up, down, act, up_first = roles
    fn = _ACT_FUNCTIONS[act][0] if act in _ACT_FUNCTIONS else getattr(module, act)
    g, u, d = getattr(module, gate), getattr(module, up), getattr(module, down)

    def formula(x):
        gx, ux = _gate_and_up(g, u, x, up_first)
        return d(fn(gx) * ux)

    return formula


def gated_mlp(module: nn.Module) -> tuple | str | None:
    """``(gate, up, down, act, up_first)`` (names; ``act``: an activation child's name or a key
    of ``_ACT_FUNCTIONS``; ``up_first``: up is called before gate) when ``module``'s forward
    is proved to be
    ``down(act(gate(x)) * up(x))``; the reason when a module with that data flow computes
    otherwise; None for a module without it."""
    found = _gated_candidate(module)
    if found is None:
        return None
    projs, act = found

    def run():
        try:
            options = _gated_roles(module, projs, act)
        except Exception:  # noqa: BLE001 - a forward that fails on a probe is not this MLP
            return None
        if not options:  # not an MLP's data flow (BERT's q, k, v): not a candidate after all
            return None
        w = _weight_of(getattr(module, projs[0]))
        why = None
        for roles in options:
            why = prove(
                module,
                lambda x: type(module).forward(module, x),
                _gated_formula(module, roles),
                w.shape[1],
                (w.dtype,),
                calls=set(projs) | ({act} if act else set()),
            )
            if why is None:
                return roles
        return f"not down(act(gate(x)) * up(x)): {why}"

    return _cached("gated", module, run)


class GatedMlp(FusedBlock, nn.Module):
    """A gated MLP (``gated_mlp``) running as one ``blocks.GatedMlpFn`` when its projections
    (and activation child) are wrapped with one setting (no hooks, training with grad).
    Where a projection is an adapter layer (PEFT's LoRA) the projections run as their own
    modules and ``act(gate(x)) * up(x)`` as one ``blocks.GatedProductFn``. Otherwise its own
    forward."""

    def forward(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else None
        parts = None if x is None or not self._mesa_block_active(x) else _gated_parts(self)
        if parts is None:
            return super().forward(*args, **kwargs)
        fused, up_first, gp, up, dp, fn, grad_fn, spec = parts
        if not fused:  # the projections in the order of the module's own calls
            _warn_unconverted(self, (gp, up, dp))
            g, u = _gate_and_up(gp, up, x, up_first)
            prod = blocks.GatedProductFn.apply(g, u, (fn, backward_for(grad_fn, spec), spec))
            return dp(prod)
        dtype = autocast_dtype("linear", x.device)
        cfg = (dtype, fn, backward_for(grad_fn, spec), spec)
        return blocks.GatedMlpFn.apply(
            x, gp.weight, gp.bias, up.weight, up.bias, dp.weight, dp.bias, cfg
        )

    def unfuse(self) -> nn.Module:
        self.__dict__.pop("_mesa_gated", None)
        self.__dict__.pop("_mesa_proved_attrs", None)
        self.__dict__.pop("_mesa_adapters_checked", None)
        return super().unfuse()


def _warn_unconverted(m: nn.Module, layers) -> None:
    """Warns once per gated MLP and set of adapters whose adapter layers hold linear layers
    ``wrap`` has not converted (PEFT's adapters added after ``wrap``, or by ``add_adapter``
    after it): those that run keep their inputs in full."""
    if torch.compiler.is_compiling():
        return
    # the layers, and how many modules the adapters hold (PEFT's add_adapter adds some)
    key = (*(id(x) for x in layers),
           sum(1 for x in layers if _adapted_linear(x) for _ in x.modules()))  # fmt: skip
    if m.__dict__.get("_mesa_adapters_checked") == key:
        return
    m.__dict__["_mesa_adapters_checked"] = key
    plain = [n for x in layers if _adapted_linear(x) for n, c in x.named_modules()
             if isinstance(c, nn.Linear) and not isinstance(c, MesaModule)]  # fmt: skip
    if plain:
        warnings.warn(
            f"mesa_lite: {type(m).__name__}'s adapter layers hold linear layers wrap has not "
            f"converted ({', '.join(plain[:3])}): those that run keep their inputs in full. "
            "Adapters added after wrap (PEFT's get_peft_model or add_adapter) are converted "
            "by calling mesa_lite.wrap(model) again.",
            stacklevel=3,
        )


def _gated_parts(m: nn.Module):
    """``(fused, up_first, gate, up, down, fn, grad_fn, spec)`` for the fast path of a gated
    MLP: ``fused`` when its projections are all converted Linears (one ``GatedMlpFn``), False
    when some are adapter layers around converted Linears (``GatedProductFn``); None for its
    own forward."""
    roles = m.__dict__.get("_mesa_gated")
    if roles is None or not still_proved(m):
        return None
    gate, up, down, act, up_first = roles
    layers = [getattr(m, n) for n in (gate, up, down)]
    fused = all(isinstance(x, Linear) for x in layers)
    # an adapter's base layer carries the setting; the adapter runs as its own module
    bases = [x.base_layer if _adapted_linear(x) else x for x in layers]
    if not all(isinstance(x, Linear) for x in bases):
        return None
    if act in _ACT_FUNCTIONS:
        fn, grad_fn = _ACT_FUNCTIONS[act]
        acts = []
    else:
        a = getattr(m, act)
        if not _is_activation(a) or getattr(a, "inplace", False):
            return None
        acts = [a]
        fn, grad_fn = a.mesa_formula()
    spec = blocks.spec_of(*bases, *acts)
    # the modules whose forwards the path skips: the projections too when fused
    skipped = (*layers, *acts) if fused else acts
    if spec is None or spec.exact or not plain_modules(m, *skipped):
        # debug_exact runs per-op: where the input is also the residual stream (Olmo2's
        # post-norm layers) its gradient sums three terms, in the order only the per-op
        # graph reproduces
        return None
    return (fused, up_first, *layers, fn, grad_fn, spec)


# ---- two-projection MLP (GPT-2's) ----------------------------------------------------------


def _mlp_candidate(module: nn.Module):
    kids = dict(module.named_children())
    if len(kids) not in (3, 4) or isinstance(module, (FusedBlock, MesaModule)):
        return None
    if _own_tensors(module):  # a layer scale or bias of its own: a step the fused path lacks
        return None
    projs = [n for n, m in kids.items() if _is_projection(m)]
    acts = [n for n, m in kids.items() if _is_activation(m)]
    drops = [n for n, m in kids.items() if isinstance(m, nn.Dropout)]
    if len(projs) != 2 or len(acts) != 1 or len(drops) != len(kids) - 3:
        return None
    return kids, projs, acts


def mlp_chain(module: nn.Module) -> tuple | str | None:
    """The names of ``(proj1, act, proj2[, dropout])`` when ``module``'s forward is proved to
    be ``dropout(proj2(act(proj1(x))))``: on a probe input in training mode each child is
    called once, in that order, on the previous one's output, the result is the last one's
    output, and the forward draws no random numbers but the dropout child's. The reason when a
    module with that chain of calls computes something more; None for a module without it."""
    found = _mlp_candidate(module)
    if found is None:
        return None
    kids, projs, acts = found

    def run():
        first = kids[projs[0]]
        x = _inputs(_in_width(first), (first.weight.dtype,))[0][1]
        try:
            with _probing(module):
                with _recording(kids) as calls:
                    out = type(module).forward(module, x)
        except Exception:  # noqa: BLE001 - a forward that fails on a probe is not this MLP
            return None
        names = tuple(name for name, _, _ in calls)
        # not this data flow: not a candidate after all (nothing to report)
        if len(names) != len(kids) or len(set(names)) != len(names):
            return None
        if not (names[0] in projs and names[1] in acts and names[2] in projs):
            return None
        given = x
        for _name, args, result in calls:  # each child takes exactly the previous one's output
            if len(args) != 1 or args[0] is not given:
                return None
            given = result
        if out is not given:
            return "its output is not its last layer's (a step after it, such as F.dropout)"

        def chain(t):
            for name in names:
                t = kids[name](t)
            return t

        # the same values and draws as the chain alone (an in-place op on a layer's output
        # keeps the objects above but changes the values), also under autocast
        why = prove(module, lambda t: type(module).forward(module, t), chain, _in_width(first),
                    (first.weight.dtype,), calls=set(names))  # fmt: skip
        return names if why is None else why

    return _cached("mlp", module, run)


class Mlp(FusedBlock, nn.Module):
    """A two-projection MLP (``mlp_chain``) running as one ``blocks.MlpFn`` when its layers
    are wrapped with one setting (no hooks, training with grad); otherwise its own forward."""

    def unfuse(self) -> nn.Module:
        self.__dict__.pop("_mesa_mlp_chain", None)
        self.__dict__.pop("_mesa_proved_attrs", None)
        return super().unfuse()

    def forward(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else None
        parts = None if x is None or not self._mesa_block_active(x) else _mlp_parts(self)
        if parts is None:
            return super().forward(*args, **kwargs)
        p1, act, p2, p, spec = parts
        fn, grad_fn = act.mesa_formula()
        kinds = tuple("linear" if isinstance(m, nn.Linear) else "addmm" for m in (p1, p2))
        dtypes = tuple(autocast_dtype(k, x.device) for k in kinds)
        cfg = (kinds, dtypes, fn, backward_for(grad_fn, spec), p, spec)
        return blocks.MlpFn.apply(x, p1.weight, p1.bias, p2.weight, p2.bias, cfg)


def _mlp_parts(m: nn.Module):
    """``(proj1, act, proj2, dropout p, spec)`` when ``m`` can run as one ``MlpFn``: its
    layers converted with one setting, each projection's compressed path taken, the dropout
    converted (p below 1, not in place), no hooks; else None."""
    chain = m.__dict__.get("_mesa_mlp_chain")
    if chain is None or not still_proved(m):
        return None
    layers = [getattr(m, name) for name in chain]
    p1, act, p2 = layers[:3]
    for proj in (p1, p2):
        if isinstance(proj, Linear):
            continue
        mesa = next((c for t, c in _PROJECTIONS.items() if isinstance(proj, t)), None)
        if mesa is None or not isinstance(proj, mesa) or proj.bias is None:
            return None
    if not _is_activation(act) or getattr(act, "inplace", False):
        return None
    p = 0.0
    if len(layers) == 4:
        drop = layers[3]
        if type(drop).forward not in (nn.Dropout.forward, Dropout.forward) or drop.inplace:
            return None
        if drop.p != 0 and not (isinstance(drop, Dropout) and drop.mesa_spec is not None):
            return None  # dropout left plain by the configuration keeps its own mask
        if not 0 <= drop.p < 1:
            return None
        p = drop.p
    spec = blocks.spec_of(p1, act, p2)
    if spec is None or not plain_modules(m, *layers):
        return None
    return p1, act, p2, p, spec


def fused_layers_converted(module: nn.Module) -> bool:
    """Whether the projections of a block recognised by proof are converted (so that it runs
    as its block Function in training), not left exact by the configuration."""
    gated = module.__dict__.get("_mesa_gated")
    chain = module.__dict__.get("_mesa_mlp_chain")
    if gated is not None:
        projections = gated[:3]  # (gate, up, down, act)
    elif chain is not None:
        projections = (chain[0], chain[2])  # (proj1, act, proj2[, dropout])
    else:
        return False
    layers = [getattr(module, n) for n in projections]
    return all(isinstance(x.base_layer if _adapted_linear(x) else x, MesaModule) for x in layers)


def _matcher(find: Callable, key: str, cls: type) -> Callable[[nn.Module], type | str | None]:
    """``module -> cls`` with what ``find`` proved recorded under ``key`` on the module, the
    reason ``find`` gave, or None."""

    def match(module: nn.Module):
        found = find(module)
        if isinstance(found, tuple):
            module.__dict__[key] = found
            module.__dict__["_mesa_proved_attrs"] = proved_attrs(module, _adapted_linear)
            return cls
        return found

    return match


def block_matchers() -> list[Callable[[nn.Module], type | str | None]]:
    """``module -> FusedBlock class`` (recognised; its roles recorded on the module), a reason
    (a candidate refused), or None (not a candidate), for ``wrap``'s block pass."""
    return [_matcher(gated_mlp, "_mesa_gated", GatedMlp),
            _matcher(mlp_chain, "_mesa_mlp_chain", Mlp)]  # fmt: skip
