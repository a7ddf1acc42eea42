"""Memory against step time: plain AMP, timm's checkpointing, compression, and compressed
checkpointing (``Config(checkpoint=...)``) with its selective policies, one run per model.

For each model, in one process and on the same inputs, each point is a full training row of
``deit_memory`` (forward, backward, AdamW step, GradScaler with fp16; peak
``max_memory_allocated`` after warm-up, median step time by CUDA events), plus the median
parameter-gradient SQNR of one backward against plain training's (same weights and batch;
timm's checkpointing is exact). Ratios are against the plain row of the same model.

Writes PREFIX.jsonl, PREFIX.md and PREFIX.png (peak reduction against step ratio, a panel per
model; the points no other point beats on both axes are ringed). On CPU it runs a small
default (DeiT-Tiny at 64 pixels, batch 8, two points per kind) and reports bytes kept for
backward instead of GPU memory.

  python benchmarks/checkpoint_pareto.py                       # GPU: DeiT-S and DeiT-B
  python benchmarks/checkpoint_pareto.py --points plain ckpt8 ckpt8-compressed
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

import mesa_lite

from . import deit_memory, grad_fidelity
from .common import (
    Outputs,
    add_dtype_argument,
    add_out_argument,
    argument_parser,
    check_device,
    check_timm_models,
    default_dtype,
    environment,
    lazy_import,
    markdown_table,
    measure_row,
    nonnegative_int,
    positive_int,
    progress,
    pyplot,
    save_figure,
    say,
    torch_dtype,
    write_jsonl,
)

torch = lazy_import("torch")

# name -> (label, deit_memory mode, Config fields or None)
POINTS = {
    "plain": ("plain AMP", "amp", None),
    "timm-ckpt": ("timm checkpointing", "ckpt", None),
    "int8": ("int8", "mesa", {}),
    "int4": ("int4", "mesa", {"bits": 4}),
    "ckpt8": ("ckpt int8", "mesa", {"checkpoint": "blocks"}),
    "ckpt4": ("ckpt int4", "mesa", {"checkpoint": "blocks", "checkpoint_bits": 4}),
    "ckpt8-exact": (
        "ckpt int8, exact inside", "mesa", {"checkpoint": "blocks", "checkpoint_inner": "exact"},
    ),
    "ckpt8-compressed": (
        "ckpt int8, int8 inside", "mesa",
        {"checkpoint": "blocks", "checkpoint_inner": "compressed"},
    ),
    "ckpt4-compressed": (
        "ckpt int4, int4 inside", "mesa",
        {"bits": 4, "checkpoint": "blocks", "checkpoint_inner": "compressed"},
    ),
    "ckpt8-every2": (
        "ckpt int8 every 2nd block", "mesa", {"checkpoint": "blocks", "checkpoint_every": 2},
    ),
    "ckpt8-mlp": ("ckpt int8, MLPs only", "mesa", {"checkpoint": "mlp"}),
    "ckpt8-attention": ("ckpt int8, attention only", "mesa", {"checkpoint": "attention"}),
}  # fmt: skip
MODELS = ["deit_small_patch16_224", "deit_base_patch16_224"]


def build_parser() -> argparse.ArgumentParser:
    p = argument_parser(__doc__)
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        metavar="NAME",
        help="timm models (default: DeiT-S and DeiT-B on a GPU, DeiT-Ti on CPU)",
    )
    p.add_argument(
        "--points",
        nargs="+",
        choices=list(POINTS),
        default=None,
        help="rows: "
        + ", ".join(f"{k} = {v[0]}" for k, v in POINTS.items())
        + " (default: all on a GPU; plain, timm-ckpt, int8, ckpt8, ckpt8-exact on CPU)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="images per step (default: 128 on a GPU, 8 on CPU)",
    )
    add_dtype_argument(p, gpu="fp16")
    p.add_argument(
        "--img-size",
        type=positive_int,
        default=None,
        help="input resolution (default: 224 on a GPU, 64 on CPU)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="measured steps (default: 20 on a GPU, 2 on CPU)",
    )
    p.add_argument(
        "--warmup",
        type=nonnegative_int,
        default=None,
        help="steps before measuring (default: 3 on a GPU, 1 on CPU)",
    )
    p.add_argument(
        "--sqnr-batch",
        type=positive_int,
        default=None,
        help="images of the gradient-SQNR backward (default: 32 on a GPU, 4 on CPU)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="passes over all points, interleaved (plain, ..., plain, ...); a "
        "point's step time is the median of its passes' medians, its peak the "
        "largest (timing on a shared machine drifts between rows)",
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    add_out_argument(p, "checkpoint_pareto", "PREFIX.jsonl, .md and .png")
    return p  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(p, args.device)
    gpu = args.device == "cuda"
    defaults = {
        "models": MODELS if gpu else ["deit_tiny_patch16_224"],
        "points": list(POINTS) if gpu else ["plain", "timm-ckpt", "int8", "ckpt8",
                                            "ckpt8-exact"],
        "batch_size": 128 if gpu else 8,
        "img_size": 224 if gpu else 64,
        "steps": 20 if gpu else 2,
        "warmup": 3 if gpu else 1,
        "sqnr_batch": 32 if gpu else 4,
    }  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = default_dtype(args.device)
    check_timm_models(p, args.models)
    return args


def config_of(point: str):
    fields = POINTS[point][2]
    return None if fields is None else mesa_lite.Config(**fields)


def grad_sqnr(name: str, point: str, args, device) -> float:
    """Median parameter-gradient SQNR (dB) of one backward against plain training's."""
    mode, cfg = POINTS[point][1], config_of(point)
    if mode != "mesa":
        return float("inf")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(args.sqnr_batch, 3, args.img_size, args.img_size, generator=g).to(device)
    y = torch.randint(0, 1000, (args.sqnr_batch,), generator=g).to(device)
    dtype = torch_dtype(args.dtype)
    plain = deit_memory.make_model(name, "fused", "amp", args.img_size).to(device)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain), cfg)
    _, ref = grad_fidelity._grads(plain, x, y, dtype)
    _, got = grad_fidelity._grads(wrapped, x, y, dtype)
    dbs = [grad_fidelity._sqnr(ref[n], got[n]) for n in ref]
    finite = [d for d in dbs if d != float("inf")] or [float("inf")]
    return statistics.median(finite)


def _measure(name: str, point: str, x, y, args, sqnr: bool) -> dict:
    """One point's training row (``deit_memory``'s) and its gradient SQNR."""
    _, mode, _ = POINTS[point]
    run_row = deit_memory.gpu_row if x.is_cuda else deit_memory.cpu_row
    out = run_row(name, mode, args.dtype, "fused", x, y, args, config=config_of(point))
    return {**out, "sqnr_db": grad_sqnr(name, point, args, x.device)} if sqnr else out


def merge_passes(rows: list[dict]) -> list[dict]:
    """One row per (model, point) from several passes: the first pass's row with the median
    of the passes' step times (each pass's in ``step_ms_passes``) and the largest peak."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["point"])
        m = merged.setdefault(key, dict(r, step_ms_passes=[]))
        if "error" in r:
            m["error"] = r["error"]
            continue
        m["step_ms_passes"].append(r["step_ms"])
        for k in ("peak_mib", "kept_for_backward_mib"):
            if k in r:
                m[k] = max(m[k], r[k])
    for m in merged.values():
        if m["step_ms_passes"]:
            m["step_ms"] = statistics.median(m["step_ms_passes"])
    return list(merged.values())


def add_ratios(rows: list[dict], memory_key: str) -> None:
    base = {r["model"]: r for r in rows if r["point"] == "plain" and "error" not in r}
    for r in rows:
        b = base.get(r["model"])
        if b is None or "error" in r:
            continue
        r["memory_reduction"] = b[memory_key] / r[memory_key]
        r["step_ratio"] = r["step_ms"] / b["step_ms"]
    for r in rows:  # no other point of the model at least as good on both, better on one
        if "memory_reduction" not in r:
            continue
        others = [o for o in rows if o is not r and o["model"] == r["model"]
                  and "memory_reduction" in o]  # fmt: skip
        r["pareto"] = not any(
            o["memory_reduction"] >= r["memory_reduction"] and o["step_ratio"] <= r["step_ratio"]
            and (o["memory_reduction"], o["step_ratio"]) != (r["memory_reduction"],
                                                             r["step_ratio"])
            for o in others
        )  # fmt: skip


def table(rows: list[dict], gpu: bool) -> str:
    rows = [
        dict(
            r,
            short=r["model"].replace("_patch16_224", ""),
            on_front="yes" if r.get("pareto") else "",
        )
        for r in rows
    ]
    cols = [("short", "model", "s"), ("label", "point", "s")]
    if gpu:
        cols += [("peak_mib", "peak MiB", ".0f"), ("static_mib", "static MiB", ".0f")]
    else:
        cols += [("kept_for_backward_mib", "kept for backward MiB (CPU)", ".1f")]
    cols += [("memory_reduction", "memory reduction", ".2f"), ("step_ms", "step ms", ".1f"),
             ("step_ratio", "step ratio", ".2f"), ("sqnr_db", "grad SQNR median dB", ".1f"),
             ("on_front", "Pareto", "s")]  # fmt: skip
    return markdown_table(rows, cols)


def plot(rows: list[dict], path: Path, gpu: bool) -> None:
    plt = pyplot()
    rows = [r for r in rows if "memory_reduction" in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.2), squeeze=False)
    colors = {"amp": "tab:gray", "ckpt": "tab:orange"}
    for ax, model in zip(axes[0], models, strict=True):
        for r in (r for r in rows if r["model"] == model):
            c = colors.get(r["mode"], "tab:green" if "checkpoint" in r["config"] else "tab:blue")
            ax.scatter(r["memory_reduction"], r["step_ratio"], color=c, s=40, zorder=3)
            if r.get("pareto"):
                ax.scatter(r["memory_reduction"], r["step_ratio"], s=140, facecolors="none",
                           edgecolors="k", zorder=2)  # fmt: skip
            ax.annotate(r["label"], (r["memory_reduction"], r["step_ratio"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")  # fmt: skip
        ax.set_xlabel("peak memory reduction (x)" if gpu else "kept-for-backward reduction (x)")
        ax.set_ylabel("step time / plain")
        ax.set_title(model.replace("_patch16_224", ""))
        ax.grid(alpha=0.3)
    fig.suptitle(
        "gray plain, orange timm checkpointing, blue mesa_lite compression, "
        "green compressed checkpointing; ringed: Pareto points",
        fontsize=9,
    )
    save_figure(fig, path)


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    out = Outputs(args.out, "checkpoint_pareto")
    env = environment()
    env["device"] = torch.cuda.get_device_name(device) if gpu else env["device"]
    rows: list[dict] = []
    plan = [(r, m, p) for r in range(args.repeats) for m in args.models for p in args.points]
    for rep, name, point in progress(plan, desc="rows", unit="row"):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g)
        y = torch.randint(0, 1000, (args.batch_size,), generator=g)
        label, mode, fields = POINTS[point]
        row = {"model": name, "point": point, "label": label, "mode": mode,
               "config": dict(fields or {}), "batch": args.batch_size, "dtype": args.dtype,
               **env}  # fmt: skip
        x, y = x.to(device), y.to(device)
        measure_row(row, device, _measure, name, point, x, y, args, rep == 0)
        rows.append(row)
        what = f"{name.replace('_patch16_224', '')} {label}"
        if "error" in row:
            say(f"{what}: FAILED {row['error']}")
        else:
            mem = row.get("peak_mib", row.get("kept_for_backward_mib"))
            say(f"{what}: memory {mem:.0f} MiB, step {row['step_ms']:.1f} ms")
    rows = merge_passes(rows)
    memory_key = "peak_mib" if gpu else "kept_for_backward_mib"
    add_ratios(rows, memory_key)
    write_jsonl(out.path(".jsonl"), rows)
    header = (
        f"Compressed checkpointing against plain AMP and timm's checkpointing, batch "
        f"{args.batch_size}, "
        + ("fp32 (no autocast)" if args.dtype == "fp32" else f"{args.dtype} autocast")
        + f", {env['device']}, torch {env['torch']}, "
        f"timm {env['timm']}, {env['date']}. Memory: "
        + ("peak max_memory_allocated" if gpu else "bytes one forward keeps for backward (CPU)")
        + f"; step: median of the measured steps ({args.steps} after {args.warmup} warm-up)"
        + (f", the median over {args.repeats} interleaved passes" if args.repeats > 1 else "")
        + ".\n"
    )
    text = table(rows, gpu)
    out.path(".md").write_text(header + "\n" + text + "\n")
    if not args.no_plot:
        plot(rows, out.path(".png"), gpu)
    print()
    print(header)
    print(text)
    out.print_paths()
    return rows


def main(argv=None) -> int:
    rows = run(argv)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
