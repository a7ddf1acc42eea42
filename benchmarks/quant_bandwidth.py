"""Quantize/dequantize kernels against the device's copy bandwidth (GPU only).

Bytes counted: quantize reads the input and writes int8 codes + fp32 scales; dequantize reads
codes + scales and writes the output; copy reads and writes the input's dtype. Writes
PREFIX.jsonl and PREFIX.md (a fresh runs/ folder unless --out names a prefix).

    python benchmarks/quant_bandwidth.py --out benchmarks/results/quant_bandwidth_gpu
"""

from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

from .common import (
    Outputs,
    add_out_argument,
    argument_parser,
    cuda_median_ms,
    environment,
    lazy_import,
    markdown_table,
    positive_int,
    progress,
    require_cuda,
)

torch = lazy_import("torch")
gq = lazy_import("mesa_lite.kernels.group_quant")


def _measure(n: int, g: int, dtype: torch.dtype) -> dict:
    x = torch.randn(n, device="cuda", dtype=dtype)
    codes, scales = gq.quantize(x, g)
    el = x.element_size()
    copy_ms = cuda_median_ms(lambda: x.clone())
    q_ms = cuda_median_ms(lambda: gq.quantize(x, g))
    d_ms = cuda_median_ms(lambda: gq.dequantize(codes, scales, g, dtype))
    moved = n * el + n + scales.numel() * 4
    row = {
        "elements": n,
        "group_size": g,
        "copy_gbs": 2 * n * el / copy_ms / 1e6,
        "quantize_gbs": moved / q_ms / 1e6,
        "dequantize_gbs": moved / d_ms / 1e6,
        "quantize_ms": q_ms,
        "dequantize_ms": d_ms,
    }
    row["quantize_vs_copy"] = row["quantize_gbs"] / row["copy_gbs"]
    row["dequantize_vs_copy"] = row["dequantize_gbs"] / row["copy_gbs"]
    return row


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--sizes", nargs="+", type=lambda s: int(float(s)),
                   default=[19_400_000, 77_500_000, 310_000_000],
                   help="elements per tensor, one row each")  # fmt: skip
    p.add_argument("--group-size", type=positive_int, default=128, help="elements per scale")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16",
                   help="input dtype")  # fmt: skip
    add_out_argument(p, "quant_bandwidth", "PREFIX.jsonl and PREFIX.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    require_cuda(p)
    return args


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    env = environment()
    rows = [dict(_measure(n, args.group_size, dtype), dtype=args.dtype, **env)
            for n in progress(list(map(int, args.sizes)), desc="sizes")]  # fmt: skip
    cols = [("elements", "elements", ","), ("copy_gbs", "copy GB/s", ".0f"),
            ("quantize_gbs", "quantize GB/s", ".0f"), ("quantize_vs_copy", "vs copy", ".0%"),
            ("dequantize_gbs", "dequantize GB/s", ".0f"),
            ("dequantize_vs_copy", "vs copy", ".0%")]  # fmt: skip
    text = markdown_table(rows, cols)
    head = (
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}, "
        f"{args.dtype}, groups of {args.group_size}\n\n"
    )
    Outputs(args.out, "quant_bandwidth").write_report(rows, head + text + "\n")
    return rows


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
