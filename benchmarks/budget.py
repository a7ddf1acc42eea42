"""Training within a memory budget: mesa_lite.planner's plans against plain training and timm's
checkpointing, predicted and measured.

For each model: plain AMP and timm's activation checkpointing (every block) are measured;
``mesa_lite.planner.measure`` measures the model under each policy; then for each budget (a
fraction of the plain peak) ``planner.choose`` picks the per-block policies and the model is
trained with the plan's Config, so each row has the predicted and the measured peak and step
time. On a GPU the peak is ``torch.cuda.max_memory_allocated`` over measured steps (after
warm-up); without one, the memory is the bytes one training step's forward (its loss
included) keeps for backward, counted as the planner counts them, plus the static memory
(parameters, gradients, AdamW state), labelled as such (a CPU row has no backward
temporaries or recompute to measure: compare it with the prediction less its transient
term).

Writes PREFIX.jsonl, PREFIX.md and PREFIX.png (memory on x, step time on y, per model) into
a fresh runs/ folder unless --out names a prefix. Not yet in it: PyTorch's
``activation_memory_budget`` under compile as a further alternative, and the Hugging Face
models.

  python benchmarks/budget.py --models deit_small_patch16_224 --batch-size 128 --dtype fp16
  python benchmarks/budget.py --device cpu --models deit_tiny_patch16_224 --batch-size 2 \\
      --img-size 64 --budgets 1.0 0.6 0.4
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest as the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from .common import (
    MIB,
    Outputs,
    add_device_argument,
    add_out_argument,
    argument_parser,
    autocast,
    environment,
    lazy_import,
    markdown_table,
    nonnegative_int,
    positive_int,
    pyplot,
    resolve_device,
    save_figure,
    say,
    torch_dtype,
    write_jsonl,
)
from .deit_memory import cpu_row, gpu_row, make_model

torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")
planner = lazy_import("mesa_lite.planner")


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--models", nargs="+", default=["deit_small_patch16_224"], help="timm models")
    p.add_argument("--batch-size", type=positive_int, default=128, help="images per step")
    p.add_argument("--img-size", type=positive_int, default=224, help="input size")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16",
                   help="autocast dtype (fp32: none)")  # fmt: skip
    p.add_argument("--budgets", nargs="+", type=float,
                   default=[1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.25],
                   help="budgets as fractions of the plain peak")  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=5, help="measured steps per row")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="warm-up steps per row")
    add_device_argument(p)
    add_out_argument(p, "budget", "PREFIX.jsonl, PREFIX.md and PREFIX.png")
    p.add_argument("--no-plot", action="store_true", help="no chart")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if any(not 0 < b <= 1.5 for b in args.budgets):
        p.error(f"--budgets are fractions of the plain peak in (0, 1.5], got {args.budgets}")
    resolve_device(args, p)
    args.attention = "fused"
    return args


def _memory(row: dict, static_mib: float, gpu: bool, model=None, step_fn=None, m=None) -> float:
    """The row's memory in MiB: the GPU peak, or on the CPU the bytes one training step's
    forward (loss included) keeps for backward, counted as ``planner.measure`` counts them,
    plus the static memory."""
    if gpu:
        return row["peak_mib"]
    per_block, outside, _, _ = planner._kept_by_block(
        model, step_fn, None, m.blocks, torch.device("cpu")
    )
    return (sum(per_block.values()) + outside) / MIB + static_mib


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    env = environment()
    env["device"] = torch.cuda.get_device_name(device) if gpu else env["device"]
    out = Outputs(args.out, "budget")
    dtype = torch_dtype(args.dtype)
    row_of = gpu_row if gpu else cpu_row
    rows: list[dict] = []
    for name in args.models:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g)
        y = torch.randint(0, 1000, (args.batch_size,), generator=g)
        x, y = x.to(device), y.to(device)

        def step_fn(model, x=x, y=y):
            with autocast(device.type, dtype):
                return F.cross_entropy(model(x), y)

        base = {"model": name, "batch": args.batch_size, "dtype": args.dtype, **env}
        m = planner.measure(
            make_model(name, "fused", "amp", args.img_size).to(device), step_fn,
            lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05),
            warmup=args.warmup, timed=args.steps,
        )  # fmt: skip
        static_mib = m.static / MIB

        def memory(row, mode, config=None, name=name, static_mib=static_mib, m=m, fn=step_fn):
            model = None if gpu else make_model(name, "fused", mode, args.img_size, config=config)
            return _memory(row, static_mib, gpu, model, fn, m)

        plain = row_of(name, "amp", args.dtype, "fused", x, y, args)
        plain_mib = memory(plain, "amp")
        rows.append({**base, "row": "plain", **plain, "memory_mib": plain_mib})
        ckpt = row_of(name, "ckpt", args.dtype, "fused", x, y, args)
        rows.append({**base, "row": "timm checkpointing", **ckpt,
                     "memory_mib": memory(ckpt, "ckpt")})  # fmt: skip
        for fraction in args.budgets:
            budget = int(fraction * plain_mib * MIB)
            row = {**base, "row": f"plan {fraction:g}", "budget_mib": budget / MIB}
            try:
                plan = planner.choose(m, budget)
            except planner.PlanError as e:
                rows.append({**row, "error": str(e)})
                say(f"{name} budget {fraction:g}: {e}")
                continue
            counts = {p: plan.policies.count(p) for p in planner.POLICIES}
            row["policies"] = ", ".join(f"{p} x{n}" for p, n in counts.items() if n)
            row["predicted_mib"] = plan.peak / MIB
            row["predicted_transient_mib"] = plan.terms["transient"] / MIB
            row["predicted_step_ms"] = plan.seconds * 1e3
            row.update(row_of(name, "mesa", args.dtype, "fused", x, y, args, config=plan.config))
            row["memory_mib"] = memory(row, "mesa", plan.config)
            rows.append(row)
            say(f"{name} budget {fraction:g}: {row['policies']}, memory "
                f"{row['memory_mib']:.0f} MiB (predicted {row['predicted_mib']:.0f}), step "
                f"{row['step_ms']:.1f} ms")  # fmt: skip
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        for r in rows:
            if r["model"] == name and "memory_mib" in r:
                r["step_ratio"] = r["step_ms"] / plain["step_ms"]
                r["memory_fraction"] = r["memory_mib"] / plain_mib
    write_jsonl(out.path(".jsonl"), rows)
    memory = "peak MiB" if gpu else "kept for backward + static MiB (CPU)"
    cols = [("model", "model", "s"), ("row", "row", "s"), ("budget_mib", "budget MiB", ".0f"),
            ("policies", "policies", "s"), ("predicted_mib", "predicted MiB", ".0f"),
            ("memory_mib", memory, ".0f"), ("memory_fraction", "of plain", ".2f"),
            ("predicted_step_ms", "predicted step ms", ".1f"), ("step_ms", "step ms", ".1f"),
            ("step_ratio", "step / plain", ".2f"), ("error", "error", "s")]  # fmt: skip
    header = (f"Training within a memory budget, batch {args.batch_size}, {args.dtype}, "
              f"{env['device']}, torch {env['torch']}, timm {env['timm']}, "
              f"{env['date']}.\n\n")  # fmt: skip
    text = header + markdown_table(rows, cols) + "\n"
    out.path(".md").write_text(text)
    if not args.no_plot:
        _plot(rows, out.path(".png"), memory)
    print(text)
    out.print_paths()
    return rows


def _plot(rows: list[dict], path: Path, memory: str) -> None:
    plt = pyplot()
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == name and "memory_mib" in r]
        plans = [r for r in mine if r["row"].startswith("plan")]
        ax.plot([r["memory_mib"] for r in plans], [r["step_ms"] for r in plans], "o-",
                label="mesa_lite plans (measured)")  # fmt: skip
        ax.plot([r["predicted_mib"] for r in plans], [r["predicted_step_ms"] for r in plans],
                "x--", label="mesa_lite plans (predicted)")  # fmt: skip
        for r in mine:
            if not r["row"].startswith("plan"):
                ax.plot(r["memory_mib"], r["step_ms"], "s", label=r["row"])
        ax.set_xlabel(memory)
        ax.set_ylabel("step ms")
        ax.set_title(name)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    rows = run(argv)
    return 1 if any("error" in r and not r["row"].startswith("plan") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
