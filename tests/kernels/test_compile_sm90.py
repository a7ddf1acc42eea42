"""Every kernel variant compiles for the H100/H200 (sm_90) without a GPU.

The interpreter runs the kernels' Python semantics; this runs Triton's real code generation
(TTIR -> PTX -> cubin with the ptxas Triton ships), which catches what the interpreter cannot
(layout, type and lowering errors). It runs in a subprocess because this test session has
TRITON_INTERPRET=1 set. On a GPU machine the compiled kernels run in the other tests instead.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: kernels run compiled")

_SCRIPT = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mesa_lite.kernels import group_quant as gq
from mesa_lite.kernels import gated
from mesa_lite.kernels import norm_backward as nb
from mesa_lite.kernels import softmax_backward as sb

def compile_(fn, signature, constexprs, warps, attrs=None):
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert len(k.asm["cubin"]) > 1000
    return k

CASES = [(8, True, False, "*fp16", True, 0), (8, False, True, "*bf16", False, 1),
         (4, True, True, "*fp32", True, 2), (2, False, False, "*fp16", False, 3),
         (8, True, False, "*bf16", False, 4), (8, True, False, "*fp16", True, 5),
         (4, False, True, "*bf16", True, 6), (8, False, False, "*fp16", True, 3),
         (2, True, False, "*bf16", True, 1), (2, False, False, "*fp16", True, 5)]
# packed codes: quantize through gq.PACKED_LAYOUTS[epi % 3] (bytes at 4 bits normalized and at
# 2 bits), dequantize through lanes where epi >= 3
for bits, signed, stochastic, x_dtype, one_pass, epi in CASES:
    per = gq.per_byte(bits)
    qmin, qmax = gq.qrange(signed, bits)
    rows = gq._launch_shape(128, bits)[0]  # as shipped: 32 at 8 bits, 8 below
    codes = "*i8" if (bits == 8 and signed) else "*u8"
    compile_(gq._quantize_kernel,
             {"x_ptr": x_dtype, "codes_ptr": codes, "scales_ptr": "*fp32", "mean_ptr": "*fp32",
              "rstd_ptr": "*fp32", "n": "i32", "n_groups": "i32", "group_size": "i32",
              "row_len": "i32", "seed": "i32"},
             {"QMIN": qmin, "QMAX": qmax, "BITS": bits, "PER_BYTE": per, "STOCHASTIC": stochastic,
              "NORM": epi % 2 == 0, "POSITIVE": bits == 8 and not signed and epi % 2 == 1,
              "ONE_PASS": one_pass, "RN": True, "PACKING": epi % 3, "ROWS": rows, "BLOCK": 128},
             4 if bits == 8 else 1)
    compile_(gq._dequantize_kernel,
             {"codes_ptr": codes, "scales_ptr": "*fp32",
              "out_ptr": "*i16" if stochastic else "*fp16", "p1_ptr": "*fp32", "p2_ptr": "*fp16",
              "n": "i32", "n_groups": "i32", "group_size": "i32", "row_len": "i32"},
             {"QMIN": qmin, "BITS": bits, "PER_BYTE": per, "OUT_BF16": stochastic, "EPI": epi,
              "HAS_P1": True, "HAS_P2": epi != 1, "MID": epi % 3, "RN": True,
              "LANES": epi >= 3, "ROWS": rows, "BLOCK": 128}, 4 if bits == 8 else 2)
    print("compiled", bits, signed, stochastic, x_dtype)

# the norms' backward: LayerNorm fp32, Hugging Face's RMSNorm into bf16, RMSNorm's 2-bit codes
# on the widest tile, each at its shipped launch shape
for bits, center, has_w, hf, grad, out, row_len in [
        (8, True, True, False, "*fp32", "*fp32", 384), (4, False, True, True, "*fp32", "*i16", 2048),
        (2, False, False, False, "*fp16", "*fp16", nb.MAX_ROW)]:
    rows, block, warps = nb._launch_shape(row_len)
    compile_(nb._norm_backward_kernel,
             {"codes_ptr": "*i8" if bits == 8 else "*u8", "scales_ptr": "*fp32", "grad_ptr": grad,
              "w_ptr": "*fp32", "rstd_ptr": "*fp32", "gx_ptr": out, "part_ptr": "*fp32",
              "n_rows": "i32", "row_len": "i32", "group_size": "i32", "rows_per_prog": "i32"},
             {"QMIN": gq.qrange(True, bits)[0], "BITS": bits, "PER_BYTE": gq.per_byte(bits),
              "CENTER": center, "HAS_W": has_w, "NEED_X": True, "PARTS": True, "HF": hf,
              "MID_X": 2 if hf else 0, "MID_G": 0, "OUT_BF16": out == "*i16", "ROWS": rows,
              "BLOCK": block}, warps)
    print("compiled norm backward", bits, row_len)

# the gated product's backward: SiLU into bf16 (in place, bits out), GELU fp16 at 4 bits, the
# tanh GELU fp32 at 2 bits without the product
for bits, act, dt, prod in [(8, 0, "*bf16", True), (4, 1, "*fp16", True), (2, 2, "*fp32", False)]:
    rows, block = gq._launch_shape(128, bits)
    out = "*i16" if dt == "*bf16" else dt
    codes = "*i8" if bits == 8 else "*u8"
    compile_(gated._gated_backward_kernel,
             {"g_codes_ptr": codes, "g_scales_ptr": "*fp32", "u_codes_ptr": codes,
              "u_scales_ptr": "*fp32", "dp_ptr": dt, "prod_ptr": out, "gg_ptr": out,
              "gu_ptr": out, "n": "i32", "n_groups": "i32", "group_size": "i32"},
             {"QMIN": gq.qrange(True, bits)[0], "BITS": bits, "PER_BYTE": gq.per_byte(bits),
              "ACT": act, "MID": {"*fp32": 0, "*fp16": 1, "*bf16": 2}[dt], "WRITE_PROD": prod,
              "ROWS": rows, "BLOCK": block}, 4 if bits == 8 else 2)
    print("compiled gated backward", bits, act)

# softmax's backward: DeiT's 197-token rows into fp16 at 8 bits, 4-bit bf16 rows of 1024, and
# the longest row at 2 bits in fp32 (8 warps)
for bits, dt, row_len in [(8, "*fp16", 197), (4, "*bf16", 1024), (2, "*fp32", sb.MAX_ROW)]:
    rows, block = sb._launch_shape(row_len)
    compile_(sb._softmax_backward_kernel,
             {"codes_ptr": "*u8", "scales_ptr": "*fp32", "grad_ptr": dt,
              "out_ptr": "*i16" if dt == "*bf16" else dt, "n_rows": "i32", "row_len": "i32"},
             {"GROUP": 128, "QMIN": 0, "BITS": bits, "PER_BYTE": gq.per_byte(bits),
              "MID": {"*fp32": 0, "*fp16": 1, "*bf16": 2}[dt], "ROWS": rows, "BLOCK": block},
             4 if block <= 2048 else 8)
    print("compiled softmax backward", bits, row_len)

# BatchNorm's backward: both passes, ResNet-50's first rows (112 x 112) into fp16 at 8 bits,
# 7 x 7 rows into bf16 at 4 bits with no weight, and 2-bit fp32 rows of 3 (a group of 100)
from mesa_lite.kernels import batch_norm_backward as bb
for bits, dt, s, group, weight in [(8, "*fp16", 12544, 128, True), (4, "*bf16", 49, 128, False),
                                   (2, "*fp32", 3, 100, True)]:
    rows, block = bb._launch_shape(s)
    consts = {"GROUP": group, "QMIN": gq.qrange(True, bits)[0], "BITS": bits,
              "PER_BYTE": gq.per_byte(bits), "ROWS": rows, "BLOCK": block}
    codes = "*i8" if bits == 8 else "*u8"
    compile_(bb._bn_sums_kernel,
             {"codes_ptr": codes, "scales_ptr": "*fp32", "grad_ptr": dt, "part_ptr": "*fp32",
              "n_rows": "i32", "S": "i32"}, consts, 4)
    compile_(bb._bn_input_grad_kernel,
             {"codes_ptr": codes, "scales_ptr": "*fp32", "grad_ptr": dt, "sums_ptr": "*fp32",
              "weight_ptr": "*fp32", "invstd_ptr": "*fp32",
              "out_ptr": "*i16" if dt == "*bf16" else dt, "n_rows": "i32", "S": "i32",
              "C": "i32", "m": "i32"},
             {**consts, "HAS_WEIGHT": weight, "OUT_BF16": dt == "*bf16"}, 4)
    print("compiled batch_norm backward", bits, s)
# M = N * S of 1 (a (1, C, 1) input): Triton passes that int as a constant
compile_(bb._bn_input_grad_kernel,
         {"codes_ptr": "*i8", "scales_ptr": "*fp32", "grad_ptr": "*fp32", "sums_ptr": "*fp32",
          "weight_ptr": "*fp32", "invstd_ptr": "*fp32", "out_ptr": "*fp32", "n_rows": "i32",
          "S": "i32", "C": "i32"},
         {"m": 1, "GROUP": 128, "QMIN": -127, "BITS": 8, "PER_BYTE": 1, "HAS_WEIGHT": True,
          "OUT_BF16": False, "ROWS": 4096, "BLOCK": 1}, 4)
print("compiled batch_norm backward, M of 1")
# rows and groups longer than 2**31 elements (int64 arguments): row_col's two branches
compile_(gq._dequantize_kernel,
         {"codes_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": "*fp16", "p1_ptr": "*fp32",
          "p2_ptr": "*fp32", "n": "i64", "n_groups": "i64", "group_size": "i64",
          "row_len": "i64"},
         {"QMIN": -127, "BITS": 8, "PER_BYTE": 1, "OUT_BF16": False, "EPI": 2, "HAS_P1": True,
          "HAS_P2": True, "MID": 0, "RN": True, "LANES": False, "ROWS": 4, "BLOCK": 1024}, 4)
print("compiled dequantize unnormalize, 64-bit rows")

# ReLU's backward from its consumer's 8- and 4-bit codes (an fp16 gradient as raw int16 bits)
from mesa_lite.kernels import bits as kbits
for bits in (8, 4):
    compile_(kbits._relu_backward_codes_kernel,
             {"grad_ptr": "*i16", "codes_ptr": "*u8", "out_ptr": "*i16", "n": "i32"},
             {"BITS": bits, "BLOCK": 4 * kbits._BLOCK}, 4)
    print("compiled relu backward from codes", bits)

# attention's q, k and v in one launch (quantize3), 8 and 4 bits at their shipped shapes
for bits, x_dtype in ((8, "*bf16"), (4, "*fp16")):
    rows = gq._launch_shape(128, bits)[0]
    codes = "*i8" if bits == 8 else "*u8"
    compile_(gq._quantize3_kernel,
             {**{f"x{i}_ptr": x_dtype for i in range(3)}, **{f"c{i}_ptr": codes for i in range(3)},
              **{f"s{i}_ptr": "*fp32" for i in range(3)}, "n0": "i32", "n1": "i32", "n2": "i32",
              "g0": "i32", "g1": "i32", "g2": "i32", "p0": "i32", "p1": "i32",
              "group_size": "i32"},
             {"QMIN": gq.qrange(True, bits)[0], "QMAX": gq.qrange(True, bits)[1], "BITS": bits,
              "PER_BYTE": gq.per_byte(bits), "ONE_PASS": True, "RN": True, "PACKING": 0,
              "ROWS": rows, "BLOCK": 128}, 4 if bits == 8 else 1)
    print("compiled quantize3", bits)

# packed codes move as vectors: the 4-bit quantize's stores of code bytes
# at the shipped shape, the sizes divisible by 16 as Triton specializes them at launch (a byte
# at a time, 16 per thread, when the masks' bound was (n + 1) // 2)
aligned = {(i,): [["tt.divisibility", 16]] for i in range(9)}
rows = gq._launch_shape(128, 4)[0]
k = compile_(gq._quantize_kernel,
             {"x_ptr": "*fp16", "codes_ptr": "*u8", "scales_ptr": "*fp32", "mean_ptr": "*fp32",
              "rstd_ptr": "*fp32", "n": "i32", "n_groups": "i32", "group_size": "i32",
              "row_len": "i32", "seed": "i32"},
             {"QMIN": -7, "QMAX": 7, "BITS": 4, "PER_BYTE": 2, "STOCHASTIC": False, "NORM": False,
              "POSITIVE": False, "ONE_PASS": True, "RN": True, "PACKING": 0, "ROWS": rows,
              "BLOCK": 128}, 1, attrs=aligned)
print("packed stores", sorted(set(re.findall(r"st\.global\.v\d\.b32", k.asm["ptx"]))))
"""


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("compiled") == 28, res.stdout
    assert "packed stores ['st.global.v2.b32']" in res.stdout, res.stdout


_ABI_SCRIPT = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mesa_lite.kernels import group_quant as gq, launch

launch._STATIC_LAUNCH = launch._STATIC_LAUNCH or print  # torch without it: the mapping alone
PTX = {"O": "u64", "i": "u32", "l": "u64", "f": "f32", "d": "f64", "K": "u64", "I": "u32"}
# n_groups specialized to 1 (a constexpr the launch drops) and a 64-bit seed
quantize = ({"x_ptr": "*fp16", "codes_ptr": "*i8", "scales_ptr": "*fp32", "mean_ptr": "*fp32",
             "rstd_ptr": "*fp32", "n": "i32", "group_size": "i32", "seed": "i64"},
            {"n_groups": 1, "row_len": 1, "QMIN": -127, "QMAX": 127, "BITS": 8, "PER_BYTE": 1,
             "STOCHASTIC": False, "NORM": False, "POSITIVE": False, "ONE_PASS": True, "RN": True,
             "PACKING": 0, "ROWS": 32, "BLOCK": 128}, "OOOOOiil")
dequantize = ({"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*i16", "p1_ptr": "*fp32",
               "p2_ptr": "*fp16", "n": "i32", "n_groups": "i32", "group_size": "i32",
               "row_len": "i32"},
              {"QMIN": 0, "BITS": 4, "PER_BYTE": 2, "OUT_BF16": True, "EPI": 2, "HAS_P1": True,
               "HAS_P2": True, "MID": 0, "RN": True, "LANES": True, "ROWS": 8, "BLOCK": 128},
              "OOOOOiiii")
# the one-pass backwards: bf16 (int16 stores), n_groups specialized to 1
gated_bw = ({"g_codes_ptr": "*i8", "g_scales_ptr": "*fp32", "u_codes_ptr": "*i8",
             "u_scales_ptr": "*fp32", "dp_ptr": "*bf16", "prod_ptr": "*i16", "gg_ptr": "*i16",
             "gu_ptr": "*i16", "n": "i32", "group_size": "i32"},
            {"n_groups": 1, "QMIN": -127, "BITS": 8, "PER_BYTE": 1, "ACT": 0, "MID": 2,
             "WRITE_PROD": True, "ROWS": 32, "BLOCK": 128}, "OOOOOOOOii")
softmax_bw = ({"codes_ptr": "*u8", "scales_ptr": "*fp32", "grad_ptr": "*fp16",
               "out_ptr": "*fp16", "n_rows": "i32", "row_len": "i32"},
              {"GROUP": 128, "QMIN": 0, "BITS": 8, "PER_BYTE": 1, "MID": 1, "ROWS": 16,
               "BLOCK": 256}, "OOOOii")
# BatchNorm's backward: both passes
bn = {"codes_ptr": "*i8", "scales_ptr": "*fp32", "grad_ptr": "*fp16"}
bn_cx = {"GROUP": 128, "QMIN": -127, "BITS": 8, "PER_BYTE": 1, "ROWS": 2, "BLOCK": 2048}
bn_sums = ({**bn, "part_ptr": "*fp32", "n_rows": "i32", "S": "i32"}, bn_cx, "OOOOii")
bn_dx = ({**bn, "sums_ptr": "*fp32", "weight_ptr": "*fp32", "invstd_ptr": "*fp32",
          "out_ptr": "*fp16", "n_rows": "i32", "S": "i32", "C": "i32", "m": "i32"},
         {**bn_cx, "HAS_WEIGHT": True, "OUT_BF16": False}, "OOOOOOOiiii")
from mesa_lite.kernels import batch_norm_backward as bb, gated, softmax_backward as sb
for fn, (sig, cx, expected) in ((gq._quantize_kernel, quantize),
                                (gq._dequantize_kernel, dequantize),
                                (gated._gated_backward_kernel, gated_bw),
                                (sb._softmax_backward_kernel, softmax_bw),
                                (bb._bn_sums_kernel, bn_sums),
                                (bb._bn_input_grad_kernel, bn_dx)):
    k = triton.compile(ASTSource(fn=fn, signature={**sig, **dict.fromkeys(cx, "constexpr")},
                                 constexprs=cx), target=GPUTarget("cuda", 90, 32))
    entry = launch.static_entry(k, len(fn.arg_names), tuple(range(expected.count("O"))))
    types = entry[3]
    assert types.startswith(expected), (types, expected)
    ptx = k.asm["ptx"]
    head = ptx[ptx.index(".entry"):]
    params = re.findall(r"\.param \.(\w+)", head[: head.index(")")])
    assert [PTX[t] for t in types] == params, (types, params)
    print("abi", fn.__name__, types)
"""


def test_static_launch_types_match_the_kernels_parameters():
    """The static launcher passes each runtime argument as the type the compiled kernel's
    PTX entry declares, in order, constexprs (and ints specialized to 1) left out, Triton's
    scratch pointers last: the launch ABI checked without a GPU, on this Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", _ABI_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("abi") == 6, res.stdout
