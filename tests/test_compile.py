"""torch.compile of a wrapped model: the wrapped layers run as eager islands (graph breaks),
compressed exactly as in eager mode; the rest compiles.

The ``aot_eager`` backend (Dynamo and AOTAutograd, no code generation) keeps this test free of
a C++ compiler and makes its numerics those of eager mode, so results compare bit for bit.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_equal

import mesa_lite
from mesa_lite import quant


def tiny_vit(fused: bool):
    import timm

    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5
    )
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
    return model


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
        assert_equal(q.grad, p.grad, n)
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
