"""Checkpoints of wrapped models: pickling, optimizer state, and resuming training."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_equal, tiny_vit

import mesa_lite


def batches(n):
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g))
            for _ in range(n)]  # fmt: skip


def step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("bits", [8, 4], ids=["int8_nearest", "int4_stochastic"])
def test_resume_gives_the_same_next_steps(bits):
    """Save model, optimizer and RNG state after 3 steps; a fresh process-like restart
    (new model from other weights, loaded from the checkpoint) gives bit-identical losses and
    weights for the next two steps. Stochastic rounding takes its seeds from mesa_lite's own
    counter (it leaves torch's generators alone), so its state (``mesa_lite.rounding_state()``)
    belongs in the checkpoint with torch's RNG state."""
    config = mesa_lite.Config(bits=bits)
    data = batches(5)
    model = mesa_lite.wrap(tiny_vit(), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in data[:3]:
        step(model, opt, x, y)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "rng": torch.get_rng_state(), "rounding": mesa_lite.rounding_state()},
               buf)  # fmt: skip
    running = [step(model, opt, x, y) for x, y in data[3:]]

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = mesa_lite.wrap(tiny_vit(seed=99), config)
    resumed.load_state_dict(ckpt["model"], strict=True)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(ckpt["opt"])
    torch.set_rng_state(ckpt["rng"])
    mesa_lite.set_rounding_state(ckpt["rounding"])
    again = [step(resumed, opt2, x, y) for x, y in data[3:]]
    for a, b in zip(running, again, strict=True):
        assert_equal(b, a, "loss after resuming")
    for (n, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert_equal(q, p, n)


def test_optimizer_state_interchangeable_with_plain_model():
    """The optimizer of a wrapped model holds the same state layout as the plain model's:
    either loads into the other."""
    data = batches(2)
    plain, wrapped = tiny_vit(), mesa_lite.wrap(tiny_vit())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, wrapped)]
    for m, o in zip((plain, wrapped), opts, strict=True):
        for x, y in data:
            step(m, o, x, y)
    sd_plain, sd_wrapped = (o.state_dict() for o in opts)
    assert sd_plain["param_groups"] == sd_wrapped["param_groups"]
    assert sd_plain["state"].keys() == sd_wrapped["state"].keys()
    for k, st in sd_plain["state"].items():
        for name, v in st.items():
            assert v.shape == sd_wrapped["state"][k][name].shape, (k, name)
    fresh = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    fresh.load_state_dict(sd_wrapped)
    torch.optim.AdamW(wrapped.parameters(), lr=1e-3).load_state_dict(sd_plain)


def test_pickle_round_trip_of_a_wrapped_model():
    model = mesa_lite.wrap(tiny_vit())
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded.blocks[0].mlp.fc1) is mesa_lite.Linear
    assert loaded.blocks[0].mlp.fc1.mesa_spec == model.blocks[0].mlp.fc1.mesa_spec
    x, y = batches(1)[0]
    model.eval(), loaded.eval()
    assert_equal(loaded(x), model(x), "forward after pickling")
    # and it still trains compressed: the saved activations are codes, not the inputs
    loaded.train()
    kept = mesa_lite.report.saved_bytes(loaded, x)
    plain_kept = mesa_lite.report.saved_bytes(mesa_lite.unwrap(copy.deepcopy(loaded)), x)
    assert kept < 0.5 * plain_kept
    step(loaded, torch.optim.SGD(loaded.parameters(), lr=0.1), x, y)
