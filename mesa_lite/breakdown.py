"""``memory_breakdown``: where one training step's memory goes; ``estimate_activations``: what a
Hugging Face transformer should keep for backward, term by term.

The measurement runs warm-up steps, then one measured step of forward, ``loss.backward()``,
``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``, and splits it into the
static part (parameters, gradients, optimizer state: unique storages, any device), the
activations kept at the end of forward, backward's temporaries and the peak. On CUDA the last
three come from the caching allocator's counters; on CPU, which has none, the activations are
the unique storages saved for backward (as ``mesa_lite.report`` counts them) and the other two
are None.

The estimate follows Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (``korthikanti``), and itemizes what the Hugging Face implementations
keep under autocast with fp32 parameters, which differs from the paper's fp16 model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

__all__ = [
    "TERMS",
    "MemoryBreakdown",
    "estimate_activations",
    "kept_total",
    "korthikanti",
    "memory_breakdown",
    "train_step",
]

_MIB = 2**20
TRANSIENT = "transient."  # prefix of estimate terms alive during forward, not kept after it
# every term estimate_activations can return, in the order it returns them
TERMS = (
    "embed.ids", "embed.norm", "embed.dropout_mask", "norm.inputs", "norm.normalized",
    "norm.stats", "attn.qkv_input", "attn.qkv", "attn.kv_cache_copies", "attn.rope_cos_sin",
    "attn.logsumexp", "attn.softmax", "attn.probs_dropout_mask", "attn.probs", "attn.output",
    "attn.dropout_mask", "mlp.fc_input", "mlp.fc_output", "mlp.act", "mlp.proj_input",
    "mlp.dropout_mask", "final_norm", "head.transform", "lm_head.input", "loss.log_softmax",
    "loss.nll_input", "loss.labels", "autocast.weight_copies", TRANSIENT + "logits",
    TRANSIENT + "logits_fp32",
)  # fmt: skip


@dataclasses.dataclass
class MemoryBreakdown:
    """Bytes of one measured training step.

    Attributes:
        parameters: unique storages of the model's Parameters.
        gradients: unique storages of their ``.grad`` after backward.
        optimizer_state: unique storages of the tensors in ``optimizer.state`` (AdamW: exp_avg,
            exp_avg_sq and the step counters), Parameters and gradients excluded.
        activations: kept at the end of forward. CUDA: allocated after forward minus allocated
            before it. CPU: ``saved_for_backward``.
        saved_for_backward: unique storages saved for backward during forward (through
            ``torch.autograd.graph.saved_tensors_hooks``; Parameters excluded, autocast's
            low-precision weight copies included) plus the returned loss; any device.
        backward_temporaries: CUDA: peak during backward minus allocated when it started.
            None on CPU.
        peak: CUDA: ``torch.cuda.max_memory_allocated`` over the step. None on CPU.
        peak_training: CUDA: the peak over forward and backward only, without the optimizer
            step (whose temporaries, AdamW's foreach lists, are about the parameters' size and
            set the step's peak when activations are small). None on CPU.
        before_forward: CUDA: allocated before forward (parameters, optimizer state, inputs,
            anything else alive; gradients too unless ``set_to_none``). None on CPU.
        device: the device type of the model's parameters.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    saved_for_backward: int
    backward_temporaries: int | None = None
    peak: int | None = None
    before_forward: int | None = None
    device: str = "cpu"
    peak_training: int | None = None

    @property
    def static(self) -> int:
        """parameters + gradients + optimizer_state."""
        return self.parameters + self.gradients + self.optimizer_state

    def to_dict(self) -> dict:
        """The fields (bytes) and ``static``."""
        return {**dataclasses.asdict(self), "static": self.static}

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        """A markdown table in MiB; '-' for what this device does not measure."""
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("static (sum of the three)", self.static),
            ("before forward (allocated)", self.before_forward),
            ("activations kept at end of forward", self.activations),
            ("saved for backward (hook count)", self.saved_for_backward),
            ("backward temporaries", self.backward_temporaries),
            ("peak over forward and backward", self.peak_training),
            ("peak (max allocated, optimizer step included)", self.peak),
        ]
        lines = [f"| {self.device} | MiB |", "|---|---|"]
        lines += [f"| {k} | {'-' if v is None else f'{v / _MIB:.2f}'} |" for k, v in rows]
        if any(v is None for _, v in rows):
            lines += ["", f"-: not measured on {self.device}: the allocator's counters that "
                      "give these rows (torch.cuda.memory_allocated, max_memory_allocated) are "
                      "CUDA's; activations then count what is saved for backward"]  # fmt: skip
        return "\n".join(lines)


def _storages(tensors: Iterable[torch.Tensor | None], skip: dict[int, int]) -> dict[int, int]:
    """{data_ptr: nbytes} of the unique storages of ``tensors`` not in ``skip``."""
    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in skip:
                out.setdefault(st.data_ptr(), st.nbytes())
    return out


def _state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values()]


def train_step(
    model: nn.Module,
    step_fn: Callable[[nn.Module], torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    set_to_none: bool = True,
) -> torch.Tensor:
    """One unmeasured step as ``memory_breakdown`` runs it; returns the detached loss.

    ``step_fn(model)`` runs the forward and returns the loss; then ``loss.backward()``,
    ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)`` (without an optimizer
    the model's gradients are set to None).
    """
    loss = step_fn(model)
    loss.backward()
    _finish(model, optimizer, set_to_none)
    return loss.detach()


def _finish(model: nn.Module, optimizer: torch.optim.Optimizer | None, set_to_none: bool) -> None:
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    else:
        model.zero_grad(set_to_none=set_to_none)


def memory_breakdown(
    model: nn.Module,
    step_fn: Callable[[nn.Module], torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    steps: int = 2,
    set_to_none: bool = True,
) -> MemoryBreakdown:
    """Measures one training step of ``model`` and splits its memory by kind.

    Args:
        model: the model, on the device to measure (its first Parameter's device).
        step_fn: ``step_fn(model) -> loss``: the forward only (inputs, autocast and the loss
            are its business). The backward and the optimizer step are run here, so that
            forward and backward are measured apart.
        optimizer: stepped after each backward, then ``zero_grad(set_to_none=True)``; None
            counts no optimizer state and sets the gradients to None after each step.
        steps: steps in all; the last is measured, the ones before warm up the optimizer
            state and the allocator's caches.
        set_to_none: ``zero_grad``'s argument after each step. True (PyTorch's default) frees
            the gradients between steps, so backward allocates them again and the peak minus
            the memory before forward includes them; False keeps them allocated (zeroed), so
            that difference is activations and backward temporaries only.

    Returns:
        A MemoryBreakdown (bytes).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    for _ in range(steps - 1):
        train_step(model, step_fn, optimizer, set_to_none)
    params = _storages(model.parameters(), {})
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved.setdefault(st.data_ptr(), st.nbytes())
        return t.detach()  # t itself would tie a saved output to its own grad_fn (a cycle)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_fn(model)
    pack(loss)
    fields: dict = {"saved_for_backward": sum(saved.values()), "device": device.type}
    if cuda:
        torch.cuda.synchronize(device)
        after_forward = torch.cuda.memory_allocated(device)
        peaks = [torch.cuda.max_memory_allocated(device)]
        torch.cuda.reset_peak_memory_stats(device)
    loss.backward()
    del loss
    grads = _storages((p.grad for p in model.parameters()), params)
    if cuda:
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
    if optimizer is not None:
        optimizer.step()
    state = _storages(_state_tensors(optimizer), {**params, **grads})
    if cuda:
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
        fields.update(
            activations=after_forward - before,
            backward_temporaries=peaks[1] - after_forward,
            # each reset sets the peak to what is allocated then: the max of the parts is the
            # step's peak
            peak=max(peaks),
            peak_training=max(peaks[:2]),
            before_forward=before,
        )
    else:
        fields["activations"] = fields["saved_for_backward"]
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=set_to_none)
    else:
        model.zero_grad(set_to_none=set_to_none)
    return MemoryBreakdown(
        parameters=sum(params.values()),
        gradients=sum(grads.values()),
        optimizer_state=sum(state.values()),
        **fields,
    )


# ---- the analytic estimate --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Dims:
    kind: str  # "gpt2", "llama" or "bert"
    h: int  # hidden size
    a: int  # attention heads
    kv: int  # key/value heads
    d: int  # head dim
    ffn: int  # MLP intermediate size
    layers: int
    vocab: int
    positions: int
    p_attn: float  # dropout on the attention probabilities
    p_hidden: float  # dropout on the residual branches
    p_embed: float  # dropout on the embeddings


_LLAMA_LIKE = ("llama", "mistral", "qwen2")


def _dims(config) -> _Dims:
    kind = config.model_type
    h, a = config.hidden_size, config.num_attention_heads
    if kind == "gpt2":
        return _Dims(kind, h, a, a, h // a, config.n_inner or 4 * h, config.n_layer,
                     config.vocab_size, config.n_positions, config.attn_pdrop,
                     config.resid_pdrop, config.embd_pdrop)  # fmt: skip
    if kind in _LLAMA_LIKE:
        d = getattr(config, "head_dim", None) or h // a
        p = getattr(config, "attention_dropout", 0.0)
        return _Dims("llama", h, a, config.num_key_value_heads or a, d, config.intermediate_size,
                     config.num_hidden_layers, config.vocab_size,
                     config.max_position_embeddings, p, 0.0, 0.0)  # fmt: skip
    if kind == "bert":
        p = config.hidden_dropout_prob
        return _Dims(kind, h, a, a, h // a, config.intermediate_size, config.num_hidden_layers,
                     config.vocab_size, config.max_position_embeddings,
                     config.attention_probs_dropout_prob, p, p)  # fmt: skip
    raise ValueError(
        f"estimate_activations: model_type {kind!r} is not supported; "
        f"supported: gpt2, bert, {', '.join(_LLAMA_LIKE)}"
    )


def korthikanti(config, batch: int, seq: int) -> dict[str, int]:
    """The paper's activation bytes for the whole model, and the simple rule of thumb.

    Korthikanti et al. 2022, eq. 1: a GPT block with fp16 activations, dropout and no
    recomputation keeps ``s*b*h*(34 + 5*a*s/h)`` bytes (s sequence, b batch, h hidden, a
    heads); see ``estimate_activations`` for its terms.

    Returns:
        ``{"korthikanti": L * s*b*h*(34 + 5*a*s/h), "simple_12hbsL": 12*h*b*s*L}``.
    """
    m = _dims(config)
    s, b, h, a, L = seq, batch, m.h, m.a, m.layers
    per_layer = 34 * s * b * h + 5 * a * s * s * b
    return {"korthikanti": L * per_layer, "simple_12hbsL": 12 * h * b * s * L}


def kept_total(terms: dict[str, int]) -> int:
    """The sum of an ``estimate_activations`` result without its transient terms."""
    return sum(v for k, v in terms.items() if not k.startswith(TRANSIENT))


def estimate_activations(
    config,
    batch: int,
    seq: int,
    *,
    dtype_bytes: int = 2,
    param_bytes: int = 4,
    attention: str = "sdpa",
) -> dict[str, int]:
    """Bytes one training forward of a Hugging Face model keeps for backward, by term.

    The paper's block (Korthikanti et al. 2022, fp16 activations, dropout, no recomputation)
    keeps per layer:

    - attention, 11sbh + 5as^2b: the QKV matmul's input 2sbh; Q and K for QK^T 4sbh; the
      softmax output 2as^2b; its dropout mask as^2b; the dropout output 2as^2b and V 2sbh for
      the product with V; the output projection's input 2sbh; its dropout mask sbh;
    - MLP, 19sbh: the first linear's input 2sbh; the GeLU's input 8sbh; the second linear's
      input 8sbh; the dropout mask sbh;
    - the two layernorms' inputs, 4sbh.

    What the Hugging Face models keep under ``torch.autocast`` with fp32 parameters (the
    usual mixed-precision setup) differs; each difference is a separate term:

    - the residual stream is fp32 (embeddings and residual adds of fp32 and bf16 give fp32),
      so each norm keeps a ``param_bytes`` input (``norm.inputs``), fp32 statistics
      (``norm.stats``) and, for Llama's RMSNorm, the fp32 normalized tensor;
    - autocast casts a norm's output to the compute dtype once per Linear that reads it
      (activations are not cast-cached): Llama keeps three copies for q/k/v and two for
      gate/up, BERT three for its q/k/v (``*.input`` terms);
    - SDPA (cuDNN, flash or memory-efficient) keeps q, k, v, its output and an fp32
      logsumexp (4abs) but no s^2 term; its dropout mask is regenerated from the RNG state.
      Eager attention, and SDPA's math path (taken in fp32 with GQA), keeps the fp32 softmax
      output (autocast runs softmax in fp32), the cast or dropout output in the compute dtype
      and a 1-byte mask with dropout;
    - GPT-2 builds a DynamicCache in training too (``use_cache`` defaults to True): SDPA keeps
      the cache's concatenated copies of k and v, and through q, a view of the fused c_attn
      output, all of that output (``attn.kv_cache_copies``, 2 x the paper's k and v);
    - GQA: k and v are ``kv * head_dim`` wide (SDPA's enable_gqa, no repeat), full width in
      eager attention (repeat_kv);
    - Llama's gated MLP keeps gate and up outputs, the SiLU output and the product (4 x
      intermediate size); no dropout anywhere in Llama (attention_dropout defaults to 0);
    - GPT-2's NewGELU is separate elementwise ops, each keeping a tensor: pow's input, tanh,
      1 + tanh and 0.5 * x, 4 x intermediate size where the paper keeps one; autocast runs
      ``pow`` in fp32, which makes the first three fp32;
    - dropout masks are 1 byte per element (PyTorch's bool mask);
    - Parameters autocast casts for the matmuls are kept for backward
      (``autocast.weight_copies``), as is RoPE's fp32 cos/sin (once, shared by the layers);
    - the loss: the causal models cast the logits (``transient.logits``, compute dtype) to
      fp32 (``transient.logits_fp32``) and keep the fp32 log-softmax (4bsV); BERT's masked-LM
      head calls CrossEntropyLoss on the low-precision logits, so it keeps a low-precision
      log-softmax and the fp32 cast autocast makes of it for nll_loss (``loss.nll_input``).
      The transient terms are alive during forward but freed when it returns the loss.

    Args:
        config: a transformers GPT2Config, BertConfig (BertForMaskedLM), LlamaConfig,
            MistralConfig or Qwen2Config; dispatched on ``config.model_type``.
        batch: sequences per batch.
        seq: tokens per sequence.
        dtype_bytes: bytes of the compute dtype: 2 under bf16/fp16 autocast, 4 without.
        param_bytes: bytes of the parameters (and so of the residual stream); autocast's
            casts exist only when it differs from ``dtype_bytes``.
        attention: "sdpa" (a fused kernel: no s^2 term) or "eager".

    Returns:
        ``{term: bytes}`` for the whole model; ``kept_total`` sums the kept terms (names
        without the ``transient.`` prefix).
    """
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    m = _dims(config)
    b, s, L, V, act = batch, seq, m.layers, m.vocab, dtype_bytes
    amp = dtype_bytes != param_bytes
    if attention == "sdpa" and act == 4 and m.kv != m.a:
        attention = "eager"  # no fused kernel takes fp32 GQA: SDPA's math path keeps the same
    sbh, sbi, bs, as2b = s * b * m.h, s * b * m.ffn, b * s, m.a * s * s * b
    kv = s * b * m.kv * m.d
    lin_in = lambda n: (n * act if amp else param_bytes) * sbh  # noqa: E731
    mask = lambda p, n: n if p > 0 else 0  # noqa: E731  (1 byte per element)
    llama, bert = m.kind == "llama", m.kind == "bert"
    t: dict[str, int] = {}
    t["embed.ids"] = 8 * bs + {"gpt2": 8 * s, "bert": 8 * s + 8 * m.positions}.get(m.kind, 0)
    if bert:  # BERT normalizes the embeddings
        t["embed.norm"] = param_bytes * sbh + 8 * bs
    t["embed.dropout_mask"] = mask(m.p_embed, sbh)
    t["norm.inputs"] = L * 2 * param_bytes * sbh
    if llama:
        t["norm.normalized"] = L * 2 * 4 * sbh
    t["norm.stats"] = L * 2 * (4 if llama else 8) * bs
    n_qkv = 1 if m.kind == "gpt2" else 3
    t["attn.qkv_input"] = L * lin_in(n_qkv)
    if attention == "eager" or not llama:
        t["attn.qkv"] = L * 3 * act * sbh
    else:
        t["attn.qkv"] = L * act * (sbh + 2 * kv)
    if m.kind == "gpt2" and attention == "sdpa" and getattr(config, "use_cache", False):
        # q, a view of c_attn's output, keeps all of it; k and v are the cache's cat copies
        t["attn.kv_cache_copies"] = L * 2 * act * sbh
    if llama:
        t["attn.rope_cos_sin"] = 2 * param_bytes * s * m.d  # one position row per batch
    if attention == "sdpa":
        t["attn.logsumexp"] = L * 4 * m.a * bs
    else:
        t["attn.softmax"] = L * (4 if amp else act) * as2b  # autocast's softmax is fp32
        t["attn.probs_dropout_mask"] = L * mask(m.p_attn, as2b)
        t["attn.probs"] = L * act * as2b if (amp or m.p_attn > 0) else 0
    t["attn.output"] = L * act * sbh  # the out-projection's input
    t["attn.dropout_mask"] = L * mask(m.p_hidden, sbh)
    t["mlp.fc_input"] = L * lin_in(2 if llama else 1)
    if m.kind == "gpt2":  # NewGELU: pow's input, tanh, 1 + tanh (fp32 under autocast), 0.5x
        t["mlp.act"] = L * (3 * (4 if amp else act) + act) * sbi
    elif llama:
        t["mlp.fc_output"] = L * 2 * act * sbi  # gate and up
        t["mlp.act"] = L * act * sbi  # SiLU output
    else:
        t["mlp.fc_output"] = L * act * sbi  # GELU input
    t["mlp.proj_input"] = L * act * sbi
    t["mlp.dropout_mask"] = L * mask(m.p_hidden, sbh)
    if llama:  # input, fp32 normalized, rsqrt
        t["final_norm"] = (param_bytes + 4) * sbh + 4 * bs
    elif m.kind == "gpt2":
        t["final_norm"] = param_bytes * sbh + 8 * bs
    else:  # BERT's MLM head: dense, GELU, LayerNorm (fp32 under autocast)
        t["head.transform"] = lin_in(1) + act * sbh + 4 * sbh + 8 * bs
    t["lm_head.input"] = lin_in(1)
    if bert:  # CrossEntropyLoss on the low-precision logits; nll_loss keeps an fp32 cast
        t["loss.log_softmax"] = act * bs * V
        t["loss.nll_input"] = 4 * bs * V if amp else 0
    else:  # ForCausalLMLoss casts the logits to fp32 first
        t["loss.log_softmax"] = 4 * bs * V
    t["loss.labels"] = 8 * bs
    if amp:
        qkvo = 4 * m.h * m.h if not llama else 2 * m.h * m.a * m.d + 2 * m.h * m.kv * m.d
        mlp = (3 if llama else 2) * m.h * m.ffn
        t["autocast.weight_copies"] = act * (L * (qkvo + mlp) + V * m.h + bert * m.h * m.h)
    t[TRANSIENT + "logits"] = act * bs * V
    t[TRANSIENT + "logits_fp32"] = 4 * bs * V if amp and not bert else 0
    return {k: t[k] for k in TERMS if t.get(k)}
