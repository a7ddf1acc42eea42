"""Hugging Face transformers integration: GPT-2, Llama-family (Llama, Mistral, Qwen2, ...) and
BERT models compressed by ``wrap(model)`` with no model-specific code.

What ``wrap`` converts, when transformers is importable:

- ``Conv1D`` (GPT-2's projections): ``torch.addmm`` keeping its input compressed, as Linear.
- The activation classes (``NewGELUActivation``, ``GELUTanh``, ``FastGELUActivation``,
  ``QuickGELUActivation``, ``GELUActivation``, ``AccurateGELUActivation``: kind "gelu";
  ``SiLUActivation``: kind "silu"): one compressed copy of the input, the module's own formula
  forward and its derivative in backward (``modules.Activation``).
- RMSNorms, gated MLPs and two-projection MLPs are recognised by proof in the core
  (``mesa_lite.recognize``), for any model; this module registers ``Conv1D`` there as a
  projection an MLP may be built of (GPT-2's ``GPT2MLP``).
- Attention modules (``GPT2Attention``, ``LlamaAttention``, ``BertSelfAttention``, ...: a class
  from ``transformers.models`` whose name ends in ``Attention`` and that holds its q/k/v
  projections): their own forward runs unchanged, with the attention functions it calls
  (``F.scaled_dot_product_attention`` from the ``sdpa`` implementation, ``torch.matmul``,
  softmax and dropout from the ``eager`` one) routed to mesa_lite's compressed forms by a
  ``TorchFunctionMode`` for the duration of that forward. Causal, padding masks and grouped
  k/v heads run through the fused-attention Function.
- The causal-LM loss (models whose ``loss_type`` is ``ForCausalLM``): the model's
  ``loss_function`` is set to ``causal_lm_loss``, a chunked cross-entropy that keeps no fp32
  ``batch x seq x vocab`` tensor (kind "loss"); ``unwrap`` removes it.
- ``nn.Dropout`` (core, ``modules.Dropout``) keeps its mask as 1 bit per element.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mesa_lite import quant, recognize
from mesa_lite.config import QuantSpec
from mesa_lite.modules import GELU_FORMS, Activation, LayerNorm, MesaModule, RMSNorm, SiLU
from mesa_lite.ops.attention import scaled_dot_product_attention
from mesa_lite.ops.common import in_functorch_transform, needs_grad
from mesa_lite.ops.cross_entropy import cross_entropy
from mesa_lite.ops.dropout import dropout
from mesa_lite.ops.linear import addmm, addmm_forward
from mesa_lite.ops.linear_cross_entropy import linear_cross_entropy
from mesa_lite.ops.matmul import matmul
from mesa_lite.ops.softmax import softmax
from mesa_lite.recognize import GatedMlp, Mlp  # noqa: F401 - their home before the core had them

try:
    import transformers.activations as _acts
    from transformers.pytorch_utils import Conv1D as _Conv1D
except ImportError:  # pragma: no cover - transformers is optional
    _acts = None
    _Conv1D = None

__all__ = ["registrations", "structural", "after_wrap", "after_unwrap", "GatedMlp", "Mlp"]

# name -> the GELU its formula computes (None: another function, QuickGELU's x * sigmoid(1.702x))
_GELU_NAMES = {
    "NewGELUActivation": "tanh", "GELUTanh": "tanh", "PytorchGELUTanh": "tanh",
    "FastGELUActivation": "tanh", "AccurateGELUActivation": "tanh", "GELUActivation": "none",
    "QuickGELUActivation": None,
}  # fmt: skip


def registrations() -> list[tuple[type, type, str, object, str | None]]:
    """(transformers type, mesa_lite class, kind, accepts or None, why) for ``wrap``."""
    if _acts is None:
        return []
    recognize.register_projection(_Conv1D, Conv1D, addmm=True)
    regs = [(_Conv1D, Conv1D, "linear", None, None)]
    seen = set()
    for name, approximate in _GELU_NAMES.items():
        cls = getattr(_acts, name, None)
        if cls is not None and cls not in seen:
            seen.add(cls)
            regs.append((cls, Activation, "gelu", None, None))
            if approximate is not None:
                GELU_FORMS[cls] = approximate
    silu = getattr(_acts, "SiLUActivation", None)
    if silu is not None and silu is not nn.SiLU:
        regs.append((silu, SiLU, "silu", None, None))
    return regs


if _Conv1D is not None:

    class Conv1D(MesaModule, _Conv1D):
        """transformers' ``Conv1D`` (weight (in, out)) keeping its input compressed."""

        mesa_kind = "linear"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight, bias = self.weight, self.bias  # once each, as transformers' forward
            if bias is None or not self._mesa_active(x, weight, bias):
                return addmm_forward(x, weight, bias, None)  # transformers' forward
            return addmm(x, weight, bias, self.mesa_spec)

        def __repr__(self) -> str:  # transformers' own __repr__ leaves out extra_repr
            return f"{super().__repr__()[:-1]}, {self.extra_repr()})"

        def extra_repr(self) -> str:
            return MesaModule.extra_repr(self).lstrip(", ")


# ---- recognised by structure ----------------------------------------------------------------


def structural() -> list[tuple[object, type, str, object, str | None]]:
    """(matches(module), mesa_lite class, kind, accepts(module) or None, why accepts rejects)
    for module types ``wrap`` does not know by name: transformers' attention classes. The
    RMSNorms and MLPs of any model are recognised in the core (``mesa_lite.recognize``)."""
    if _acts is None:
        return []
    return [(_attention_candidate, HFAttention, "attention", None, None)]


# ---- attention modules ----------------------------------------------------------------------

_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)
_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


class _AttentionOps(TorchFunctionMode):
    """Routes the attention functions a Hugging Face attention forward calls to mesa_lite's
    compressed forms (each computes PyTorch's forward bit for bit)."""

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__()
        self.spec = spec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa(self.spec, *args, **kwargs)
        if func in _MATMUL and len(args) == 2 and not kwargs:
            a, b = args
            if a.dim() >= 2 and b.dim() >= 2 and needs_grad(a, b):
                return matmul(a, b, self.spec)
        elif func in _SOFTMAX:
            return _softmax(self.spec, func, args, kwargs)
        elif func is F.dropout:
            return dropout(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in _VIEWS and torch.compiler.is_compiling():
            _propagate(func, args, out)
        return out


# the ops Hugging Face's attention turns its output into the output projection's input with;
# under torch.compile the attention output's codes follow them (quant.propagate_traced)
_VIEWS = {
    torch.Tensor.transpose, torch.transpose, torch.Tensor.permute, torch.permute,
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.contiguous,
    torch.Tensor.flatten, torch.flatten,
}  # fmt: skip
# of those, the ones that copy when their input is not contiguous
_COPY_IF_STRIDED = {torch.Tensor.reshape, torch.reshape, torch.Tensor.contiguous,
                    torch.Tensor.flatten, torch.flatten}  # fmt: skip


def _propagate(func, args, out) -> None:
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor) or getattr(src, quant.TRACED_ATTR, None) is None:
        return
    # a reshape to the same shape is a view (transformers' pack_gqa undo); a contiguous of
    # a strided tensor, or another reshape of one, may have copied, in src's logical order
    # (not the codes' order)
    same_shape = func is not torch.Tensor.contiguous and out.shape == src.shape
    if func in _COPY_IF_STRIDED and not (src.is_contiguous() or same_shape):
        return
    quant.propagate_traced(src, out)


def _sdpa(spec, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):  # fmt: skip
    return scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        spec=spec, enable_gqa=enable_gqa,
    )  # fmt: skip


def _softmax(spec, func, args, kwargs):
    """``softmax(x, dim, dtype=None)`` (any of its spellings) through mesa_lite's softmax."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dtype = kwargs.get("dtype", args[3] if func is F.softmax and len(args) > 3 else None)
    if func is not F.softmax and len(args) > 2:
        dtype = args[2]
    extra = set(kwargs) - {"dim", "dtype", "_stacklevel"}
    if dim is None or extra or not needs_grad(x):
        return func(*args, **kwargs)
    if dtype is not None:
        x = x.to(dtype)
    return softmax(x, dim, spec)


def _attention_candidate(module: nn.Module) -> bool:
    cls = type(module)
    if not cls.__module__.startswith("transformers.models.") or not cls.__name__.endswith(
        "Attention"
    ):
        return False
    names = set(dict(module.named_children()))
    return bool({"q_proj", "query", "c_attn"} & names)


class HFAttention(MesaModule, nn.Module):
    """A Hugging Face attention module running its own forward with the attention functions
    routed to mesa_lite's compressed forms (``_AttentionOps``).

    With the ``sdpa`` implementation in eager mode only transformers' ``sdpa_attention_forward``
    runs under the mode (``_routed_sdpa`` stands in for it in transformers' table of attention
    functions and passes every call of other modules through); with the others (``eager``),
    and under torch.compile, the whole forward does, so that its matmuls, softmax and dropout
    are routed and the attention output's codes follow its reshapes (``_propagate``)."""

    mesa_kind = "attention"

    def _mesa_on(self) -> bool:
        return self.mesa_spec is not None and self.training and torch.is_grad_enabled()

    def forward(self, *args, **kwargs):
        if not self._mesa_on():
            return super().forward(*args, **kwargs)
        config = getattr(self, "config", None)
        sdpa = getattr(config, "_attn_implementation", None) == "sdpa"
        # (under torch.compile the mode costs nothing per step: the whole forward runs under
        # it, so that the attention output's codes follow its reshapes to the projection)
        if sdpa and not torch.compiler.is_compiling() and _route_sdpa():
            return super().forward(*args, **kwargs)
        with _AttentionOps(self.mesa_spec):
            return super().forward(*args, **kwargs)


def _routed_sdpa(module, *args, **kwargs):
    """transformers' ``sdpa_attention_forward`` under ``_AttentionOps`` for mesa_lite's
    attention modules; itself for every other caller."""
    if isinstance(module, HFAttention) and module._mesa_on():
        with _AttentionOps(module.mesa_spec):
            return _routed_sdpa.original(module, *args, **kwargs)
    return _routed_sdpa.original(module, *args, **kwargs)


def _route_sdpa() -> bool:
    """Puts ``_routed_sdpa`` in transformers' table of attention functions for ``sdpa`` (once;
    it changes nothing for modules mesa_lite did not convert); False where the table is not
    there (the whole forward then runs under the mode)."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # pragma: no cover - older transformers
        return False
    table = getattr(AttentionInterface, "_global_mapping", None)
    if not isinstance(table, dict) or "sdpa" not in table:
        return False
    if table["sdpa"] is not _routed_sdpa:
        if torch.compiler.is_compiling():  # wrap installs it; a trace changes no global state
            return False
        _routed_sdpa.original = table["sdpa"]
        table["sdpa"] = _routed_sdpa
    return True


# ---- the causal-LM loss ---------------------------------------------------------------------


def _shifted(labels, shift_labels, rows: torch.Size, ignore_index: int, device):
    """transformers' causal-LM labels for positions of shape ``rows``: each position's next
    token, ``ignore_index`` after the last (or the ``shift_labels`` given)."""
    if shift_labels is None:
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a tensor of token ids, got {type(labels).__name__}")
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    if shift_labels.shape != rows and shift_labels.numel() == rows.numel():
        shift_labels = shift_labels.reshape(rows)  # flattened, as transformers' loss takes them
    return shift_labels.to(device)


def causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None,
                   ignore_index: int = -100, shift_labels=None, **kwargs):  # fmt: skip
    """transformers' ``ForCausalLMLoss`` through a chunked cross-entropy: the same shift and
    reduction, without the fp32 copy of the logits and its log-softmax kept for backward.
    Equal to transformers' loss within fp32 rounding (the sum runs chunk by chunk)."""
    rows = logits.shape[:-1]
    shift_labels = _shifted(labels, shift_labels, rows, ignore_index, logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    # the logits in their own shape (see ChunkedCrossEntropyFn); rows x vocab for the plain op
    loss = cross_entropy(logits, shift_labels, ignore_index, reduction, rows=True)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class _CausalLMLoss:
    """The ``loss_function`` ``wrap`` gives a causal LM (picklable; ``unwrap`` removes it): the
    chunked loss in training, transformers' own in eval mode (``track``, a forward pre-hook on
    the model, records which), where every wrapped layer runs plain too.

    With a ``head`` (the model's ``lm_head``, a mesa_lite Linear, on a model whose forward
    hands the head's output straight to its loss: ``FUSED_HEAD_MODELS``), a training forward
    with ``labels`` and grad enabled runs the head and the loss as one Function
    (``linear_cross_entropy``): ``track`` arms the head, whose forward then returns an empty
    placeholder of shape ``(..., 0)`` instead of the logits (``defer``), the loss computes
    from the head's input, and ``end`` (a forward hook) returns the output with ``logits``
    None. ``Config(keep_logits=True)`` gives no head: the logits are built and returned."""

    def __init__(self, spec: QuantSpec, head: nn.Module | None = None) -> None:
        self.mesa_spec = spec  # None: transformers' own loss (report.plain_model sets it)
        self.training = True
        self.head = head
        self.armed = False
        self.pending: tuple | None = None  # the head's input, weight and bias, deferred
        self.model = ""  # the class of the model that armed it (for errors)

    def __getstate__(self) -> dict:  # a copy holds no tensors of a forward in flight
        return {**self.__dict__, "armed": False, "pending": None}

    def track(self, module, args, kwargs) -> None:
        self.training = module.training
        self.pending = None
        self.model = type(module).__name__
        head = self.head
        self.armed = (
            head is not None and self.mesa_spec is not None and module.training
            and torch.is_grad_enabled() and kwargs.get("labels") is not None
            and not in_functorch_transform()  # inside torch.func every layer runs plain
            # the head as wrap found it: not replaced (PEFT's LoRA around it), no forward hook
            # that would see (and could change) the logits, not an FSDP2 unit of its own
            and getattr(module, "lm_head", None) is head
            and not (head._forward_hooks or nn.modules.module._global_forward_hooks)
            and not _sharded_apart(head)
        )  # fmt: skip

    def defer(self, x, weight, bias) -> torch.Tensor | None:
        """The armed head's forward: keeps its input and returns the placeholder, or returns
        None (the head then computes its logits) where the fused Function would keep more
        than the logits: its fp32 weight gradient, vocab x hidden, against the tokens x vocab
        logits in 2 bytes, so below 2 x hidden tokens."""
        self.armed = False  # one deferral a forward
        if x.numel() < 2 * x.shape[-1] * x.shape[-1]:
            return None
        self.pending = (x, weight, bias)
        return x.new_empty((*x.shape[:-1], 0))

    def end(self, module, args, kwargs, output):
        # deferred: the head returned the placeholder (whether a loss took it or not), so the
        # output has no logits; output None: the forward raised
        deferred, self.pending, self.armed = self.pending is not None, None, False
        return _without_logits(output) if deferred and output is not None else None

    def __call__(self, logits, labels, vocab_size: int, **kwargs):
        if self.pending is not None and logits.shape[-1] == 0:
            x, weight, bias = self.pending
            self.pending = ()  # taken: ``end`` still drops the placeholder
            return self._fused(x, weight, bias, labels, vocab_size, **kwargs)
        if self.pending:
            raise RuntimeError(
                f"mesa_lite: {self.model}'s loss got logits its lm_head did not return: the "
                "lm_head was called more than once in this forward (an auxiliary or "
                "logit-lens call, which got an empty placeholder) or the logits were changed "
                "before the loss; the fused head and loss cannot follow either: wrap the "
                "model with mesa_lite.Config(keep_logits=True)"
            )
        if not self.training or self.mesa_spec is None:
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(logits, labels, vocab_size, **kwargs)
        return causal_lm_loss(logits, labels, vocab_size, **kwargs)

    @staticmethod
    def _fused(x, weight, bias, labels, vocab_size: int, num_items_in_batch=None,
               ignore_index: int = -100, shift_labels=None, **kwargs):  # fmt: skip
        if vocab_size != weight.shape[0]:
            raise ValueError(
                f"mesa_lite: the language-model head has {weight.shape[0]} outputs but the "
                f"loss was given vocab_size={vocab_size}"
            )
        shift_labels = _shifted(labels, shift_labels, x.shape[:-1], ignore_index, x.device)
        return linear_cross_entropy(x, weight, bias, shift_labels, ignore_index,
                                    num_items_in_batch)  # fmt: skip


def _sharded_apart(head: nn.Module) -> bool:
    """An lm_head that FSDP2 shards as a unit of its own: its gathered weight is freed when
    its forward returns, before the loss would read it; it then builds its logits."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(head, FSDPModule)


def _without_logits(output):
    """A causal LM's output with ``logits`` None: a new ``ModelOutput`` of the same class
    without them, or the tuple with None in their place."""
    if isinstance(output, tuple):
        return output[:1] + (None,) + output[2:] if len(output) > 1 else output
    fields = {k: v for k, v in output.items() if k != "logits"}
    return type(output)(**fields)


# causal LMs whose forward hands ``lm_head``'s output to ``loss_function`` unchanged
# (checked in their source: transformers 5.17 and 5.25), so the head may run deferred
FUSED_HEAD_MODELS = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM",
                     "Qwen2ForCausalLM")  # fmt: skip


def fused_head(module: nn.Module) -> tuple[nn.Module | None, str | None]:
    """``(lm_head, None)`` when ``module``'s head and loss can run as one Function, else
    ``(None, why not)``."""
    from mesa_lite.modules import Linear

    cls = type(module)
    names = [c.__name__ for c in cls.__mro__]
    checked = next((i for i, n in enumerate(names) if n in FUSED_HEAD_MODELS), None)
    if checked is None or not cls.__mro__[checked].__module__.startswith("transformers.models."):
        return None, f"{cls.__name__}'s forward is not one mesa_lite has checked"
    if any("forward" in c.__dict__ for c in cls.__mro__[:checked]):  # a subclass's own
        return None, f"{cls.__name__} has a forward of its own"
    if "forward" in module.__dict__:
        return None, "its forward is set on the instance"
    head = getattr(module, "lm_head", None)
    get = getattr(module, "get_output_embeddings", None)
    if head is None or get is None or get() is not head:
        return None, "its lm_head is not its output embeddings"
    if not isinstance(head, Linear):
        return None, f"its lm_head is a {type(head).__name__}, not a wrapped Linear"
    return head, None


def _causal_lm(module: nn.Module) -> bool:
    """A language model whose ``loss_function`` is transformers' ``ForCausalLMLoss``: its
    ``loss_type`` says so, or it has none (transformers then falls back to that loss) and an
    ``lm_head``. A loss function the user set is left alone."""
    if "_loss_function" in module.__dict__ or not hasattr(type(module), "loss_function"):
        return False
    loss_type = getattr(module, "loss_type", None)
    if loss_type == "ForCausalLM":
        return True
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # pragma: no cover - older transformers
        return False
    return loss_type not in LOSS_MAPPING and isinstance(getattr(module, "lm_head", None), nn.Module)


class _LossOps(TorchFunctionMode):
    """Routes ``F.cross_entropy`` on 2-D logits that need grad (mean or sum, no class weights
    or label smoothing) to the chunked cross-entropy: the loss heads that call
    ``CrossEntropyLoss()`` inline (``BertForMaskedLM``) keep no fp32 log-probabilities."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            got = _chunked(*args, **kwargs)
            if got is not None:
                return got
        return func(*args, **kwargs)


def _chunked(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean", label_smoothing=0.0):  # fmt: skip
    plain = weight is not None or size_average is not None or reduce is not None
    if plain or label_smoothing != 0.0 or reduction not in ("mean", "sum"):
        return None
    if input.dim() != 2 or target.dim() != 1 or target.is_floating_point():
        return None
    if not (input.is_floating_point() and input.requires_grad and torch.is_grad_enabled()):
        return None
    # as F.cross_entropy itself: no cast of its own (autocast's policy decides, chunk by chunk)
    return cross_entropy(input, target, ignore_index, reduction, upcast=False)


class _LossHooks:
    """Hooks that hold ``_LossOps`` over the end of a model's forward: from the output of its
    output embeddings (the logits' projection) to the end of its forward, where the loss is
    computed. Only those few calls pass through the mode."""

    def __init__(self, spec: QuantSpec) -> None:
        self.mesa_spec = spec  # None: the model's own loss (report.plain_model sets it)
        self.modes: list[_LossOps] = []
        self.depth = 0

    def start(self, module, args):
        self.depth += 1

    def logits(self, module, args, output):
        if self.depth != 1 or self.modes or self.mesa_spec is None:
            return
        if module.training and torch.is_grad_enabled():
            mode = _LossOps()
            mode.__enter__()
            self.modes.append(mode)

    def end(self, module, args, output):
        self.depth -= 1
        if self.depth == 0 and self.modes:
            self.modes.pop().__exit__(None, None, None)


def _inline_loss_head(module: nn.Module) -> bool:
    """A transformers masked LM, whose forward computes its cross-entropy itself, after its
    output embeddings."""
    return (
        type(module).__module__.startswith("transformers.models.")
        and type(module).__name__.endswith("ForMaskedLM")
        and callable(getattr(module, "get_output_embeddings", None))
    )


# The norms and activations inside a block whose output only that block's next layers read
# (transformers never returns it nor changes it in place): under torch.compile their codes
# serve those layers (``mesa_share_traced``, ``ops.common.shared_output``), one saved copy as
# in eager mode. By block class: GPT-2's ln_1 -> attention, ln_2 -> MLP; the Llama family's
# input_layernorm -> q/k/v, post_attention_layernorm -> gate/up; BERT's attention output
# LayerNorm -> the intermediate dense (and the residual, read out of place), its intermediate
# GELU -> the output dense. (BERT's layer output LayerNorm is the layer's output, which
# transformers returns: not marked.)
_LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
BLOCK_INTERNAL = {
    "GPT2Block": ("ln_1", "ln_2", "ln_cross_attn"),
    "LlamaDecoderLayer": _LLAMA_NORMS,
    "MistralDecoderLayer": _LLAMA_NORMS,
    "Qwen2DecoderLayer": _LLAMA_NORMS,
    "BertSelfOutput": ("LayerNorm",),
    "BertIntermediate": ("intermediate_act_fn",),
}


def _mark_block_internal(model: nn.Module) -> None:
    for module in model.modules():
        cls = type(module)
        if not cls.__module__.startswith("transformers.models."):
            continue
        for name in BLOCK_INTERNAL.get(cls.__name__, ()):
            child = getattr(module, name, None)
            if isinstance(child, (Activation, LayerNorm, RMSNorm)):
                child.mesa_share_traced = True


def after_wrap(model: nn.Module, config, filter_fn=None) -> tuple[list, int, list[str]]:
    """Sets the chunked loss on the language models in ``model`` (the ``loss_function`` of
    causal LMs, fused with their head where ``fused_head`` allows; a ``_LossOps`` over the
    forward of masked LMs) that ``config`` and ``filter_fn`` leave to compress; returns their
    specs, how many losses ``config`` or ``filter_fn`` left exact, and a note per causal LM on
    its head for wrap's line."""
    after_unwrap(model)
    if any(isinstance(m, HFAttention) for m in model.modules()):
        _route_sdpa()  # now, not at the first forward: that may be under torch.compile
    _mark_block_internal(model)
    specs, exact, notes = [], 0, []
    for name, module in model.named_modules():
        causal = _causal_lm(module)
        if not (causal or _inline_loss_head(module)):
            continue
        spec = config.spec_for(name, "loss")
        if spec is None or (filter_fn is not None and not filter_fn(name, module)):
            exact += 1
            continue
        if spec.exact:  # the chunked sum is not bit for bit: debug_exact keeps transformers'
            continue
        if causal:
            head, why = (None, None) if config.keep_logits else fused_head(module)
            loss = _CausalLMLoss(spec, head)
            module._loss_function = loss
            module.__dict__["_mesa_loss_hooks"] = (
                module.register_forward_pre_hook(loss.track, with_kwargs=True),
                module.register_forward_hook(loss.end, with_kwargs=True, always_call=True),
            )
            if head is not None:
                head.__dict__["_mesa_head"] = loss
                notes.append("fused with its head (logits None in training with labels)")
            elif why is not None:
                notes.append(f"not fused with its head ({why})")
        else:
            head = module.get_output_embeddings()
            if head is None:
                continue
            loss = _LossHooks(spec)
            module.__dict__["_mesa_loss_hooks"] = (
                module.register_forward_pre_hook(loss.start),
                head.register_forward_hook(loss.logits),
                module.register_forward_hook(loss.end, always_call=True),
            )
        module.__dict__["_mesa_loss"] = loss  # report.plain_model turns it off by its spec
        specs.append(spec)
    return specs, exact, notes


def after_unwrap(model: nn.Module) -> None:
    """Removes what ``after_wrap`` set."""
    for module in model.modules():
        module.__dict__.pop("_mesa_head", None)
        module.__dict__.pop("mesa_share_traced", None)
        if isinstance(module.__dict__.get("_loss_function"), _CausalLMLoss):
            del module.__dict__["_loss_function"]
        for handle in module.__dict__.pop("_mesa_loss_hooks", ()):
            handle.remove()
        module.__dict__.pop("_mesa_loss", None)
