"""Where one DeiT training step spends its time: torch.profiler tables, plain AMP vs mesa_lite.

python benchmarks/profile_step.py --model deit_small_patch16_224 --dtype fp16 --attention fused
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: import the rest as the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from mesa_lite.kernels import group_quant as gq

from .deit_memory import DTYPES, _train_step, make_model


def launch_overhead_us(reps: int = 2000) -> dict:
    """Host time per call of a small op: Triton quantize/dequantize against torch.add."""
    x = torch.randn(4096, device="cuda", dtype=torch.float16)
    codes, scales = gq.quantize(x, 128)
    out = {}
    for name, fn in {
        "torch.add": lambda: x.add(1),
        "quantize": lambda: gq.quantize(x, 128),
        "dequantize": lambda: gq.dequantize(codes, scales, 128, torch.float16),
    }.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t) / reps * 1e6
    return out


def kernel_ms(events) -> float:
    """Device time of the kernels alone (an aten op reports its kernels' time as well, so a sum
    over all events counts it twice)."""
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.self_device_time_total for e in events if e.device_type == cuda) / 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    p.add_argument("--attention", choices=["fused", "explicit"], default="fused")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=["amp", "mesa"])
    p.add_argument("--rows", type=int, default=18, help="rows of each profiler table")
    args = p.parse_args(argv)
    print("host us per call:", {k: round(v, 1) for k, v in launch_overhead_us().items()})
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, 3, 224, 224, generator=g).cuda()
    y = torch.randint(0, 1000, (args.batch_size,), generator=g).cuda()
    for mode in args.modes:
        model = make_model(args.model, args.attention, mode, 224).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        for _ in range(3):
            _train_step(model, opt, scaler, x, y, dtype)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                _train_step(model, opt, scaler, x, y, dtype)
            torch.cuda.synchronize()
        avg = prof.key_averages()
        print(f"\n== {mode}: GPU kernel time per step {kernel_ms(prof.events()) / 3:.1f} ms")
        print(
            avg.table(
                sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=50
            )
        )
        print(
            avg.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=50)
        )
        del model, opt


if __name__ == "__main__":
    main(sys.argv[1:])
