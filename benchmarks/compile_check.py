"""Training check of every family under mesa_lite.compile and eager: first-step gradients
against the eager plain model's, and the loss over a few AdamW steps against plain's.

Per family (small configs of timm DeiT, Swin, ConvNeXt, a ResNet with the opt-in kinds, Hugging
Face GPT-2 with dropout off and on, Llama, Qwen2, BERT), three runs from the same weights on the
same batch: eager plain, eager wrapped and ``mesa_lite.compile(wrapped)`` (Inductor). Each
reports the worst and median per-parameter gradient SQNR of its first step against eager
plain's (parameters whose plain gradient is ~0 left out; not with dropout on, where the masks
differ), then the loss after ``--steps`` AdamW steps. A run passes when its worst gradient is
within ``--floor`` dB and its loss falls by at least 80% of plain's fall.

The comparison runs under autocast (bf16 on a GPU, fp32 on the CPU), so the floor covers the
8-bit codes plus the low-precision ops' own rounding differences between eager and compiled.

Writes PREFIX.jsonl and PREFIX.md; exits 1 if a run failed its check.

  python benchmarks/compile_check.py                         # GPU: every family
  python benchmarks/compile_check.py --families gpt2 llama --device cpu --steps 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

from .common import (
    Outputs,
    add_device_argument,
    add_out_argument,
    argument_parser,
    autocast,
    environment,
    lazy_import,
    markdown_table,
    positive_int,
    resolve_device,
    say,
)

torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")
mesa_lite = lazy_import("mesa_lite")

FAMILIES = ("deit", "swin", "convnext", "resnet", "gpt2", "gpt2-dropout", "llama", "qwen2",
            "bert")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argument_parser(__doc__)
    p.add_argument(
        "--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="families to check"
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "fp16", "bf16"],
        default=None,
        help="autocast dtype (default: bf16 on a GPU; the CPU runs fp32)",
    )
    p.add_argument("--steps", type=positive_int, default=8, help="AdamW steps per run")
    p.add_argument("--floor", type=float, default=15.0,
                   help="worst per-parameter gradient SQNR a run must reach, dB")  # fmt: skip
    add_device_argument(p)
    add_out_argument(p, "compile_check", "PREFIX.jsonl and PREFIX.md")
    return p


def _vision(name: str):
    import timm

    torch.manual_seed(0)
    if name == "deit":
        return timm.create_model("deit_small_patch16_224", depth=4, num_classes=10), 224, None
    if name == "swin":
        # stochastic depth off (timm's Swin default is 0.1): compiled draws differ from eager
        return timm.create_model("swin_tiny_patch4_window7_224", depths=(2, 2, 2, 2),
                                 num_classes=10, drop_path_rate=0.0), 224, None  # fmt: skip
    if name == "convnext":
        return timm.create_model("convnext_tiny", depths=(1, 1, 2, 1), num_classes=10), 224, None
    cnn = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)
    return timm.create_model("resnet26", num_classes=10), 224, cnn


def _language(name: str):
    import transformers as tf

    tf.logging.set_verbosity_error()
    p = 0.1 if name == "gpt2-dropout" else 0.0
    if name.startswith("gpt2"):
        cfg = tf.GPT2Config(n_layer=2, attn_pdrop=p, resid_pdrop=p, embd_pdrop=p)
        cls = tf.GPT2LMHeadModel
    elif name == "bert":
        cfg = tf.BertConfig(
            num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        cls = tf.BertForMaskedLM
    else:
        conf = tf.LlamaConfig if name == "llama" else tf.Qwen2Config
        cfg = conf(hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
        cls = tf.LlamaForCausalLM if name == "llama" else tf.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation="sdpa").train(), cfg


def _case(name: str, device, gpu: bool):
    """(plain model, wrap config, loss function of a model, dropout on)."""
    g = torch.Generator().manual_seed(0)
    if name in ("deit", "swin", "convnext", "resnet"):
        model, size, config = _vision(name)
        n = 16 if gpu else 2
        x = torch.randn(n, 3, size, size, generator=g).to(device)
        y = torch.randint(0, 10, (n,), generator=g).to(device)
        return model, config, lambda m: F.cross_entropy(m(x), y), False
    model, cfg = _language(name)
    batch, seq = (4, 512) if gpu else (2, 32)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    labels = ids.clone()
    if name == "bert":
        labels[torch.rand(batch, seq, generator=g).to(device) < 0.85] = -100
    return model, None, lambda m: m(input_ids=ids, labels=labels).loss, name == "gpt2-dropout"


def _sqnr(ref, got) -> float:
    ref, got = ref.double(), got.double()
    err = (ref - got).norm()
    return float("inf") if err == 0 else (20 * torch.log10(ref.norm() / err)).item()


def _run(model, loss_fn, device, dtype, steps: int):
    """(first-step gradients by name, losses of every step)."""
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=1e-4 if dtype == "fp32" else 3e-4)
    losses, first = [], None
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same dropout draws in eager runs
        opt.zero_grad(set_to_none=True)
        with autocast(device.type, dtype):
            loss = loss_fn(model)
        loss.backward()
        if first is None:  # in parameter order: a wrapped model's names may differ
            first = [None if p.grad is None else p.grad.detach().float().clone()
                     for p in params.values()]  # fmt: skip
        opt.step()
        losses.append(loss.item())
    return first, losses


def check(name: str, args) -> list[dict]:
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    plain, config, loss_fn, dropout = _case(name, device, gpu)
    plain = plain.to(device)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), config)
    compiled_src = copy.deepcopy(wrapped)
    torch._dynamo.reset()
    compiled = mesa_lite.compile(compiled_src)
    ref_list, ref_losses = _run(plain, loss_fn, device, args.dtype, args.steps)
    names = [n for n, _ in plain.named_parameters()]
    ref_grads = dict(zip(names, ref_list, strict=True))
    scale = max(g.norm().item() for g in ref_grads.values() if g is not None)
    fall = ref_losses[0] - ref_losses[-1]
    rows = [{"family": name, "run": "plain eager", "loss_first": ref_losses[0],
             "loss_last": ref_losses[-1], "ok": True}]  # fmt: skip
    for run, model in (("mesa eager", wrapped), ("mesa compiled", compiled)):
        try:
            got, losses = _run(model, loss_fn, device, args.dtype, args.steps)
            grads = dict(zip(names, got, strict=True))
        except Exception as e:  # a failed compile is a result
            rows.append(
                {
                    "family": name,
                    "run": run,
                    "ok": False,
                    "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                }
            )
            continue
        row = {"family": name, "run": run, "loss_first": losses[0], "loss_last": losses[-1]}
        missing = [n for n, g in ref_grads.items() if g is not None and grads.get(n) is None]
        dbs = {
            n: _sqnr(g, grads[n])
            for n, g in ref_grads.items()
            if g is not None and n not in missing and g.norm().item() >= 1e-4 * scale
        }
        ok_loss = fall <= 0 or (losses[0] - losses[-1]) >= 0.8 * fall
        row["loss_falls"] = ok_loss
        if dropout:
            row["ok"] = ok_loss and not missing
        else:
            worst = min(dbs, key=dbs.get)
            row.update(
                worst_db=dbs[worst], worst_param=worst, median_db=statistics.median(dbs.values())
            )
            row["ok"] = ok_loss and not missing and dbs[worst] >= args.floor
        if missing:
            row["error"] = f"no gradient: {missing[:3]}"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    resolve_device(args, p, gpu="bf16")
    if torch.device(args.device).type != "cuda":
        args.dtype = "fp32"
    rows = []
    for name in args.families:
        say(f"compile_check: {name}")
        rows.extend(check(name, args))
    env = environment()
    for r in rows:
        r.update(env)
    head = (
        f"Compiled and eager training checked against eager plain, {args.dtype} autocast, "
        f"{args.steps} AdamW steps, {env['device']}, torch {env['torch']}, {env['date']}. "
        "Gradient SQNR: first step, per parameter, against eager plain (not with dropout).\n\n"
    )
    cols = [("family", "family", ""), ("run", "run", ""), ("worst_db", "worst dB", ".1f"),
            ("worst_param", "worst parameter", ""), ("median_db", "median dB", ".1f"),
            ("loss_first", "loss step 1", ".4f"), ("loss_last", "loss last", ".4f"),
            ("ok", "ok", ""), ("error", "error", "")]  # fmt: skip
    Outputs(args.out, "compile_check").write_report(rows, head + markdown_table(rows, cols) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
