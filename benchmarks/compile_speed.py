"""Step time and activation memory of eager and compiled training, plain and mesa_lite, in
one process, as the median of interleaved passes.

Rows (each a full AdamW step under autocast, one model per row, all alive at once):
  plain / mesa eager                  the model as built, and wrapped (default Config);
  plain compiled                      torch.compile(model);
  mesa compiled, custom_op            quantize/dequantize as opaque custom ops (Triton);
  mesa compiled, decomposed           quantize/dequantize as PyTorch ops Inductor can fuse
                                      (``mesa_lite.quant.COMPILE_FORM``).

Each pass runs ``--steps`` steps of every row in turn; a row's step time is the median over
all its steps of all passes, and its ratio is against the plain row of the same mode (eager or
compiled). Activation memory: the row's peak over its steps minus what was allocated before
them (all models' parameters, gradients and optimizer state are alive throughout, so this is
the row's own activations and temporaries). Needs a GPU.

    python benchmarks/compile_speed.py --models deit_base_patch16_224 --out results/compile_b
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest as the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from .common import (
    Outputs,
    StepTimer,
    add_out_argument,
    argument_parser,
    environment,
    lazy_import,
    markdown_table,
    positive_int,
    torch_dtype,
)

torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")
quant = lazy_import("mesa_lite.quant")

MIB = 2**20
ROWS = (
    ("plain", "amp", False, None),
    ("mesa int8", "mesa", False, None),
    ("plain compiled", "amp", True, None),
    ("mesa int8 compiled, custom_op", "mesa", True, "custom_op"),
    ("mesa int8 compiled, decomposed", "mesa", True, "decomposed"),
)


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--models", nargs="+", default=["deit_small_patch16_224"],
                   help="timm model names")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=128, help="images per step")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16", help="autocast dtype")
    p.add_argument("--steps", type=positive_int, default=10, help="steps of each row per pass")
    p.add_argument("--passes", type=positive_int, default=3, help="interleaved passes")
    p.add_argument("--warmup", type=positive_int, default=3,
                   help="steps of each row before the passes (compiles there)")  # fmt: skip
    add_out_argument(p, "compile_speed", "PREFIX.jsonl and PREFIX.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    return args


class _Row:
    def __init__(self, name, mode, compiled, form, model_name, dtype):
        self.name, self.form, self.dtype = name, form, dtype
        from .deit_memory import make_model

        model = make_model(model_name, "fused", mode, 224).cuda()
        self.model = torch.compile(model) if compiled else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
        self.scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        self.times: list[float] = []
        self.activation: list[float] = []

    def step(self, x, y):
        if self.form is not None:  # read while tracing; guarded, so set it for every call
            quant.COMPILE_FORM = self.form
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=self.dtype):
            loss = F.cross_entropy(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()


def run_model(name: str, args) -> list[dict]:
    dtype = torch_dtype(args.dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, 224, 224, generator=g).cuda()
    y = torch.randint(0, 1000, (args.batch_size,), generator=g).cuda()
    rows = [_Row(*r, name, dtype) for r in ROWS]
    for r in rows:  # compiles here
        for _ in range(args.warmup):
            r.step(x, y)
    torch.cuda.synchronize()
    for _ in range(args.passes):
        for r in rows:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            timer = StepTimer(x.device)
            for _ in range(args.steps):
                with timer:
                    r.step(x, y)
            r.times.extend(timer.times_ms)
            r.activation.append((torch.cuda.max_memory_allocated() - before) / MIB)
    env = environment()
    out = []
    for r in rows:
        out.append({"model": name, "row": r.name, "dtype": args.dtype,
                    "batch": args.batch_size, "step_ms": statistics.median(r.times),
                    "activation_mib": max(r.activation), **env})  # fmt: skip
    for r in out:
        base = out[2] if "compiled" in r["row"] else out[0]
        r["step_ratio"] = r["step_ms"] / base["step_ms"]
        r["activation_reduction"] = base["activation_mib"] / r["activation_mib"]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for name in args.models:
        rows.extend(run_model(name, args))
        torch.cuda.empty_cache()
    e = rows[0]
    head = (
        f"Eager and compiled training, {args.dtype} autocast, batch {args.batch_size}, "
        f"median of {args.passes} interleaved passes x {args.steps} steps, {e['device']}, "
        f"torch {e['torch']}, triton {e['triton']}, timm {e['timm']}, {e['date']}.\n\n"
    )
    cols = [("model", "model", ""), ("row", "row", ""), ("step_ms", "step ms", ".1f"),
            ("step_ratio", "step / plain (same mode)", ".2f"),
            ("activation_mib", "activations MiB", ".0f"),
            ("activation_reduction", "activation reduction", ".2f")]  # fmt: skip
    Outputs(args.out, "compile_speed").write_report(rows, head + markdown_table(rows, cols) + "\n")


if __name__ == "__main__":
    main()
