"""Gradient fidelity: the same batch through the exact and the compressed model.

For each model and each (bits, rounding) setting: per-parameter gradient SQNR
(20 log10 ||g|| / ||g - g_mesa||) and cosine similarity against the plain model's gradients
under the same autocast, summarised per layer kind and per transformer block, plus a plot of
SQNR by depth. The loss is checked bit-identical (forward is exact). Writes PREFIX.jsonl,
PREFIX.md and PREFIX.png into a fresh runs/ folder unless --out names a prefix.

    python benchmarks/grad_fidelity.py                              # DeiT-Ti/S (and B on a GPU)
    python benchmarks/grad_fidelity.py --models deit_small_patch16_224 --bits 8 --dtype fp16
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

import mesa_lite

from .common import (
    Outputs,
    add_device_argument,
    add_dtype_argument,
    add_out_argument,
    argument_parser,
    autocast,
    check_timm_models,
    environment,
    lazy_import,
    markdown_table,
    positive_int,
    progress,
    pyplot,
    read_jsonl,
    resolve_device,
    save_figure,
    torch_dtype,
    write_jsonl,
)
from .deit_memory import make_model

torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument(
        "--models", nargs="+", default=None, metavar="NAME",
        help="timm model names (default: DeiT-Ti and DeiT-S, and DeiT-B on a GPU)",
    )  # fmt: skip
    p.add_argument("--bits", nargs="+", type=int, choices=[8, 4, 2], default=[8, 4, 2],
                   help="code widths, one setting each")  # fmt: skip
    p.add_argument(
        "--rounding", nargs="+", choices=["nearest", "stochastic"],
        default=["nearest", "stochastic"], help="rounding modes, one setting each",
    )  # fmt: skip
    add_dtype_argument(p)
    p.add_argument("--attention", choices=["fused", "explicit"], default="fused",
                   help="timm attention mode")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="images in the batch (default: 64 on a GPU, 8 on CPU)")  # fmt: skip
    p.add_argument("--img-size", type=positive_int, default=224, help="input resolution")
    add_device_argument(p)
    add_out_argument(p, "grad_fidelity", "PREFIX.jsonl, .md and .png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    p.add_argument(
        "--from-jsonl", nargs="+", type=Path, default=None, metavar="FILE",
        help="measure nothing: summarize and plot the per-parameter rows of earlier runs",
    )  # fmt: skip
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.from_jsonl:
        return args
    check_timm_models(p, args.models or [])
    resolve_device(args, p)
    gpu = torch.device(args.device).type == "cuda"
    if args.models is None:
        args.models = ["deit_tiny_patch16_224", "deit_small_patch16_224"]
        args.models += ["deit_base_patch16_224"] if gpu else []
    if args.batch_size is None:
        args.batch_size = 64 if gpu else 8
    return args


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    err = (ref - x).norm()
    return float("inf") if err == 0 else (20 * torch.log10(ref.norm() / err)).item()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _kind_and_block(model, name: str) -> tuple[str, int | None]:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    m = re.search(r"blocks\.(\d+)\.", name)
    return type(owner).__name__, int(m.group(1)) if m else None


def _grads(model, x, y, dtype):
    model.zero_grad(set_to_none=True)
    with autocast(x.device.type, dtype):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def measure(name: str, args, device) -> list[dict]:
    plain = make_model(name, args.attention, "amp", args.img_size).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g).to(device)
    y = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)
    dtype = torch_dtype(args.dtype)
    loss_ref, g_ref = _grads(plain, x, y, dtype)
    rows = []
    settings = [(b, r) for b in args.bits for r in args.rounding]
    for bits, rounding in progress(settings, desc=name.replace("_patch16_224", ""), leave=False):
        model = mesa_lite.wrap(copy.deepcopy(plain), mesa_lite.Config(bits=bits, rounding=rounding))
        torch.manual_seed(0)
        loss, g_mesa = _grads(model, x, y, dtype)
        for pname, gr in g_ref.items():
            kind, block = _kind_and_block(plain, pname)
            rows.append({
                "model": name, "bits": bits, "rounding": rounding, "param": pname,
                "kind": kind, "block": block, "sqnr_db": _sqnr(gr, g_mesa[pname]),
                "cosine": _cos(gr, g_mesa[pname]),
                "loss_exact": bool(torch.equal(loss, loss_ref)),
            })  # fmt: skip
        del model
    return rows


def summarize(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(per model/bits/rounding and layer kind, per model/bits/rounding and block)."""

    def group(key):
        acc: dict[tuple, list[dict]] = {}
        for r in rows:
            acc.setdefault(key(r), []).append(r)
        return acc

    by_kind, by_block = [], []
    for (model, bits, rounding), rs in group(
        lambda r: (r["model"], r["bits"], r["rounding"])
    ).items():
        finite = [r["sqnr_db"] for r in rs if r["sqnr_db"] != float("inf")]
        by_kind.append({"model": model, "bits": bits, "rounding": rounding, "kind": "all",
                        "median_db": statistics.median(finite), "min_db": min(finite),
                        "min_cos": min(r["cosine"] for r in rs),
                        "loss_exact": all(r["loss_exact"] for r in rs)})  # fmt: skip
        kinds: dict[str, list[dict]] = {}
        for r in rs:
            kinds.setdefault(r["kind"], []).append(r)
        for kind, ks in sorted(kinds.items()):
            vals = [r["sqnr_db"] for r in ks if r["sqnr_db"] != float("inf")] or [float("inf")]
            by_kind.append({
                "model": model, "bits": bits, "rounding": rounding, "kind": kind,
                "median_db": statistics.median(vals), "min_db": min(vals),
                "min_cos": min(r["cosine"] for r in ks), "loss_exact": None,
            })  # fmt: skip
        blocks: dict[int, list[float]] = {}
        for r in rs:
            if r["block"] is not None and r["sqnr_db"] != float("inf"):
                blocks.setdefault(r["block"], []).append(r["sqnr_db"])
        for b, vals in sorted(blocks.items()):
            by_block.append({
                "model": model, "bits": bits, "rounding": rounding, "block": b,
                "median_db": statistics.median(vals), "min_db": min(vals),
            })  # fmt: skip
    return by_kind, by_block


def plot(by_block: list[dict], path: Path) -> None:
    """Median SQNR by block: a colour per model, a marker per width, dashed for stochastic."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(9, 5.5))
    series: dict[tuple, list[dict]] = {}
    for r in by_block:
        series.setdefault((r["model"], r["bits"], r["rounding"]), []).append(r)
    models = sorted({m for m, _, _ in series})
    colours = {m: f"C{i}" for i, m in enumerate(models)}
    markers = {8: "o", 4: "s", 2: "^"}
    for (model, bits, rounding), rs in series.items():
        ax.plot([r["block"] for r in rs], [r["median_db"] for r in rs], color=colours[model],
                marker=markers.get(bits, "x"), ms=3, ls="--" if rounding == "stochastic" else "-",
                label=f"{model.replace('_patch16_224', '')} int{bits} {rounding}")  # fmt: skip
    ax.set_xlabel("block")
    ax.set_ylabel("median parameter-gradient SQNR (dB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    save_figure(fig, path)


def run(argv=None) -> dict:
    """Measures (or reads) and summarizes; returns {"rows", "by_kind", "by_block"}."""
    args = parse_args(argv)
    if args.from_jsonl:
        rows = read_jsonl(args.from_jsonl)
        env = {k: rows[0][k] for k in ("device", "torch", "date")}
        args.dtype, args.attention = rows[0]["dtype"], rows[0]["attention"]
        args.batch_size = rows[0].get("batch_size", args.batch_size)
    else:
        device = torch.device(args.device)
        env = environment()
        rows = []
        for name in progress(args.models, desc="models", unit="model"):
            rows += [
                dict(r, **env, dtype=args.dtype, attention=args.attention,
                     batch_size=args.batch_size)
                for r in measure(name, args, device)
            ]  # fmt: skip
    by_kind, by_block = summarize(rows)
    out = Outputs(args.out, "grad_fidelity")
    write_jsonl(out.path(".jsonl"), rows)
    cols = [("model", "model", "s"), ("bits", "bits", "d"), ("rounding", "rounding", "s"),
            ("kind", "layer kind", "s"), ("median_db", "median SQNR dB", ".1f"),
            ("min_db", "min SQNR dB", ".1f"), ("min_cos", "min cosine", ".4f")]  # fmt: skip
    precision = "fp32 (no autocast)" if args.dtype == "fp32" else f"{args.dtype} autocast"
    head = (
        f"Parameter-gradient fidelity, {args.attention} attention, {precision}, "
        f"batch {args.batch_size}, {env['device']}, torch {env['torch']}, {env['date']}.\n\n"
    )
    text = head + markdown_table(by_kind, cols) + "\n"
    out.path(".md").write_text(text)
    if not args.no_plot:
        plot(by_block, out.path(".png"))
    print(text)
    out.print_paths()
    return {"rows": rows, "by_kind": by_kind, "by_block": by_block}


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
