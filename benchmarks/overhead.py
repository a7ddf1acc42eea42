"""Host time per wrapped op, forward + backward, against the plain torch module.

Each op kind runs on tensors small enough that the device's own work is negligible (batch 2,
16 tokens, width 64 by default), so the time per iteration is the host's: Python, autograd and
kernel launches. An iteration is forward, ``sum().backward()`` and dropping the gradients, the
same for the plain module and its wrapped copy, under the autocast dtype given. Reported per
kind: microseconds per iteration plain and wrapped (the median of --repeats timings of --iters
iterations each, after warm-up, plain's and wrapped's timings interleaved), their ratio, and
the difference, the host cost mesa_lite adds; the wrapped module in the exact (debug) mode,
the same Functions keeping uncompressed copies, no quantize or dequantize (what the Functions'
structure costs without the compression); on a GPU also the wrapped module with its kept
kernels launched by Triton's own launcher (the launch path before the static one), and for
the kinds with a norm the wrapped module with the norms' one-launch backward switched on
(``ops.layer_norm.FUSED_BACKWARD``, kernels/norm_backward.py), same run.
"attention" is timm's Attention block (its qkv and proj Linears and fused attention),
"rmsnorm" torch.nn.RMSNorm, "matmul" mesa_lite.MatMul on a @ b^T, "block" timm's
vision-transformer Block (two block-level Functions), "block-per-op" the same Block through its
per-op modules (each layer its own Function; what the block-level Functions replace). On a GPU
the loop is synchronized once per timing, so queued work counts as well.

``--profile N`` also writes PREFIX_profile.txt: per kind, the N functions with the most host
time of their own (cProfile's tottime) over one timing's iterations of the wrapped module, with
autograd's backward on the calling thread (on a GPU it otherwise runs on a device thread,
which cProfile does not see). A torch op called from Python counts in its own entry; one called
as an operator (``a @ b``) counts in its caller's.

Writes PREFIX.jsonl and PREFIX.md (a fresh runs/ folder unless --out names a prefix).

    python benchmarks/overhead.py
    python benchmarks/overhead.py --kinds linear gelu --iters 500 --dtype fp32
    python benchmarks/overhead.py --kinds linear block --profile 25
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

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
    environment,
    launcher_switches,
    lazy_import,
    markdown_table,
    positive_int,
    progress,
    resolve_device,
    say,
    sync,
)

torch = lazy_import("torch")

KINDS = [
    "linear",
    "layernorm",
    "rmsnorm",
    "gelu",
    "softmax",
    "matmul",
    "attention",
    "block",
    "block-per-op",
]
NORM_KINDS = ("layernorm", "rmsnorm", "block", "block-per-op")


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS, help="op kinds to time")
    p.add_argument("--batch-size", type=positive_int, default=2, help="sequences")
    p.add_argument("--tokens", type=positive_int, default=16, help="tokens per sequence")
    p.add_argument("--width", type=positive_int, default=64, help="features (4 heads)")
    p.add_argument("--iters", type=positive_int, default=200, help="iterations per timing")
    p.add_argument("--repeats", type=positive_int, default=5, help="timings; the median counts")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also write PREFIX_profile.txt: the N functions with most host time "
                        "per kind (cProfile of the wrapped module; 0: no profile)")  # fmt: skip
    add_dtype_argument(p)
    add_device_argument(p)
    add_out_argument(p, "overhead", "PREFIX.jsonl, PREFIX.md (and PREFIX_profile.txt)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.width % 4:
        p.error(f"--width must be a multiple of 4 (4 heads), got {args.width}")
    resolve_device(args, p)
    return args


def _pair(kind: str, width: int, config=None):
    """(plain module, its wrapped copy, number of inputs) of a kind (wrapped with ``config``;
    None: the default Config)."""
    nn = torch.nn
    if kind == "matmul":  # mesa_lite's own module; with no spec it runs a @ b
        plain = mesa_lite.MatMul()
        plain.mesa_spec = None
        spec = None if config is None else config.spec_for("", "matmul")
        return plain, mesa_lite.MatMul(spec), 2
    if kind == "attention":
        from timm.layers import Attention

        plain = Attention(width, num_heads=4)
    elif kind.startswith("block"):
        from timm.models.vision_transformer import Block

        plain = Block(width, num_heads=4, qkv_bias=True)
        wrapped = mesa_lite.wrap(copy.deepcopy(plain), config)
        if kind == "block-per-op":
            wrapped.unfuse()
        return plain, wrapped, 1
    else:
        make = {"linear": lambda: nn.Linear(width, width), "layernorm": lambda: nn.LayerNorm(width),
                "rmsnorm": lambda: nn.RMSNorm(width), "gelu": nn.GELU,
                "softmax": lambda: nn.Softmax(dim=-1)}  # fmt: skip
        plain = make[kind]()
    return plain, mesa_lite.wrap(copy.deepcopy(plain), config), 1


def _stepper(module, inputs, args, device):
    """One iteration: forward, backward, gradients dropped."""

    def step():
        with autocast(device.type, args.dtype):
            out = module(*inputs)
        out.float().sum().backward()
        for t in inputs:
            t.grad = None
        for q in module.parameters():
            q.grad = None

    return step


def _profile(module, inputs, args, device) -> str:
    """cProfile's top ``args.profile`` entries by own time over ``args.iters`` iterations, per
    iteration in microseconds, backward on the calling thread."""
    step = _stepper(module, inputs, args, device)
    with torch.autograd.set_multithreading_enabled(False):
        step()
        sync(device)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            step()
        sync(device)
        prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.profile]
    lines = [f"{'own us/iter':>11} {'total us/iter':>13} {'calls/iter':>10}  function"]
    for (file, line, name), (_, calls, own, total, _) in rows:
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        lines.append(f"{own / args.iters * 1e6:11.1f} {total / args.iters * 1e6:13.1f} "
                     f"{calls / args.iters:10.1f}  {where}")  # fmt: skip
    return "\n".join(lines)


def _time_us(variants: dict, args, device) -> dict:
    """Median microseconds per iteration (forward, backward, gradients dropped) of each
    ``name: (module, inputs, setup)``, ``setup`` a context manager run around its timings;
    the variants' timings interleaved, ``args.repeats`` each."""
    steps = {name: (_stepper(m, inputs, args, device), setup)
             for name, (m, inputs, setup) in variants.items()}  # fmt: skip
    for step, setup in steps.values():
        with setup():
            for _ in range(max(5, args.iters // 10)):
                step()
    times: dict = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, (step, setup) in steps.items():
            with setup():
                sync(device)
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    step()
                sync(device)
            times[name].append((time.perf_counter() - t0) / args.iters * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(kind: str, args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    plain, wrapped, n_inputs = _pair(kind, args.width)
    torch.manual_seed(0)
    exact = _pair(kind, args.width, mesa_lite.Config(debug_exact=True))[1]
    plain, wrapped, exact = (m.to(device).train() for m in (plain, wrapped, exact))
    g = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.tokens, args.width)
    inputs = [torch.randn(*shape, generator=g).to(device).requires_grad_() for _ in range(n_inputs)]
    if kind == "matmul":  # a @ b^T: (B, N, C) @ (B, C, N)
        inputs[1] = inputs[1].detach().transpose(1, 2).contiguous().requires_grad_()
    variants = {"plain": (plain, inputs, contextlib.nullcontext),
                "wrapped": (wrapped, inputs, contextlib.nullcontext),
                "exact": (exact, inputs, contextlib.nullcontext)}  # fmt: skip
    if device.type == "cuda":
        variants["triton_run"] = (wrapped, inputs, lambda: launcher_switches(static=False))
        if kind in NORM_KINDS:
            from mesa_lite.ops import layer_norm as layer_norm_op

            variants["fused_norm"] = (
                wrapped, inputs, lambda: mock.patch.object(layer_norm_op, "FUSED_BACKWARD", True)
            )  # fmt: skip
    us = _time_us(variants, args, device)
    profile = _profile(wrapped, inputs, args, device) if args.profile else None
    row = {
        "kind": kind,
        "plain_us": us["plain"],
        "wrapped_us": us["wrapped"],
        "ratio": us["wrapped"] / us["plain"],
        "added_us": us["wrapped"] - us["plain"],
        "exact_us": us["exact"],
    }
    if "triton_run" in us:
        row["triton_run_us"] = us["triton_run"]
        row["triton_run_added_us"] = us["triton_run"] - us["plain"]
    if "fused_norm" in us:
        row["fused_norm_us"] = us["fused_norm"]
        row["fused_norm_ratio"] = us["fused_norm"] / us["plain"]
    return profile, row


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    env = environment()
    shape = {"batch": args.batch_size, "tokens": args.tokens, "width": args.width}
    rows, profiles = [], []
    for kind in progress(args.kinds, desc="kinds", unit="kind"):
        profile, row = measure(kind, args)
        row = dict(row, dtype=args.dtype, iters=args.iters, **shape, **env)
        rows.append(row)
        if profile is not None:
            profiles.append(f"## {kind}: wrapped {row['wrapped_us']:.0f} us per iteration, "
                            f"plain {row['plain_us']:.0f}\n\n{profile}\n")  # fmt: skip
        say(f"{kind}: plain {row['plain_us']:.0f} us, wrapped {row['wrapped_us']:.0f} us "
            f"({row['ratio']:.2f}x)")  # fmt: skip
    cols = [("kind", "op", "s"), ("plain_us", "plain us", ".0f"),
            ("wrapped_us", "mesa_lite us", ".0f"), ("ratio", "ratio", ".2f"),
            ("added_us", "added us", ".0f"),
            ("exact_us", "mesa_lite exact us", ".0f")]  # fmt: skip
    if any("triton_run_us" in r for r in rows):  # the launch path before, same run
        cols += [("triton_run_us", "mesa_lite us, Triton's launcher", ".0f"),
                 ("triton_run_added_us", "added us, Triton's launcher", ".0f")]  # fmt: skip
    if any("fused_norm_us" in r for r in rows):  # the norms' one-launch backward, same run
        cols += [("fused_norm_us", "mesa_lite us, fused norm backward", ".0f"),
                 ("fused_norm_ratio", "ratio, fused norm backward", ".2f")]  # fmt: skip
    precision = "fp32 (no autocast)" if args.dtype == "fp32" else f"{args.dtype} autocast"
    head = (
        f"Host time per op, forward + backward, input {args.batch_size}x{args.tokens}x"
        f"{args.width}, {precision}, median of {args.repeats} x {args.iters} iterations, "
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}.\n\n"
    )
    text = head + markdown_table(rows, cols) + "\n"
    outputs = Outputs(args.out, "overhead")
    if profiles:
        outputs.path("_profile.txt").write_text(
            f"Host profile per iteration (cProfile, backward on the calling thread), "
            f"{head.strip()}\n\n" + "\n".join(profiles)
        )
    outputs.write_report(rows, text)
    return rows


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
