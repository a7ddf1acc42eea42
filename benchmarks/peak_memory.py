"""What holds the GPU memory peak of one DeiT training step, by where it was allocated.

Runs warm-up steps (so the optimizer state exists), then records the CUDA caching allocator's
history (``torch.cuda.memory._record_memory_history``) over one more step, replays the trace to
the moment of the step's peak, and groups the blocks alive then by the innermost Python frame
in mesa_lite, kernels, timm or the benchmark (the autograd engine's own allocations, which have
no Python frame, form one group). Blocks allocated before the recorded step and still alive
at the peak (parameters, optimizer state, inputs) are one line; the previous step's gradients,
freed by ``zero_grad(set_to_none=True)``, are not in it.

Writes PREFIX.md (one table per configuration) into a fresh runs/ folder unless --out names a
prefix, and prints it. GPU only.

    python benchmarks/peak_memory.py --models deit_small_patch16_224 --modes amp mesa --bits 8 4
    python benchmarks/peak_memory.py --modes amp mesa --compile   # Inductor's buffers by line
"""

from __future__ import annotations

import argparse
import gc
import sys

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

from .common import (
    DTYPE_NAMES,
    MIB,
    Outputs,
    add_out_argument,
    argument_parser,
    check_timm_models,
    lazy_import,
    live_at_peak,
    live_sites,
    markdown_table,
    memory_history,
    nonnegative_int,
    positive_int,
    progress,
    require_cuda,
    say,
    torch_dtype,
)
from .deit_memory import _train_step, make_model

torch = lazy_import("torch")


def profile(model, x, y, dtype, warmup: int) -> dict:
    device = x.device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    for _ in range(warmup):
        _train_step(model, opt, scaler, x, y, dtype)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    trace = memory_history(lambda: _train_step(model, opt, scaler, x, y, dtype), device)
    rise, freed_before, live = live_at_peak(trace)
    return {
        "before": before,
        "before_at_peak": before - freed_before,
        "peak_replayed": before + rise,
        "peak_measured": torch.cuda.max_memory_allocated(device),
        "groups": [(r["site"], [r["bytes"], r["count"]]) for r in live_sites(live)],
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--models", nargs="+", default=["deit_small_patch16_224"],
                   help="timm model names")  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=["amp", "mesa"], default=["amp", "mesa"],
                   help="amp = plain training, mesa = wrapped")  # fmt: skip
    p.add_argument("--bits", nargs="+", type=int, choices=[8, 4, 2], default=[8],
                   help="code widths of the mesa configurations")  # fmt: skip
    p.add_argument("--attention", nargs="+", choices=["fused", "explicit"], default=["fused"],
                   help="timm attention modes")  # fmt: skip
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp16",
                   help="autocast dtype (fp32: no autocast)")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=128, help="images per step")
    p.add_argument(
        "--warmup", type=nonnegative_int, default=2, help="steps before the recorded one"
    )
    p.add_argument("--top", type=positive_int, default=25, help="groups listed per configuration")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile each model before its warm-up"
    )
    add_out_argument(p, "peak_memory", "PREFIX.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    require_cuda(p, "needs a GPU: the allocator history is a CUDA feature")
    check_timm_models(p, args.models)
    return args


def run(argv=None) -> str:
    """Profiles every configuration; returns the text it wrote (``main``: the exit status)."""
    args = parse_args(argv)
    device = torch.device("cuda")
    dtype = torch_dtype(args.dtype)
    parts = [f"What is alive at the peak of one training step, batch {args.batch_size}, "
             f"{args.dtype} autocast, {torch.cuda.get_device_name(device)}.\n"]  # fmt: skip
    plan = [
        (name, attention, mode, bits)
        for name in args.models
        for attention in args.attention
        for mode in args.modes
        for bits in (args.bits if mode == "mesa" else [None])
    ]
    inputs = None
    for name, attention, mode, bits in progress(plan, desc="configurations", unit="config"):
        if inputs is None or inputs[0] != name:
            g = torch.Generator().manual_seed(1)
            x = torch.randn(args.batch_size, 3, 224, 224, generator=g).to(device)
            y = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)
            inputs = (name, x, y)
        _, x, y = inputs
        model = make_model(name, attention, mode, 224, bits or 8).to(device)
        if args.compile:  # a fresh graph per configuration: compiled graphs are shared by class
            torch._dynamo.reset()
            model = torch.compile(model)
        r = profile(model, x, y, dtype, args.warmup)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        title = f"{name} {attention} {mode}" + (f" int{bits}" if bits else "")
        title += " compiled" if args.compile else ""
        kept = "allocated before the step, still alive (params, optimizer state, inputs)"
        rows = [{"where": kept, "mib": r["before_at_peak"] / MIB, "blocks": ""}]
        rows += [{"where": k, "mib": v[0] / MIB, "blocks": v[1]}
                 for k, v in r["groups"][: args.top]]  # fmt: skip
        rest = r["groups"][args.top :]
        if rest:
            rows.append({"where": f"{len(rest)} other places",
                         "mib": sum(v[0] for _, v in rest) / MIB,
                         "blocks": sum(v[1] for _, v in rest)})  # fmt: skip
        cols = [("where", "allocated at", "s"), ("mib", "MiB at peak", ".1f"),
                ("blocks", "blocks", "")]  # fmt: skip
        parts.append(
            f"### {title}\npeak {r['peak_measured'] / MIB:.0f} MiB measured, "
            f"{r['peak_replayed'] / MIB:.0f} MiB replayed\n\n" + markdown_table(rows, cols)
        )
        say(parts[-1])
    text = "\n\n".join(parts) + "\n"
    out = Outputs(args.out, "peak_memory")
    out.path(".md").write_text(text)
    out.print_paths()
    return text


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
