"""wrap/unwrap and Config: in place, idempotent, same Parameters and state_dict, clear errors."""

import copy
import dataclasses
import io
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import assert_equal

import mesa_lite
from mesa_lite import Config, QuantSpec
from mesa_lite.modules import MesaModule


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 10)
        self.sm = nn.Softmax(dim=-1)
        self.sub = nn.Sequential(nn.Linear(10, 10), nn.ReLU())

    def forward(self, x):
        return self.sub(self.sm(self.fc2(self.act(self.fc1(self.norm(x))))))


def test_wrap_in_place_keeps_parameters_and_keys():
    net = Net()
    params = {n: p for n, p in net.named_parameters()}
    keys = list(net.state_dict())
    out = mesa_lite.wrap(net)
    assert out is net
    assert {n: p for n, p in net.named_parameters()} == params
    assert all(p is params[n] for n, p in net.named_parameters())
    assert list(net.state_dict()) == keys
    kinds = {n: type(m).__name__ for n, m in mesa_lite.wrapped_modules(net).items()}
    assert kinds == {
        "norm": "LayerNorm", "fc1": "Linear", "act": "GELU", "fc2": "Linear",
        "sm": "Softmax", "sub.0": "Linear",
    }  # fmt: skip
    assert isinstance(net.fc1, nn.Linear) and isinstance(net.act, nn.GELU)
    assert type(net.sub[1]) is nn.ReLU


def test_wrap_is_idempotent_and_unwrap_restores():
    net = Net()
    mesa_lite.wrap(net)
    specs = {n: m.mesa_spec for n, m in mesa_lite.wrapped_modules(net).items()}
    mesa_lite.wrap(net, Config(group_size=64))  # already converted: unchanged
    assert {n: m.mesa_spec for n, m in mesa_lite.wrapped_modules(net).items()} == specs
    mesa_lite.unwrap(net)
    assert mesa_lite.wrapped_modules(net) == {}
    assert type(net.fc1) is nn.Linear and type(net.norm) is nn.LayerNorm
    assert "mesa" not in repr(net)
    mesa_lite.wrap(net, Config(group_size=64))
    assert net.fc1.mesa_spec.group_size == 64


def test_state_dict_strict_round_trip_both_ways():
    torch.manual_seed(0)
    plain, wrapped = Net(), mesa_lite.wrap(Net())
    wrapped.load_state_dict(plain.state_dict(), strict=True)
    other = Net()
    other.load_state_dict(wrapped.state_dict(), strict=True)
    for (k, v1), (_, v2) in zip(
        plain.state_dict().items(), other.state_dict().items(), strict=True
    ):
        assert_equal(v2, v1, k)
    buf = io.BytesIO()
    torch.save(wrapped, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.fc1) is mesa_lite.Linear
    x = torch.randn(3, 32)
    assert_equal(loaded(x), plain(x), "reloaded forward")
    assert type(copy.deepcopy(wrapped).fc1) is mesa_lite.Linear


def test_bare_root_module():
    lin = nn.Linear(8, 4)
    w = lin.weight
    assert mesa_lite.wrap(lin) is lin
    assert type(lin) is mesa_lite.Linear and lin.weight is w
    mesa_lite.unwrap(lin)
    assert type(lin) is nn.Linear


def test_repr_shows_compression():
    net = mesa_lite.wrap(Net(), Config(overrides={"fc2": {"group_size": 32}}))
    text = repr(net)
    assert "Linear(in_features=32, out_features=64, bias=True, mesa=int8 g128 nearest)" in text
    assert "mesa=int8 g32 nearest" in text
    assert "Softmax(dim=-1, mesa=int8 g128 nearest)" in text


def test_filter_fn_layers_and_overrides():
    net = mesa_lite.wrap(Net(), filter_fn=lambda name, m: not name.startswith("sub"))
    assert type(net.sub[0]) is nn.Linear and type(net.fc1) is mesa_lite.Linear
    net = mesa_lite.wrap(Net(), Config(layers={"linear"}))
    assert set(mesa_lite.wrapped_modules(net)) == {"fc1", "fc2", "sub.0"}
    net = mesa_lite.wrap(
        Net(), Config(overrides={"fc*": {"enabled": False}, "sub.0": {"rounding": "stochastic"}})
    )
    assert type(net.fc1) is nn.Linear and type(net.fc2) is nn.Linear
    assert net.sub[0].mesa_spec == QuantSpec(rounding="stochastic")


def test_rounding_defaults_by_bits():
    assert QuantSpec().rounding == "nearest"
    assert QuantSpec(bits=4).rounding == "stochastic"
    assert QuantSpec(bits=2, rounding="nearest").rounding == "nearest"
    net = mesa_lite.wrap(Net(), Config(overrides={"fc1": {"bits": 4}, "fc2": {"bits": 2}}))
    assert net.fc1.mesa_spec == QuantSpec(bits=4, rounding="stochastic")
    assert net.fc2.mesa_spec.describe() == "int2 g128 stochastic"
    assert net.norm.mesa_spec.describe() == "int8 g128 nearest"
    assert "mesa=int4 g128 stochastic" in repr(net)


def test_wrapped_forward_equals_plain_and_trains():
    torch.manual_seed(0)
    plain = Net()
    net = mesa_lite.wrap(copy.deepcopy(plain))
    x = torch.randn(16, 32)
    assert_equal(net(x), plain(x), "forward")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        loss = net(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"bits must be one of \[8, 4, 2\], got 3"):
        Config(bits=3)
    with pytest.raises(ValueError, match=r"group_size must be a multiple of 4 with bits=2"):
        Config(bits=2, group_size=6)
    with pytest.raises(ValueError, match=r"overrides\['fc1'\] must be a multiple of 2 with bits=4"):
        Config(group_size=5, overrides={"fc1": {"bits": 4}})
    with pytest.raises(TypeError, match="bits must be an int"):
        Config(bits=8.0)
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        Config(group_size=0)
    with pytest.raises(ValueError, match="group_size must be a positive int, got -5"):
        QuantSpec(group_size=-5)
    with pytest.raises(TypeError, match="group_size must be an int"):
        Config(group_size="128")
    with pytest.raises(ValueError, match=r"rounding must be one of \['nearest', 'stochastic'\]"):
        Config(rounding="floor")
    with pytest.raises(ValueError, match=r"layers has unknown kinds \['conv'\]"):
        Config(layers={"linear", "conv"})
    with pytest.raises(TypeError, match="layers must be a set"):
        Config(layers="linear")
    with pytest.raises(ValueError, match=r"overrides\['fc1'\] has unknown fields \['bitz'\]"):
        Config(overrides={"fc1": {"bitz": 8}})
    with pytest.raises(ValueError, match=r"overrides\['fc1'\].bits must be one of"):
        Config(overrides={"fc1": {"bits": 3}})
    with pytest.raises(ValueError, match=r"'nope' matches no module"):
        mesa_lite.wrap(Net(), Config(overrides={"nope": {"enabled": False}}))
    with pytest.raises(TypeError, match="config must be a mesa_lite.Config"):
        mesa_lite.wrap(Net(), {"bits": 8})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        mesa_lite.wrap("model")


def test_config_is_frozen():
    cfg = Config(overrides={"fc1": {"group_size": 64}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 4
    with pytest.raises(TypeError):
        cfg.overrides["fc1"]["group_size"] = 1


def test_no_supported_layers_warns_and_returns_unchanged():
    net = nn.Sequential(nn.ReLU(), nn.Conv2d(3, 3, 1))
    with pytest.warns(UserWarning, match="no supported layers"):
        out = mesa_lite.wrap(net)
    assert out is net and not any(isinstance(m, MesaModule) for m in net.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesa_lite.wrap(mesa_lite.wrap(nn.Linear(2, 2)))  # already wrapped: no warning


def test_subclasses_are_not_taken_for_their_base():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    net = nn.Sequential(MyLinear(4, 4), nn.Linear(4, 4))
    mesa_lite.wrap(net)
    assert type(net[0]) is MyLinear and type(net[1]) is mesa_lite.Linear
