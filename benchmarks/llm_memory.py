"""LLM training memory by kind: Hugging Face GPT-2, Llama and BERT, plain vs mesa_lite int8/int4
vs Hugging Face gradient checkpointing, next to the analytic estimate.

Each row builds a randomly initialized model from its config (nothing is downloaded), trains it
with AdamW on random tokens (labels = inputs for the causal models; masked-LM labels with 85%
set to -100 for BERT) under autocast (fp32 parameters), and measures one step with
mesa_lite.memory_breakdown after --warmup steps:
  peak        torch.cuda.max_memory_allocated() over the step;
  activation  the peak over forward and backward minus the memory allocated before forward,
              gradients already allocated (zero_grad(set_to_none=False)): activations and
              backward temporaries; no parameters, gradients, optimizer state or optimizer-
              step temporaries (AdamW's, about the parameters' size, set the step's peak
              when activations are small);
  kept        activations kept at the end of forward (allocated after forward minus before);
  static      parameters + gradients + optimizer state (unique storages);
  step        median time of --steps more steps (CUDA events);
with ratios against the plain row of the same model (peak reduction, activation reduction,
step time ratio) and, for every row, the plain model's analytic estimate
(mesa_lite.breakdown.estimate_activations, Korthikanti et al. 2022, 12*h*b*s*L). A second
table splits the estimate into its terms next to the plain rows' measurements.

On CPU there is no allocator counter: kept is the unique storages saved for backward, the
activation reduction is on it and peak is not reported. Sequences longer than a model's
position table are cut to it (BERT 512, GPT-2 1024).

Writes PREFIX.jsonl (one row per line, with device, versions and date) and PREFIX.md (the two
tables) into a fresh runs/ folder unless --out names a prefix. Exits 1 if a row failed.

  python benchmarks/llm_memory.py                     # GPU: gpt2, gpt2-medium, llama-1b, bert
  python benchmarks/llm_memory.py --models llama-1b --modes plain int8 --batch 4 --seq 2048
  python benchmarks/llm_memory.py --device cpu        # tiny-gpt2, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

import mesa_lite

from .common import (
    DTYPE_NAMES,
    FP8_PASS_OPTIONS,
    MIB,
    Outputs,
    StepTimer,
    add_device_argument,
    add_out_argument,
    argument_parser,
    autocast,
    hf_checkpointing_enable,
    lazy_import,
    live_at_peak,
    live_sites,
    markdown_table,
    measure_row,
    memory_history,
    nonnegative_int,
    positive_int,
    resolve_device,
    say,
)

torch = lazy_import("torch")
breakdown = lazy_import("mesa_lite.breakdown")

MODELS = {
    "gpt2": "GPT-2 124M (GPT2Config defaults)",
    "gpt2-medium": "GPT-2 medium 355M",
    "llama-1b": "Llama, 8 layers of 2048, GQA 16/4 heads, 32k vocabulary (about 0.5B)",
    "bert": "BERT base, masked LM (BertConfig defaults)",
    "tiny-gpt2": "2 layers of 64, vocabulary 256",
    "tiny-llama": "2 layers of 64, GQA 4/2 heads, vocabulary 256",
    "tiny-bert": "2 layers of 64, vocabulary 256",
}
MODES = {
    "plain": "plain training (baseline)",
    "int8": "mesa_lite.wrap(model)",
    "int8-logits": "mesa_lite.wrap(model, Config(keep_logits=True)): the logits built, head and"
    " loss not fused",
    "int4": "mesa_lite.wrap(model, Config(bits=4))",
    "hf-ckpt": "Hugging Face's checkpointing (activation_checkpointing_enable())",
    "ckpt8": "mesa_lite.wrap(model, Config(checkpoint='blocks')): compressed checkpointing",
    "ckpt4": "mesa_lite.wrap(model, Config(checkpoint='blocks', checkpoint_bits=4))",
    "ckpt8-mlp": "mesa_lite.wrap(model, Config(checkpoint='mlp')): each MLP recomputed in"
    " backward from its input's 8-bit codes, the rest compressed as int8",
}
# compiled rows (torch.compile, Inductor): each mode compiles a fresh model with options of its
# own, so no row reuses another's graph
COMPILED = {
    "plain-compiled": ("plain", {"trace.enabled": False}, None),
    "int8-compiled": ("int8", None, None),
    "int8-logits-compiled": ("int8-logits", None, None),
    "ckpt8-compiled": ("ckpt8", None, None),
    "ckpt8-mlp-compiled": ("ckpt8-mlp", None, None),
    "hf-ckpt-compiled": ("hf-ckpt", {"trace.enabled": False, "trace.debug_log": False}, None),
    "budget0.5-compiled": (
        "plain", {"trace.enabled": False, "trace.info_log": False},
        {"activation_memory_budget": 0.5}),
    "fp8-compiled": ("plain", FP8_PASS_OPTIONS, None),
}  # fmt: skip
MODES.update({
    "plain-compiled": "torch.compile(model)",
    "int8-compiled": "mesa_lite.compile(mesa_lite.wrap(model))",
    "int8-logits-compiled": "mesa_lite.compile(mesa_lite.wrap(model, Config(keep_logits=True))):"
    " the logits built, head and loss not fused",
    "ckpt8-compiled": "mesa_lite.compile(mesa_lite.wrap(model, Config(checkpoint='blocks')))",
    "ckpt8-mlp-compiled": "mesa_lite.compile(mesa_lite.wrap(model, Config(checkpoint='mlp')))",
    "hf-ckpt-compiled": "torch.compile of the model with activation_checkpointing_enable()",
    "budget0.5-compiled": "torch.compile with activation_memory_budget 0.5",
    "fp8-compiled": "torch.compile with Inductor's fp8 (e5m2) saved-activation pass",
})  # fmt: skip
DEFAULT_MODES = ["plain", "int8", "int4", "hf-ckpt"]


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                   help="models (default: gpt2 gpt2-medium llama-1b bert on a GPU, tiny-gpt2 on "
                   "CPU): "
                   + "; ".join(f"{k}: {v}" for k, v in MODELS.items()))  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=DEFAULT_MODES,
                   help="rows: " + ", ".join(f"{k} = {v}" for k, v in MODES.items()))  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=None,
                   help="sequences per batch (default: 8 on a GPU, 2 on CPU)")  # fmt: skip
    p.add_argument("--seq", type=positive_int, default=None,
                   help="tokens per sequence (default: 1024 on a GPU, 64 on CPU)")  # fmt: skip
    p.add_argument(
        "--dtype", choices=DTYPE_NAMES, default=None,
        help="autocast dtype over fp32 parameters; fp16 runs without a GradScaler (the same "
        "memory); fp32 runs without autocast (default: bf16 on a GPU; on a CPU bf16 where it "
        "has native bf16, else fp32, since emulated bf16 is very slow)",
    )  # fmt: skip
    p.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa",
                   help="Hugging Face attention implementation (and the estimate's)")  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed steps after the measured one (default: 10 on a GPU, 2 on CPU)",
                   )  # fmt: skip
    p.add_argument("--warmup", type=nonnegative_int, default=None,
                   help="steps before the measured one (default: 2 on a GPU, 1 on CPU)",
                   )  # fmt: skip
    p.add_argument("--time-lock", type=Path, default=None, metavar="FILE",
                   help="hold an exclusive lock on FILE while timing steps, so that processes "
                   "run side by side (one per model: Inductor compiles on the host) time one at "
                   "a time")  # fmt: skip
    p.add_argument("--timeline", type=nonnegative_int, default=0, metavar="N",
                   help="on a GPU, one more step per row with the allocator's history on: "
                   "the N largest allocation sites alive at that step's peak (file:line of "
                   "the Python frame, Inductor's generated code included), in PREFIX.md "
                   "(default 0: none)")  # fmt: skip
    p.add_argument("--head-chunk", type=positive_int, default=None, metavar="ELEMENTS",
                   help="the fused head and loss's chunk: about this many logits (tokens x "
                   "vocab) at a time (default: mesa_lite.ops.linear_cross_entropy's "
                   "CHUNK_ELEMENTS, 2**24)")  # fmt: skip
    add_device_argument(p)
    add_out_argument(p, "llm_memory", "PREFIX.jsonl and .md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    resolve_device(args, p, gpu="bf16")
    gpu = torch.device(args.device).type == "cuda"
    defaults = {
        "models": ["gpt2", "gpt2-medium", "llama-1b", "bert"] if gpu else ["tiny-gpt2"],
        "batch": 8 if gpu else 2,
        "seq": 1024 if gpu else 64,
        "steps": 10 if gpu else 2,
        "warmup": 2 if gpu else 1,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# the tiny models' shared sizes, for CPU
_TINY = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
             max_position_embeddings=128)  # fmt: skip
# name -> (transformers config class, its arguments); GPT2Config maps the Llama-style names
CONFIGS = {
    "gpt2": ("GPT2Config", {}),
    "gpt2-medium": ("GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16)),
    "llama-1b": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)),
    "bert": ("BertConfig", {}),
    "tiny-gpt2": ("GPT2Config", dict(_TINY, hidden_size=64, bos_token_id=0, eos_token_id=0)),
    "tiny-llama": ("LlamaConfig", dict(
        _TINY, hidden_size=64, intermediate_size=176, num_key_value_heads=2,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
    "tiny-bert": ("BertConfig", dict(_TINY, hidden_size=64, intermediate_size=256,
                                     pad_token_id=0)),
}  # fmt: skip


def make_config(name: str):
    """The transformers config of a model name (random init; the tiny ones for CPU)."""
    import transformers

    cls, kwargs = CONFIGS[name]
    return getattr(transformers, cls)(**kwargs)


def max_positions(config) -> int:
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def make_model(name: str, mode: str, attention: str = "sdpa", config=None):
    """A randomly initialized model in train mode, converted for ``mode``."""
    import transformers as tf

    config = config if config is not None else make_config(name)
    auto = tf.AutoModelForMaskedLM if config.model_type == "bert" else tf.AutoModelForCausalLM
    if mode in COMPILED:
        base, options, _ = COMPILED[mode]
        model = make_model(name, base, attention, config)
        if base in ("plain", "hf-ckpt"):
            return torch.compile(model, options=options)
        return mesa_lite.compile(model, options=options)
    torch.manual_seed(0)  # every row of a model starts from the same weights
    model = auto.from_config(config, attn_implementation=attention).train()
    if mode == "int8":
        mesa_lite.wrap(model)
    elif mode == "int8-logits":
        mesa_lite.wrap(model, mesa_lite.Config(keep_logits=True))
    elif mode == "int4":
        mesa_lite.wrap(model, mesa_lite.Config(bits=4))
    elif mode == "hf-ckpt":
        hf_checkpointing_enable(model)
    elif mode in ("ckpt8", "ckpt4"):
        bits = 8 if mode == "ckpt8" else 4
        mesa_lite.wrap(model, mesa_lite.Config(checkpoint="blocks", checkpoint_bits=bits))
    elif mode == "ckpt8-mlp":
        mesa_lite.wrap(model, mesa_lite.Config(checkpoint="mlp"))
    return model


def make_inputs(config, batch: int, seq: int, device):
    """Random token ids and their labels: the ids (causal LM) or MLM labels, 85% -100."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    if config.model_type == "bert":
        labels[torch.rand(batch, seq, generator=g) < 0.85] = -100
    return ids.to(device), labels.to(device)


@contextlib.contextmanager
def _exclusive(path: Path | None):
    """An exclusive advisory lock on ``path`` for the block (nothing without a path)."""
    if path is None:
        yield
        return
    import fcntl  # POSIX only, and only when asked for

    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure(name: str, mode: str, config, ids, labels, args) -> dict:
    """One row: memory_breakdown of a step after the warm-up, then the timed steps."""
    device = torch.device(args.device)
    model = make_model(name, mode, args.attention, config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step_fn(m):
        with autocast(device.type, args.dtype):
            return m(input_ids=ids, labels=labels).loss

    # gradients stay allocated between steps (zeroed), so that "before forward" holds all the
    # static memory and the activation figure holds no gradients
    patches = COMPILED[mode][2] if mode in COMPILED else None
    with torch._functorch.config.patch(patches or {}):  # read while compiling
        bd = breakdown.memory_breakdown(
            model, step_fn, opt, steps=args.warmup + 1, set_to_none=False
        )
        timer = StepTimer(device)
        with _exclusive(args.time_lock):
            for _ in range(args.steps):
                with timer:
                    loss = breakdown.train_step(model, step_fn, opt, set_to_none=False)
    mib = lambda v: None if v is None else v / MIB  # noqa: E731
    gpu = bd.peak is not None
    timeline = {}
    if args.timeline and device.type == "cuda":
        trace = memory_history(
            lambda: breakdown.train_step(model, step_fn, opt, set_to_none=False), device
        )
        rise, _, live = live_at_peak(trace)
        timeline = {"timeline_peak_mib": rise / MIB,
                    "peak_sites": [{**r, "mib": r["bytes"] / MIB}
                                   for r in live_sites(live, args.timeline)]}  # fmt: skip
    return {
        **timeline,
        "peak_mib": mib(bd.peak),
        # forward and backward only: the optimizer step's temporaries are not activations
        "activation_mib": mib(bd.peak_training - bd.before_forward) if gpu else None,
        "kept_mib": mib(bd.activations),
        "saved_mib": mib(bd.saved_for_backward),
        "backward_tmp_mib": mib(bd.backward_temporaries),
        "before_forward_mib": mib(bd.before_forward),
        "static_mib": mib(bd.static),
        "parameters_mib": mib(bd.parameters),
        "gradients_mib": mib(bd.gradients),
        "optimizer_mib": mib(bd.optimizer_state),
        "step_ms": timer.median_ms(),
        "final_loss": float(loss),
    }


def estimate(config, batch: int, seq: int, args) -> tuple[dict, dict]:
    """(the estimate's terms in bytes, the row's estimate columns in MiB)."""
    width = 4 if args.dtype == "fp32" else 2
    terms = breakdown.estimate_activations(
        config, batch, seq, dtype_bytes=width, attention=args.attention
    )
    paper = breakdown.korthikanti(config, batch, seq)
    return terms, {
        "estimate_mib": breakdown.kept_total(terms) / MIB,
        "korthikanti_mib": paper["korthikanti"] / MIB,
        "simple_12hbsL_mib": paper["simple_12hbsL"] / MIB,
    }


def add_ratios(rows: list[dict], gpu: bool) -> None:
    """Ratios against the plain row of the same model: plain / row for memory (peak and
    activations; kept on CPU), row / plain for step time."""
    base = {(r["model"], r["mode"]): r for r in rows
            if r["mode"] in ("plain", "plain-compiled") and "error" not in r}  # fmt: skip
    act = "activation_mib" if gpu else "kept_mib"
    for r in rows:
        # a compiled row against compiled plain, an eager row against eager plain
        b = base.get((r["model"], "plain-compiled" if r["mode"] in COMPILED else "plain"))
        if b is None or "error" in r:
            continue
        if gpu:
            r["peak_reduction"] = b["peak_mib"] / r["peak_mib"]
        r["activation_reduction"] = b[act] / r[act]
        r["step_ratio"] = r["step_ms"] / b["step_ms"]


def table(rows: list[dict], gpu: bool) -> str:
    cols = [("model", "model", "s"), ("mode", "mode", "s"), ("batch", "batch", "d"),
            ("seq", "seq", "d"), ("dtype", "dtype", "s")]  # fmt: skip
    if gpu:
        cols += [("peak_mib", "peak MiB", ".0f"),
                 ("activation_mib", "activation MiB (fwd+bwd peak - before fwd)", ".0f"),
                 ("kept_mib", "kept at end of fwd MiB", ".0f"),
                 ("backward_tmp_mib", "bwd temporaries MiB", ".0f")]  # fmt: skip
    else:
        cols += [("kept_mib", "saved for backward MiB (CPU, not GPU peak)", ".2f")]
    cols += [("static_mib", "static MiB", ".0f" if gpu else ".2f"),
             ("step_ms", "step ms", ".1f" if gpu else ".0f")]  # fmt: skip
    if gpu:
        cols += [("peak_reduction", "peak reduction", ".2f")]
    cols += [("activation_reduction", "activation reduction", ".2f"),
             ("step_ratio", "step ratio", ".2f"),
             ("estimate_mib", "plain estimate MiB", ".0f" if gpu else ".2f"),
             ("korthikanti_mib", "Korthikanti MiB", ".0f" if gpu else ".2f"),
             ("simple_12hbsL_mib", "12hbsL MiB", ".0f" if gpu else ".2f")]  # fmt: skip
    return markdown_table(rows, cols)


def terms_table(rows: list[dict], terms: dict[str, dict], gpu: bool) -> str:
    """The plain estimate term by term (MiB), one column per model, then its totals and the
    plain rows' measurements."""
    plain = {r["model"]: r for r in rows if r["mode"] == "plain" and "error" not in r}
    models = list(terms)
    names = [k for k in breakdown.TERMS if any(k in t for t in terms.values())]
    out = [{"term": k, **{m: terms[m].get(k, 0) / MIB for m in models}} for k in names]
    totals = [("estimate, kept (sum without transient.*)", "estimate_mib"),
              ("Korthikanti et al. 2022, L*sbh(34 + 5as/h)", "korthikanti_mib"),
              ("12*h*b*s*L", "simple_12hbsL_mib"),
              ("measured: kept at end of forward", "kept_mib"),
              ("measured: saved for backward (hook count)", "saved_mib")]  # fmt: skip
    if gpu:
        totals.append(("measured: forward+backward peak - before forward", "activation_mib"))
    for label, key in totals:
        out.append({"term": f"**{label}**", **{m: plain.get(m, {}).get(key) for m in models}})
    return markdown_table(out, [("term", "term (MiB)", "s")] + [(m, m, ".2f") for m in models])


def run(argv=None) -> list[dict]:
    """Measures every row; returns the rows (``main`` is the command line's exit status)."""
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    from mesa_lite.ops import linear_cross_entropy as lce

    if args.head_chunk is not None:
        lce.CHUNK_ELEMENTS = args.head_chunk
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    out = Outputs(args.out, "llm_memory")
    env = _environment(device)
    rows: list[dict] = []
    all_terms: dict[str, dict] = {}
    for name in args.models:
        config = make_config(name)
        seq = min(args.seq, max_positions(config))
        if seq < args.seq:
            say(f"{name}: --seq {args.seq} cut to its {seq} positions")
        ids, labels = make_inputs(config, args.batch, seq, device)
        all_terms[name], est = estimate(config, args.batch, seq, args)
        for mode in args.modes:
            row = {"model": name, "mode": mode, "batch": args.batch, "seq": seq,
                   "dtype": args.dtype, "attention": args.attention,
                   "head_chunk": lce.CHUNK_ELEMENTS, **env}  # fmt: skip
            measure_row(row, device, measure, name, mode, config, ids, labels, args)
            if "error" not in row:
                row.update(est)
            rows.append(row)
            say(_row_line(row))
    add_ratios(rows, gpu)
    precision = "fp32" if args.dtype == "fp32" else f"{args.dtype} autocast, fp32 parameters"
    header = (
        f"LLM training memory, batch {args.batch}, {precision}, {args.attention} attention, "
        f"AdamW, {env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['date']}.\n"
    )
    if not gpu:
        header += (
            "CPU run: memory is bytes saved for backward by one forward (unique storages, "
            "Parameters excluded), not GPU memory; there is no peak. The estimate models the "
            "CUDA kernels: on CPU dropout keeps its mask in the input's dtype (not 1 byte) and "
            "SDPA with dropout takes the math path (s^2 terms).\n"
        )
    text = (
        header + "\n" + table(rows, gpu) + "\n\nThe plain estimate by term, next to the "
        "plain rows' measurements (transient.* terms are alive during forward only):\n\n"
        + terms_table(rows, all_terms, gpu)
        + "\n"
    )
    text += timeline_text(rows)
    out.write_report(rows, text)
    return rows


def timeline_text(rows: list[dict]) -> str:
    """For each row measured with ``--timeline``: the allocation sites alive at the traced
    step's peak."""
    parts = []
    for r in rows:
        if not r.get("peak_sites"):
            continue
        parts.append(
            f"\n{r['model']}, {r['mode']}: {r['timeline_peak_mib']:,.0f} MiB allocated during one "
            "step at its peak (over what was allocated before it); alive then, by site:\n\n"
            + markdown_table(
                r["peak_sites"],
                [("site", "site", "s"), ("mib", "MiB", ",.1f"), ("count", "allocations", "d")],
            )  # fmt: skip
        )
    return "".join(parts)


def _environment(device) -> dict:
    """Device name, versions and date for every row: common.environment's fields, with
    transformers for timm, which is not imported (seconds of CPU, and not used here)."""
    import datetime
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    try:
        triton = version("triton")
    except PackageNotFoundError:
        triton = None
    gpu = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if gpu else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "triton": triton,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def _row_line(row: dict) -> str:
    what = f"{row['model']} {row['mode']} b{row['batch']} s{row['seq']} {row['dtype']}"
    if "error" in row:
        return f"{what}: FAILED {row['error']}"
    if row["peak_mib"] is not None:
        return f"{what}: peak {row['peak_mib']:.0f} MiB, step {row['step_ms']:.1f} ms"
    return f"{what}: saved for backward {row['kept_mib']:.2f} MiB, step {row['step_ms']:.0f} ms"


def main(argv=None) -> int:
    """The command line: 0 when every row ran, 1 when a row failed (its error is in the row)."""
    rows = run(argv)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
