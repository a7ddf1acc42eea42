"""The memory-budget planner's core (``mesa_lite.planner``): the choice against brute force on
injected measurements (deterministic), the prediction never above the budget, clear errors
naming the terms, the Config round trip through JSON, and the predicted bytes against the
saved-tensor count of a real model wrapped with the plan."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json

import pytest
import torch
from conftest import saved_activation_bytes

import mesa_lite
from mesa_lite.planner import (
    POLICIES,
    Measurements,
    PlanError,
    PolicyCost,
    _unit,
    choose,
    plain_peak,
    smallest_budget,
    smallest_peak,
    to_config,
)

MIB = 2**20
# per block (the same for each): kept MiB, seconds, transient MiB, shaped as DeiT-S measured
COST = {
    "plain": PolicyCost(300 * MIB, 0.0020),
    "int8": PolicyCost(110 * MIB, 0.0030),
    "int4": PolicyCost(60 * MIB, 0.0036),
    "ckpt8": PolicyCost(25 * MIB, 0.0041, transient=110 * MIB),
    "ckpt4": PolicyCost(13 * MIB, 0.0045, transient=110 * MIB),
    "ckpt": PolicyCost(37 * MIB, 0.0034, transient=300 * MIB),
}


def _measurements(n=5, jitter=True):
    costs = {}
    for p, c in COST.items():
        # blocks that differ a little, so that the order of the choice matters
        costs[p] = tuple(
            PolicyCost(
                c.kept + (i * 3 * MIB if jitter else 0), c.seconds * (1 + 0.01 * i), c.transient
            )  # fmt: skip
            for i in range(n)
        )
    return Measurements(blocks=tuple(f"blocks.{i}" for i in range(n)), costs=costs,
                        static=500 * MIB, outside=40 * MIB, temporaries=80 * MIB,
                        other_seconds=0.005)  # fmt: skip


def _block_bytes(m: Measurements, choice) -> list[int]:
    """What each block keeps under ``choice``: its measured bytes; after a block under
    another policy also what it borrowed from it, less the tensors passed between them that
    both keep as they are; and unless all blocks up to it have one policy, what it borrowed
    from blocks further back."""
    cs = [m.costs[p][i] for i, p in enumerate(choice)]
    out = [cs[0].kept]
    for i in range(1, len(cs)):
        apart = choice[i] != choice[i - 1]
        both = sum(min(o, k) for o, k in zip(cs[i - 1].raw_out, cs[i].raw_in, strict=False))
        mixed = len(set(choice[: i + 1])) > 1
        out.append(cs[i].kept + (cs[i].borrowed - both) * apart + cs[i].borrowed_far * mixed)
    return out


def _training_peak(m: Measurements, choice) -> int:
    """The planner's peak model, written out: the most alive while some block's backward runs
    (the blocks up to it keep their bytes)."""
    fixed = m.static + m.outside + m.temporaries
    cs = [m.costs[p][i] for i, p in enumerate(choice)]
    kept = _block_bytes(m, choice)
    return fixed + max(sum(kept[: i + 1]) + cs[i].transient for i in range(len(cs)))


def _every_choice(m: Measurements) -> list[tuple[float, tuple, int]]:
    """(seconds, choice, training peak) of every choice, one checkpoint width per plan."""
    out = []
    for choice in itertools.product(POLICIES, repeat=len(m.blocks)):
        if len({"ckpt8", "ckpt4", "ckpt"} & set(choice)) > 1:
            continue
        t = sum(m.costs[p][i].seconds for i, p in enumerate(choice))
        out.append((t, choice, _training_peak(m, choice)))
    return out


def _brute_force(m: Measurements, budget: int, choices=None):
    """The fastest feasible choice by enumeration (``choices``: ``_every_choice(m)``), or
    plain on every block where that fits (``choose`` trusts no timing faster than plain's)."""
    best = None
    for t, choice, peak in choices or _every_choice(m):
        if peak <= budget and set(choice) == {"plain"}:
            return (t, choice, peak)
        if peak <= budget and (best is None or t < best[0] - 1e-12):
            best = (t, choice, peak)
    return best


@pytest.mark.parametrize("budget_mib", [2300, 1700, 1300, 1000, 900, 850])
def test_choice_is_the_fastest_that_fits(budget_mib):
    m = _measurements()
    budget = budget_mib * MIB
    plan = choose(m, budget)
    assert plan.peak <= budget
    # the choice counts bytes exactly and time in units of _unit(m), each block's rounded to
    # the nearest: it is no faster than the exact optimum, and slower by under a unit a block
    best = _brute_force(m, budget)
    t = plan.seconds - m.other_seconds
    assert best[0] - 1e-12 <= t <= best[0] + len(m.blocks) * _unit(m), (plan.policies, best)
    cs = [m.costs[p][i] for i, p in enumerate(plan.policies)]
    assert plan.saved == sum(c.kept for c in cs)
    assert plan.peak == _training_peak(m, plan.policies)
    assert plan.peak == sum(v for k, v in plan.terms.items() if k != "optimizer_step")
    assert plan.seconds == pytest.approx(m.other_seconds + sum(c.seconds for c in cs))


def test_tighter_budgets_cost_time_and_the_loosest_is_plain():
    m = _measurements()
    times = [choose(m, b * MIB).seconds for b in (2300, 1500, 1100, 900, 850)]
    assert times == sorted(times)
    assert choose(m, 2300 * MIB).policies == ("plain",) * 5


def test_budget_below_static_memory_names_the_terms():
    m = _measurements()
    with pytest.raises(PlanError, match=r"parameters, gradients and optimizer state 500\.0 MiB"):
        choose(m, 600 * MIB)


def test_budget_below_every_choice_says_so():
    m = _measurements()
    exact = min(_training_peak(m, ch) for ch in itertools.product(POLICIES, repeat=5)
                if len({"ckpt8", "ckpt4", "ckpt"} & set(ch)) <= 1)  # fmt: skip
    floor, peak = smallest_budget(m), smallest_peak(m)
    # bytes are counted exactly; the search stops within 1/10,000 of the budget
    slack = floor // 10_000 + 1
    assert exact <= peak <= floor <= exact + slack
    assert choose(m, floor).peak == peak
    with pytest.raises(PlanError, match=f"smallest budget a plan fits is {floor / 2**20:.1f} MiB"):
        choose(m, floor - floor // 5000)


def test_the_peak_follows_the_backward_order():
    """A block's recompute happens while only the blocks before it hold their bytes: a large
    transient fits at the first block where it would not at the last; the optimizer step's
    peak can be the peak."""
    big = PolicyCost(10 * MIB, 1.0, transient=100 * MIB)  # slow but keeps little
    plain = PolicyCost(60 * MIB, 0.1)
    m = Measurements(blocks=("a", "b"), costs={"plain": (plain, plain), "ckpt8": (big, big)},
                     static=0)  # fmt: skip
    # first block checkpointed: max(10 + 100, 10 + 60) = 110; last: max(60, 60 + 10 + 100)
    assert choose(m, 110 * MIB).policies == ("ckpt8", "plain")  # bytes counted exactly
    assert choose(m, 120 * MIB).policies == ("plain", "plain")
    with pytest.raises(PlanError):
        choose(m, 109 * MIB)
    fast = PolicyCost(10 * MIB, 0.01, transient=100 * MIB)
    plain = PolicyCost(70 * MIB, 0.1)  # plain on both blocks (140) does not fit 139
    m = dataclasses.replace(m, costs={"plain": (plain, plain), "ckpt8": (fast, fast)})
    plan = choose(m, 139 * MIB)  # (ckpt8, ckpt8): 110 at a, 20 + 100 at b
    assert plan.policies == ("ckpt8", "ckpt8") and plan.peak == 120 * MIB
    assert plan.terms["kept"] == 20 * MIB and plan.terms["transient"] == 100 * MIB
    assert plan.saved == 20 * MIB
    m = dataclasses.replace(m, optimizer_peak=130 * MIB)
    plan = choose(m, 131 * MIB)
    assert plan.peak == 130 * MIB and plan.where == "optimizer step"
    assert plan.terms["optimizer_step"] == 130 * MIB
    with pytest.raises(PlanError, match="optimizer step's peak 130.0 MiB"):
        choose(m, 125 * MIB)


def test_bad_measurements_are_refused():
    with pytest.raises(ValueError, match="unknown policies"):
        Measurements(blocks=("b",), costs={"int3": (COST["int8"],)}, static=0)
    with pytest.raises(ValueError, match="1 entries for 2 blocks"):
        Measurements(blocks=("a", "b"), costs={"int8": (COST["int8"],)}, static=0)
    with pytest.raises(ValueError, match="non-negative"):
        PolicyCost(-1, 0.1)
    with pytest.raises(ValueError, match="one width"):
        to_config(["a", "b"], ["ckpt8", "ckpt4"])


def test_a_larger_budget_never_loses_a_plan():
    """Found by review: the memory unit used to follow the budget, so a budget one byte larger
    could round a block up past it and find nothing. It follows the measurements now."""
    m = _measurements()
    floor = smallest_budget(m)
    times = []
    for budget in range(floor, floor + 40 * MIB, 997 * 1024 + 1):
        times.append(choose(m, budget).seconds)  # never a PlanError above the floor
    assert times == sorted(times, reverse=True)


@pytest.mark.parametrize("shared", [False, True])
def test_the_choice_against_brute_force_on_seeded_random_blocks(shared):
    """Random costs per block and policy (fixed seeds): a plan is found exactly when one fits,
    it fits, and it is the fastest up to the time rounding; with ``shared`` the blocks also
    borrow from their neighbours and keep the tensors passed between them (the peak then
    depends on the neighbours' policies)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(15):
        r = torch.rand(4, len(POLICIES), 6, generator=gen).tolist()

        def cost(i, k, p, r=r):
            x = r[i][k]
            kept = int(1 + 100 * MIB * x[0])
            transient = int(50 * MIB * x[2]) if p in ("ckpt8", "ckpt4", "ckpt") else 0
            if not shared:
                return PolicyCost(kept, x[1], transient)
            borrowed = int(40 * MIB * x[3])
            # two tensors passed between blocks, each kept as it is or not, on either side
            raw = int(30 * MIB * x[4])
            raw_in, raw_out = (raw * (x[5] > 0.5), raw * (x[5] < 0.3)), (raw * (x[5] > 0.2), 0)
            far = int(20 * MIB * x[3] * x[4]) * (i > 1)
            return PolicyCost(kept + sum(raw_in), x[1], transient, borrowed, raw_in, raw_out, far)

        costs = {p: tuple(cost(i, k, p) for i in range(4)) for k, p in enumerate(POLICIES)}
        m = Measurements(blocks=tuple("abcd"), costs=costs, static=10 * MIB)
        choices = _every_choice(m)
        for budget in torch.linspace(10 * MIB, 300 * MIB, 9, dtype=torch.float64).tolist():
            best = _brute_force(m, int(budget), choices)
            if best is None:
                with pytest.raises(PlanError):
                    choose(m, int(budget))
                continue
            plan = choose(m, int(budget))
            assert plan.peak == _training_peak(m, plan.policies) <= budget
            assert plan.saved == sum(_block_bytes(m, plan.policies))
            t = plan.seconds - m.other_seconds
            assert best[0] - 1e-12 <= t <= best[0] + 4 * _unit(m)


def test_budget_as_a_fraction_of_the_plain_peak_and_bad_budgets():
    m = _measurements()
    full = plain_peak(m)
    assert full == _training_peak(m, ["plain"] * 5)
    assert choose(m, 1.0).policies == ("plain",) * 5
    half = choose(m, 0.5)
    assert half.peak <= full // 2 and half.policies == choose(m, full // 2).policies
    assert choose(m, float(full)).policies == ("plain",) * 5  # whole bytes as a float
    np = pytest.importorskip("numpy")
    assert choose(m, np.int64(full // 2)).policies == half.policies  # numpy's scalars
    assert choose(m, np.float32(0.5)).peak <= full // 2
    for bad, err in [("1GB", TypeError), (True, TypeError), (0.0, ValueError), (1, ValueError),
                     (-5, ValueError), (float("nan"), ValueError), (1.5, ValueError)]:  # fmt: skip
        with pytest.raises(err, match="budget"):
            choose(m, bad)
    no_plain = dataclasses.replace(m, costs={"int8": m.costs["int8"]})
    with pytest.raises(ValueError, match="no 'plain' policy"):
        choose(no_plain, 0.5)


def test_choose_leaves_out_4_bits_for_a_base_with_an_odd_group_size():
    m = _measurements()
    with pytest.warns(UserWarning, match="even group size"):
        plan = choose(m, 1000 * MIB, mesa_lite.Config(group_size=127))
    assert not {"int4", "ckpt4"} & set(plan.policies)
    assert plan.config.group_size == 127
    assert "int4" in choose(m, 1000 * MIB).policies  # the choice with an even group size


def test_errors_name_the_term_that_is_over_the_budget():
    m = dataclasses.replace(_measurements(), optimizer_peak=700 * MIB)
    with pytest.raises(PlanError, match=r"below the optimizer step's peak 700\.0 MiB") as e:
        choose(m, 650 * MIB)  # above the fixed terms (620 MiB), below the optimizer's peak
    assert "no activation policy changes: 620" not in str(e.value)
    tiny = Measurements(blocks=("b",), costs={"plain": (PolicyCost(10, 0.1),)}, static=5000)
    with pytest.raises(PlanError, match="budget 4,000 bytes .* 5,000 bytes"):
        choose(tiny, 4000)
    with pytest.raises(ValueError, match="more than once"):
        Measurements(blocks=("a", "a"), costs={"plain": (COST["plain"],) * 2}, static=0)
    with pytest.raises(ValueError, match="finite"):
        PolicyCost(1, float("inf"))


def test_plan_overrides_come_after_the_base_s():
    """Found by review: a base override with a block's own key kept its earlier place, so a
    later base glob won over the plan's choice for that block."""
    base = mesa_lite.Config(overrides={"b0.*": {"group_size": 32}, "b*": {"bits": 2}})
    cfg = to_config(["b0", "b1"], ["int8", "plain"], base)
    assert list(cfg.overrides)[-4:] == ["b0", "b0.*", "b1", "b1.*"]
    assert cfg.spec_for("b0.fc", "linear").bits == 8
    assert cfg.spec_for("b0.fc", "linear").group_size == 32
    assert cfg.spec_for("b1.fc", "linear") is None


def test_blocks_whose_names_are_globs():
    """Found by review: a block named ``l[0]`` made a "l[0].*" override, an fnmatch class
    that matches nothing inside it; names are escaped now."""
    from mesa_lite.planner import measure

    torch.manual_seed(0)
    net = torch.nn.Sequential()
    for i in range(2):
        net.add_module(f"l[{i}]", torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()))
    net.add_module("l0", torch.nn.Linear(16, 4))  # what "l[0]" as a glob would match
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    m = measure(net, lambda mdl: mdl(x).square().mean(), blocks=["l[0]", "l[1]"], timed=1,
                policies=("plain", "int8", "ckpt8"))  # fmt: skip
    assert m.costs["plain"][0].kept > m.costs["int8"][0].kept > 0
    cfg = to_config(m.blocks, ["int8", "ckpt8"], leaves=m.leaves)
    assert cfg.spec_for("l[0].0", "linear").bits == 8 and cfg.spec_for("l0", "linear").bits == 8
    cfg = to_config(m.blocks, ["plain", "ckpt8"], leaves=m.leaves)
    assert cfg.spec_for("l[0].0", "linear") is None
    assert cfg.spec_for("l0", "linear") is not None  # the glob class no longer matches l0
    wrapped = mesa_lite.wrap(copy.deepcopy(net), cfg)
    assert torch.equal(wrapped(x), net(x))
    with pytest.raises(ValueError, match="more than once"):
        measure(net, lambda mdl: mdl(x).sum(), blocks=["l[0]", "l[0]"], timed=1)
    with pytest.raises(ValueError, match="no parameters"):
        measure(torch.nn.Sequential(torch.nn.GELU()), lambda mdl: mdl(x).sum(), blocks=["0"])


def test_config_round_trip_through_json():
    m = _measurements()
    plan = choose(m, 1000 * MIB, mesa_lite.Config(group_size=64))
    assert {"plain", "int4"} & set(plan.policies) or "ckpt8" in plan.policies
    kwargs = json.loads(json.dumps(plan.config_kwargs()))
    again = mesa_lite.Config(**kwargs)
    assert again == plan.config
    assert again.group_size == 64
    assert "plan: peak" in str(plan) and "blocks:" in str(plan)


def _kept(model, x) -> int:
    params = list(model.parameters())
    kept, out = saved_activation_bytes(lambda: model(x), params)
    del out
    return kept


def test_predicted_bytes_match_the_saved_tensors_of_the_wrapped_model():
    """On a 4-block timm ViT (fp32, CPU): each policy's bytes per block are measured with the
    policy on every block; the plan for a budget between all-int8 and all-int4 mixes policies;
    wrapped with the plan's Config, the model keeps what the plan predicts, within 2%."""
    torch.manual_seed(0)
    import timm

    base = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2, num_classes=5
    ).train()
    blocks = tuple(f"blocks.{i}" for i in range(4))
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    total = {}
    for p in ("plain", "int8", "int4"):
        total[p] = _kept(mesa_lite.wrap(copy.deepcopy(base), to_config(blocks, [p] * 4)), x)
    # outside the blocks the model keeps the same under every policy: plain's patch embedding
    # and head (wrapped, the Linear head and last norm keep int8: measured on their own)
    plain_model = copy.deepcopy(base)
    outside = _kept(plain_model, x) - _kept_blocks(plain_model, x)
    per_block = {p: (total[p] - outside) / 4 for p in total}
    assert per_block["plain"] > per_block["int8"] > per_block["int4"] > 0
    costs = {p: tuple(PolicyCost(round(per_block[p]), 1.0 + {"plain": 0, "int8": 1, "int4": 2}[p])
                      for _ in blocks) for p in per_block}  # fmt: skip
    m = Measurements(blocks=blocks, costs=costs, static=0, outside=round(outside))
    slack = (per_block["int8"] - per_block["int4"]) / 2  # room for rounding, not a third int8
    budget = round(outside + 2 * per_block["int8"] + 2 * per_block["int4"] + slack)
    plan = choose(m, budget)
    assert sorted(plan.policies) == ["int4", "int4", "int8", "int8"], plan.policies
    measured = _kept(mesa_lite.wrap(copy.deepcopy(base), plan.config), x)
    assert measured == pytest.approx(plan.peak, rel=0.02), (measured, plan.peak)


def _kept_blocks(model, x) -> int:
    """Bytes kept by the blocks alone (their forward under the saved-tensor count)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    hooks = []
    for b in model.blocks:
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks.append(b.register_forward_pre_hook(lambda *a, c=ctx: c.__enter__()))
        hooks.append(b.register_forward_hook(lambda *a, c=ctx: c.__exit__(None, None, None)))
    out = model(x)
    for h in hooks:
        h.remove()
    del out
    return sum(v for k, v in seen.items() if k not in skip)


def test_measure_then_choose_on_a_real_model():
    """measure() on a 4-block timm ViT (CPU, fp32, AdamW): the policies keep what they should
    relative to each other, the static term is parameters + gradients + AdamW's two moments
    (and its step counters), and a plan chosen from the measurements keeps, wrapped, what it
    predicts (outside the blocks included) within 2%."""
    import timm

    from mesa_lite.planner import measure

    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2, num_classes=5
    ).train()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def step_fn(m):
        return m(x).square().mean()

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)

    m = measure(model, step_fn, adamw, timed=1)
    assert m.blocks == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    kept = {p: m.costs[p][0].kept for p in POLICIES}
    assert kept["plain"] > kept["int8"] > kept["int4"] > 0
    assert kept["int8"] > kept["ckpt8"] > kept["ckpt4"] > 0  # the input copy only
    # exact checkpointing keeps the fp32 input itself: four times the int8 codes, less scales
    assert 3.5 * kept["ckpt8"] < kept["ckpt"] < kept["int4"]
    assert m.costs["ckpt8"][0].transient == m.costs["ckpt"][0].transient == kept["plain"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    assert params * 4 <= m.static <= params * 4 + n_tensors * 8  # + AdamW's step counters
    assert all(c.seconds > 0 for cs in m.costs.values() for c in cs)
    # CPU timings are noise: the choice below runs on fixed times (plain fastest), so that
    # the test checks the bytes, deterministically
    rank = {"plain": 1.0, "int8": 2.0, "int4": 3.0, "ckpt8": 4.0, "ckpt4": 5.0, "ckpt": 3.5}
    costs = {p: tuple(dataclasses.replace(c, seconds=rank[p]) for c in cs)
             for p, cs in m.costs.items()}  # fmt: skip
    m = dataclasses.replace(m, costs=costs)
    budget = m.static + m.outside + 2 * kept["int8"] + 2 * kept["plain"] + kept["plain"] // 4
    plan = choose(m, budget)
    assert plan.peak <= budget and "plain" in plan.policies
    wrapped = mesa_lite.wrap(copy.deepcopy(model), plan.config)
    measured = _kept(wrapped, x)
    assert measured == pytest.approx(plan.terms["outside"] + plan.terms["kept"], rel=0.02)


def test_measure_finds_a_hugging_face_decoder_s_layers():
    """A tiny Llama (transformers): its decoder layers are the blocks, the policies measure
    and a plan wraps it with the same loss (forward outputs are torch's)."""
    transformers = pytest.importorskip("transformers")
    from mesa_lite.planner import measure

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=100, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))

    def step_fn(m):
        return m(input_ids=ids, labels=ids).loss

    m = measure(model, step_fn, policies=("plain", "int8", "ckpt8"), timed=1)
    assert m.blocks == ("model.layers.0", "model.layers.1", "model.layers.2")
    kept = {p: m.costs[p][0].kept for p in m.costs}
    assert kept["plain"] > kept["int8"] > kept["ckpt8"] > 0
    plan = choose(m, m.static + m.outside + m.temporaries + kept["plain"] + 2 * kept["int8"])
    wrapped = mesa_lite.wrap(copy.deepcopy(model), plan.config)
    assert torch.equal(step_fn(wrapped), step_fn(model))


def test_config_from_a_base_with_its_own_checkpointing_rounding_and_overrides():
    """Found by review: the plan decides what is checkpointed (a base's checkpoint and
    checkpoint_every do not leak into it), an int8 block is int8 whatever a base glob says,
    a base override with the planner's key is merged, and every field survives JSON."""
    base = mesa_lite.Config(checkpoint="blocks", checkpoint_every=2, rounding="stochastic",
                            checkpoint_inner="compressed",
                            overrides={"b1.*": {"bits": 4}, "b2.*": {"group_size": 32}})  # fmt: skip
    cfg = to_config(["b0", "b1", "b2"], ["ckpt8", "int8", "int4"], base)
    assert cfg.checkpoint == ("b0",) and cfg.checkpoint_every == 1 and cfg.checkpoint_bits == 8
    assert dict(cfg.overrides["b1.*"]) == {"bits": 8}
    assert dict(cfg.overrides["b2.*"]) == {"group_size": 32, "bits": 4}
    m = Measurements(blocks=("b0", "b1", "b2"), costs={p: (COST[p],) * 3 for p in POLICIES},
                     static=0)  # fmt: skip
    plan = choose(m, 10 * 2**30, base)
    again = mesa_lite.Config(**json.loads(json.dumps(plan.config_kwargs())))
    assert again == plan.config and again.rounding == "stochastic"
    assert again.checkpoint is None  # all plain at this budget: nothing checkpointed


def test_measure_leaf_blocks_eval_mode_and_odd_group_size():
    """Leaf modules as blocks get no "<name>.*" override (wrap refuses a pattern that matches
    nothing); a model in eval mode is measured as it trains; 4-bit policies are skipped with
    a warning when the group size is odd."""
    from mesa_lite.planner import measure

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                              torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()  # fmt: skip
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    m = measure(net, lambda mdl: mdl(x).square().mean(), blocks=["0", "2"], timed=1,
                policies=("plain", "int8"))  # fmt: skip
    assert m.leaves == ("0", "2")
    assert m.costs["plain"][0].kept > m.costs["int8"][0].kept > 0  # trained, not eval
    with pytest.warns(UserWarning, match="need an even group size"):
        m = measure(net, lambda mdl: mdl(x).square().mean(), blocks=["0", "2"], timed=1,
                    base=mesa_lite.Config(group_size=63))  # fmt: skip
    assert set(m.costs) == {"plain", "int8", "ckpt8", "ckpt"}
    plan = choose(m, m.static + m.outside + sum(c.kept for c in m.costs["plain"]))
    mesa_lite.wrap(copy.deepcopy(net), plan.config)  # the plan's patterns all match


@pytest.mark.parametrize("name", ["test_convnext", "resnet18", "swin"])
def test_measure_and_plan_other_timm_families(name):
    """Swin, ConvNeXt and ResNet (small timm models, CPU, no drop path): the repeated blocks are
    found inside the stages, every policy is measured, and a plan at a budget between the
    leanest and the plainest wraps the model with the same forward output as plain. Mixed
    policies keep no more than predicted (a ResNet block's in-place ReLU output is the next
    block's input, kept once by both, or as codes the next convolutions reuse: policies that
    differ across that boundary keep it twice, or in two forms), and at most 10% less."""
    timm = pytest.importorskip("timm")
    from mesa_lite.planner import measure

    torch.manual_seed(0)
    if name == "swin":
        model = timm.models.swin_transformer.SwinTransformer(
            img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2),
            num_heads=(2, 2), num_classes=5, drop_path_rate=0.0)  # fmt: skip
    else:
        model = timm.create_model(name, pretrained=False, num_classes=5)
    model.train()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    base = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)
    m = measure(model, lambda mdl: mdl(x).square().mean(), timed=1, base=base)
    assert len(m.blocks) >= 2 and set(m.costs) == set(POLICIES)
    plain = sum(c.kept for c in m.costs["plain"])
    assert all(sum(c.kept for c in m.costs[p]) < plain for p in POLICIES if p != "plain")
    budget = m.static + m.outside + (plain + sum(c.kept for c in m.costs["int8"])) // 2
    plan = choose(m, budget)
    assert plan.peak <= budget
    wrapped = mesa_lite.wrap(copy.deepcopy(model), plan.config)
    with torch.no_grad():
        assert torch.equal(wrapped(x), model(x))
    n = len(m.blocks)
    mixes = [plan.policies] + [
        tuple((p, q)[i % 2] for i in range(n))
        for p, q in itertools.permutations(("plain", "int8", "ckpt"), 2)
    ]
    for choice in mixes:
        config = to_config(m.blocks, choice, base, m.leaves)
        kept = _kept_in_training(model, config, x)
        fresh = mesa_lite.wrap(copy.deepcopy(model), config)
        first, _ = saved_activation_bytes(lambda fresh=fresh: fresh(x).square().mean(),
                                          list(fresh.parameters()))  # fmt: skip
        predicted = m.outside + sum(_block_bytes(m, choice))
        # the prediction bounds the first step too (its ReLUs keep their own codes); bounding
        # it costs a ResNet's mixes up to 9% over what they keep
        assert max(kept, first) <= predicted <= 1.1 * max(kept, first), (choice, kept, predicted)


def _kept_in_training(model, config, x) -> int:
    """Bytes a copy of ``model`` wrapped with ``config`` keeps in the forward of its third
    training step (``model(x).square().mean()``, the step ``measure`` was given): the ReLUs
    learn in training whether the next layer reuses their codes."""
    wrapped = mesa_lite.wrap(copy.deepcopy(model), config)
    for _ in range(2):
        wrapped(x).square().mean().backward()
    kept, out = saved_activation_bytes(
        lambda: wrapped(x).square().mean(), list(wrapped.parameters())
    )
    return kept


class _TwoTensors(torch.nn.Module):
    """Blocks passing two tensors: plain keeps ``a`` as it is (the ReLU's output), int8 keeps
    ``b`` as it is (a plain multiply)."""

    def __init__(self, d):
        super().__init__()
        self.l1, self.act, self.l2 = torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d)

    def forward(self, a, b):
        return self.act(self.l1(a)), self.l2(b) * b


class _Reads(torch.nn.Module):
    """A block reading a context tensor ``c`` (``uses``) or not."""

    def __init__(self, d, uses):
        super().__init__()
        self.l, self.lc = torch.nn.Linear(d, d), torch.nn.Linear(d, d) if uses else None

    def forward(self, h, c):
        return h + self.l(h) + (self.lc(c) if self.lc is not None else 0)


class _Net(torch.nn.Module):
    def __init__(self, kind, d=32):
        super().__init__()
        self.kind, self.inp = kind, torch.nn.Linear(d, 2 * d)
        if kind == "two tensors":
            self.blocks = torch.nn.ModuleList(_TwoTensors(d) for _ in range(4))
        else:  # blocks 0 and 2 read c, made outside: block 2 shares it with block 0
            self.blocks = torch.nn.ModuleList(_Reads(d, i % 2 == 0) for i in range(4))

    def forward(self, x):
        a, b = (t.contiguous() for t in self.inp(x).chunk(2, -1))
        for block in self.blocks:
            a, b = block(a, b) if self.kind == "two tensors" else (block(a, b), b)
        return a + b


@pytest.mark.parametrize("kind", ["two tensors", "context"])
def test_mixes_of_blocks_sharing_several_tensors_or_one_further_back(kind):
    """Found in review: blocks passing two tensors, each kept as it is by another policy
    (counted as one, 12% under), and a tensor a block shares with a block two back (17%
    under). Every mix of plain and int8: the prediction is never below the kept bytes, and
    above them at most by the context tensor counted again where a block between (under
    another policy) hides that its reader shares it (up to 21% of these tiny blocks)."""
    from mesa_lite.planner import measure

    torch.manual_seed(0)
    net = _Net(kind).train()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    blocks = [f"blocks.{i}" for i in range(4)]
    m = measure(net, lambda mdl: mdl(x).square().mean(), timed=1, blocks=blocks,
                policies=("plain", "int8"))  # fmt: skip
    for choice in itertools.product(("plain", "int8"), repeat=4):
        kept = _kept_in_training(net, to_config(m.blocks, choice), x)
        predicted = m.outside + sum(_block_bytes(m, choice))
        assert kept <= predicted <= 1.25 * kept, (choice, kept, predicted)


def _resnet_and_base():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=5).train()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    base = mesa_lite.Config(layers=mesa_lite.DEFAULT_LAYERS | mesa_lite.OPT_IN_KINDS)
    return model, x, base


def test_the_plan_applies_the_base_it_was_measured_on():
    """Measured with the convolutions compressed, the plan compresses them too (its config
    is written on the measured base, not on Config()), and a plan asked on another base is
    refused by name."""
    from mesa_lite.planner import measure

    model, x, base = _resnet_and_base()
    m = measure(model, lambda mdl: mdl(x).square().mean(), timed=1, base=base,
                policies=("plain", "int8"))  # fmt: skip
    assert m.base == base
    plan = choose(m, 1.0)
    assert plan.config.layers == base.layers
    wrapped = mesa_lite.wrap(copy.deepcopy(model), plan.config)
    assert any(type(mod).__name__ == "Conv2d" and hasattr(mod, "mesa_spec")
               for mod in wrapped.modules())  # fmt: skip
    kept = _kept_in_training(model, plan.config, x)
    assert kept <= m.outside + sum(_block_bytes(m, plan.policies))
    with pytest.raises(ValueError, match="base differs from the Config the measurements"):
        choose(m, 1.0, base=mesa_lite.Config())
    assert choose(m, 1.0, base=base).config == plan.config


def test_the_prediction_bounds_the_first_step_of_a_fresh_model():
    """A model freshly wrapped with the plan keeps, in its first training step, no more than
    the prediction (its ReLUs keep their own codes until their first backward)."""
    from mesa_lite.planner import measure

    model, x, base = _resnet_and_base()
    m = measure(model, lambda mdl: mdl(x).square().mean(), timed=1, base=base,
                policies=("plain", "int8"))  # fmt: skip
    n = len(m.blocks)
    for choice in (("int8",) * n, tuple(("plain", "int8")[i % 2] for i in range(n))):
        config = to_config(m.blocks, choice, base, m.leaves)
        wrapped = mesa_lite.wrap(copy.deepcopy(model), config)
        first, _ = saved_activation_bytes(
            lambda w=wrapped: w(x).square().mean(), list(wrapped.parameters())
        )
        assert first <= m.outside + sum(_block_bytes(m, choice)), choice


def test_plain_wherever_it_fits_whatever_the_timings_say():
    """Timings from a loaded machine (exact checkpointing and int8 timed faster than plain):
    at a budget the plain model fits, the plan is plain; below it, the fastest that fits."""
    noisy = {**COST, "plain": PolicyCost(300 * MIB, 0.0118), "int8": PolicyCost(110 * MIB, 0.0082),
             "int4": PolicyCost(60 * MIB, 0.0360), "ckpt": PolicyCost(37 * MIB, 0.0066,
                                                                        transient=300 * MIB)}  # fmt: skip
    costs = {p: (c,) * 5 for p, c in noisy.items()}
    m = Measurements(blocks=tuple(f"blocks.{i}" for i in range(5)), costs=costs,
                     static=500 * MIB, outside=40 * MIB, temporaries=80 * MIB)  # fmt: skip
    assert choose(m, 1.0).policies == ("plain",) * 5
    assert choose(m, plain_peak(m)).policies == ("plain",) * 5
    below = choose(m, plain_peak(m) - MIB)
    assert below.policies != ("plain",) * 5 and below.peak <= plain_peak(m) - MIB


def test_plans_print_in_one_unit():
    plan = choose(_measurements(), 2300 * MIB)
    lines = str(plan).splitlines()
    units = {u for line in lines for u in ("GiB", "MiB", "bytes") if f" {u}" in line}
    assert units == {"GiB"}, lines


def test_noisy_step_times_are_timed_longer_then_reported(monkeypatch):
    """A step time that varies beyond planner.NOISE is timed over more steps (up to _MORE
    times as many), and measure warns naming the policy; steady times take ``timed`` steps."""
    from mesa_lite import planner

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
                                  for _ in range(2)])  # fmt: skip
    x = torch.randn(4, 8)
    calls: list[int] = []
    real = planner._step_seconds

    def clock(durations):
        t = [0.0]
        it = itertools.cycle(durations)

        def now():  # start and end of each step: the step lasts the next duration
            calls.append(1)
            if len(calls) % 2:
                return t[0]
            t[0] += next(it)
            return t[0]

        return now

    for durations, steps, warns in (([0.010], 3, False), ([0.010, 0.030, 0.005], 12, True)):
        calls.clear()
        monkeypatch.setattr(planner.time, "perf_counter", clock(durations))
        median, spread = real(model, lambda m: m(x).pow(2).mean(), None, 3, torch.device("cpu"))
        assert len(calls) == 2 * steps and (spread > planner.NOISE) == warns
        assert median == pytest.approx(0.010)
    monkeypatch.setattr(planner, "_step_seconds", lambda *a: (0.02, 0.5))
    with pytest.warns(UserWarning, match=r"varied beyond 10%.*plain 50%.*int8 50%"):
        planner.measure(model, lambda m: m(x).pow(2).mean(), policies=("plain", "int8"),
                        blocks=["0", "1"])  # fmt: skip


def test_no_policy_times_faster_than_plain(monkeypatch):
    """Every policy does plain's work and more: a faster time (a loaded machine) is taken as
    plain's, so a budget just below the plain peak cannot pick a plan predicted faster than
    plain (found by review, with int8 timed faster)."""
    from mesa_lite import planner

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
                                  for _ in range(2)])  # fmt: skip
    x = torch.randn(4, 8)
    # plain, ckpt and int8 (noise: faster), int4, in that order
    times = iter([0.020, 0.010, 0.012, 0.030])
    monkeypatch.setattr(planner, "_step_seconds", lambda *a: (next(times), 0.0))
    m = planner.measure(model, lambda m: m(x).pow(2).mean(),
                        policies=("plain", "ckpt", "int8", "int4"), blocks=["0", "1"])  # fmt: skip
    assert [c.seconds for c in m.costs["ckpt"]] == [0.010, 0.010]  # plain's per block
    assert [c.seconds for c in m.costs["int8"]] == [0.010, 0.010]
    assert [c.seconds for c in m.costs["int4"]] == [0.015, 0.015]


@pytest.mark.parametrize("timed, warmup", [(True, 1), (-1, 1), (2.5, 1), (1, -1)])
def test_bad_step_counts_are_refused(timed, warmup):
    """Found by review: timed=0 looped forever (it is the memory-only mode now)."""
    from mesa_lite import planner

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8)) for _ in range(2)])
    x = torch.randn(4, 8)
    what = "timed" if timed is True or timed != 1 else "warmup"
    with pytest.raises(ValueError, match=f"measure: {what} must be"):
        planner.measure(model, lambda m: m(x).sum(), blocks=["0", "1"], timed=timed, warmup=warmup)


def test_memory_only_measures_the_same_bytes_and_times_nothing(monkeypatch):
    """measure(timed=0) times no step (issue 53: an answer in seconds): the same kept bytes
    and static memory as a timed measurement, the policies ranked by PROXY_STEP_RATIOS, and
    a plan that predicts its peak but no step time, and says so."""
    from mesa_lite import planner

    def no_timing(*a, **k):
        raise AssertionError("memory only: no step may be timed")

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                                      torch.nn.Linear(64, 32))
                                  for _ in range(4)])  # fmt: skip
    x = torch.randn(1024, 32)  # activations well above the static memory
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    step = lambda m: m(x).pow(2).mean()  # noqa: E731
    kw = dict(blocks=["0", "1", "2", "3"], policies=("plain", "int8", "int4"), progress=False)
    timed = planner.measure(model, step, opt, **kw)
    monkeypatch.setattr(planner, "_step_seconds", no_timing)
    fast = planner.measure(model, step, opt, timed=0, **kw)
    assert timed.timed and not fast.timed
    assert fast.static == timed.static and fast.outside == timed.outside
    for p, costs in fast.costs.items():
        assert [c.kept for c in costs] == [c.kept for c in timed.costs[p]], p
        assert {c.seconds for c in costs} == {planner.PROXY_STEP_RATIOS[p] / 4}, p
    plan = planner.choose(fast, 0.6)
    assert plan.seconds is None and "step not timed (memory only)" in str(plan)
    assert plan.peak == planner.choose(
        dataclasses.replace(timed, costs={
            p: [dataclasses.replace(c, seconds=f.seconds) for c, f in zip(cs, fast.costs[p],
                                                                          strict=True)]
            for p, cs in timed.costs.items()}), 0.6).peak  # fmt: skip
    assert plan.peak <= 0.6 * planner.plain_peak(fast)
    assert set(plan.policies) - {"plain"}, plan.policies  # something had to be compressed


def test_a_memory_only_measurement_stays_so_through_budget_py_s_rows():
    """Found by review: budget.py's "measurements" row dropped ``timed``, so a memory-only
    measurement read back predicted the proxy ranking as milliseconds."""
    from mesa_lite.benchmarks import budget

    from mesa_lite import planner

    costs = {p: [PolicyCost(kept=k, seconds=planner.PROXY_STEP_RATIOS[p] / 2)] * 2
             for p, k in (("plain", 4000), ("int8", 1000))}  # fmt: skip
    m = Measurements(blocks=("a", "b"), costs=costs, static=100, timed=False)
    back = budget.measurements_of(json.loads(json.dumps(budget._measurements_row(m))))
    assert back.timed is False
    plan = planner.choose(back, 5000)
    assert plan.seconds is None and "not timed" in str(plan)
    timed = dataclasses.replace(m, timed=True)
    assert budget.measurements_of(budget._measurements_row(timed)).timed is True


def test_measure_shows_progress_with_the_step_count_up_front(monkeypatch):
    """planner.measure draws a tqdm bar whose description states the steps it will run (each
    policy's warmup, one counted step and the timed ones) and ticks once a step (issue 53: a
    200 s measure printed nothing)."""
    import tqdm

    from mesa_lite import planner

    made = []

    class Bar:
        def __init__(self, total, desc, **kw):
            self.total, self.desc, self.n, self.postfix = total, desc, 0, []
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            self.n += n

        def set_postfix_str(self, s):
            self.postfix.append(s)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    t = [0.0]

    def steady():  # every step lasts 10 ms: no noise, so exactly `timed` steps are timed
        t[0] += 0.005
        return t[0]

    monkeypatch.setattr(planner.time, "perf_counter", steady)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
                                  for _ in range(2)])  # fmt: skip
    x = torch.randn(4, 8)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    planner.measure(model, lambda m: m(x).pow(2).mean(), opt, policies=("plain", "int8"),
                    blocks=["0", "1"], warmup=2, timed=3)  # fmt: skip
    (bar,) = made
    assert bar.desc == "planner.measure: 2 policies x 6 steps" and bar.total == 12
    assert bar.n == 12 and bar.postfix == ["plain", "int8"]
    made.clear()
    planner.measure(model, lambda m: m(x).pow(2).mean(), policies=("plain",), blocks=["0", "1"],
                    progress=False)  # fmt: skip
    assert made == []
