"""Every Triton kernel against a device-to-device copy of the same bytes and against the torch
op it accompanies, on DeiT-Ti/S/B activation shapes (GPU only).

Shapes: batch 128 x 197 tokens x width C (LayerNorm inputs, qkv/proj inputs) and x 4C (the
MLP's hidden activation), fp16, groups of 128. A kernel's bytes are what it must read and write
(codes 1 byte per element, fp32 scales, fp16 tensors 2 bytes); its GB/s is those bytes over
its median time (CUDA events, 30 repetitions), "vs copy" that against a ``clone`` of its
largest fp16 tensor (read + write at copy bandwidth). Also reported: host microseconds per
launch of the quantize kernel through mesa_lite's launcher (cached compiled kernel called
directly) and through ``kernel[grid]`` (Triton's JIT path), beside ``torch.add``.

    python benchmarks/kernels.py --out benchmarks/results/kernels_gpu
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
    host_us_per_call,
    launcher_switches,
    lazy_import,
    markdown_table,
    positive_int,
    progress,
    require_cuda,
    say,
)

torch = lazy_import("torch")
gq = lazy_import("mesa_lite.kernels.group_quant")
gated = lazy_import("mesa_lite.kernels.gated")
softmax_bw = lazy_import("mesa_lite.kernels.softmax_backward")
bn_bw = lazy_import("mesa_lite.kernels.batch_norm_backward")

WIDTHS = {"deit_tiny": 192, "deit_small": 384, "deit_base": 768}


def _ms(fn) -> float:
    return cuda_median_ms(fn, reps=30, warmup=3)


def _cases(rows: int, width: int, g: int) -> list[tuple[str, int, object, object, int]]:
    """(kernel, bytes moved, kernel call, the torch op it accompanies or None, elements of
    its largest fp16 tensor)."""
    f16 = torch.float16
    x = torch.randn(rows, width, device="cuda", dtype=f16)
    h = torch.randn(rows, 4 * width, device="cuda", dtype=f16)
    w = torch.randn(width, device="cuda", dtype=f16)
    b = torch.randn(width, device="cuda", dtype=f16)
    _, mean, rstd = torch.native_layer_norm(x, (width,), w, b, 1e-6)
    cx, sx = gq.quantize(x, g)
    ch, sh = gq.quantize(h, g)
    n, m = x.numel(), h.numel()
    scale_x, scale_h = sx.numel() * 4, sh.numel() * 4
    stats = 2 * rows * 4
    # attention probabilities: rows / 197 images x width / 64 heads x 197 x 197
    att = torch.randn(rows // 197, width // 64, 197, 197, device="cuda", dtype=f16).softmax(-1)
    ca, sa = gq.quantize(att, g, signed=False)
    a, scale_a = att.numel(), sa.numel() * 4
    cases = [
        ("quantize", 2 * n + n + scale_x, lambda: gq.quantize(x, g), None),
        (
            "quantize (4C)",
            2 * m + m + scale_h,
            lambda: gq.quantize(h, g),
            lambda: torch.nn.functional.gelu(h),
        ),
        (
            "quantize normalized (LayerNorm)",
            2 * n + stats + n + scale_x,
            lambda: gq.quantize(x, g, normalize=(mean, rstd)),
            lambda: torch.native_layer_norm(x, (width,), w, b, 1e-6),
        ),
        ("dequantize", n + scale_x + 2 * n, lambda: gq.dequantize(cx, sx, g, f16), None),
        ("dequantize (4C)", m + scale_h + 2 * m, lambda: gq.dequantize(ch, sh, g, f16), None),
        (
            "dequantize affine (LayerNorm output)",
            n + scale_x + 2 * n,
            lambda: gq.dequantize(cx, sx, g, f16, epilogue=("affine", w, b)),
            None,
        ),
        (
            "dequantize unnormalize (LayerNorm input)",
            n + scale_x + stats + 2 * n,
            lambda: gq.dequantize(cx, sx, g, f16, epilogue=("unnormalize", mean, rstd)),
            lambda: torch.ops.aten.native_layer_norm_backward(
                x, x, (width,), mean, rstd, w, b, [True, True, True]
            ),
        ),
        (
            "dequantize GELU (fc2 input, 4C)",
            m + scale_h + 2 * m,
            lambda: gq.dequantize(ch, sh, g, f16, epilogue=("gelu", "none", f16)),
            lambda: torch.nn.functional.gelu(h),
        ),
        (
            "GELU backward from codes (4C)",
            m + scale_h + 4 * m,
            lambda: gq.dequantize(ch, sh, g, f16, epilogue=("gelu_backward", "none", h)),
            lambda: torch.ops.aten.gelu_backward(h, h),
        ),
        (
            # a gated MLP's product (SwiGLU, the 4C tensor as gate and up): the product and
            # both factors' gradients from two sets of codes; its torch op is the op-by-op form
            "gated product backward from codes (4C)",
            2 * (m + scale_h) + 2 * m + 6 * m,
            lambda: gated.gated_backward((ch, sh), (ch, sh), h, g, f16, "silu"),
            lambda: _gated_op_by_op(ch, sh, h, g),
        ),
    ]
    out = [(*c, m if "4C" in c[0] else n) for c in cases]
    out.append(
        (
            # softmax's backward (attention probabilities, unsigned codes): one pass against
            # a dequantize and PyTorch's backward
            "softmax backward from codes (attention)",
            a + scale_a + 2 * a + 2 * a,
            lambda: softmax_bw.softmax_backward(ca, sa, att, g, f16),
            lambda: torch._softmax_backward_data(
                att, gq.dequantize(ca, sa, g, f16, signed=False).view(att.shape), -1, f16
            ),
            a,
        )
    )
    out.append(_batch_norm_case(rows // 197, g))
    return out


def _batch_norm_case(batch: int, g: int) -> tuple:
    """BatchNorm's backward from x_hat's codes (a ResNet-50 stage-1 input, batch x 64 x 56 x
    56, whatever the model's width) against the op-by-op form eager mode ran before: the
    input rebuilt by the unnormalize dequantize, then torch's own backward as F.batch_norm's
    autograd calls it (``_batch_norm_impl_index_backward``: cuDNN where it takes the input)."""
    f16 = torch.float16
    x = torch.randn(batch, 64, 56, 56, device="cuda", dtype=f16)
    dy = torch.randn_like(x)
    w, b = torch.rand(64, device="cuda") + 0.5, torch.zeros(64, device="cuda")
    rm, rv = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
    _, mean, invstd, reserve, impl = torch.ops.aten._batch_norm_impl_index(
        x, w, b, rm, rv, True, 0.1, 1e-5, torch.backends.cudnn.enabled
    )
    stats = (mean.repeat(batch), invstd.repeat(batch))
    codes, scales = gq.quantize(x, g, normalize=stats)
    e = x.numel()

    def op_by_op():
        xr = gq.dequantize(codes, scales, g, f16, epilogue=("unnormalize", *stats)).view(x.shape)
        return torch.ops.aten._batch_norm_impl_index_backward(
            impl, xr, dy, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True], reserve
        )

    return (
        "BatchNorm backward from codes (64 x 56 x 56)",
        # codes and the gradient read twice, the input's gradient written
        2 * (e + scales.numel() * 4 + 2 * e) + 2 * e,
        lambda: bn_bw.batch_norm_backward(codes, scales, dy, invstd, w, g),
        op_by_op,
        e,
    )


def _gated_op_by_op(codes, scales, dp, g):
    """``blocks.GatedMlpFn``'s op-by-op backward through the product (both factors from the
    same codes here): two dequantizes, SiLU, the product, two products, SiLU's backward."""
    f16 = torch.float16
    gx = gq.dequantize(codes, scales, g, f16).view(dp.shape)
    ux = gq.dequantize(codes, scales, g, f16).view(dp.shape)
    a = torch.nn.functional.silu(gx)
    prod = a * ux
    return prod, torch.ops.aten.silu_backward(dp * ux, gx), dp * a


def _measure(model: str, width: int, batch: int, g: int) -> list[dict]:
    rows = []
    for name, nbytes, fn, op, elements in _cases(batch * 197, width, g):
        biggest = 2 * elements
        src = torch.empty(biggest // 2, device="cuda", dtype=torch.float16)
        copy_ms = _ms(lambda src=src: src.clone())
        ms = _ms(fn)
        row = {"model": model, "kernel": name, "ms": ms, "bytes": nbytes,
               "gbs": nbytes / ms / 1e6, "copy_gbs": 2 * biggest / copy_ms / 1e6,
               "torch_op_ms": _ms(op) if op is not None else None}  # fmt: skip
        row["vs_copy"] = row["gbs"] / row["copy_gbs"]
        rows.append(row)
    return rows


def host_us_per_launch() -> dict:
    """Host time per call (small tensor, so the device is idle): torch.add, quantize and
    dequantize through the launcher's kept kernels with the static launcher, the same with
    Triton's own launcher (``CompiledKernel.run``, the path before), and quantize through
    ``kernel[grid]``."""
    x = torch.randn(4096, device="cuda", dtype=torch.float16)
    codes, scales = gq.quantize(x, 128)
    calls = {
        "quantize": lambda: gq.quantize(x, 128),
        "dequantize": lambda: gq.dequantize(codes, scales, 128, torch.float16),
    }
    out = host_us_per_call({"torch.add": lambda: x.add(1), **calls})
    with launcher_switches(static=False):
        out.update({f"{k} (Triton's launcher)": v for k, v in host_us_per_call(calls).items()})
    with launcher_switches(direct=False):
        out.update(host_us_per_call({"quantize (kernel[grid])": lambda: gq.quantize(x, 128)}))
    out["static launches"] = gq._QUANTIZE.launches[0] + gq._DEQUANTIZE.launches[0]
    return out


def host_profile(calls: int = 500) -> str:
    """Where the host time of one quantize call goes (cProfile, top entries by own time)."""
    import cProfile
    import io
    import pstats

    x = torch.randn(4096, device="cuda", dtype=torch.float16)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        gq.quantize(x, 128)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    return text.getvalue()


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--models", nargs="+", choices=list(WIDTHS), default=list(WIDTHS),
                   help="activation shapes of these models")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=128, help="images per step")
    p.add_argument("--group-size", type=positive_int, default=128, help="elements per scale")
    add_out_argument(p, "kernels", "PREFIX.jsonl and PREFIX.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    require_cuda(p)
    return args


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    env = environment()
    host = {k: round(v, 1) for k, v in host_us_per_launch().items()}
    say(f"host us per call: {host}")
    profile = host_profile()
    rows = []
    for model in progress(args.models, desc="models"):
        rows += _measure(model, WIDTHS[model], args.batch_size, args.group_size)
    for r in rows:
        r.update(env)
    cols = [("model", "model", ""), ("kernel", "kernel", ""), ("ms", "ms", ".3f"),
            ("gbs", "GB/s", ".0f"), ("copy_gbs", "copy GB/s", ".0f"), ("vs_copy", "vs copy", ".0%"),
            ("torch_op_ms", "torch op ms", ".3f")]  # fmt: skip
    head = (
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
        f"fp16, batch {args.batch_size} x 197 tokens, groups of {args.group_size}. "
        f"torch op: the op the kernel accompanies (LayerNorm forward/backward, GELU "
        f"forward/backward), for scale; for the gated product's and softmax's backwards, the "
        f"op-by-op form each replaces.\n\nHost us per call: {host}\n\n"
    )
    tail = f"\nHost profile of 500 quantize calls:\n\n```\n{profile.strip()}\n```\n"
    Outputs(args.out, "kernels").write_report(rows, head + markdown_table(rows, cols) + "\n" + tail)
    return rows


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
