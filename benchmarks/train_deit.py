r"""Train a timm DeiT with or without mesa_lite, DeiT-style.

With ``--data-path`` it reads an ImageNet-layout folder (``train/`` and ``val/`` of class
folders, torchvision ImageFolder) with DeiT's transforms (RandAugment, random erasing; resize
and center crop for evaluation). Without it, it trains on synthetic data, so the script and
its memory figures can be checked anywhere. AdamW with a linear warm-up and a cosine schedule,
fp16 (with GradScaler) or bf16 autocast or fp32, a tqdm progress bar and DeiT-style log lines
with loss, lr, time and ``max mem`` in MB. A checkpoint is saved after each epoch (into a fresh
runs/ folder unless --output names one); ``--resume`` continues from one (model, optimizer,
scaler, schedule, epoch). For DeiT's full ImageNet recipe (mixup, EMA, repeated augmentation)
use timm's own train.py through ``python -m mesa_lite.timm_train`` (see the README).

    python benchmarks/train_deit.py --model deit_tiny_patch16_224 --mesa --epochs 1
    python benchmarks/train_deit.py --data-path /data/imagenet --mesa --amp-dtype fp16 \
        --batch-size 128 --epochs 300 --output runs/deit_tiny_mesa
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest as the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import mesa_lite

from .common import (
    Outputs,
    add_device_argument,
    add_dtype_argument,
    argument_parser,
    autocast,
    check_timm_models,
    lazy_import,
    nonnegative_int,
    positive_int,
    progress,
    resolve_device,
    torch_dtype,
)

torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--model", default="deit_tiny_patch16_224", help="timm model name")
    p.add_argument(
        "--data-path",
        type=Path,
        default=None,
        help="ImageNet-layout folder (train/ and val/); without it: synthetic data",
    )
    p.add_argument(
        "--mesa", action=argparse.BooleanOptionalAction, default=True,
        help="wrap the model with mesa_lite; --no-mesa for the plain baseline (default: --mesa)",
    )  # fmt: skip
    p.add_argument("--bits", type=int, choices=[8, 4, 2], default=8, help="mesa_lite code width")
    add_dtype_argument(p, aliases=("--amp-dtype",))
    p.add_argument("--epochs", type=positive_int, default=1, help="training epochs")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per step")
    p.add_argument("--lr", type=float, default=5e-4, help="peak lr for batch 512, scaled linearly")
    p.add_argument("--weight-decay", type=float, default=0.05, help="AdamW weight decay")
    p.add_argument("--warmup-epochs", type=float, default=0.0, help="linear warm-up epochs")
    p.add_argument("--min-lr", type=float, default=1e-5, help="lr at the end of the cosine")
    p.add_argument("--img-size", type=positive_int, default=224, help="input resolution")
    p.add_argument(
        "--num-classes",
        type=positive_int,
        default=None,
        help="classifier width (default: the data's classes; 10 for synthetic)",
    )
    p.add_argument(
        "--synthetic-size", type=positive_int, default=256, help="images per synthetic epoch"
    )
    p.add_argument("--workers", type=nonnegative_int, default=4, help="data loader processes")
    p.add_argument(
        "--output", type=Path, default=None,
        help="folder for checkpoint.pth (default: a fresh runs/train_deit-<date>-<time>/)",
    )  # fmt: skip
    p.add_argument("--resume", type=Path, default=None, help="checkpoint to continue from")
    p.add_argument(
        "--max-steps", type=positive_int, default=None, help="stop after this many steps"
    )
    p.add_argument("--log-every", type=positive_int, default=10, help="steps between log lines")
    p.add_argument("--seed", type=int, default=0, help="random seed (weights, data order)")
    add_device_argument(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_timm_models(p, args.model)
    resolve_device(args, p)
    return args


def _posterize(img, bits_to_keep, **_):
    """timm's posterize, with Pillow < 12's result for 0 bits kept (a black image).

    DeiT's RandAugment ("inc1") keeps 4 - int(magnitude / 10 * 4) bits, so 0 bits at magnitude
    10; Pillow 12 and later reject 0 bits with a ValueError instead of zeroing every channel."""
    from PIL import ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)
    return ImageOps.posterize(img, bits_to_keep)


def deit_train_transform(img_size: int):
    """DeiT's training transform (RandAugment m9 mstd0.5, random erasing 0.25), made to run
    on every Pillow release (see ``_posterize``)."""
    from timm.data import create_transform
    from timm.data.auto_augment import RandAugment

    tf = create_transform(
        img_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
        interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1,
    )  # fmt: skip
    for t in tf.transforms:
        if isinstance(t, RandAugment):
            for op in t.ops:
                if op.name.startswith("Posterize"):
                    op.aug_fn = _posterize
    return tf


def build_data(args):
    """(train loader, val loader or None, number of classes)."""
    from torch.utils.data import DataLoader, TensorDataset

    if args.data_path is None:
        g = torch.Generator().manual_seed(args.seed)
        n_cls = args.num_classes or 10
        x = torch.randn(args.synthetic_size, 3, args.img_size, args.img_size, generator=g)
        y = torch.randint(0, n_cls, (args.synthetic_size,), generator=g)
        ds = TensorDataset(x, y)
        train = DataLoader(ds, args.batch_size, shuffle=True, drop_last=True, generator=g)
        return train, DataLoader(ds, args.batch_size), n_cls

    from timm.data import create_transform
    from torchvision.datasets import ImageFolder

    train_tf = deit_train_transform(args.img_size)
    val_tf = create_transform(
        args.img_size, is_training=False, interpolation="bicubic", crop_pct=0.875
    )
    train_ds = ImageFolder(args.data_path / "train", train_tf)
    val_dir = args.data_path / "val"
    val_ds = ImageFolder(val_dir, val_tf) if val_dir.is_dir() else None
    kw = dict(num_workers=args.workers, pin_memory=str(args.device).startswith("cuda"))
    train = DataLoader(train_ds, args.batch_size, shuffle=True, drop_last=True, **kw)
    val = DataLoader(val_ds, args.batch_size, **kw) if val_ds is not None else None
    return train, val, args.num_classes or len(train_ds.classes)


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warm-up, then cosine decay from ``peak`` to ``floor``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, t)))


def evaluate(model, loader, device, dtype) -> float:
    """Top-1 accuracy (%) over ``loader``, in eval mode under no_grad."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device.type, dtype):
                correct += (model(x).argmax(-1) == y).sum().item()
            total += y.numel()
    model.train()
    return 100.0 * correct / max(1, total)


def run(argv=None) -> dict:
    """Trains; returns {"losses", "step", "model", "val_acc", "checkpoint"} (``main`` is the
    command line's exit status)."""
    args = parse_args(argv)
    import timm

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    train, val, n_cls = build_data(args)
    model = timm.create_model(
        args.model, pretrained=False, num_classes=n_cls, img_size=args.img_size
    )
    if args.mesa:
        mesa_lite.wrap(model, mesa_lite.Config(bits=args.bits))
    model.to(device).train()
    dtype = torch_dtype(args.dtype)
    lr = args.lr * args.batch_size / 512
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    steps_per_epoch = len(train)
    total = args.epochs * steps_per_epoch
    warmup = int(args.warmup_epochs * steps_per_epoch)
    start_epoch, step = 0, 0
    if args.resume is not None:
        ckpt = torch.load(args.resume, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        torch.set_rng_state(ckpt["rng"])
        print(f"resumed from {args.resume} at epoch {start_epoch}, step {step}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    history = []
    acc = None
    for epoch in range(start_epoch, args.epochs):
        t_epoch = time.perf_counter()
        bar = progress(train, desc=f"Epoch: [{epoch}]", leave=False, unit="step")
        for i, (x, y) in enumerate(bar):
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, warmup, lr, min(args.min_lr, lr))
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device.type, dtype):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            step += 1
            loss_v = loss.item()
            if not math.isfinite(loss_v) and dtype != torch.float16:
                raise FloatingPointError(f"loss is {loss_v} at step {step}")
            history.append(loss_v)
            mem = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            if i % args.log_every == 0 or i == steps_per_epoch - 1:
                eta = (time.perf_counter() - t_epoch) / (i + 1) * (steps_per_epoch - i - 1)
                print(
                    f"Epoch: [{epoch}]  [{i:>4}/{steps_per_epoch}]  eta: {eta:.0f}s  "
                    f"lr: {opt.param_groups[0]['lr']:.6f}  loss: {loss_v:.4f}  "
                    f"time: {time.perf_counter() - t0:.4f}  "
                    f"max mem: {'-' if mem is None else f'{mem:.0f}'}",
                    flush=True,
                )
            bar.set_postfix(
                loss=f"{loss_v:.3f}", **({} if mem is None else {"mem": f"{mem:.0f}MB"})
            )
            if args.max_steps is not None and step >= args.max_steps:
                break
        acc = evaluate(model, val, device, dtype) if val is not None else None
        print(f"Epoch: [{epoch}] done in {time.perf_counter() - t_epoch:.1f}s; val acc@1: {acc}")
        if args.output is None:  # made at the first save: a failed run leaves no folder
            args.output = Outputs(None, "train_deit").prefix.parent
        args.output.mkdir(parents=True, exist_ok=True)
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch,
            "step": step,
            "rng": torch.get_rng_state(),
            "args": vars(args),
        }
        torch.save(state, args.output / "checkpoint.pth")
        if args.max_steps is not None and step >= args.max_steps:
            break
    checkpoint = args.output / "checkpoint.pth" if args.output is not None else None
    if checkpoint is not None and checkpoint.exists():
        print(f"\nWrote:\n  {checkpoint}")
    return {"losses": history, "step": step, "model": model, "val_acc": acc,
            "checkpoint": checkpoint}  # fmt: skip


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
