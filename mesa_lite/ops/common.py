"""What every op's Function and functional form share: autocast's cast target per op and the
cast itself, the registry lookup that reuses a producer's codes, the first-order guard, and the
checks that send an op to the plain torch path.

Autocast: the functional forms cast the inputs exactly as autocast itself would cast them for
each op (``autocast_dtype`` gives the op's cast target, ``autocast_cast`` casts one tensor as
autocast's ``cached_cast`` does, without its per-region cache of leaf casts), outside the
Function (so autograd casts the gradients back as autocast's own casts would), and the
Functions run the same aten op on the cast inputs (autocast, still on, then has nothing left
to cast). Outside autocast nothing is cast: mixed dtypes reach the aten op as they came, so it
accepts what torch accepts (an fp32 LayerNorm on bf16 input) and raises torch's own error for
what torch rejects. Forward outputs are therefore bit-identical to PyTorch's, with and without
autocast, on any device.

Each Function keeps only what the gradients asked for need (``ctx.needs_input_grad``): a
frozen Linear whose input needs grad keeps no copy of that input, as in torch.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
import weakref

import torch

from mesa_lite import quant
from mesa_lite.config import QuantSpec

# ---- the dtype autocast gives an op ---------------------------------------------------------

# op name -> (arity, the op on ``arity`` tensors); each op's file registers its own
_PROBES: dict[str, tuple[int, object]] = {}


def register_probe(op: str, arity: int, fn) -> None:
    """How ``autocast_dtype`` finds autocast's cast target for ``op``: ``fn`` run on ``arity``
    1-element tensors under autocast."""
    _PROBES[op] = (arity, fn)


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def _probe(op: str, device: str, autocast_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    arity, fn = _PROBES[op]
    args = [torch.zeros(1, 1, dtype=dtype, device=device) for _ in range(arity)]
    with torch.no_grad(), torch.autocast(device_type=device, dtype=autocast_dtype):
        return fn(*args).dtype


@functools.cache
def _autocast_policy(op: str, device: str, autocast_dtype: torch.dtype) -> torch.dtype | None:
    """Autocast's cast target for ``op``: its dtype for lower-precision ops, fp32 for fp32 ops,
    None for ops it leaves alone. Found by running the op on 1-element tensors under autocast,
    so it follows PyTorch's own lists on every device and version."""
    if _probe(op, device, autocast_dtype, torch.float32) == autocast_dtype:
        return autocast_dtype
    if _probe(op, device, autocast_dtype, autocast_dtype) == torch.float32:
        return torch.float32
    return None


def autocast_dtype(op: str, device: torch.device) -> torch.dtype | None:
    """The dtype the current autocast state casts ``op``'s floating inputs on ``device`` to, or
    None when autocast is off there or leaves ``op`` alone."""
    dev = device.type
    if dev not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(dev):
        return None
    return _autocast_policy_constant(op, dev, torch.get_autocast_dtype(dev))


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing Dynamo when mesa_lite is
    imported (2.6 s on a first ``wrap``): the same mark, which Dynamo reads while tracing
    (torch 2.11 to 2.14; the compile tests with ``fullgraph=True`` fail without it)."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def _autocast_policy_constant(op: str, device: str, autocast_dtype: torch.dtype):
    # torch.compile calls this once while tracing (no probe ops in the graph)
    return _autocast_policy(op, device, autocast_dtype)


def autocast_cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` cast to ``dtype`` where autocast would cast it (a floating tensor other than fp64;
    ``dtype`` None: no cast), else ``t`` itself."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    if not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return cast(t, dtype)


def weight_cast(w: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``autocast_cast`` of a weight in a Function's forward, where grad mode is off: the cast
    carries the weight's ``requires_grad``, as autocast's own (differentiable) cast does in
    the module's forward. ``F.linear`` of a non-contiguous 3-D input runs ``at::matmul``,
    which folds the batch into one mm only when the weight requires grad, else runs a bmm that
    rounds otherwise (LeViT's transposed qkv input under bf16 autocast on the CPU)."""
    out = autocast_cast(w, dtype)
    if out is not w and w.requires_grad and not torch.compiler.is_compiling():
        out.requires_grad_()
    return out


def kept_cast(weight: torch.Tensor, w_cast: torch.Tensor, spec) -> torch.Tensor | None:
    """What a Function saves of ``w_cast``, the forward's autocast copy of ``weight``: the copy
    where ``spec.keep_weight_casts`` asks for it (eager mode; a copy, not the weight itself),
    else None (backward casts ``weight`` again: ``recast``)."""
    if not spec.keep_weight_casts or w_cast is weight or torch.compiler.is_compiling():
        return None
    return w_cast


def recast(t: torch.Tensor | None, dtype: torch.dtype | None, kept=None) -> torch.Tensor | None:
    """``autocast_cast`` of a parameter again in backward, or ``kept``, the forward's copy,
    where the Function kept it (``kept_cast``).

    Under torch.compile the cast goes through an unsqueeze/squeeze pair: the compiler merges
    identical ops of forward and backward (CSE on the joint graph), and a backward cast merged
    with the forward's makes the partitioner keep that low-precision copy of every weight from
    forward to backward (it will not recompute a tensor a matmul reads in backward), where the
    parameter itself is free to keep. GPT-2 small kept 235 MiB of weight copies that way."""
    if kept is not None:
        return kept
    if t is not None and dtype is not None and torch.compiler.is_compiling():
        return autocast_cast(t.unsqueeze(0), dtype).squeeze(0)
    return autocast_cast(t, dtype)


# a dtype's own conversion method parses its arguments faster than ``Tensor.to`` (host time on
# every cast of every layer)
_CASTS = {
    torch.float32: torch.Tensor.float,
    torch.float16: torch.Tensor.half,
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float64: torch.Tensor.double,
}


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, with less host time for floating dtypes."""
    method = _CASTS.get(dtype)
    return t.to(dtype) if method is None else method(t)


def dtypes_of(*tensors: torch.Tensor | None) -> tuple[torch.dtype | None, ...]:
    """Each tensor's dtype (None for None): what a Function casts its parameters' gradients
    back to."""
    return tuple(None if t is None else t.dtype for t in tensors)


def channels_last_perm(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation that makes a channels-last ``x`` contiguous (N, spatial..., C); None for
    a contiguous ``x`` or any other layout (kept in row-major order)."""
    if x.dim() < 4 or x.is_contiguous():
        return None
    perm = (0, *range(2, x.dim()), 1)
    return perm if x.permute(perm).is_contiguous() else None


def inverse_perm(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def fresh(out: torch.Tensor) -> torch.Tensor:
    """A Function's output that is a view of a tensor made inside it (``F.linear`` on 3-D input,
    a folded matmul, an attention backend's transposed output), as a non-view alias of the same
    memory: autograd forbids in-place ops on views made inside a custom Function, while torch's
    own ops allow them on their outputs (an in-place ReLU or SiLU after a Linear). Under
    torch.compile through ``_unsafe_view``, which the compiler does not treat as a view (as
    ``F.linear`` itself returns its 3-D output), and which copies nothing."""
    if out._base is None:
        return out
    if torch.compiler.is_compiling():
        return torch.ops.aten._unsafe_view(out, out.shape)
    return out.detach()


def shared_output(out: torch.Tensor, p: quant.Packed, memory_order: bool = False,
                  traced: bool = True) -> torch.Tensor:  # fmt: skip
    """Inside a producer's Function: registers ``p``, the codes of its output ``out`` (in memory
    order with ``memory_order``), for the consumer, and returns the output. In eager mode
    through the registry (``quant.share``).

    Under torch.compile, where Dynamo traces no ``id()`` and reads no version counter, the
    codes ride on the output as an attribute (``quant.share_traced``), and the output is a
    view of ``out`` made here (no copy), which autograd refuses to change in place, so no
    consumer can reuse codes of a tensor changed since. Only where ``traced``, for outputs no
    code changes in place: the fused attention's (Hugging Face's attention reshapes it for the
    output projection), and the norms' and activations' inside a Hugging Face block that
    ``after_wrap`` marks (``mesa_share_traced``: GPT-2's ``ln_1``, Llama's
    ``input_layernorm``, ...). Other norms and activations are not shared under compile
    (``traced`` False): user code and mesa_lite's own in-place activations change those in
    place (an in-place ReLU after a LayerNorm, a compiled backbone's last norm), so there their
    consumers keep their own copy."""
    if not (traced and torch.compiler.is_compiling()):
        quant.share(out, p, memory_order=memory_order)  # (nothing under compile)
        return out
    if p.spec.exact:
        return out
    out = out.view_as(out)
    quant.share_traced(out, p, memory_order)
    return out


# ReLU outputs offered to a consumer: id(storage owner) -> (owner ref, version, offset, shape,
# stride, spec, Offer); dropped with the owner
_OFFERS: dict[int, tuple] = {}
# backward passes through a ReLU so far: the steps an offer's claim is judged across
BACKWARDS = [0]


class Offer:
    """One offered output: whether a consumer kept it (``claimed``) and ``BACKWARDS`` when it
    was offered."""

    __slots__ = ("claimed", "epoch")

    def __init__(self) -> None:
        self.claimed = False
        self.epoch = BACKWARDS[0]


def _owner(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def offer(out: torch.Tensor, spec: QuantSpec) -> Offer:
    """Registers ``out``, a fresh ReLU output kept at ``spec``, for ``claim``."""
    owner = _owner(out)
    key = id(owner)
    if key not in _OFFERS:
        weakref.finalize(owner, _OFFERS.pop, key, None)
    record = Offer()
    _OFFERS[key] = (weakref.ref(owner), out._version, out.storage_offset(), tuple(out.shape),
                    out.stride(), spec, record)  # fmt: skip
    return record


def claim(x: torch.Tensor, spec: QuantSpec, memory_order: bool = False) -> None:
    """A consumer keeps ``x`` at ``spec``: when ``x`` is an offered ReLU output, unchanged,
    ``spec`` has its codes' width and group size, and the consumer would find the codes the
    ReLU registers (in memory order for a channels-last output: a consumer reading them in
    logical order, ``memory_order`` False, finds those only where ``x`` is contiguous), the
    offer is claimed (``ops/relu.py``)."""
    if torch.compiler.is_compiling() or not _OFFERS:
        return
    entry = _OFFERS.get(id(_owner(x)))
    if entry is None:
        return
    ref, version, offset, shape, stride, kept, record = entry
    if (ref() is not _owner(x) or x._version != version or x.storage_offset() != offset
            or tuple(x.shape) != shape or x.stride() != stride):  # fmt: skip
        return
    if spec.exact or spec.bits != kept.bits or spec.group_size != kept.group_size:
        return
    if memory_order == (channels_last_perm(x) is not None) or x.is_contiguous():
        record.claimed = True


def keep(
    x: torch.Tensor,
    spec: QuantSpec,
    signed: bool = True,
    share_key=None,
    max_steps=None,
    offer: bool = False,
) -> quant.Packed:
    """Reuses the codes a producer registered for ``x`` (or for ``share_key``, the tensor before
    the autocast cast that made ``x``), else quantizes ``x`` (and tells a ReLU whose output
    ``x`` is that it can keep codes for its consumer: ``claim``).

    ``max_steps``: reuse only codes whose recipe has at most this many steps (a producer that
    extends the recipe passes ``MAX_RECIPE_STEPS - 1``). ``offer``: codes quantized here are
    registered for ``x`` (``quant.share``), so that another consumer of the same tensor (a
    ResNet's max-pooling output feeds two convolutions) keeps no second copy; only for an
    op's output in the autograd graph (``offerable``), never for a tensor the user holds.
    """
    shared = quant.lookup_shared(x, spec, key=share_key)
    claim(x if share_key is None else share_key, spec)  # a ReLU's codes in use count too
    if shared is not None and (max_steps is None or len(shared.recipe) <= max_steps):
        return shared
    p = quant.quantize(x, spec, signed)
    if offer and (share_key is None or share_key is x) and offerable(x):
        quant.share(x, p)  # (not for an autocast cast of it: its codes are keyed on the cast)
    return p


def offerable(x: torch.Tensor) -> bool:
    """Whether codes quantized for ``x`` may be registered for other consumers of it: only
    when ``x`` is an op's output in this step's autograd graph. A leaf (a batch the user
    holds, a buffer refilled each step through ``.data`` or numpy, which moves no version
    counter, a slice of a dataset held as one tensor) lives across steps: its codes would be
    reused with stale values or frozen stochastic rounding, and kept while it lives. Never
    under torch.compile (no registry there; Dynamo cannot read a ``grad_fn``)."""
    return not torch.compiler.is_compiling() and x.grad_fn is not None


def first_order_only(backward):
    """Backward from compressed copies is not differentiable again: with ``create_graph=True``
    (double backward) it would silently give wrong second-order gradients, so it raises."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "mesa_lite: double backward (create_graph=True) through compressed activations "
                "is not supported; unwrap the model (mesa_lite.unwrap) or disable the layer "
                "with Config(overrides={name: {'enabled': False}})"
            )
        return backward(ctx, *grads)

    return wrapper


# ---- when an op runs plain ------------------------------------------------------------------

_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if torch.compiler.is_compiling():
        _warn_while_tracing(key, message)
    elif key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


@assume_constant_result
def _warn_while_tracing(key: str, message: str) -> bool:
    # torch.compile runs this once while tracing (Dynamo cannot trace warnings.warn)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=2)
    return True


CPUINFO = "/proc/cpuinfo"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (x86 AVX512-BF16 or AMX-BF16, Arm BF16).

    Without it torch emulates bf16 matmuls, tens to a hundred times slower than fp32 (a
    1024^3 bf16 matmul: 15.9 s against 0.15 s in fp32 on a 2-core AVX2 machine).
    """
    try:
        with open(CPUINFO) as f:
            flags = f.read().split()
    except OSError:
        flags = []
    if flags:
        return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags))
    if sys.platform == "darwin":  # Apple silicon from M2 on
        try:
            out = subprocess.run(
                ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                capture_output=True, text=True, timeout=5, check=False,
            )  # fmt: skip
            return out.stdout.strip() == "1"
        except OSError:
            return False
    return False


_HALF = (torch.bfloat16, torch.float16)


def check_cpu_bf16(x: torch.Tensor) -> None:
    """Warns once when a compressed op runs in bf16 or fp16 on a CPU without native bf16
    (under CPU autocast to either, or on such an input): torch emulates both there, and
    training is many times slower than in fp32, plain or wrapped alike. Nothing is read
    while torch.compile traces (a guard on the warned set would recompile every graph after
    any warning), so a compiled model is not checked."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or "cpu-bf16" in _WARNED:
        return
    if not (x.dtype in _HALF or (torch.is_autocast_enabled("cpu")
                                 and torch.get_autocast_dtype("cpu") in _HALF)):  # fmt: skip
        return
    if cpu_has_native_bf16():
        _WARNED.add("cpu-bf16")  # nothing to say on this CPU
        return
    warn_once(
        "cpu-bf16",
        "mesa_lite: training in bf16/fp16 on a CPU without native bf16 (no AVX512-BF16, AMX "
        "or Arm BF16): torch emulates it, many times slower than fp32 (a 512^3 matmul 100x), "
        "plain or wrapped; train in fp32 on this CPU",
    )


def in_functorch_transform() -> bool:
    """Inside a torch.func transform (grad, vjp, jacrev, vmap, ...), in eager mode and while
    torch.compile traces one (``torch.compile(lambda p: torch.func.grad(f)(p))``).

    Dynamo reads ``peek_interpreter_stack()`` at trace time and wraps its value, None
    included, in an object whose ``is not None`` is always True; ``isinstance`` on it Dynamo
    answers from the value (torch 2.11-2.15, fullgraph). Answering False while tracing, as
    before, sent the transform through the compressed Functions, which are not
    functorch-aware: every layer after the first got a zero gradient, silently."""
    return isinstance(
        torch._C._functorch.peek_interpreter_stack(), torch._C._functorch.CInterpreter
    )


def plain_under_functorch(name: str) -> bool:
    """True (after a one-time warning) when a compressed path is asked for inside a torch.func
    transform: mesa_lite's Functions and kernels are not functorch-aware, so the plain torch
    op runs there (exact, uncompressed)."""
    if not in_functorch_transform():
        return False
    warn_once(
        "functorch",
        f"mesa_lite: {name} runs as plain torch (uncompressed) inside torch.func transforms "
        "(grad, vjp, jacrev, vmap); its results are exact there",
    )
    return True


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """The compressed path applies: grad mode on, some tensor needs grad, and all are floating
    point (integer or complex inputs run the plain op, so they fail or work exactly as in
    torch)."""
    given = [t for t in tensors if t is not None]
    return (
        torch.is_grad_enabled()
        and any(t.requires_grad for t in given)
        and all(t.is_floating_point() for t in given)
    )
