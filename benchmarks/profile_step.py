"""Where one DeiT training step spends its time: torch.profiler tables, plain AMP vs mesa_lite.

Prints the host time per call of a small op (torch.add against the Triton quantizer), then per
mode the GPU kernel time per step and two profiler tables (by device time, by host time), and
writes the same text to PREFIX.txt (a fresh runs/ folder unless --out names a prefix). GPU only.

  python benchmarks/profile_step.py --model deit_small_patch16_224 --dtype fp16 --attention fused
  python benchmarks/profile_step.py --model gpt2 --dtype bf16 --batch-size 8 --seq 1024

--model takes a timm model or one of benchmarks/llm_memory.py's Hugging Face models (gpt2,
gpt2-medium, llama-1b, bert, ...: random tokens, --seq long, the model's own loss).
"""

from __future__ import annotations

import argparse
import functools
import sys

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

from .common import (
    DTYPE_NAMES,
    Outputs,
    add_out_argument,
    argument_parser,
    check_timm_models,
    host_us_per_call,
    lazy_import,
    positive_int,
    progress,
    require_cuda,
    say,
    torch_dtype,
)
from .deit_memory import _compiled, _train_step, make_model
from .llm_memory import MODELS as LLM_MODELS

torch = lazy_import("torch")
gq = lazy_import("mesa_lite.kernels.group_quant")


def launch_overhead_us() -> dict:
    """Host time per call of a small op: Triton quantize/dequantize against torch.add."""
    x = torch.randn(4096, device="cuda", dtype=torch.float16)
    codes, scales = gq.quantize(x, 128)
    return host_us_per_call({
        "torch.add": lambda: x.add(1),
        "quantize": lambda: gq.quantize(x, 128),
        "dequantize": lambda: gq.dequantize(codes, scales, 128, torch.float16),
    })  # fmt: skip


def kernel_ms(events) -> float:
    """Device time of the kernels alone (an aten op reports its kernels' time as well, so a sum
    over all events counts it twice)."""
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.self_device_time_total for e in events if e.device_type == cuda) / 1e3


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--model", default="deit_small_patch16_224", help="timm model name")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp16",
                   help="autocast dtype (fp32: no autocast)")  # fmt: skip
    p.add_argument("--attention", choices=["fused", "explicit"], default="fused",
                   help="timm attention mode")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=128,
                   help="images (sequences, for a language model) per step")  # fmt: skip
    p.add_argument("--seq", type=positive_int, default=1024,
                   help="tokens per sequence (language models)")  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=["amp", "mesa"], default=["amp", "mesa"],
                   help="amp = plain training, mesa = wrapped with the default Config")  # fmt: skip
    p.add_argument("--rows", type=positive_int, default=18, help="rows of each profiler table")
    p.add_argument("--compile", action="store_true",
                   help="compile each model (timm or Hugging Face), a wrapped one through "
                   "mesa_lite.compile (a fresh graph per mode)")  # fmt: skip
    add_out_argument(p, "profile_step", "PREFIX.txt")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    require_cuda(p)
    if args.model not in LLM_MODELS:
        check_timm_models(p, args.model)
    return args


def _llm_stepper(args, mode: str):
    """A language model of llm_memory.py (``mesa``: wrapped at 8 bits) and its train step."""
    from mesa_lite.breakdown import train_step

    from . import llm_memory as lm
    from .common import autocast

    config = lm.make_config(args.model)
    lm_mode = ("int8" if mode == "mesa" else "plain") + ("-compiled" if args.compile else "")
    model = lm.make_model(args.model, lm_mode, config=config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, labels = lm.make_inputs(config, args.batch_size, args.seq, torch.device("cuda"))

    def step_fn(m):
        with autocast("cuda", args.dtype):
            return m(input_ids=ids, labels=labels).loss

    return lambda: train_step(model, step_fn, opt, set_to_none=False)


def run(argv=None) -> str:
    """Profiles each mode; returns the text it printed and wrote."""
    args = parse_args(argv)
    parts = []

    def emit(text: str) -> None:
        parts.append(text)
        say(text)

    overhead = {k: round(v, 1) for k, v in launch_overhead_us().items()}
    emit(f"host us per call: {overhead}")
    dtype = torch_dtype(args.dtype)
    g = torch.Generator().manual_seed(1)
    if args.model not in LLM_MODELS:
        x = torch.randn(args.batch_size, 3, 224, 224, generator=g).cuda()
        y = torch.randint(0, 1000, (args.batch_size,), generator=g).cuda()
    kernel_time = {}
    for mode in progress(args.modes, desc="modes", unit="mode"):
        if args.model in LLM_MODELS:
            torch._dynamo.reset()
            step = _llm_stepper(args, mode)
        else:
            model = make_model(args.model, args.attention, mode, 224).cuda()
            if args.compile:  # compiled graphs are shared by class: a fresh one per mode
                torch._dynamo.reset()
                model = _compiled(model, True, mode)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
            step = functools.partial(_train_step, model, opt, scaler, x, y, dtype)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        kernel_time[mode] = kernel_ms(prof.events()) / 3
        emit(f"\n== {mode}: GPU kernel time per step {kernel_time[mode]:.1f} ms")
        emit(avg.table(sort_by="self_device_time_total", row_limit=args.rows,
                       max_name_column_width=50))  # fmt: skip
        emit(avg.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                       max_name_column_width=50))  # fmt: skip
        del step
    if len(kernel_time) == 2:
        ratio = kernel_time["mesa"] / kernel_time["amp"]
        emit(f"\nGPU kernel time per step, mesa / amp: {ratio:.2f}x")
    text = "\n".join(parts) + "\n"
    out = Outputs(args.out, "profile_step")
    out.path(".txt").write_text(text)
    out.print_paths()
    return text


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
