"""torch.compile of a wrapped model: the wrapped layers run as eager islands (graph breaks),
compressed exactly as in eager mode; the rest compiles.

The ``aot_eager`` backend (Dynamo and AOTAutograd, no code generation) keeps this test free of
a C++ compiler and makes its numerics those of eager mode, so results compare bit for bit.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_equal, sqnr_db, tiny_vit

import mesa_lite
from mesa_lite import quant

# With torch 2.11 (the H200 image), the compiled model's gradients are not bit-identical to
# eager mode's (fc2's weight gradient differed in 87% of its elements, bf16 ulps, on the code
# before and after issue 10 alike); they stay within the int8 floor of eager mode's. The likely
# cause: a tensor that leaves one eager island and reaches the next through a compiled region
# (timm's Mlp: GELU -> Dropout(0) -> fc2) comes back as another object, so fc2 quantizes it
# afresh instead of reusing the GELU's codes. torch 2.14 (CI) matches eager mode bit for bit.
ISLANDS_KEEP_IDENTITY = torch.__version__ >= "2.14"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_compiled_wrapped_model_equals_eager_wrapped(fused):
    torch._dynamo.reset()
    eager = mesa_lite.wrap(tiny_vit(fused))
    compiled_src = copy.deepcopy(eager)
    compiled = torch.compile(compiled_src, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_e = F.cross_entropy(eager(x), y)
        loss_c = F.cross_entropy(compiled(x), y)
    assert_equal(loss_c, loss_e, "loss")
    # compressed under compile as in eager mode: fewer bytes kept than the plain model
    kept = mesa_lite.report.saved_bytes(compiled, x, autocast=torch.bfloat16)
    plain = mesa_lite.report.saved_bytes(tiny_vit(fused), x, autocast=torch.bfloat16)
    assert kept < 0.5 * plain, (kept, plain)
    loss_e.backward()
    loss_c.backward()
    for (n, p), q in zip(eager.named_parameters(), compiled_src.parameters(), strict=True):
        if ISLANDS_KEEP_IDENTITY:
            assert_equal(q.grad, p.grad, n)
        else:
            assert sqnr_db(p.grad, q.grad) >= 30, (n, sqnr_db(p.grad, q.grad))
    del loss_c, loss_e
    assert not quant._SHARED


def test_eager_under_compile_is_transparent_outside_compile():
    calls = []

    @mesa_lite.modules.eager_under_compile
    def f(a, b=1):
        calls.append((a, b))
        return a + b

    assert f(2, b=3) == 5 and calls == [(2, 3)]
    assert f.__name__ == "f"


def test_plain_paths_compile_without_graph_breaks():
    """Only the compressed paths are eager islands: in eval mode (the plain ops) a wrapped
    model compiles into one graph."""
    torch._dynamo.reset()
    model = mesa_lite.wrap(tiny_vit(True)).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    model.train()  # the compressed paths do break the graph
    assert torch._dynamo.explain(model)(x).graph_break_count > 0
