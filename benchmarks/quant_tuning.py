"""Launch shapes of the quantize and dequantize kernels against the copy bandwidth (GPU only).

For each tensor size, times the copy (``x.clone()``) and the group-quantization kernels at
each (ROWS, num_warps) given, 8 and 4 bits (``--bits``), fp16 input, groups of 128, packed
codes in each of ``gq.PACKED_LAYOUTS`` (a reshaped tile, lanes, bytes; the kernels alone:
codes and scales are allocated once, outside the timing). ``--timing queued`` (the default)
queues the launches behind a spin kernel and takes the inputs in turn from copies that exceed
the L2 cache, so a cell is the kernel's device time even where it is shorter than its launch
(about 50 us of host time through ``kernel[grid]``); ``--timing single`` is one call between
two CUDA events, as the runs up to 2026-12-04, whose figures for tensors below ~50M elements
are bounded by the launch. Also times two twin 8-bit quantize kernels that differ in one line, the
per-element ``x / scale`` (IEEE division, the quantizer's step before 2026-12-04) against
``x * (1 / scale)`` (its step since), to tell whether the kernel is bound by arithmetic or by
memory. Bytes counted as
quant_bandwidth.py: input + codes + scales. Writes PREFIX.jsonl and PREFIX.md (a fresh runs/
folder unless --out names a prefix).

    python benchmarks/quant_tuning.py --out benchmarks/results/quant_tuning_gpu
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
    cuda_queued_ms,
    environment,
    lazy_import,
    markdown_table,
    positive_int,
    progress,
    require_cuda,
)

torch = lazy_import("torch")
gq = lazy_import("mesa_lite.kernels.group_quant")

_TWINS = None
tl = libdevice = None  # set by _twins: a @triton.jit body reads the module's globals


def _twins():
    """The two 8-bit twin kernels (defined on first use: Triton is imported lazily)."""
    global _TWINS, tl, libdevice
    if _TWINS is None:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice

        @triton.jit
        def twin(x_ptr, c_ptr, s_ptr, n, n_groups, MUL: tl.constexpr, ROWS: tl.constexpr,
                 G: tl.constexpr):  # fmt: skip
            rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
            row_ok = rows < n_groups
            offs = rows.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
            mask = row_ok[:, None] & (offs < n)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
            scale = tl.math.div_rn(
                bits.to(tl.float32, bitcast=True), tl.full([ROWS], 127.0, tl.float32)
            )
            tl.store(s_ptr + rows, scale, mask=row_ok)
            safe = tl.where((scale > 0.0) & (scale < float("inf")), scale, 1.0)[:, None]
            if MUL:
                y = libdevice.mul_rn(x, tl.math.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe))
            else:
                y = tl.math.div_rn(x, tl.broadcast_to(safe, x.shape))
            q = tl.minimum(tl.maximum((y + 12582912.0) - 12582912.0, -127.0), 127.0)
            tl.store(c_ptr + offs, q.to(tl.int8), mask=mask)

        _TWINS = twin
    return _TWINS


def _quantize_launch(x, codes, scales, bits, rows, warps, layout):
    n, g = x.numel(), 128
    ng = n // g
    qmin, qmax = gq.qrange(True, bits)
    pb = gq.per_byte(bits)
    return lambda: gq._quantize_kernel[((ng + rows - 1) // rows,)](
        x, codes, scales, x, x, n, ng, g, 1, 0, qmin, qmax, bits, pb, False, False, False,
        True, not gq.INTERPRETING, gq.PACKED_LAYOUTS.index(layout) if bits < 8 else 0, rows, 128,
        num_warps=warps,
    )  # fmt: skip


def _dequantize_launch(codes, scales, out, bits, rows, warps, layout):
    n, g = out.numel(), 128
    ng = n // g
    qmin, _ = gq.qrange(True, bits)
    return lambda: gq._dequantize_kernel[((ng + rows - 1) // rows,)](
        codes, scales, out, out, out, n, ng, g, 1, qmin, bits, gq.per_byte(bits), False,
        0, False, False, 0, False, layout == "lanes", rows, 128, num_warps=warps,
    )  # fmt: skip


def _copies(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` and enough clones of it that, taken in turn, together they exceed the L2 cache
    four times over (60 MB on the H200; at most 8 tensors)."""
    k = min(8, max(1, -(-240_000_000 // (t.numel() * t.element_size()))))
    return [t] + [t.clone() for _ in range(k - 1)]


def _launch_shapes(xs, scales, bits: int, configs, add) -> None:
    """Times quantize and dequantize at each launch shape, each output checked against the
    references (torch ops), bit for bit."""
    x = xs[0]
    n = x.numel()
    ref_codes, ref_scales = gq.quantize_ref(x, 128, bits=bits)
    ref_out = gq.dequantize_ref(ref_codes, ref_scales, 128, x.dtype, bits, True, n)
    codes, out = torch.empty_like(ref_codes), torch.empty_like(x)
    code_copies = _copies(ref_codes)

    def quantized() -> bool:
        return torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)

    def dequantized() -> bool:
        return torch.equal(out, ref_out)

    # packed codes: each of gq.PACKED_LAYOUTS (the shipped one is gq.PACKED_LAYOUT); dequantize
    # has no "bytes" form (it reads them as "tile")
    for layout in gq.PACKED_LAYOUTS if bits < 8 else ["-"]:
        for rows, warps in configs:
            add("quantize", bits, rows, warps,
                [_quantize_launch(xi, codes, scales, bits, rows, warps, layout) for xi in xs],
                quantized, layout)  # fmt: skip
        if layout == "bytes":
            continue
        for rows, warps in configs:
            add("dequantize", bits, rows, warps,
                [_dequantize_launch(c, ref_scales, out, bits, rows, warps, layout)
                 for c in code_copies], dequantized, layout)  # fmt: skip


def _measure(n: int, configs: list[tuple[int, int]], queued: bool, bits_list=(8, 4)) -> list[dict]:
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    xs = _copies(x) if queued else [x]
    ng = n // 128
    scales = torch.empty(ng, device="cuda", dtype=torch.float32)

    def time_ms(fns) -> float:
        return cuda_queued_ms(fns) if queued else cuda_median_ms(fns[0])

    copy_ms = time_ms([lambda xi=xi: xi.clone() for xi in xs])
    copy_gbs = 4 * n / copy_ms / 1e6
    rows_out = []

    def add(kernel, bits, rows, warps, fns, check=None, layout="-"):
        ms = time_ms(fns)
        moved = 2 * n + n * bits // 8 + ng * 4
        rows_out.append({"elements": n, "kernel": kernel, "bits": bits, "layout": layout,
                         "rows": rows, "num_warps": warps, "ms": ms, "gbs": moved / ms / 1e6,
                         "copy_gbs": copy_gbs, "vs_copy": moved / ms / 1e6 / copy_gbs,
                         "exact": None if check is None else check(),
                         "timing": "queued" if queued else "single"})  # fmt: skip

    for bits in bits_list:
        _launch_shapes(xs, scales, bits, configs, add)
    if 8 not in bits_list:
        return rows_out
    codes = torch.empty(n, device="cuda", dtype=torch.int8)
    twin = _twins()
    for mul in (False, True):
        for rows, warps in configs:
            add("twin " + ("x * (1 / scale)" if mul else "x / scale"), 8, rows, warps,
                [lambda xi=xi, r=rows, w=warps, m=mul: twin[((ng + r - 1) // r,)](
                    xi, codes, scales, n, ng, m, r, 128, num_warps=w) for xi in xs])  # fmt: skip
    return rows_out


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--sizes", nargs="+", type=lambda s: int(float(s)),
                   default=[19_365_888, 51_380_224, 205_520_896],
                   help="elements per tensor, multiples of 128 (default: DeiT-B's block input "
                   "at batch 128; ResNet-50's 64 x 56 x 56 and 256 x 56 x 56 maps at batch "
                   "256)")  # fmt: skip
    p.add_argument("--rows", nargs="+", type=positive_int, default=[8, 16, 32, 64],
                   help="groups per program")  # fmt: skip
    p.add_argument("--warps", nargs="+", type=positive_int, default=[2, 4, 8],
                   help="num_warps values")  # fmt: skip
    p.add_argument("--timing", choices=["queued", "single"], default="queued",
                   help="queued: launches queued behind a spin kernel, inputs taken in turn "
                   "from copies that exceed the L2 cache (the kernels' device time); single: "
                   "one call between two CUDA events, as the runs before 2026-12-05 (it counts "
                   "the host's launch wherever the kernel is shorter)")  # fmt: skip
    p.add_argument("--bits", nargs="+", type=int, choices=[8, 4, 2], default=[8, 4],
                   help="code widths (the twin kernels run with 8)")  # fmt: skip
    add_out_argument(p, "quant_tuning", "PREFIX.jsonl and PREFIX.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    require_cuda(p)
    if any(n % 128 for n in args.sizes):
        p.error("--sizes must be multiples of 128")
    return args


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    env = environment()
    configs = [(r, w) for r in args.rows for w in args.warps]
    rows = []
    for n in progress(args.sizes, desc="sizes"):
        rows += [dict(r, **env) for r in _measure(n, configs, args.timing == "queued", args.bits)]
    cols = [("elements", "elements", ","), ("kernel", "kernel", "s"), ("bits", "bits", "d"),
            ("layout", "packed layout", "s"), ("rows", "ROWS", "d"),
            ("num_warps", "num_warps", "d"), ("ms", "ms", ".3f"),
            ("gbs", "GB/s", ".0f"), ("copy_gbs", "copy GB/s", ".0f"),
            ("vs_copy", "vs copy", ".0%"), ("exact", "equals the reference", "")]  # fmt: skip
    head = (
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}, "
        f"{args.timing} timing, fp16 "
        'input, groups of 128. "equals the reference": the launch\'s codes and scales (its '
        "output, for dequantize) equal quantize_ref's (dequantize_ref's) bit for bit.\n\n"
    )
    Outputs(args.out, "quant_tuning").write_report(rows, head + markdown_table(rows, cols) + "\n")
    return rows


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
