"""MatMul against ``torch.matmul`` where torch's own path depends on layout and on which operand
requires grad: a learned ``(1, n, d)`` table broadcast over the batch (Perceiver-style latents,
``x @ table.mT``), a 2-D Parameter against 3-D input, column-major 2-D operands (``h.t() @ g``).

debug_exact: forward and every gradient bit for bit. int8: forward bit for bit; a gradient that
needs only a Parameter operand (kept as itself, not compressed) bit for bit too; one that
needs a compressed operand (an activation, or a view of the Parameter such as ``p.mT``)
within an SQNR floor.
"""

import pytest
import torch
import torch.nn as nn
from conftest import assert_equal, sqnr_db

import mesa_lite
from mesa_lite import QuantSpec

INT8_SQNR_FLOOR_DB = 30.0  # as tests/test_modules.py: randn operands, one backward

B, M, N, D = 3, 37, 23, 40  # odd sizes: no shape is a multiple of another or of a group

# name -> (x's shape, p's shape, the matmul's operands from the leaves x and p, whether p is a
# Parameter). x is an activation; its gradient needs only p's operand, p's only x's.
CASES = {
    # Perceiver-style latents: torch squeezes the table's batch of one when it requires grad
    # and folds the batch of the other operand into one mm
    "latents_x_at_table_mT": ((B, M, D), (1, N, D), lambda x, p: (x, p.mT), True),
    "latents_table_at_x_mT": ((B, M, D), (1, N, D), lambda x, p: (p, x.mT), True),
    "latents_x_at_table": ((B, M, D), (1, D, N), lambda x, p: (x, p), True),
    "latents_table_mT_at_x": ((B, D, M), (1, D, N), lambda x, p: (p.mT, x), True),
    # 4-D: no squeeze, an expanded bmm whose gradient is summed over the broadcast dims
    "latents_4d": ((2, 3, M, D), (1, 1, N, D), lambda x, p: (x, p.mT), True),
    "latents_4d_heads": ((2, 3, M, D), (1, 3, N, D), lambda x, p: (x, p.mT), True),
    "latents_4d_left": ((2, 3, M, D), (1, 1, N, D), lambda x, p: (p, x.mT), True),
    # a 2-D Parameter against 3-D input: one mm of the folded batch
    "param_2d_x_at_p_mT": ((B, M, D), (N, D), lambda x, p: (x, p.mT), True),
    "param_2d_p_at_x_mT": ((B, M, D), (N, D), lambda x, p: (p, x.mT), True),
    "param_2d_x_at_p": ((B, M, D), (D, N), lambda x, p: (x, p), True),
    # a batch that folds only by a copy (and, with p frozen, no fold: a bmm)
    "param_2d_batch_strided": ((M, B, D), (N, D), lambda x, p: (x.transpose(0, 1), p.mT), True),
    # column-major 2-D operands: torch's mm backward computes their gradients transposed
    "col_major_left": ((D, M), (D, N), lambda x, p: (x.t(), p), True),
    "col_major_right": ((M, D), (N, D), lambda x, p: (x, p.t()), True),
    "col_major_both": ((D, M), (N, D), lambda x, p: (x.t(), p.t()), True),
    "col_major_left_acts": ((D, M), (D, N), lambda x, p: (x.t(), p), False),
    "col_major_right_acts": ((M, D), (N, D), lambda x, p: (x, p.t()), False),
    "col_major_left_3d": ((D, M), (B, D, N), lambda x, p: (x.t(), p), False),
    # controls: contiguous operands
    "contiguous_2d": ((M, D), (D, N), lambda x, p: (x, p), True),
    "contiguous_3d": ((B, M, D), (B, D, N), lambda x, p: (x, p), False),
    "contiguous_3d_2d": ((B, M, D), (D, N), lambda x, p: (x, p), True),
}
NEEDS = {"both": (True, True), "x_only": (True, False), "p_only": (False, True)}


def _leaves(case, needs, device):
    """Two identical pairs of leaves (x, p), for torch and for mesa_lite."""
    sx, sp, _, param = CASES[case]
    need_x, need_p = NEEDS[needs]
    gen = torch.Generator().manual_seed(0)
    x0, p0 = torch.randn(sx, generator=gen), torch.randn(sp, generator=gen)
    pairs = []
    for _ in range(2):
        x = x0.clone().to(device).requires_grad_(need_x)
        p = p0.clone().to(device)
        p = nn.Parameter(p, requires_grad=need_p) if param else p.requires_grad_(need_p)
        pairs.append((x, p))
    return pairs


def _run(case, needs, exact, device):
    (x1, p1), (x2, p2) = _leaves(case, needs, device)
    operands = CASES[case][2]
    y1 = torch.matmul(*operands(x1, p1))
    a2, b2 = operands(x2, p2)
    y2 = mesa_lite.MatMul(QuantSpec(exact=exact))(a2, b2)
    assert type(y2.grad_fn).__name__ == "MatMulFnBackward", type(y2.grad_fn).__name__
    assert_equal(y2, y1, "forward")
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(y1.shape, generator=gen).to(device)
    y1.backward(g)
    y2.backward(g)
    p_kept = isinstance(p2, nn.Parameter) and (a2 is p2 or b2 is p2)
    return (x1, p1), (x2, p2), p_kept


@pytest.mark.parametrize("needs", NEEDS)
@pytest.mark.parametrize("case", CASES)
def test_debug_exact_gradients_bit_for_bit(case, needs, device):
    (x1, p1), (x2, p2), _ = _run(case, needs, True, device)
    for what, t1, t2 in (("x", x1, x2), ("p", p1, p2)):
        if t1.requires_grad:
            assert_equal(t2.grad, t1.grad, f"grad of {what}")
        else:
            assert t2.grad is None, f"grad of {what}"


@pytest.mark.parametrize("needs", NEEDS)
@pytest.mark.parametrize("case", CASES)
def test_int8_gradients(case, needs, device):
    (x1, p1), (x2, p2), p_kept = _run(case, needs, False, device)
    if x1.requires_grad:
        if p_kept:  # x's gradient needs only the Parameter, kept as itself: exact
            assert_equal(x2.grad, x1.grad, "grad of x")
        else:
            db = sqnr_db(x1.grad, x2.grad)
            assert INT8_SQNR_FLOOR_DB <= db < float("inf"), f"grad of x: {db:.1f} dB"
    if p1.requires_grad:  # needs the compressed x
        db = sqnr_db(p1.grad, p2.grad)
        assert INT8_SQNR_FLOOR_DB <= db < float("inf"), f"grad of p: {db:.1f} dB"
