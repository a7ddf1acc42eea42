"""Memory against accuracy: sweep mesa_lite configs, one CSV row each, and chart the Pareto front.

For every config of the grid (bits x group size x rounding x which layer kinds) it measures:
  memory     GPU peak of DeiT training steps (``deit_memory``'s row) on a GPU, else the bytes one
             DeiT forward keeps for backward (CPU), with the plain model's figure beside it;
  accuracy   test accuracy on scikit-learn's digits (``accuracy``), mean over ``--seeds``;
  gradients  median parameter-gradient SQNR on DeiT (``grad_fidelity``).
Rows already in the CSV are skipped, so an interrupted sweep resumes where it stopped (pass its
--csv again); CSVs of sweeps run in parallel can be concatenated (one header) and passed as
--csv to redraw the front. Without --csv it writes ablate.csv and ablate.png into a fresh runs/
folder.

    python benchmarks/ablate.py                               # the default grid
    python benchmarks/ablate.py --bits 8 4 --group-sizes 32 128 --layers all no-attention
"""

from __future__ import annotations

import argparse
import copy
import csv
import itertools
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

import mesa_lite
from mesa_lite.config import LAYER_KINDS

from . import accuracy, grad_fidelity
from .common import (
    MIB,
    Outputs,
    add_device_argument,
    add_dtype_argument,
    argument_parser,
    check_timm_models,
    lazy_import,
    positive_int,
    progress,
    pyplot,
    resolve_device,
    save_figure,
    torch_dtype,
)
from .deit_memory import gpu_row, make_model

torch = lazy_import("torch")

LAYER_SETS = {
    "all": set(LAYER_KINDS),
    "no-attention": set(LAYER_KINDS) - {"attention", "softmax", "matmul"},
    "linear-only": {"linear"},
}
FIELDS = ["bits", "group_size", "rounding", "layers", "memory_kind", "memory_mib", "plain_mib",
          "memory_reduction", "acc_mean", "acc_std", "plain_acc_mean", "grad_median_db",
          "grad_min_db", "pareto"]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--bits", nargs="+", type=int, choices=[8, 4, 2], default=[8, 4, 2],
                   help="code widths of the grid")  # fmt: skip
    p.add_argument("--group-sizes", nargs="+", type=positive_int, default=[32, 128, 512],
                   help="group sizes of the grid")  # fmt: skip
    p.add_argument(
        "--rounding", nargs="+", choices=["nearest", "stochastic", "default"],
        default=["default"],
        help="roundings of the grid; 'default' is Config's rule: nearest at 8 bits, "
        "stochastic below",
    )  # fmt: skip
    p.add_argument("--layers", nargs="+", choices=list(LAYER_SETS), default=["all"],
                   help="which layer kinds are compressed: " + ", ".join(
                       f"{k} = {' '.join(sorted(v))}" for k, v in LAYER_SETS.items()))  # fmt: skip
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1],
                   help="digits training seeds per config")  # fmt: skip
    p.add_argument("--epochs", type=positive_int, default=15, help="digits training epochs")
    p.add_argument("--memory-model", default="deit_tiny_patch16_224",
                   help="timm model of the memory and gradient measurements")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="memory batch (default: 128 on a GPU, 8 on CPU)")  # fmt: skip
    add_dtype_argument(p)
    p.add_argument(
        "--csv", type=Path, default=None,
        help="the CSV to extend (rows in it are skipped) and its .png chart (default: "
        "runs/ablate-<date>-<time>/ablate.csv, a fresh folder that git ignores)",
    )  # fmt: skip
    add_device_argument(p)
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_timm_models(p, args.memory_model)
    resolve_device(args, p)
    return args


def _config(bits, group_size, rounding, layers) -> mesa_lite.Config:
    return mesa_lite.Config(
        bits=bits, group_size=group_size, layers=LAYER_SETS[layers],
        rounding=None if rounding == "default" else rounding,
    )  # fmt: skip


def _key(row: dict) -> tuple:
    return (int(row["bits"]), int(row["group_size"]), row["rounding"], row["layers"])


def _memory(cfg: mesa_lite.Config | None, args, device) -> tuple[str, float]:
    if device.type == "cuda":
        batch = args.batch_size or 128
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, 224, 224, generator=g).to(device)
        y = torch.randint(0, 1000, (batch,), generator=g).to(device)
        ns = argparse.Namespace(img_size=224, warmup=2, steps=3)
        mode = "amp" if cfg is None else "mesa"
        row = gpu_row(args.memory_model, mode, args.dtype, "fused", x, y, ns, config=cfg)
        return "gpu peak MiB", row["peak_mib"]
    batch = args.batch_size or 8
    model = make_model(args.memory_model, "fused", "amp", 224)
    if cfg is not None:
        mesa_lite.wrap(model, cfg)
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    kept = mesa_lite.report.saved_bytes(model, x, autocast=torch_dtype(args.dtype))
    return "cpu kept-for-backward MiB", kept / MIB


def _accuracy(cfg: mesa_lite.Config | None, args, device) -> list[float]:
    data = accuracy.digits_data()
    ns = argparse.Namespace(batch_size=32, lr=3e-3, weight_decay=0.05, epochs=args.epochs,
                            dtype=args.dtype)  # fmt: skip
    accs = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        model = accuracy.digits_model(depth=2).to(device)
        if cfg is not None:
            mesa_lite.wrap(model, cfg)
        torch.manual_seed(seed)
        accs.append(accuracy.train_once(model, data, ns, seed, device)["test_acc"])
    return accs


def _grad_sqnr(cfg: mesa_lite.Config, args, device) -> tuple[float, float]:
    torch.manual_seed(0)
    size = 224 if device.type == "cuda" else 64
    plain = make_model(args.memory_model, "fused", "amp", size).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, size, size, generator=g).to(device)
    y = torch.randint(0, 1000, (8,), generator=g).to(device)
    dtype = torch_dtype(args.dtype)

    _, ref = grad_fidelity._grads(plain, x, y, dtype)
    torch.manual_seed(0)
    _, got = grad_fidelity._grads(mesa_lite.wrap(copy.deepcopy(plain), cfg), x, y, dtype)
    dbs = [grad_fidelity._sqnr(ref[n], got[n]) for n in ref]
    finite = [d for d in dbs if d != float("inf")] or [float("inf")]
    return statistics.median(finite), min(finite)


def pareto(rows: list[dict]) -> None:
    """Marks rows no other row beats on both memory (lower) and accuracy (higher)."""
    for r in rows:
        r["pareto"] = not any(
            o is not r
            and float(o["memory_mib"]) <= float(r["memory_mib"])
            and float(o["acc_mean"]) >= float(r["acc_mean"])
            and (float(o["memory_mib"]), float(o["acc_mean"]))
            != (float(r["memory_mib"]), float(r["acc_mean"]))
            for o in rows
        )


def plot(rows: list[dict], path: Path) -> list[str]:
    """Memory against accuracy, a point per config: marker = bits, colour = group size, filled =
    nearest rounding, hollow = stochastic; the layer set is written beside points that do not
    compress all kinds; the Pareto front is circled and joined. Returns the legend entries
    (only what is drawn)."""
    plt = pyplot()
    from matplotlib.lines import Line2D

    markers = {8: "o", 4: "s", 2: "^"}
    sizes = sorted({int(r["group_size"]) for r in rows})
    colours = {g: f"C{i}" for i, g in enumerate(sizes)}

    def rounding(r) -> str:  # "default": nearest at 8 bits, stochastic below (Config's rule)
        if r["rounding"] != "default":
            return r["rounding"]
        return "nearest" if int(r["bits"]) == 8 else "stochastic"

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        x, y, c = float(r["memory_mib"]), float(r["acc_mean"]), colours[int(r["group_size"])]
        filled = rounding(r) == "nearest"
        ax.scatter(x, y, marker=markers[int(r["bits"])], s=40, edgecolors=c,
                   facecolors=c if filled else "none", linewidths=1.2)  # fmt: skip
        if r["layers"] != "all":
            ax.annotate(r["layers"], (x, y), xytext=(4, 4), textcoords="offset points",
                        fontsize=7)  # fmt: skip
    front = sorted((r for r in rows if r["pareto"] in (True, "True")),
                   key=lambda r: float(r["memory_mib"]))  # fmt: skip
    xs, ys = [float(r["memory_mib"]) for r in front], [float(r["acc_mean"]) for r in front]
    ax.plot(xs, ys, "r--", lw=1)
    ax.scatter(xs, ys, s=160, facecolors="none", edgecolors="tab:red", linewidths=1)
    handles = [Line2D([], [], ls="", marker=markers[b], color="gray", label=f"{b} bits")
               for b in markers if any(int(r["bits"]) == b for r in rows)]  # fmt: skip
    handles += [Line2D([], [], ls="", marker="o", color=colours[g], label=f"group {g}")
                for g in sizes]  # fmt: skip
    roundings = {rounding(r) for r in rows}
    if "nearest" in roundings:  # fill, not shape, tells the rounding
        handles.append(Line2D([], [], ls="", marker="D", color="gray", label="filled: nearest"))
    if "stochastic" in roundings:
        handles.append(Line2D([], [], ls="", marker="D", markerfacecolor="none",
                              markeredgecolor="gray", label="hollow: stochastic"))  # fmt: skip
    if front:
        handles.append(Line2D([], [], ls="--", color="tab:red", marker="o",
                              markerfacecolor="none", label="Pareto front"))  # fmt: skip
    if rows:
        ax.axhline(float(rows[0]["plain_acc_mean"]), color="gray", lw=1)
        ax.axvline(float(rows[0]["plain_mib"]), color="gray", lw=1, ls=":")
        handles.append(Line2D([], [], color="gray", lw=1, label="plain accuracy"))
        handles.append(Line2D([], [], color="gray", lw=1, ls=":", label="plain memory"))
        ax.set_xlabel(rows[0]["memory_kind"])
    ax.set_ylabel("digits test accuracy % (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("mesa_lite: memory against accuracy")
    save_figure(fig, path)
    return [h.get_label() for h in handles]


def write_csv(rows: list[dict], path: Path) -> None:
    """Marks the Pareto front over all rows and writes them."""
    pareto(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def run(argv=None) -> list[dict]:
    """Measures the grid's missing rows; returns all rows (``main`` is the exit status)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    csv_path = args.csv if args.csv is not None else Outputs(None, "ablate").path(".csv")
    rows: list[dict] = []
    if csv_path.exists():
        with csv_path.open() as f:
            rows = list(csv.DictReader(f))
    done = {_key(r) for r in rows}
    grid = [g for g in itertools.product(args.bits, args.group_sizes, args.rounding, args.layers)
            if (g[1] % (8 // g[0]) == 0) and g not in done]  # fmt: skip
    plain_kind, plain_mib = _memory(None, args, device) if grid else ("", 0.0)
    plain_acc = statistics.mean(_accuracy(None, args, device)) if grid else 0.0
    for bits, group_size, rounding, layers in progress(grid, desc="ablation", unit="config"):
        cfg = _config(bits, group_size, rounding, layers)
        kind, mib = _memory(cfg, args, device)
        accs = _accuracy(cfg, args, device)
        med, low = _grad_sqnr(cfg, args, device)
        rows.append({
            "bits": bits, "group_size": group_size, "rounding": rounding, "layers": layers,
            "memory_kind": kind, "memory_mib": mib, "plain_mib": plain_mib,
            "memory_reduction": plain_mib / mib, "acc_mean": statistics.mean(accs),
            "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "plain_acc_mean": plain_acc, "grad_median_db": med, "grad_min_db": low,
            "pareto": False,
        })  # fmt: skip
        write_csv(rows, csv_path)  # rewritten after every row: resumable
    written = []
    if rows:
        write_csv(rows, csv_path)  # the front again: rows may come from several merged sweeps
        written.append(csv_path)
    if rows and not args.no_plot:
        plot(rows, csv_path.with_suffix(".png"))
        written.append(csv_path.with_suffix(".png"))
    print("\nWrote:" + "".join(f"\n  {p}" for p in written) if written else "\nWrote nothing")
    return rows


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
