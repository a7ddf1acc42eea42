"""Reliability under training conditions: AMP overflow, double backward, retain_graph,
activation checkpointing, hooks."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt
from conftest import assert_equal, sqnr_db

import mesa_lite


class Block(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, 4 * c)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * c, c)
        self.sm = nn.Softmax(-1)

    def forward(self, x, inject=None):
        h = self.fc1(self.norm(x))
        if inject is not None:
            h = h + inject  # an activation that overflows
        return self.sm(self.fc2(self.act(h)))[:, :-1]  # the last token does not reach the loss


def test_grad_scaler_skips_the_same_steps(device):
    """fp16 autocast + GradScaler: with inf and NaN injected into an activation on some steps,
    the wrapped model's gradients are non-finite exactly when the plain model's are, so the
    scaler skips the same steps and its scale follows the same path.

    The overflow sits in a token the loss drops: the loss stays finite and only the saved
    activations carry it into the weight gradients (0 * inf = NaN in plain PyTorch), so a
    quantizer that made non-finite values finite would make these steps look clean."""
    torch.manual_seed(0)
    plain = Block().to(device)
    wrapped = mesa_lite.wrap(copy.deepcopy(plain))
    x = torch.randn(8, 10, 32, device=device)
    inject_at = {2: float("inf"), 5: float("nan"), 6: float("-inf")}
    history = {}
    for name, model in (("plain", plain), ("mesa", wrapped)):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
        trace = []
        for step in range(9):
            inject = None
            if step in inject_at:
                inject = torch.zeros(8, 10, 128, device=device)
                inject[1, -1, 7] = inject_at[step]
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = model(x, inject).square().sum()
            assert torch.isfinite(loss), "the overflow must reach only the gradients"
            scaler.scale(loss).backward()
            finite = all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
            scaler.step(opt)
            scaler.update()
            trace.append((finite, scaler.get_scale()))
        history[name] = trace
    assert history["mesa"] == history["plain"], history
    assert [f for f, _ in history["plain"]].count(False) == 3


def test_double_backward_is_a_clear_error():
    lin = mesa_lite.wrap(nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    (g,) = torch.autograd.grad(lin(x).square().sum(), x, create_graph=False)
    with pytest.raises(RuntimeError, match="mesa_lite: double backward"):
        torch.autograd.grad(mesa_lite.wrap(nn.GELU())(x).sum(), x, create_graph=True)


def test_retain_graph_two_backwards():
    torch.manual_seed(0)
    model = mesa_lite.wrap(Block())
    x = torch.randn(4, 6, 32)
    out = model(x).square().sum()
    out.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    out.backward()
    for a, p in zip(first, model.parameters(), strict=True):
        assert_equal(p.grad, 2 * a, "second backward adds the same gradients")


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_inside_activation_checkpointing(reentrant):
    torch.manual_seed(0)
    model = mesa_lite.wrap(Block())
    x = torch.randn(4, 6, 32, requires_grad=True)

    def grads(use_ckpt):
        model.zero_grad()
        x.grad = None
        if use_ckpt:
            out = ckpt.checkpoint(model, x, use_reentrant=reentrant)
        else:
            out = model(x)
        out.square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    # nearest rounding is deterministic: the recomputed forward keeps the very same codes
    for a, b in zip(grads(False), grads(True), strict=True):
        assert_equal(b, a, "gradient with checkpointing")


def test_hooks_fire_and_train_eval_switch():
    model = mesa_lite.wrap(Block())
    seen = []
    model.fc1.register_forward_hook(lambda m, i, o: seen.append("fwd"))
    model.fc1.register_full_backward_hook(lambda m, gi, go: seen.append("bwd"))
    x = torch.randn(2, 3, 32, requires_grad=True)
    model(x).sum().backward()
    assert seen == ["fwd", "bwd"]
    model.eval()
    y_eval = model(x)
    assert "Fn" not in type(model.fc1(x[..., :32].detach()).grad_fn or object()).__name__
    model.train()
    y_train = model(x)
    assert_equal(y_train, y_eval, "same forward in both modes")


def test_checkpoint_gradients_close_to_exact():
    torch.manual_seed(0)
    plain = Block()
    model = mesa_lite.wrap(copy.deepcopy(plain))
    x = torch.randn(4, 6, 32)
    ckpt.checkpoint(model, x, use_reentrant=False).square().sum().backward()
    plain(x).square().sum().backward()
    for p0, p1 in zip(plain.parameters(), model.parameters(), strict=True):
        assert sqnr_db(p0.grad, p1.grad) > 30
