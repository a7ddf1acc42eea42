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

Distributed: under ``torchrun --nproc_per_node=N`` with ``--dist ddp`` (DistributedDataParallel)
or ``--dist fsdp`` (FSDP2: ``fully_shard`` per block and at the root, a ``MixedPrecisionPolicy``
with the --dtype's parameters and fp32 gradient reduction; bf16 or fp32). --batch-size is per
process; the data is split by a DistributedSampler; mesa_lite wraps the model before DDP or
FSDP2 is applied (``wrap`` after DDP works too). Every log line gives each rank's ``max mem``;
the checkpoint is rank 0's ``checkpoint.pth`` under DDP and a ``torch.distributed.checkpoint``
folder (``checkpoint/``, written and read by all ranks) under FSDP2. NCCL on CUDA, gloo on CPU.

    python benchmarks/train_deit.py --model deit_tiny_patch16_224 --mesa --epochs 1
    python benchmarks/train_deit.py --data-path /data/imagenet --mesa --amp-dtype fp16 \
        --batch-size 128 --epochs 300 --output runs/deit_tiny_mesa
    torchrun --nproc_per_node=2 benchmarks/train_deit.py --model deit_base_patch16_224 \
        --dist fsdp --dtype bf16 --batch-size 128 --max-steps 50
"""

from __future__ import annotations

import argparse
import math
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
    p.add_argument(
        "--cuda-graph", action="store_true",
        help="replay each training forward and backward as CUDA graphs (mesa_lite.graphed; "
        "one GPU, every batch the same shape: the loader drops the last partial one)",
    )  # fmt: skip
    p.add_argument(
        "--dist", choices=["none", "ddp", "fsdp"], default="none",
        help="data parallel under torchrun: DistributedDataParallel or FSDP2 (fully_shard)",
    )  # fmt: skip
    add_device_argument(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_timm_models(p, args.model)
    resolve_device(args, p)
    if args.cuda_graph and (args.dist != "none" or not str(args.device).startswith("cuda")):
        p.error("--cuda-graph runs on one GPU (no --dist, --device cuda)")
    if args.dist != "none":
        import os

        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            p.error(f"--dist {args.dist} runs under torchrun (RANK and WORLD_SIZE are not set)")
        if args.dist == "fsdp" and args.dtype == "fp16":
            p.error("--dist fsdp takes --dtype bf16 or fp32 (fp16 needs a sharded GradScaler)")
    return args


class Dist:
    """The process group of a --dist run (rank 0 of 1 otherwise)."""

    def __init__(self, args) -> None:
        import os

        self.kind = args.dist
        self.rank, self.world = 0, 1
        if self.kind == "none":
            return
        import torch.distributed as dist

        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        if str(args.device).startswith("cuda"):
            torch.cuda.set_device(local)
            args.device = f"cuda:{local}"
        backend = "nccl" if str(args.device).startswith("cuda") else "gloo"
        # a caller that set up the group (a test's workers) keeps it
        self.owner = not dist.is_initialized()
        if self.owner:
            dist.init_process_group(backend)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def gather(self, value: float) -> list[float]:
        """``value`` of every rank (one all_gather), or ``[value]``."""
        if self.kind == "none":
            return [value]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def parallel(self, model, dtype):
        """``model`` in DDP or FSDP2 (after mesa_lite wrapped it)."""
        if self.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            dev = next(model.parameters()).device
            return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        if self.kind == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        return model

    def close(self) -> None:
        if self.kind != "none" and self.owner:
            import torch.distributed as dist

            dist.destroy_process_group()


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
        if args.dist != "none":
            return _sharded(ds, ds, args, n_cls)
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
    if args.dist != "none":
        return _sharded(train_ds, val_ds, args, args.num_classes or len(train_ds.classes))
    kw = dict(num_workers=args.workers, pin_memory=str(args.device).startswith("cuda"))
    train = DataLoader(train_ds, args.batch_size, shuffle=True, drop_last=True, **kw)
    val = DataLoader(val_ds, args.batch_size, **kw) if val_ds is not None else None
    return train, val, args.num_classes or len(train_ds.classes)


def _sharded(train_ds, val_ds, args, n_cls):
    """Loaders over this rank's share of the data (DistributedSampler; the train one reshuffles
    per epoch through ``set_epoch``)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    kw = dict(num_workers=args.workers, pin_memory=str(args.device).startswith("cuda"))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train = DataLoader(train_ds, args.batch_size, sampler=sampler, drop_last=True, **kw)
    val = None
    if val_ds is not None:
        vs = DistributedSampler(val_ds, shuffle=False)
        val = DataLoader(val_ds, args.batch_size, sampler=vs, **kw)
    return train, val, n_cls


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warm-up, then cosine decay from ``peak`` to ``floor``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, t)))


def evaluate(model, loader, device, dtype, dist=None) -> float:
    """Top-1 accuracy (%) over ``loader`` (every rank's share, under --dist), in eval mode
    under no_grad."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device.type, dtype):
                correct += (model(x).argmax(-1) == y).sum().item()
            total += y.numel()
    model.train()
    if dist is not None and dist.kind != "none":
        correct, total = sum(dist.gather(correct)), sum(dist.gather(total))
    return 100.0 * correct / max(1, total)


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def run(argv=None) -> dict:
    """Trains; returns {"losses", "step", "model", "val_acc", "checkpoint"} (``main`` is the
    command line's exit status)."""
    args = parse_args(argv)
    import timm

    dist = Dist(args)
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
    model = dist.parallel(model, dtype)
    lr = args.lr * args.batch_size / 512
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    steps_per_epoch = len(train)
    total = args.epochs * steps_per_epoch
    warmup = int(args.warmup_epochs * steps_per_epoch)
    start_epoch, step = 0, 0
    if args.resume is not None and dist.kind == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _dcp_state(model, opt)
        dcp.load(state, checkpoint_id=str(args.resume))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
        meta = torch.load(Path(args.resume) / "meta.pth", weights_only=False)
        start_epoch, step = meta["epoch"] + 1, meta["step"]
        torch.set_rng_state(meta["rng"])
        if dist.main:
            print(f"resumed from {args.resume} at epoch {start_epoch}, step {step}")
    elif args.resume is not None:
        ckpt = torch.load(args.resume, map_location=device, weights_only=False)
        getattr(model, "module", model).load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        torch.set_rng_state(ckpt["rng"])
        if dist.main:
            print(f"resumed from {args.resume} at epoch {start_epoch}, step {step}")
    if args.cuda_graph:  # captured on a synthetic batch of the loader's shape (its own RNG)
        g = torch.Generator().manual_seed(args.seed)
        sample = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g)
        model = mesa_lite.graphed(model, (sample.to(device),), autocast=dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    history = []
    acc = None
    for epoch in range(start_epoch, args.epochs):
        t_epoch = time.perf_counter()
        if dist.kind != "none":
            train.sampler.set_epoch(epoch)
        bar = progress(train, desc=f"Epoch: [{epoch}]", leave=False, unit="step",
                       disable=None if dist.main else True)  # fmt: skip
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
                mems = dist.gather(mem)  # every rank's, as DeiT's log gives its own
                text = "/".join("-" if m is None else f"{m:.0f}" for m in mems)
                if dist.main:
                    print(
                        f"Epoch: [{epoch}]  [{i:>4}/{steps_per_epoch}]  eta: {eta:.0f}s  "
                        f"lr: {opt.param_groups[0]['lr']:.6f}  loss: {loss_v:.4f}  "
                        f"time: {time.perf_counter() - t0:.4f}  "
                        f"max mem: {text}",
                        flush=True,
                    )
            bar.set_postfix(
                loss=f"{loss_v:.3f}", **({} if mem is None else {"mem": f"{mem:.0f}MB"})
            )
            if args.max_steps is not None and step >= args.max_steps:
                break
        acc = evaluate(model, val, device, dtype, dist) if val is not None else None
        if dist.main:
            took = time.perf_counter() - t_epoch
            print(f"Epoch: [{epoch}] done in {took:.1f}s; val acc@1: {acc}")
        checkpoint = _save(args, dist, model, opt, scaler, epoch, step)
        if args.max_steps is not None and step >= args.max_steps:
            break
    checkpoint = None if args.output is None else _checkpoint_path(args, dist)
    if checkpoint is not None and checkpoint.exists() and dist.main:
        print(f"\nWrote:\n  {checkpoint}")
    dist.close()
    return {"losses": history, "step": step, "model": model, "val_acc": acc,
            "checkpoint": checkpoint}  # fmt: skip


def _checkpoint_path(args, dist) -> Path:
    return args.output / ("checkpoint" if dist.kind == "fsdp" else "checkpoint.pth")


def _save(args, dist, model, opt, scaler, epoch: int, step: int) -> Path:
    """The epoch's checkpoint: rank 0's ``checkpoint.pth`` (one process or DDP), or under
    FSDP2 a ``torch.distributed.checkpoint`` folder that every rank writes its shards to, with
    the schedule's position in ``meta.pth``."""
    if args.output is None:  # made at the first save: a failed run leaves no folder
        out = Outputs(None, "train_deit").prefix.parent if dist.main else None
        args.output = Path(dist.gather(None if out is None else str(out))[0])
    path = _checkpoint_path(args, dist)
    meta = {"epoch": epoch, "step": step, "rng": torch.get_rng_state(), "args": vars(args)}
    if dist.kind == "fsdp":
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_state(model, opt), checkpoint_id=str(path))
        if dist.main:
            torch.save(meta, path / "meta.pth")
        dist.gather(0)  # every rank waits for meta.pth
        return path
    if dist.main:
        args.output.mkdir(parents=True, exist_ok=True)
        state = {
            "model": getattr(model, "module", model).state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(),
            **meta,
        }
        torch.save(state, path)
    dist.gather(0)
    return path


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
