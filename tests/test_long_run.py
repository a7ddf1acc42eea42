"""Long runs and interrupted steps: nothing compressed outlives its graph, memory does not grow.

On CPU: weak references to every code and scale tensor the quantizer makes, checked dead (with
no garbage collection run, so a reference cycle counts as a leak) after backward, after a graph
dropped without backward, and after exceptions in the loss and in backward; the sharing
registry is empty each time. On a GPU: 1,000 training steps of a wrapped DeiT-Tiny with
``torch.cuda.memory_allocated()`` identical after every step and the per-step peak constant
(``MESA_LONG_RUN_STEPS`` changes the count).
"""

import gc
import os
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny_vit
from mesa_lite.kernels import group_quant

import mesa_lite
from mesa_lite import quant


@pytest.fixture
def tracked(monkeypatch):
    """Weak references to every (codes, scales) pair the quantizer returns."""
    refs: list[weakref.ref] = []
    original = group_quant.quantize

    def quantize(*args, **kwargs):
        codes, scales = original(*args, **kwargs)
        refs.extend((weakref.ref(codes), weakref.ref(scales)))
        return codes, scales

    monkeypatch.setattr(quant.group_quant, "quantize", quantize)
    return refs


def alive(refs) -> int:
    return sum(r() is not None for r in refs)


@pytest.fixture(params=["fused", "explicit"])
def model(request):
    return mesa_lite.wrap(tiny_vit(request.param == "fused"))


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)


def test_training_steps_free_everything(model, tracked):
    gc.disable()  # a cycle would survive until the collector runs: count it as a leak
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = batch()
        for _ in range(5):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            assert alive(tracked) > 0
            loss.backward()
            opt.step()
            del loss
            assert alive(tracked) == 0, "compressed tensors outlived their backward"
            assert not quant._SHARED, "sharing registry kept entries after backward"
        assert len(tracked) > 20
    finally:
        gc.enable()


def test_graph_dropped_without_backward(model, tracked):
    gc.disable()
    try:
        x, _ = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        assert alive(tracked) > 0
        del out
        assert alive(tracked) == 0
        assert not quant._SHARED
    finally:
        gc.enable()


def test_exception_in_loss_frees_the_graph(model, tracked):
    x, y = batch()

    def bad_loss(out, y):
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bad_loss(model(x), y)
    # the traceback pytest.raises keeps references the frame, and with it the output
    gc.collect()
    assert alive(tracked) == 0
    assert not quant._SHARED


def test_exception_in_backward_frees_the_graph(model, tracked):
    x, y = batch()

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(Boom.apply(x.requires_grad_())), y)
        loss.backward()
    del loss
    gc.collect()
    assert alive(tracked) == 0
    assert not quant._SHARED


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory run")
@pytest.mark.parametrize("attention", ["fused", "explicit"])
def test_cuda_memory_does_not_grow(attention):
    from mesa_lite.benchmarks.deit_memory import make_model

    steps = int(os.environ.get("MESA_LONG_RUN_STEPS", "1000"))
    warmup = 5
    model = make_model("deit_tiny_patch16_224", attention, "mesa", 224).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 224, 224, generator=g).cuda()
    y = torch.randint(0, 1000, (32,), generator=g).cuda()
    allocated, peaks = [], []
    for _ in range(steps):
        torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        del loss
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        peaks.append(torch.cuda.max_memory_allocated())
    allocated, peaks = allocated[warmup:], peaks[warmup:]
    mib = 2**20
    print(
        f"\n{attention}: {steps} steps, allocated after each step "
        f"{min(allocated) / mib:.3f}..{max(allocated) / mib:.3f} MiB, "
        f"peak per step {min(peaks) / mib:.3f}..{max(peaks) / mib:.3f} MiB"
    )
    assert max(allocated) == min(allocated), "memory_allocated grew over the run"
    assert max(peaks) - min(peaks) <= mib, "per-step peak changed over the run"
    assert not quant._SHARED


def test_plain_module_not_counted(tracked):
    """Guard for the fixture itself: an unwrapped model makes no tracked tensors."""
    net = nn.Linear(4, 4)
    net(torch.randn(2, 4)).sum().backward()
    assert tracked == []
