r"""Accuracy with and without mesa_lite: paired training runs on real data.

Default: scikit-learn's bundled handwritten digits (1,797 real 8x8 images, no download), a fixed
stratified 80/20 train/test split, a small timm VisionTransformer sized for 8x8 inputs, AdamW
with a cosine schedule, autocast (fp16 with GradScaler on a GPU; on a CPU bf16 where it has
native bf16, else fp32). For every seed,
plain AMP and each mesa_lite width start from the same initial weights and see the same batches
in the same order (a dedicated generator), so differences come from the compression alone.

With ``--data-path`` (an ImageNet-layout folder, ``train/`` and ``val/``) and ``--model``, the
same comparison runs on a user's data with a timm model, for a Mesa-style ImageNet study.

Writes one JSON line per run and a markdown table of mean and spread per configuration (into a
fresh runs/ folder unless --out names a prefix):

    python benchmarks/accuracy.py                        # digits, plain + 8/4/2 bits, 5 seeds
    python benchmarks/accuracy.py --bits 8 --seeds 0 1 2 --epochs 20
    python benchmarks/accuracy.py --data-path /data/imagenet --model deit_tiny_patch16_224 \
        --epochs 300 --batch-size 256 --seeds 0
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
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
    nonnegative_int,
    positive_int,
    progress,
    read_jsonl,
    resolve_device,
    say,
    torch_dtype,
    write_jsonl,
)

torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--data-path", type=Path, default=None,
                   help="ImageNet-layout folder (train/ and val/); without it: digits")  # fmt: skip
    p.add_argument("--model", default=None, help="timm model name (needed with --data-path)")
    p.add_argument(
        "--img-size", type=positive_int, default=224, help="with --data-path: input size"
    )
    p.add_argument(
        "--workers", type=nonnegative_int, default=4, help="with --data-path: loader workers"
    )
    p.add_argument(
        "--bits", nargs="*", type=int, choices=[8, 4, 2], default=[8, 4, 2],
        help="mesa_lite widths to compare with plain training, one run each per seed",
    )  # fmt: skip
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[0, 1, 2, 3, 4],
        help="paired seeds: each gives every config the same init and batches",
    )
    p.add_argument("--epochs", type=positive_int, default=30, help="training epochs per run")
    p.add_argument("--arch", choices=["vit", "cnn"], default="vit",
                   help="digits model: a small ViT, or a small CNN (Conv-BatchNorm-ReLU, "
                        "max-pooling; its mesa runs add mesa_lite.OPT_IN_KINDS)")  # fmt: skip
    p.add_argument("--depth", type=positive_int, default=4, help="digits ViT: blocks")
    p.add_argument("--embed-dim", type=positive_int, default=64, help="digits ViT: width (4 heads)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.05, help="AdamW weight decay")
    add_dtype_argument(p, aliases=("--amp-dtype",))
    add_device_argument(p)
    p.add_argument(
        "--config",
        default=None,
        help="extra mesa_lite.Config fields for the mesa runs: key=value,...",
    )
    add_out_argument(p, "accuracy", "PREFIX.jsonl and PREFIX.md")
    p.add_argument(
        "--control",
        action="store_true",
        help="add 'plain perturbed': plain training from the initial weights times "
        "(1 + 1e-6 N(0, 1)), the noise floor of a paired difference on this task",
    )
    p.add_argument(
        "--from-jsonl", nargs="+", type=Path, default=None, metavar="FILE",
        help="train nothing: summarize the runs in these JSON-lines files (e.g. seeds run in "
        "parallel processes) into --out",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no line per run, no progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.from_jsonl:
        return args
    if args.model is not None and args.data_path is None:
        p.error("--model is for --data-path runs; the digits study uses its own ViT (--depth, "
                "--embed-dim)")  # fmt: skip
    if args.data_path is not None:
        if args.model is None:
            p.error("--data-path needs --model (a timm model name)")
        check_timm_models(p, args.model)
    try:
        extra = parse_config(args.config)
        if "bits" in extra:
            raise ValueError("bits is set by --bits")
        for bits in args.bits:
            mesa_lite.Config(bits=bits, **extra)
    except (TypeError, ValueError) as e:
        p.error(f"--config {args.config!r}: {e}")
    resolve_device(args, p)
    return args


def digits_data():
    """(x_train, y_train, x_test, y_test): 8x8 images scaled to [0, 1], stratified 80/20."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        range(len(y)), test_size=0.2, stratify=d.target, random_state=0
    )
    mean, std = x[idx_train].mean(), x[idx_train].std()
    x = (x - mean) / std
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def digits_model(depth: int = 4, embed_dim: int = 64):
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=embed_dim, depth=depth,
        num_heads=4, mlp_ratio=2.0, class_token=True, global_pool="token",
    )  # fmt: skip


def digits_cnn(width: int = 32):
    """A small CNN for 8x8 digits: three Conv-BatchNorm-ReLU stages (a max-pool after the
    first), global average pooling and a Linear head."""
    nn = torch.nn

    def stage(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True)]  # fmt: skip

    return nn.Sequential(
        *stage(1, width), nn.MaxPool2d(2), *stage(width, 2 * width), *stage(2 * width, 2 * width),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10),
    )  # fmt: skip


def parse_config(text: str | None) -> dict:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        if "=" not in item:
            raise ValueError(f"{item!r} is not key=value")
        key, value = item.split("=", 1)
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def train_once(model, data, args, seed: int, device) -> dict:
    """Trains ``model`` in place; returns final test accuracy (%) and the last train loss."""
    x_tr, y_tr, x_te, y_te = (t.to(device) for t in data)
    dtype = torch_dtype(args.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    order = torch.Generator().manual_seed(10_000 + seed)  # same batches for every config
    steps_per_epoch = math.ceil(len(y_tr) / args.batch_size)
    total = args.epochs * steps_per_epoch
    step, loss = 0, torch.tensor(float("nan"))
    model.train()
    for _ in range(args.epochs):
        perm = torch.randperm(len(y_tr), generator=order).to(device)
        for i in range(0, len(y_tr), args.batch_size):
            b = perm[i : i + args.batch_size]
            for g in opt.param_groups:
                g["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / total))
            with autocast(device.type, dtype):
                loss = F.cross_entropy(model(x_tr[b]), y_tr[b])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            step += 1
    model.eval()
    with torch.no_grad(), autocast(device.type, dtype):
        pred = model(x_te).argmax(-1)
    return {"test_acc": 100.0 * (pred == y_te).float().mean().item(), "train_loss": loss.item()}


def run_digits(args) -> list[dict]:
    device = torch.device(args.device)
    data = digits_data()
    env = environment()
    extra = parse_config(args.config)
    suffix = "".join(f" {k}={v}" for k, v in extra.items())  # e.g. " checkpoint=blocks"
    configs = [("plain", None)] + [(f"mesa int{b}{suffix}", b) for b in args.bits]
    if args.control:
        configs.append(("plain perturbed", "perturb"))
    rows = []
    bar = progress(total=len(args.seeds) * len(configs), desc="runs", unit="run",
                   disable=True if args.quiet else None)  # fmt: skip
    for seed in args.seeds:
        torch.manual_seed(seed)
        # every config starts from these weights
        init = digits_cnn() if args.arch == "cnn" else digits_model(args.depth, args.embed_dim)
        for label, bits in configs:
            bar.set_postfix_str(f"seed {seed} {label}")
            model = copy.deepcopy(init).to(device)
            if bits == "perturb":
                g = torch.Generator().manual_seed(20_000 + seed)
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=g).to(p.device))
            elif bits is not None:
                kinds = {"layers": mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS}
                kinds = kinds if args.arch == "cnn" and "layers" not in extra else {}
                mesa_lite.wrap(model, mesa_lite.Config(bits=bits, **kinds, **extra))
            torch.manual_seed(seed)  # stochastic rounding draws, reproducible per run
            t0 = time.perf_counter()
            res = train_once(model, data, args, seed, device)
            width = bits if isinstance(bits, int) else None
            row = {"dataset": "digits", "arch": args.arch, "config": label, "bits": width,
                   "seed": seed,
                   "epochs": args.epochs, "amp": args.dtype, "extra_config": extra,
                   "depth": args.depth, "embed_dim": args.embed_dim, "lr": args.lr,
                   "batch_size": args.batch_size, "seconds": time.perf_counter() - t0, **res,
                   **env}  # fmt: skip
            rows.append(row)
            bar.update()
            if not args.quiet:
                msg = f"seed {seed} {label:10s} test acc {res['test_acc']:.2f}%  "
                msg += f"train loss {res['train_loss']:.4f}  {row['seconds']:.1f}s"
                say(msg)
    bar.close()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean, spread and the paired difference to plain, per configuration; ``diff_ci95`` is
    1.96 standard errors of the mean paired difference (normal approximation)."""
    by_cfg: dict[str, dict[int, float]] = {}
    for r in rows:
        by_cfg.setdefault(r["config"], {})[r["seed"]] = r["test_acc"]
    plain = by_cfg.get("plain", {})
    out = []
    for cfg, accs in by_cfg.items():
        vals = list(accs.values())
        diffs = [accs[s] - plain[s] for s in accs if s in plain]
        out.append({
            "config": cfg, "runs": len(vals), "mean_acc": statistics.mean(vals),
            "std_acc": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min_acc": min(vals), "max_acc": max(vals),
            "mean_diff_vs_plain": statistics.mean(diffs) if diffs else None,
            "diff_ci95": 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs))
            if len(diffs) > 1 else None,
            "worst_diff_vs_plain": min(diffs) if diffs else None,
        })  # fmt: skip
    return out


def run(argv=None) -> dict:
    """Trains and summarizes; returns {"rows", "summary"} (``main`` is the exit status)."""
    args = parse_args(argv)
    if args.data_path is not None:
        return run_imagenet(args)
    if args.from_jsonl:
        rows = read_jsonl(args.from_jsonl)
        for key in ("depth", "embed_dim", "lr", "batch_size", "epochs"):
            setattr(args, key, rows[0].get(key, "?"))
        args.arch = rows[0].get("arch", "vit")
        args.dtype = rows[0]["amp"]
        args.seeds = sorted({r["seed"] for r in rows})
    else:
        rows = run_digits(args)
    summary = summarize(rows)
    out = Outputs(args.out, "accuracy")
    write_jsonl(out.path(".jsonl"), rows)
    env = rows[0]
    precision = "fp32 (no autocast)" if args.dtype == "fp32" else f"{args.dtype} autocast"
    model = (
        "a small CNN (3 Conv-BatchNorm-ReLU stages, opt-in kinds on)"
        if args.arch == "cnn"
        else f"ViT {args.depth}x{args.embed_dim}"
    )
    head = (
        f"Test accuracy on scikit-learn digits (360 test images), {model}, {args.epochs} "
        f"epochs, lr {args.lr}, batch {args.batch_size}, "
        f"{precision}, {len(args.seeds)} seed{'s' if len(args.seeds) > 1 else ''} "
        f"{_seed_text(args.seeds)} (paired: "
        f"same init and batch order), {env['device']}, torch {env['torch']}, "
        f"timm {env['timm']}, {env['date']}.\n\n"
    )
    cols = [("config", "config", "s"), ("runs", "runs", "d"), ("mean_acc", "mean acc %", ".2f"),
            ("std_acc", "std", ".2f"), ("min_acc", "min", ".2f"), ("max_acc", "max", ".2f"),
            ("mean_diff_vs_plain", "mean diff vs plain (points)", "+.2f"),
            ("diff_ci95", "+- 1.96 s.e.", ".2f"),
            ("worst_diff_vs_plain", "worst paired diff", "+.2f")]  # fmt: skip
    text = head + markdown_table(summary, cols) + "\n"
    out.path(".md").write_text(text)
    print()
    print(text)
    out.print_paths()
    return {"rows": rows, "summary": summary}


def main(argv=None) -> int:
    run(argv)
    return 0


def _seed_text(seeds: list[int]) -> str:
    if len(seeds) == 1:
        return str(seeds[0])
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return str(seeds)


def run_imagenet(args) -> dict:
    """The same paired comparison on an ImageNet-layout folder through train_deit.py; each
    run's checkpoint goes into its own folder beside the JSON lines."""
    try:
        from . import train_deit
    except ImportError:
        import train_deit

    if args.model is None:
        raise SystemExit("--data-path needs --model (a timm model name)")
    out = Outputs(args.out, "accuracy")
    results = []
    for seed in args.seeds:
        for bits in [None, *args.bits]:
            label = "plain" if bits is None else f"mesa int{bits}"
            folder = out.prefix.parent / f"{out.prefix.name}-seed{seed}-{label.replace(' ', '-')}"
            argv = ["--model", args.model, "--data-path", str(args.data_path), "--epochs",
                    str(args.epochs), "--batch-size", str(args.batch_size), "--seed", str(seed),
                    "--dtype", args.dtype, "--device", args.device, "--img-size",
                    str(args.img_size), "--workers", str(args.workers),
                    "--output", str(folder)]  # fmt: skip
            argv += ["--no-mesa"] if bits is None else ["--mesa", "--bits", str(bits)]
            res = train_deit.run(argv)
            results.append({"dataset": str(args.data_path), "model": args.model, "seed": seed,
                            "config": label, "bits": bits, "val_acc": res["val_acc"]})  # fmt: skip
            say(str(results[-1]))
    write_jsonl(out.path(".jsonl"), results)
    out.print_paths()
    return {"rows": results}


if __name__ == "__main__":
    sys.exit(main())
