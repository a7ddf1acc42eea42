"""What wrap compresses in common model families, and what stays plain.

For each model (timm vision models; Hugging Face GPT-2, Llama and BERT built from small
configs when transformers is installed; nothing is downloaded) it wraps a fresh copy with the
default Config and reports, from one training-mode forward (``mesa_lite.memory_report``):
  converted     the modules wrap converted, by type;
  skipped       supported-looking modules wrap skipped, with the reason (its log line);
  reduction     activations kept for backward, plain / wrapped (autocast weight copies apart);
  plain layers  the module types whose activations stay uncompressed, largest first, with
                their share of what the wrapped model still keeps.
Sizes are small (batch 2, 224x224 images, 128 tokens, 2-layer language models), so the bytes
are not a GPU peak; the ratios and the lists are what the table is for.

Writes PREFIX.jsonl and PREFIX.md (a fresh runs/ folder unless --out names a prefix).

    python benchmarks/coverage.py
    python benchmarks/coverage.py --models deit_small_patch16_224 convnext_tiny --dtype fp32
"""

from __future__ import annotations

import argparse
import logging
import sys

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

import mesa_lite

from .common import (
    MIB,
    Outputs,
    add_device_argument,
    add_dtype_argument,
    add_out_argument,
    argument_parser,
    check_timm_models,
    environment,
    lazy_import,
    markdown_table,
    positive_int,
    progress,
    resolve_device,
    say,
    torch_dtype,
)

torch = lazy_import("torch")

# model name -> family; "hf-*" are Hugging Face models built from a small config
MODELS = {
    "deit_small_patch16_224": "ViT / DeiT (timm)",
    "swin_tiny_patch4_window7_224": "Swin (timm)",
    "convnext_tiny": "ConvNeXt (timm)",
    "resnet50": "ResNet (timm)",
    "efficientnet_b0": "EfficientNet (timm)",
    "mobilenetv3_large_100": "MobileNetV3 (timm)",
    "hf-gpt2": "GPT-2 (Hugging Face)",
    "hf-llama": "Llama (Hugging Face)",
    "hf-bert": "BERT (Hugging Face)",
}


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME",
                   help="timm model names and hf-gpt2, hf-llama, hf-bert")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=2, help="images or sequences")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    add_dtype_argument(p)
    add_device_argument(p)
    add_out_argument(p, "coverage", "PREFIX.jsonl and PREFIX.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_timm_models(p, args.models, allowed=[m for m in MODELS if m.startswith("hf-")])
    resolve_device(args, p)
    return args


def _hf_model(name: str):
    """A small randomly initialized Hugging Face model, or None without transformers."""
    try:
        import transformers as tf
    except ImportError:
        return None
    # transformers' notes about these tiny configs (token ids, tied weights) are not ours
    tf.logging.set_verbosity_error()
    if name == "hf-gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1000, n_positions=512)
        return tf.GPT2LMHeadModel(cfg)
    if name == "hf-llama":
        cfg = tf.LlamaConfig(
            hidden_size=256, intermediate_size=688, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
        )  # fmt: skip
        return tf.LlamaForCausalLM(cfg)
    if name == "hf-bert":
        cfg = tf.BertConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                            num_attention_heads=4, vocab_size=1000)  # fmt: skip
        return tf.BertForMaskedLM(cfg)
    raise ValueError(f"unknown Hugging Face model {name!r}")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def measure(name: str, args) -> dict | None:
    """One model's row; None when it needs a library that is not installed."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    if name.startswith("hf-"):
        model = _hf_model(name)
        if model is None:
            return None
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 1000, (args.batch_size, args.seq_len), generator=g)
    else:
        import timm

        model = timm.create_model(name, pretrained=False)
        x = torch.randn(args.batch_size, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    model.to(device)
    logger = logging.getLogger("mesa_lite")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        mesa_lite.wrap(model)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    converted: dict[str, int] = {}
    for m in mesa_lite.wrapped_modules(model).values():
        converted[type(m).__name__] = converted.get(type(m).__name__, 0) + 1
    summary = next((s for s in handler.lines if s.startswith("mesa_lite.wrap:")), "")
    skipped = summary.split("; skipped ", 1)[1] if "; skipped " in summary else ""
    report = mesa_lite.memory_report(
        model, x.to(device), autocast=torch_dtype(args.dtype), print_table=False
    )
    from mesa_lite.modules import FusedBlock

    # a fused block's bytes are its block-level Functions' (its layers, compressed)
    wrapped = set(mesa_lite.wrapped_modules(model))
    wrapped |= {n for n, m in model.named_modules() if isinstance(m, FusedBlock)}
    plain: dict[str, int] = {}
    for r in report.rows:
        if r.name not in wrapped and r.compressed_bytes:
            plain[r.kind] = plain.get(r.kind, 0) + r.compressed_bytes
    kept = report.compressed_total
    largest = lambda d: sorted(d.items(), key=lambda kv: -kv[1])  # noqa: E731
    return {
        "model": name,
        "family": MODELS.get(name, name),
        "converted": ", ".join(f"{k} {n}" for k, n in largest(converted)),
        "skipped": skipped,
        "plain_mib": report.plain_total / MIB,
        "wrapped_mib": kept / MIB,
        "reduction": report.reduction,
        "plain_layers": ", ".join(f"{k} {100 * b / kept:.0f}%" for k, b in largest(plain)[:5]),
        "uncompressed_share": sum(plain.values()) / kept if kept else 0.0,
    }


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    env = environment()
    rows, skipped = [], []
    for name in progress(args.models, desc="models", unit="model"):
        row = measure(name, args)
        if row is None:
            skipped.append(name)
            say(f"{name}: skipped (needs transformers: pip install transformers)")
            continue
        rows.append(dict(row, dtype=args.dtype, batch=args.batch_size, **env))
        say(f"{name}: {row['reduction']:.2f}x, converted {row['converted'] or 'nothing'}")
    cols = [("family", "family", "s"), ("model", "model", "s"), ("converted", "converted", "s"),
            ("skipped", "skipped by wrap (reason)", "s"),
            ("reduction", "activation reduction", ".2f"),
            ("uncompressed_share", "kept by plain layers", ".0%"),
            ("plain_layers", "plain layers, share of what is kept", "s")]  # fmt: skip
    precision = "fp32 (no autocast)" if args.dtype == "fp32" else f"{args.dtype} autocast"
    head = (
        f"What wrap (default Config) compresses: one training forward, batch {args.batch_size}, "
        f"{precision}, {env['device']}, torch {env['torch']}, timm {env['timm']}, "
        f"{env['date']}. Reduction: activations kept for backward, plain / wrapped.\n\n"
    )
    text = head + markdown_table(rows, cols) + "\n"
    if skipped:
        text += f"\nNot measured (transformers is not installed): {', '.join(skipped)}.\n"
    Outputs(args.out, "coverage").write_report(rows, text)
    return rows


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
