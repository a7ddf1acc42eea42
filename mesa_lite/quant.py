"""The packed form of a saved activation, sharing one copy between ops, and the one switch
between Triton and the reference.

A ``Packed`` holds codes + per-group fp32 scales and the metadata to rebuild the tensor.
Autograd Functions keep its tensors through ``ctx.save_for_backward`` (``save``/``load``), so
PyTorch's saved-tensor hooks and checkpointing see them.

A ``Packed`` may also carry a recipe that rebuilds a tensor *derived* from the stored one: the
codes of a GELU's input rebuild the GELU's output (``gelu``), the codes of a LayerNorm's
normalized input rebuild its output with the affine parameters (``affine``). Steps chain (a
GELU after a LayerNorm extends its recipe, up to ``MAX_RECIPE_STEPS``). That is how one copy
serves several ops (timm's LayerNorm -> Linear and fc1 -> GELU -> fc2).

Sharing: a producer registers its fresh output (``share(out, packed)``); a consumer that keeps
that very tensor, a dense view of the same memory (SDPA's output reshaped for the projection),
or its autocast cast (``lookup_shared(x, spec, key=pre_cast)``), reuses the codes instead of
quantizing again. Entries are checked against the tensor's version counter and dropped when
the tensor's storage owner dies. Only producers opt in, for tensors made fresh in each forward:
a tensor that lives across steps would hand the same codes (and stochastic draw) to each step.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Optional

import torch

from mesa_lite.config import QuantSpec
from mesa_lite.kernels import batch_norm_backward as _batch_norm_backward
from mesa_lite.kernels import gated, group_quant
from mesa_lite.kernels import softmax_backward as _softmax_backward
from mesa_lite.kernels.launch import HAS_TRITON, use_triton

__all__ = ["Packed", "quantize", "dequantize", "share", "lookup_shared", "save", "load"]


class Packed:
    """A compressed tensor (a plain slotted class: it is built on every forward and backward).

    Attributes:
        codes: flat codes (int8/uint8 at 8 bits, packed uint8 below), or the exact tensor
            itself when ``spec.exact``.
        scales: fp32, one per group (None when exact).
        shape: the shape of the tensor this rebuilds.
        dtype: the dtype of the tensor this rebuilds (after the recipe, if any).
        spec: how it was quantized.
        signed: signed codes (True) or unsigned codes for non-negative tensors (False).
        recipe: a tuple of steps that derive the tensor from the stored one, applied in
            order (empty: the stored tensor itself). A step is ``(kind, dtype, *params)``,
            ``dtype`` the dtype the forward op of that step ran in; each op registers its kind
            (``register_step``): ``("affine", dtype, normalized_shape, eps)`` in
            ``ops/layer_norm.py`` (a LayerNorm's output from its normalized input; weight and
            bias in ``aux``; always the first step), ``("gelu", dtype, approximate)`` in
            ``ops/gelu.py``.
        aux: tensors the steps need, in step order, kept with ``save_for_backward`` too.
    """

    __slots__ = ("codes", "scales", "shape", "dtype", "spec", "signed", "recipe", "aux")

    def __init__(
        self, codes, scales, shape, dtype, spec: QuantSpec, signed=True, recipe=(), aux=()
    ) -> None:
        self.codes = codes
        self.scales = scales
        self.shape = shape
        self.dtype = dtype
        self.spec = spec
        self.signed = signed
        self.recipe = recipe
        self.aux = aux

    def meta(self) -> tuple:
        """Everything but codes, scales and aux, to rebuild with ``Packed(c, s, *meta)``."""
        return (self.shape, self.dtype, self.spec, self.signed, self.recipe)

    def derived(self, step: tuple, dtype: torch.dtype, aux=()) -> Packed:
        """The same codes, rebuilding the output (of ``dtype``) of one more op ``step``."""
        return Packed(
            self.codes,
            self.scales,
            self.shape,
            dtype,
            self.spec,
            self.signed,
            (*self.recipe, step),
            (*self.aux, *aux),
        )

    def nbytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def __repr__(self) -> str:
        return (
            f"Packed(shape={tuple(self.shape)}, dtype={self.dtype}, {self.spec.describe()}, "
            f"signed={self.signed}, recipe={self.recipe}, {self.nbytes()} bytes)"
        )


# A chain of recipe steps is rebuilt in full by every consumer; past this length a producer
# quantizes its input afresh instead of extending the chain (GELU -> GELU -> GELU -> ...).
MAX_RECIPE_STEPS = 2


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def compressible(x: torch.Tensor) -> bool:
    """fp32, fp16 and bf16 tensors are compressed; others (fp64) are kept exactly."""
    return x.dtype in group_quant.SUPPORTED_DTYPES


@functools.lru_cache(maxsize=64)
def _exact(spec: QuantSpec) -> QuantSpec:
    return dataclasses.replace(spec, exact=True)


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    signed: bool = True,
    normalize: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Packed:
    """Compresses ``x`` as ``spec`` says (in its logical, row-major order).

    Args:
        x: the tensor to keep. fp32, fp16 and bf16 are compressed; an fp64 tensor is kept
            exactly (documented passthrough: fp64 training keeps its precision).
        spec: the layer's QuantSpec.
        signed: False for tensors known to be non-negative (unsigned codes, one more bit).
        normalize: ``(mean, rstd)`` per row: keep the fp32 ``(x.float() - mean) * rstd``
            instead (a LayerNorm's normalized input), computed inside the quantize kernel.
            Not with ``spec.exact`` or an uncompressible ``x``.
    """
    if not spec.exact and not compressible(x):
        spec = _exact(spec)
    if spec.exact:
        if normalize is not None:
            raise ValueError("quant.quantize: normalize needs a compressed spec")
        return Packed(x, None, x.shape, x.dtype, spec, signed)
    compiling = torch.compiler.is_compiling()
    if compiling and _decomposed(spec, x.numel()):
        codes, scales = group_quant.quantize_ref(
            x, spec.group_size, signed, False, spec.bits, normalize
        )
    elif compiling:
        mean, rstd = (None, None) if normalize is None else normalize
        codes, scales = torch.ops.mesa_lite.quantize(
            x, spec.group_size, signed, spec.stochastic, spec.bits, mean, rstd
        )
    else:  # eager: the kernels for CUDA tensors (use_triton without asking again)
        codes, scales = group_quant.quantize(
            x, spec.group_size, signed=signed, stochastic=spec.stochastic,
            use_triton=HAS_TRITON and x.is_cuda, bits=spec.bits, normalize=normalize,
        )  # fmt: skip
    dtype = x.dtype if normalize is None else torch.float32
    return Packed(codes, scales, x.shape, dtype, spec, signed)


def one_launch(xs, spec: QuantSpec) -> bool:
    """Whether ``quantize3`` takes these three tensors: the kernels run for them (CUDA, not
    compiling), they are of one compressible dtype on one device, and the spec is compressed
    at nearest rounding."""
    x0 = xs[0]
    return not (spec.exact or spec.stochastic or not use_triton(x0) or not compressible(x0)
                or any(x.dtype != x0.dtype or x.device != x0.device for x in xs))  # fmt: skip


def quantize3(xs, spec: QuantSpec) -> list[Packed]:
    """Three tensors kept as ``quantize(x, spec)`` keeps each, bit for bit, in one kernel
    launch (``group_quant.quantize3``: attention's q, k and v from separate projections), where
    ``one_launch`` says it applies."""
    kept = group_quant.quantize3(xs, spec.group_size, True, use_triton=True, bits=spec.bits)
    return [Packed(c, s, x.shape, x.dtype, spec, True) for x, (c, s) in zip(xs, kept, strict=True)]


def stored(p: Packed, dtype: torch.dtype, epilogue: tuple | None = None) -> torch.Tensor:
    """The stored tensor (before any recipe), flat unless exact, in ``dtype``; a compressed
    one through a dequantize ``epilogue`` (see ``group_quant.dequantize``)."""
    if p.spec.exact:
        return p.codes.to(dtype)
    numel = _prod(p.shape)
    compiling = torch.compiler.is_compiling()
    if compiling and _decomposed(p.spec, numel):
        # The codes pass through unfold (a view: no copy, no kernel) so that the Inductor
        # partitioner counts them as materialized in backward: it then weighs them at their
        # size, not twice it, and keeps them for backward rather than a full-precision tensor
        # computed from them in forward (at 8 bits the two cost it the same otherwise)
        codes = p.codes.unfold(0, 1, 1).view(-1)
        return group_quant.dequantize_ref(
            codes, p.scales, p.spec.group_size, dtype, p.spec.bits, p.signed, numel, epilogue
        )
    if compiling:
        kind, approximate, t1, t2, mid = _epilogue_op_args(epilogue, dtype)
        return torch.ops.mesa_lite.dequantize(
            p.codes, p.scales, p.spec.group_size, dtype, p.spec.bits, p.signed, numel,
            kind, approximate, mid, t1, t2,
        )  # fmt: skip
    return group_quant.dequantize(
        p.codes, p.scales, p.spec.group_size, dtype, use_triton=HAS_TRITON and p.codes.is_cuda,
        bits=p.spec.bits, signed=p.signed, numel=numel, epilogue=epilogue,
    )  # fmt: skip


def dequantize(p: Packed, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuilds the tensor of ``p`` (through its recipe, if any) in ``dtype``.

    Each step runs in the dtype its forward op ran in (the GELU's input dtype; the affine
    step in fp32, as LayerNorm outputs are narrow), with one cast between steps and one at
    the end; in the exact (debug) mode steps rerun the very ops of the forward on the exact
    input, so results are bit-identical. Compressed, the first step runs inside the dequantize
    kernel (one pass, no full-precision temporaries), in the final dtype when it is the last.
    The steps are the ops' own (``register_step``).
    """
    dtype = p.dtype if dtype is None else dtype
    if not p.recipe:
        return stored(p, dtype).view(p.shape)
    aux = iter(p.aux)
    h = None
    last = len(p.recipe) - 1
    for i, step in enumerate(p.recipe):
        rule = _STEPS.get(step[0])
        if rule is None:
            raise ValueError(f"unknown recipe step {step!r}")
        args = [next(aux) for _ in range(rule.n_aux)]
        if h is None:
            h = rule.first(p, step, args, dtype if i == last else rule.mid_dtype(step))
        elif rule.then is None:
            raise ValueError(f"{step[0]} recipe step must come first, got {p.recipe!r}")
        else:
            h = rule.then(h, step, args)
    return h.to(dtype).view(p.shape)


@dataclasses.dataclass(frozen=True)
class RecipeStep:
    """How one kind of recipe step rebuilds its op's output (an op's file registers it).

    Attributes:
        n_aux: the aux tensors it takes from the Packed, in order.
        first: ``(packed, step, aux, dtype) -> tensor``: the step on the stored tensor, as the
            first step; compressed, an epilogue of the dequantize kernel (``stored``), in the
            exact mode the op itself on the kept input.
        then: ``(tensor, step, aux) -> tensor``: the step on a previous step's result; None
            for a step that must come first.
        mid_dtype: ``step -> dtype``: the dtype of its result when another step follows.
    """

    n_aux: int
    first: Callable
    then: Callable | None
    mid_dtype: Callable


_STEPS: dict[str, RecipeStep] = {}


def register_step(kind: str, rule: RecipeStep) -> None:
    """Registers how recipe steps ``(kind, dtype, *params)`` are rebuilt."""
    _STEPS[kind] = rule


def silu_backward(p: Packed, grad: torch.Tensor, dtype: torch.dtype):
    """SiLU's input gradient from the output gradient and ``p``, the SiLU input's codes (no
    recipe, compressed), in one pass, as ``gelu_backward``."""
    return stored(p, dtype, ("silu_backward", grad)).view(p.shape)


def gelu_backward(p: Packed, grad: torch.Tensor, approximate: str, dtype: torch.dtype):
    """GELU's input gradient from the output gradient and ``p``, the GELU input's codes (no
    recipe, compressed), in one pass: the input is rebuilt in ``dtype`` in registers."""
    return stored(p, dtype, ("gelu_backward", approximate, grad)).view(p.shape)


def gated_backward(
    pg: Packed, pu: Packed, grad: torch.Tensor, act: str, write_prod: bool, in_place: bool
) -> tuple:
    """``act(g) * u``'s backward in one pass from ``pg`` and ``pu``, the codes of ``g`` and ``u``
    (compressed alike, no recipe, one dtype; ``fused_product`` says when): ``(the product or
    None, g's gradient, u's gradient)``, each of ``g``'s shape and dtype (see
    ``kernels/gated.py``; ``in_place``: g's gradient over ``grad``, the caller's own)."""
    spec = pg.spec
    prod, gg, gu = gated.gated_backward(
        (pg.codes, pg.scales), (pu.codes, pu.scales), grad, spec.group_size, pg.dtype, act,
        spec.bits, pg.signed, write_prod=write_prod, in_place=in_place,
    )  # fmt: skip
    return (None if prod is None else prod.view(pg.shape)), gg.view(pg.shape), gu.view(pg.shape)


def fused_product(pg: Packed | None, pu: Packed | None, dtypes: tuple) -> bool:
    """Whether ``gated_backward`` can take the product of ``pg`` and ``pu``: compressed codes
    of one layout, in eager mode (the kernel on CUDA, its reference elsewhere; under
    torch.compile the op-by-op form, which Inductor fuses itself), and ``dtypes`` (every
    tensor of the product: its factors, the activation's output, the product) all ``pg``'s."""
    if pg is None or pu is None or pg.spec.exact or pu.spec.exact or pg.recipe or pu.recipe:
        return False
    if pg.spec != pu.spec or pg.signed != pu.signed or pg.shape != pu.shape:
        return False
    return not torch.compiler.is_compiling() and all(d == pg.dtype for d in dtypes)


def softmax_backward(p: Packed, grad: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Softmax's input gradient from the output gradient and ``p``, the output's codes, in one
    pass over rows of the last dimension (``kernels/softmax_backward.py``; its reference off
    CUDA); None where that does not apply (another ``dim``, a recipe, kept exactly, another
    dtype, or while compiling: there the op-by-op form, which Inductor fuses)."""
    if p.spec.exact or p.recipe or grad.dtype != p.dtype or torch.compiler.is_compiling():
        return None
    if grad.dim() == 0 or dim % grad.dim() != grad.dim() - 1 or tuple(grad.shape) != tuple(p.shape):
        return None
    return _softmax_backward.softmax_backward(
        p.codes, p.scales, grad, p.spec.group_size, p.dtype, p.spec.bits, p.signed
    )


def batch_norm_backward(p: Packed, grad: torch.Tensor, invstd, weight, need_input: bool):
    """BatchNorm's gradients from ``p``, the codes of its normalized input in row-major order
    (N, C, ...), in two passes (``kernels/batch_norm_backward.py``; its reference off CUDA):
    ``(the input's gradient or None, (2, C) fp32 sums: the bias's and the weight's
    gradients)``."""
    return _batch_norm_backward.batch_norm_backward(
        p.codes, p.scales, grad, invstd, weight, p.spec.group_size, p.spec.bits, p.signed,
        need_input,
    )  # fmt: skip


def unnormalize(p: Packed, mean: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype):
    """A LayerNorm's input rebuilt from its kept normalized input: ``x_hat / rstd + mean``
    (``mean`` where ``rstd`` is 0), in ``dtype``, in one pass."""
    return stored(p, dtype, ("unnormalize", mean, rstd)).view(p.shape)


# ---- the kernels, and their form under torch.compile -----------------------------------------


def _quantize(x, group_size: int, signed: bool, stochastic: bool, bits: int, normalize,
              positive: bool = False):  # fmt: skip
    return group_quant.quantize(
        x, group_size, signed=signed, stochastic=stochastic, use_triton=use_triton(x),
        bits=bits, normalize=normalize, positive=positive,
    )  # fmt: skip


def _dequantize(codes, scales, group_size: int, dtype, bits: int, signed: bool, numel: int,
                epilogue):  # fmt: skip
    return group_quant.dequantize(
        codes, scales, group_size, dtype, use_triton=use_triton(codes), bits=bits,
        signed=signed, numel=numel, epilogue=epilogue,
    )  # fmt: skip


# The form quantize and dequantize take under torch.compile (read while tracing):
# "decomposed" (default): the PyTorch references (group absmax, scale, round, clamp, cast;
# dequantize as multiply and cast), which Inductor lowers into its own kernels, fused with the
# ops that produce and consume the activation, launched from its generated code; "custom_op":
# the Triton kernels as the opaque custom ops below, each call through Python (on the H200
# the compiled DeiT-S step was 2.0x the compiled plain one with them, see the README).
# Stochastic rounding always takes the custom op (its seed is drawn on the host per call).
COMPILE_FORM = "decomposed"


def _decomposed(spec: QuantSpec, numel: int) -> bool:
    """Whether quantize and dequantize take the decomposed form under compile: the default
    form, at nearest rounding, for a tensor that is a whole number of groups (quantize and
    dequantize decide alike). A partial last group takes the custom ops: Inductor's CPU code
    for the padded reference gave garbage gradients there (torch 2.14; the loss was right;
    ``test_inductor_with_a_partial_last_group_keeps_the_gradients``)."""
    return COMPILE_FORM == "decomposed" and not spec.stochastic and numel % spec.group_size == 0


# Under torch.compile the two kernels are custom ops (their annotations use typing.Optional,
# which every torch version's schema inference reads): Dynamo records them as single calls
# (it cannot trace the launcher or the reference's data-dependent steps usefully), and the
# graph keeps their outputs, the codes, for backward. Eager mode calls the kernels directly:
# a custom op's dispatch would cost host time on every call.


@torch.library.custom_op("mesa_lite::quantize", mutates_args=())
def _quantize_op(
    x: torch.Tensor,
    group_size: int,
    signed: bool,
    stochastic: bool,
    bits: int,
    mean: Optional[torch.Tensor],  # noqa: UP045
    rstd: Optional[torch.Tensor],  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor]:
    normalize = None if mean is None else (mean, rstd)
    return _quantize(x, group_size, signed, stochastic, bits, normalize)


@_quantize_op.register_fake
def _(x, group_size, signed, stochastic, bits, mean, rstd):
    n = x.numel()
    dtype = torch.int8 if (signed and bits == 8) else torch.uint8
    codes = x.new_empty(group_quant.n_code_bytes(n, bits), dtype=dtype)
    return codes, x.new_empty(group_quant.n_groups_of(n, group_size), dtype=torch.float32)


@torch.library.custom_op("mesa_lite::dequantize", mutates_args=())
def _dequantize_op(
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    bits: int,
    signed: bool,
    numel: int,
    epilogue: str,
    approximate: str,
    mid: torch.dtype,
    t1: Optional[torch.Tensor],  # noqa: UP045
    t2: Optional[torch.Tensor],  # noqa: UP045
) -> torch.Tensor:
    if epilogue == "none":
        epi = None
    elif epilogue == "gelu":
        epi = ("gelu", approximate, mid)
    elif epilogue == "gelu_backward":
        epi = ("gelu_backward", approximate, t1)
    elif epilogue == "silu":
        epi = ("silu", mid)
    elif epilogue == "silu_backward":
        epi = ("silu_backward", t1)
    else:
        epi = (epilogue, t1, t2)
    return _dequantize(codes, scales, group_size, dtype, bits, signed, numel, epi)


@_dequantize_op.register_fake
def _(codes, scales, group_size, dtype, bits, signed, numel, epilogue, approximate, mid, t1, t2):
    return codes.new_empty(numel, dtype=dtype)


def _epilogue_op_args(epilogue: tuple | None, dtype: torch.dtype) -> tuple:
    """``(kind, approximate, t1, t2, mid)``: a dequantize epilogue as the custom op takes it."""
    if epilogue is None:
        return "none", "none", None, None, dtype
    kind = epilogue[0]
    if kind == "gelu":
        return kind, epilogue[1], None, None, epilogue[2]
    if kind == "gelu_backward":
        return kind, epilogue[1], epilogue[2], None, dtype
    if kind == "silu":
        return kind, "none", None, None, epilogue[1]
    if kind == "silu_backward":
        return kind, "none", epilogue[1], None, dtype
    return kind, "none", epilogue[1], epilogue[2], dtype


# ---- sharing one copy between ops ------------------------------------------------------------

# id(storage owner) -> list of entries; an entry: (weakref to the owner, version, storage
# offset, shape, strides, memory_order, Packed meta tuple, codes, scales, aux)
_SHARED: dict[int, list] = {}


def _owner(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of ``t`` from outermost to innermost in memory (sorted by stride)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))


def _dense(t: torch.Tensor) -> bool:
    return t.permute(memory_order(t)).is_contiguous()


def share(x: torch.Tensor, p: Packed, memory_order: bool = False) -> None:
    """Registers ``p`` as the codes of ``x`` (an op's fresh output) while ``x`` lives.

    Args:
        x: the tensor the Packed rebuilds.
        p: its Packed (possibly with a recipe).
        memory_order: the codes follow ``x``'s memory order rather than its logical order
            (``x`` must then be dense); any contiguous view of the same memory can reuse them.

    The entry holds the codes strongly (a saved-tensor hook may keep an alias instead of the
    object saved, so a weak reference could die while the storage lives) and is dropped when
    the owner of ``x``'s storage dies. In the exact mode the stored tensor itself is held
    weakly, so nothing is kept alive by the registry.
    """
    if torch.compiler.is_compiling():
        return  # under torch.compile: see share_traced
    if x.numel() == 0 or (memory_order and not _dense(x)):
        return  # an empty tensor has nothing to share
    owner = _owner(x)
    key = id(owner)
    if key not in _SHARED:
        weakref.finalize(owner, _SHARED.pop, key, None)
        _SHARED[key] = []
    codes = weakref.ref(p.codes) if p.spec.exact else p.codes
    _SHARED[key].append(
        (weakref.ref(owner), x._version, x.storage_offset(), tuple(x.shape), x.stride(),
         memory_order, p.meta(), codes, p.scales, p.aux)
    )  # fmt: skip


def lookup_shared(
    x: torch.Tensor, spec: QuantSpec, key: torch.Tensor | None = None
) -> Packed | None:
    """The Packed already registered for ``key`` (default ``x``), for a consumer keeping ``x``.

    ``key`` is the tensor before an autocast cast (``x`` is its cast); the Packed then rebuilds
    in ``x``'s dtype when dequantized with it. Reused only for the same bits and group size,
    so the saved precision is what ``spec`` asks for; rebuilt with ``x``'s shape. Under
    torch.compile from the attribute ``share_traced`` set.
    """
    t = x if key is None else key
    if torch.compiler.is_compiling():
        return _lookup_traced(x, t, spec)
    entries = _SHARED.get(id(_owner(t)))
    if not entries:
        return None
    for ref, version, offset, shape, stride, memory_order, meta, codes, scales, aux in entries:
        if ref() is not _owner(t) or t._version != version or t.storage_offset() != offset:
            continue
        if not _fits(meta[2], spec):
            continue
        if memory_order:
            # codes in the (dense) memory order: a contiguous tensor over the same memory range
            # reads its elements in that very order
            ok = t.is_contiguous() and t.numel() == _prod(shape)
        else:
            ok = tuple(t.shape) == shape and t.stride() == stride
        if not ok:
            continue
        if meta[2].exact:
            codes = codes()
            if codes is None:
                continue
        return _reused(codes, scales, meta, aux, x)
    return None


def _fits(kept: QuantSpec, spec: QuantSpec) -> bool:
    """Codes kept at ``kept`` serve a consumer keeping at ``spec``: the same exactness and
    width, and group size when compressed."""
    if kept.exact != spec.exact or kept.bits != spec.bits:
        return False
    return spec.exact or kept.group_size == spec.group_size


def _reused(codes, scales, meta: tuple, aux, x: torch.Tensor) -> Packed:
    """The registered codes as the consumer's Packed, rebuilt with ``x``'s shape."""
    p = Packed(codes, scales, *meta)
    p.aux = aux
    p.shape = x.shape
    return p


# Under torch.compile the registry is off: Dynamo cannot trace ``id()`` nor read a version
# counter while tracing. The fused attention's output codes (in its memory order) then ride on
# the output as an attribute, which Dynamo carries through the trace: ``share_traced`` sets it
# (through ``ops.common.shared_output``, on an output autograd protects from in-place
# changes), ``propagate_traced`` hands it to views of the same memory, and ``lookup_shared``
# reads it.
TRACED_ATTR = "_mesa_codes"


def share_traced(x: torch.Tensor, p: Packed, memory_order: bool = False) -> None:
    """Under torch.compile: ``p`` (compressed, in ``x``'s memory order with ``memory_order``,
    else in its logical order) as the codes of ``x``, a producer's output (dense where in
    memory order; a consumer takes logical-order codes only through a contiguous tensor)."""
    if not memory_order or _dense(x):  # (_dense sorts strides: a graph break when symbolic)
        setattr(x, TRACED_ATTR, (p.codes, p.scales, p.meta(), p.aux, _prod(x.shape)))


def propagate_traced(src, out) -> None:
    """Under torch.compile: ``out``, a view of all of ``src``'s memory (``src``'s transpose,
    permute, view, reshape or contiguous that copied nothing), takes on the codes ``src``
    carries (the attention output's: Hugging Face's attention reshapes it for the output
    projection); a consumer finds them through a contiguous one, as the registry lets any
    contiguous view of the same memory find them."""
    entry = getattr(src, TRACED_ATTR, None)
    if entry is not None and isinstance(out, torch.Tensor) and out.numel() == entry[-1]:
        setattr(out, TRACED_ATTR, entry)


def _lookup_traced(x: torch.Tensor, t: torch.Tensor, spec: QuantSpec) -> Packed | None:
    """``lookup_shared`` under torch.compile: the codes ``share_traced`` set on ``t`` (or a
    view ``propagate_traced`` gave them to), when their spec fits and ``t`` is contiguous over
    all of their memory (its logical order is then their memory order)."""
    entry = getattr(t, TRACED_ATTR, None)
    # a view, as the producer returned it: autograd refuses to change it in place. (torch 2.11
    # hands a graph's output to the code after a graph break as a plain tensor, which can
    # be changed in place there, and Dynamo still carries the attribute: not taken then)
    if entry is None or t._base is None:
        return None
    codes, scales, meta, aux, numel = entry
    if not (_fits(meta[2], spec) and t.is_contiguous() and t.numel() == numel):
        return None
    return _reused(codes, scales, meta, aux, x)


# ---- keeping Packed objects on an autograd ctx ----------------------------------------------


def save(ctx, *items: Packed | torch.Tensor | None) -> None:
    """``ctx.save_for_backward`` for a mix of Packed, tensors and None; metadata rides on ctx."""
    tensors: list[torch.Tensor | None] = []
    layout: list[tuple | None] = []
    for item in items:
        if isinstance(item, Packed):
            tensors += [item.codes, item.scales, *item.aux]
            layout.append((item.meta(), len(item.aux)))
        else:
            tensors.append(item)
            layout.append(None)
    ctx.save_for_backward(*tensors)
    ctx.mesa_layout = layout


def load(ctx) -> list[Packed | torch.Tensor | None]:
    """The items given to :func:`save`, in order."""
    saved = iter(ctx.saved_tensors)
    out: list[Packed | torch.Tensor | None] = []
    for entry in ctx.mesa_layout:
        if entry is None:
            out.append(next(saved))
        else:
            meta, n_aux = entry
            codes, scales = next(saved), next(saved)
            aux = tuple(next(saved) for _ in range(n_aux))
            out.append(Packed(codes, scales, *meta, aux))
    return out
