"""DeiT training memory and step time: plain AMP vs mesa_lite vs activation checkpointing.

On a GPU, for each model, autocast dtype and attention mode, in one process and on the same
inputs, each row runs full training steps (forward, backward, AdamW step; GradScaler with
fp16) and reports:
  peak    torch.cuda.max_memory_allocated() over the measured steps (after warm-up, so the
          optimizer state exists);
  static  torch.cuda.memory_allocated() before the measured steps (parameters, gradients,
          AdamW state); peak - static is the activation part;
  step    median step time (CUDA events) and images/s;
and ratios against the plain AMP row of the same model, dtype and attention mode. With
--compile each plain and mesa_lite row has a torch.compile twin (default mode, compiled during
warm-up), whose ratios are against the compiled plain row. With --cuda-graph each plain and
mesa_lite row has a twin captured by mesa_lite.graphed (forward and backward replayed as two
CUDA graphs; ratios against the graphed plain row), whose peak adds the part of its graph
pool that no tensor holds between replays (the replays' working memory, held for them alone);
every GPU row also reports torch.cuda.max_memory_reserved().

Without a GPU it runs a small default (DeiT-Tiny, batch 8) and reports the bytes one forward
keeps for backward (unique storages, Parameters excluded), labelled as such: not GPU memory.

Writes PREFIX.jsonl (one row per line, with device, versions and date), PREFIX.md (the table)
and PREFIX.png (bar chart of memory and step time) into a fresh runs/ folder unless --out
names a prefix; prints the table and the paths it wrote last. Exits 1 if a row failed.

  python benchmarks/deit_memory.py              # GPU: the full matrix; CPU: about 20 s
  python benchmarks/deit_memory.py --models deit_small_patch16_224 --dtype fp16 --attention fused
  python benchmarks/deit_memory.py --models deit_small_patch16_224 --attention fused --compile
  python benchmarks/deit_memory.py --models deit_small_patch16_224 --attention fused --cuda-graph
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

import mesa_lite

from .common import (
    MIB,
    NOISE,
    Outputs,
    StepTimer,
    add_dtype_argument,
    add_out_argument,
    argument_parser,
    autocast,
    check_device,
    check_timm_models,
    default_dtype,
    environment,
    lazy_import,
    markdown_table,
    noise_warning,
    nonnegative_int,
    positive_int,
    progress,
    pyplot,
    save_figure,
    say,
    sync,
    torch_dtype,
    write_jsonl,
)

torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")

MODELS = ["deit_tiny_patch16_224", "deit_small_patch16_224", "deit_base_patch16_224"]
MODES = {
    "amp": "plain training (AMP) baseline",
    "mesa": "mesa_lite (default Config; --bits adds rows)",
    "ckpt": "timm activation checkpointing",
}


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument(
        "--models", nargs="+", default=None, metavar="NAME",
        help="timm model names (default: DeiT-Ti/S/B on a GPU, DeiT-Ti on CPU)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=positive_int, default=None,
        help="images per step (default: 128 on a GPU, 8 on CPU)",
    )  # fmt: skip
    add_dtype_argument(p, gpu="fp16 and bf16", nargs="+")
    p.add_argument(
        "--attention", nargs="+", choices=["fused", "explicit"], default=["fused", "explicit"],
        help="timm attention: fused (F.scaled_dot_product_attention, timm's default) "
        "and/or explicit (q @ k^T, softmax, @ v; the setting of Mesa's table)",
    )  # fmt: skip
    p.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=None,
        help="rows: " + ", ".join(f"{k} = {v}" for k, v in MODES.items())
        + " (default: all on a GPU, amp and mesa on CPU)",
    )  # fmt: skip
    p.add_argument(
        "--bits", nargs="+", type=int, choices=[8, 4, 2], default=[8],
        help="code widths of the mesa rows, one row each (default: 8)",
    )  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=None,
                   help="measured steps, up to 4x as many while their times spread beyond "
                   "10%% (default: 20 on a GPU, 10 on CPU)")  # fmt: skip
    p.add_argument("--warmup", type=nonnegative_int, default=None,
                   help="steps before measuring (default: 3 on a GPU, 2 on CPU)")  # fmt: skip
    p.add_argument("--img-size", type=positive_int, default=224, help="input resolution")
    p.add_argument(
        "--compile", action="store_true",
        help="add torch.compile rows of plain and mesa_lite (compiled during warm-up; their "
        "ratios are against the compiled plain row)",
    )  # fmt: skip
    p.add_argument(
        "--cuda-graph", action="store_true",
        help="add rows of plain and mesa_lite captured by mesa_lite.graphed (GPU; ratios "
        "against the graphed plain row)",
    )  # fmt: skip
    add_out_argument(p, "deit_memory", "PREFIX.jsonl, .md and .png")
    p.add_argument(
        "--device", choices=["auto", "cuda", "cpu"], default="auto",
        help="auto: cuda when a GPU is present; the defaults above follow the device",
    )  # fmt: skip
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    p.add_argument(
        "--opt-in", action="store_true",
        help="mesa rows also wrap the opt-in layer kinds (mesa_lite.OPT_IN_KINDS: convolutions, "
        "BatchNorm, ReLU), for convolutional networks",
    )  # fmt: skip
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(p, args.device)
    gpu = args.device == "cuda"
    if args.cuda_graph and not gpu:
        p.error("--cuda-graph needs a GPU (CUDA graphs)")
    defaults = {
        "models": MODELS if gpu else MODELS[:1],
        "batch_size": 128 if gpu else 8,
        "modes": list(MODES) if gpu else ["amp", "mesa"],
        "steps": 20 if gpu else 10,
        "warmup": 3 if gpu else 2,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_timm_models(p, args.models)
    if args.dtype is None:
        args.dtype = ["fp16", "bf16"] if gpu else [default_dtype("cpu")]
    return args


def make_model(name: str, attention: str, mode: str, img_size: int, bits: int = 8, config=None):
    import timm

    torch.manual_seed(0)  # every row of a model starts from the same weights
    try:
        model = timm.create_model(name, pretrained=False, img_size=img_size)
    except TypeError:  # convolutional models take any input size and no img_size argument
        model = timm.create_model(name, pretrained=False)
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = attention == "fused"
    if mode == "mesa":
        mesa_lite.wrap(model, config if config is not None else mesa_lite.Config(bits=bits))
    elif mode == "ckpt":
        model.set_grad_checkpointing(True)
    return model.train()


def _train_step(model, opt, scaler, x, y, dtype):
    """One AdamW step under autocast to ``dtype`` (None: fp32, no autocast)."""
    opt.zero_grad(set_to_none=True)
    with autocast(x.device.type, dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def _timed_steps(model, x, y, dtype, args, before_measuring=None) -> dict:
    """AdamW steps: ``args.warmup`` untimed, then ``args.steps`` timed; a row's time fields.

    ``before_measuring`` runs between the two (the GPU row resets its peak there, once the
    optimizer state exists).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    scaler = torch.amp.GradScaler(x.device.type, enabled=x.is_cuda and dtype == torch.float16)
    bar = progress(total=args.warmup + args.steps, desc="  steps", leave=False, unit="step")
    for _ in range(args.warmup):
        _train_step(model, opt, scaler, x, y, dtype)
        bar.update()
    if before_measuring is not None:
        before_measuring()
    timer = StepTimer(x.device)
    # while the times spread beyond NOISE, up to 4x as many steps (a busy CPU's first steps)
    while not timer.times_ms or (timer.spread() > NOISE and len(timer.times_ms) < 4 * args.steps):
        for _ in range(args.steps):
            with timer:
                loss = _train_step(model, opt, scaler, x, y, dtype)
            bar.update()
    bar.close()
    return {
        "step_ms": timer.median_ms(),
        "step_spread": timer.spread(),
        "timed_steps": len(timer.times_ms),
        "images_per_s": x.shape[0] / timer.median_ms() * 1e3,
        "final_loss": float(loss.detach()),
    }


def _compiled(model, compiled: bool, mode: str):
    """The row's model, compiled when asked: a wrapped one through ``mesa_lite.compile``."""
    if not compiled:
        return model
    return mesa_lite.compile(model) if mode == "mesa" else torch.compile(model)


def gpu_row(name, mode, dtype_name, attention, x, y, args, bits=8, config=None,
            compiled=False, graphed=False) -> dict:  # fmt: skip
    device = x.device
    # what is allocated before the row starts (the inputs only, if earlier rows freed all)
    before = torch.cuda.memory_allocated(device)
    model = make_model(name, attention, mode, args.img_size, bits, config).to(device)
    model = _compiled(model, compiled, mode)
    if graphed:
        model = mesa_lite.graphed(model, (x,), autocast=torch_dtype(dtype_name), fallback="error")
    static = []

    def start():
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        static.append(torch.cuda.memory_allocated(device))

    times = _timed_steps(model, x, y, torch_dtype(dtype_name), args, start)
    peak = torch.cuda.max_memory_allocated(device)
    extra = {}
    if graphed:  # the pool's part no tensor holds between replays: the replays' own
        pool = mesa_lite.graph_memory(model)
        peak += pool["reserved"] - pool["allocated"]
        extra["graph_pool_mib"] = pool["reserved"] / MIB
    reserved = torch.cuda.max_memory_reserved(device)
    del model
    return {
        "peak_mib": peak / MIB,
        "reserved_mib": reserved / MIB,
        **extra,
        "static_mib": static[0] / MIB,
        "activation_mib": (peak - static[0]) / MIB,
        **times,
        "allocated_before_row_mib": before / MIB,
    }


def cpu_row(name, mode, dtype_name, attention, x, y, args, bits=8, config=None,
            compiled=False) -> dict:  # fmt: skip
    dtype = torch_dtype(dtype_name)
    model = make_model(name, attention, mode, args.img_size, bits, config)
    model = _compiled(model, compiled, mode)
    activations, copies = mesa_lite.report.kept_bytes(model, x, autocast=dtype)
    return {
        "kept_for_backward_mib": (activations + copies) / MIB,
        # kept minus autocast's low-precision weight copies (plain AMP keeps those too)
        "activation_mib": activations / MIB,
        **_timed_steps(model, x, y, dtype, args),
    }


def add_ratios(rows: list[dict], memory_key: str) -> None:
    """Ratios against the amp row with the same model, dtype, attention and compilation."""
    key = lambda r: (
        r["model"],
        r["dtype"],
        r["attention"],
        r.get("compiled", False),  # noqa: E731
        r.get("graphed", False),
    )
    base = {key(r): r for r in rows if r["mode"] == "amp"}
    for r in rows:
        b = base.get(key(r))
        if b is None or "error" in r or "error" in b:
            continue
        r["memory_reduction"] = b[memory_key] / r[memory_key]
        if "activation_mib" in r:
            r["activation_reduction"] = b["activation_mib"] / r["activation_mib"]
        r["step_ratio"] = r["step_ms"] / b["step_ms"]


def table(rows: list[dict], gpu: bool) -> str:
    short = lambda r: r["model"].replace("_patch16_224", "")  # noqa: E731
    rows = [dict(r, model_short=short(r)) for r in rows]
    cols = [("model_short", "model", "s"), ("dtype", "precision", "s"),
            ("attention", "attention", "s"), ("label", "mode", "s")]  # fmt: skip
    if gpu:
        cols += [("peak_mib", "peak MiB", ".0f"), ("reserved_mib", "reserved MiB", ".0f"),
                 ("static_mib", "static MiB", ".0f"),
                 ("activation_mib", "peak-static MiB", ".0f"), ("step_ms", "step ms", ".1f"),
                 ("images_per_s", "img/s", ".0f"), ("memory_reduction", "peak reduction", ".2f"),
                 ("activation_reduction", "activation reduction", ".2f"),
                 ("step_ratio", "step ratio", ".2f")]  # fmt: skip
    else:
        cols += [("kept_for_backward_mib", "kept for backward MiB (CPU, not GPU peak)", ".1f"),
                 ("memory_reduction", "reduction", ".2f"),
                 ("activation_mib", "of which activations MiB", ".1f"),
                 ("activation_reduction", "activation reduction", ".2f"),
                 ("step_ms", "CPU step ms", ".0f"),
                 ("step_spread", "spread", ".0%"),
                 ("step_ratio", "step ratio", ".2f")]  # fmt: skip
    return markdown_table(rows, cols)


def _legend_label(mode: str, bits) -> str:
    if mode == "mesa":
        return f"mesa_lite int{bits or 8}"
    return {"amp": "plain training (baseline)", "ckpt": "timm activation checkpointing"}[mode]


def plot(rows: list[dict], path: Path, memory_key: str, memory_label: str) -> dict:
    """Two bar charts (memory, step time), one bar per row; the legend lists the kinds of bar
    drawn, in the order drawn. Returns the legend entries and the bars' labels."""
    plt = pyplot()
    from matplotlib.colors import to_rgba

    rows = [r for r in rows if "error" not in r]
    labels = [
        f"{r['model'].replace('_patch16_224', '').replace('deit_', '')} {r['dtype']}\n"
        f"{r['attention']}\n{r['label']}"
        for r in rows
    ]
    colors = {"amp": "tab:gray", "mesa": "tab:blue", "ckpt": "tab:orange"}
    shades = {8: 1.0, 4: 0.7, 2: 0.45}  # mesa rows: lighter for fewer bits
    color = lambda r: to_rgba(colors[r["mode"]], shades.get(r.get("bits"), 1.0))  # noqa: E731
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 0.75 * len(rows) + 2), 7.5), sharex=True)
    step_label = "step ms" if memory_key == "peak_mib" else "CPU step ms"
    for ax, key, ylabel in ((axes[0], memory_key, memory_label), (axes[1], "step_ms", step_label)):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=[color(r) for r in rows])
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(rows)), labels, fontsize=7)
    kinds = list(dict.fromkeys((r["mode"], r.get("bits")) for r in rows))
    handles = [plt.Rectangle((0, 0), 1, 1, color=color({"mode": m, "bits": b})) for m, b in kinds]
    legend = [_legend_label(m, b) for m, b in kinds]
    axes[0].legend(handles, legend, fontsize=8)
    axes[0].set_title(f"DeiT training, {rows[0]['device']}" if rows else "DeiT training")
    save_figure(fig, path)
    return {"legend": legend, "labels": labels}


def run(argv=None) -> list[dict]:
    """Measures every row; returns the rows (``main`` is the command line's exit status)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    out = Outputs(args.out, "deit_memory")
    env = environment()
    env["device"] = torch.cuda.get_device_name(device) if gpu else env["device"]
    run_row = gpu_row if gpu else cpu_row
    rows: list[dict] = []
    plan = [
        (name, dtype_name, attention, mode, bits, compiled, graphed)
        for name in args.models
        for dtype_name in args.dtype
        for attention in args.attention
        for compiled, graphed in (
            [(False, False)] + [(True, False)] * args.compile + [(False, True)] * args.cuda_graph
        )
        for mode in args.modes
        if not ((compiled or graphed) and mode == "ckpt")
        for bits in (args.bits if mode == "mesa" else [None])
    ]
    bar = progress(plan, desc="rows", unit="row")
    inputs = None
    for name, dtype_name, attention, mode, bits, compiled, graphed in bar:
        if inputs is None or inputs[0] != name:
            if inputs is not None and "mesa" in args.modes:
                where_memory_goes(inputs[0], args, inputs[1], device)
            g = torch.Generator().manual_seed(1)
            x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g)
            y = torch.randint(0, 1000, (args.batch_size,), generator=g)
            inputs = (name, x.to(device), y.to(device))
        _, x, y = inputs
        label = {"amp": "plain", "ckpt": "ckpt"}.get(mode) or f"mesa int{bits}"
        label += " compiled" if compiled else ""
        label += ", graphed" if graphed else ""
        bar.set_postfix_str(f"{name.replace('_patch16_224', '')} {dtype_name} {attention} {label}")
        row = {"model": name, "batch": args.batch_size, "dtype": dtype_name,
               "attention": attention, "mode": mode, "bits": bits, "label": label,
               "compiled": compiled, "graphed": graphed, **env}  # fmt: skip
        try:
            kw = {"compiled": True} if compiled else {}
            if graphed:
                kw["graphed"] = True
            if args.opt_in and mode == "mesa":
                layers = mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS
                kw["config"] = mesa_lite.Config(bits=bits, layers=layers)
            row.update(run_row(name, mode, dtype_name, attention, x, y, args, bits or 8, **kw))
        except Exception as e:  # a row that fails (OOM) is reported, not hidden
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        rows.append(row)
        say(_row_line(row, gpu))
    bar.close()
    if inputs is not None and "mesa" in args.modes:
        where_memory_goes(inputs[0], args, inputs[1], device)
    memory_key = "peak_mib" if gpu else "kept_for_backward_mib"
    add_ratios(rows, memory_key)
    write_jsonl(out.path(".jsonl"), rows)
    text = table(rows, gpu)
    header = (
        f"DeiT training memory, batch {args.batch_size}, {env['device']}, torch {env['torch']}, "
        f"triton {env['triton']}, timm {env['timm']}, {env['date']}.\n"
    )
    if not gpu:
        header += (
            "CPU run: memory is bytes kept for backward by one forward (unique storages, "
            "Parameters excluded), not GPU peak memory; activations exclude autocast's "
            "low-precision weight copies. Reductions are plain / mesa_lite. Step times are "
            "medians, spread the interquartile range over the median; a wrapped step costs "
            "more on a CPU than on a GPU (the PyTorch reference quantizer, no Triton).\n"
        )
    out.path(".md").write_text(header + "\n" + text + "\n")
    if not args.no_plot:
        label = "peak MiB (GPU)" if gpu else "kept for backward MiB (CPU)"
        plot(rows, out.path(".png"), memory_key, label)
    warning = noise_warning(rows)
    if warning is not None:
        text += "\n\n" + warning
    print()
    print(header)
    print(text)
    out.print_paths()
    return rows


def main(argv=None) -> int:
    """The command line: 0 when every row ran, 1 when a row failed (its error is in the row)."""
    rows = run(argv)
    return 1 if any("error" in r for r in rows) else 0


def _row_line(row: dict, gpu: bool) -> str:
    what = f"{row['model'].replace('_patch16_224', '')} {row['dtype']} {row['attention']} "
    what += row["label"]
    if "error" in row:
        return f"{what}: FAILED {row['error']}"
    if gpu:
        return f"{what}: peak {row['peak_mib']:.0f} MiB, step {row['step_ms']:.1f} ms"
    return (
        f"{what}: kept for backward {row['kept_for_backward_mib']:.1f} MiB, "
        f"CPU step {row['step_ms']:.0f} ms"
    )


def where_memory_goes(name: str, args, x, device) -> None:
    """memory_report of the wrapped model on one forward of the benchmark's batch, by type
    (skipped with a message when that forward fails; the rows already say why)."""
    try:
        model = make_model(name, args.attention[0], "mesa", args.img_size).to(device)
        report = mesa_lite.memory_report(
            model, x, autocast=torch_dtype(args.dtype[0]), print_table=False
        )
    except Exception as e:
        say(f"\nWhere {name} keeps memory for backward: not measured ({type(e).__name__}: {e})")
        return
    say(f"\nWhere {name} keeps memory for backward ({args.attention[0]} attention, "
        f"{args.dtype[0]}, batch {x.shape[0]}):")  # fmt: skip
    say(report.table(by_kind=True) + "\n")
    del model, report
    gc.collect()


if __name__ == "__main__":
    sys.exit(main())
