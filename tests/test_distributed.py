"""Wrapped models under DistributedDataParallel and FSDP2 (``fully_shard``), two CPU processes
on the gloo backend (issue 14).

One spawn runs every check (starting processes costs more than the checks): per rank a tiny
timm ViT, plain and wrapped from the same weights, on that rank's half of one batch.

- DDP, wrap before and after wrapping in DDP: gradients equal on both ranks; in ``debug_exact``
  equal to plain DDP's bit for bit; at 8 bits within the SQNR floor of plain DDP's and of a
  single process on the whole batch (the quantization groups of a rank's half differ from
  the whole batch's, so not bit for bit). ``no_sync`` gradient accumulation likewise.
- FSDP2, ``fully_shard`` per block and at the root with a bf16 ``MixedPrecisionPolicy``:
  losses and gradients (gathered) equal to plain FSDP2's bit for bit in ``debug_exact``, within
  the floor at 8 bits; and the tensors alive between steps (reachable from Python) are the
  plain model's: no unsharded copy of a parameter is held past its use.
- Activation checkpointing (``checkpoint_wrapper`` per block) under DDP (with
  ``find_unused_parameters``) and FSDP2: ``debug_exact`` equals plain bit for bit.
- Compressed checkpointing (``Config(checkpoint=...)``, issue 16) under DDP (with and without
  ``find_unused_parameters``) and FSDP2 per block: ``debug_exact`` equals plain bit for bit,
  8 bits within the floor.
- ``benchmarks/train_deit.py --dist ddp|fsdp`` in the same process group, as under torchrun:
  checkpoints written, an FSDP2 run resumed from its ``torch.distributed.checkpoint``.
"""

import copy
import gc
import math
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import sqnr_db, tiny_vit

import mesa_lite
from mesa_lite import Config

pytest.importorskip("timm")
# 8-bit gradient SQNR floor of the tiny ViT against plain (measured on CPU, 2026-12-01: DDP
# vs plain DDP and vs one process on the whole batch, no_sync accumulation and FSDP2 all above
# 31 dB)
FLOOR_DB = 25.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grads(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[n.replace("module.", "").replace("_fsdp_wrapped_module.", "")] = g
    return out


def _batch(rank: int, world: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * world, 3, 16, 16, generator=g)
    y = torch.randint(0, 5, (4 * world,), generator=g)
    return x, y, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]


def _step(model, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def _ddp_checks(rank, world) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    res = {}
    x, y, xr, yr = _batch(rank, world)
    plain = DDP(tiny_vit().train())
    _step(plain, xr, yr)
    ref = _grads(plain)
    single = mesa_lite.wrap(tiny_vit().train())
    _step(single, x, y)
    whole = _grads(single)
    for exact in (True, False):
        for order in ("before", "after"):
            model = tiny_vit().train()
            cfg = Config(debug_exact=exact)
            if order == "before":
                model = DDP(mesa_lite.wrap(model, cfg))
            else:
                model = DDP(model)
                mesa_lite.wrap(model, cfg)
            assert mesa_lite.wrapped_modules(model), "nothing was converted"
            _step(model, xr, yr)
            got = _grads(model)
            key = f"ddp-{order}-{'exact' if exact else 'int8'}"
            res[key + "-equal-to-plain"] = all(torch.equal(got[n], ref[n]) for n in ref)
            res[key + "-worst-db"] = min(sqnr_db(ref[n], got[n]) for n in ref)
            if not exact:
                res[key + "-vs-single-db"] = min(sqnr_db(whole[n], got[n]) for n in whole)
            flat = torch.cat([got[n].reshape(-1) for n in sorted(got)])
            both = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(both, flat)
            res[key + "-ranks-equal"] = all(torch.equal(both[0], b) for b in both)
    # activation checkpointing per block and find_unused_parameters: debug_exact equals plain
    ck = []
    for wrapped in (False, True):
        model = _checkpointed(tiny_vit().train())
        if wrapped:
            mesa_lite.wrap(model, Config(debug_exact=True))
        model = DDP(model, find_unused_parameters=True)
        _step(model, xr, yr)
        ck.append(_grads(model))
    res["ddp-checkpointed-exact-equal"] = all(torch.equal(ck[0][n], ck[1][n]) for n in ck[0])
    # compressed checkpointing (Config.checkpoint) under DDP, with and without
    # find_unused_parameters: the parameters' gradients reach DDP's hooks through the graph
    # two of the four combinations (the spawn's time is the suite's)
    for unused, exact in ((False, False), (True, True)):
        model = mesa_lite.wrap(
            tiny_vit().train(), Config(checkpoint=["blocks.*"], debug_exact=exact)
        )
        model = DDP(model, find_unused_parameters=unused)
        _step(model, xr, yr)
        got = _grads(model)
        key = f"ddp-ckpt-{'unused' if unused else 'static'}-{'exact' if exact else 'int8'}"
        res[key + "-equal"] = all(torch.equal(got[n], ref[n]) for n in ref)
        res[key + "-worst-db"] = min(sqnr_db(ref[n], got[n]) for n in ref)
        flat = torch.cat([got[n].reshape(-1) for n in sorted(got)])
        both = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(both, flat)
        res[key + "-ranks-equal"] = all(torch.equal(both[0], b) for b in both)
    # gradient accumulation over two micro-batches, the first under no_sync
    for exact in (True, False):
        accum = {}
        for wrapped in (False, True):
            model = tiny_vit().train()
            if wrapped:
                mesa_lite.wrap(model, Config(debug_exact=exact))
            model = DDP(model)
            with model.no_sync():
                _step(model, xr[:2], yr[:2])
            _step(model, xr[2:], yr[2:])
            accum[wrapped] = _grads(model)
        tag = "exact" if exact else "int8"
        a, b = accum[False], accum[True]
        res[f"no_sync-{tag}-equal"] = all(torch.equal(a[n], b[n]) for n in a)
        res[f"no_sync-{tag}-worst-db"] = min(sqnr_db(a[n], b[n]) for n in a)
    return res


def _checkpointed(model):
    """``model`` with each block under ``checkpoint_wrapper`` (non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


def _live_bytes(ignore=()) -> int:
    """Bytes of the distinct storages of the tensors reachable from Python (DTensor shards as
    their local tensors), but those of ``ignore`` (the checks' own results)."""
    seen, n = {t.untyped_storage().data_ptr() for t in ignore}, 0
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor):
            continue
        t = getattr(o, "_local_tensor", o)
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n


def _fsdp_checks(rank, world) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    res = {}
    _, _, xr, yr = _batch(rank, world)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {}
    kept = []  # the gradients this check keeps, left out of the live bytes
    for mode in ("plain", "exact", "int8"):
        model = tiny_vit().train()
        if mode != "plain":
            mesa_lite.wrap(model, Config(debug_exact=mode == "exact"))
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, live = [], []
        for step in range(3):
            losses.append(_step(model, xr, yr))
            if step == 0:
                grads = _grads(model)
                kept += grads.values()
            opt.step()
            opt.zero_grad(set_to_none=True)
            gc.collect()
            live.append(_live_bytes(kept + losses))
        runs[mode] = (torch.stack(losses), grads, live)
        del model, opt
        gc.collect()
    # activation checkpointing under FSDP2: debug_exact equals plain
    ck = {}
    for mode in ("plain", "exact"):
        model = _checkpointed(tiny_vit().train())
        if mode == "exact":
            mesa_lite.wrap(model, Config(debug_exact=True))
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        ck[mode] = (_step(model, xr, yr), _grads(model))
    res["fsdp-checkpointed-exact-equal"] = torch.equal(ck["plain"][0], ck["exact"][0]) and all(
        torch.equal(ck["plain"][1][n], ck["exact"][1][n]) for n in ck["plain"][1]
    )
    # compressed checkpointing of the blocks FSDP2 shards: the recompute runs on the gathered
    # parameters of the backward's all-gather
    for exact in (True, False):
        model = mesa_lite.wrap(
            tiny_vit().train(), Config(checkpoint=["blocks.*"], debug_exact=exact)
        )
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        loss, g = _step(model, xr, yr), _grads(model)
        tag = "exact" if exact else "int8"
        res[f"fsdp-ckpt-{tag}-loss-equal"] = torch.equal(loss, runs["plain"][0][0])
        res[f"fsdp-ckpt-{tag}-grads-equal"] = all(torch.equal(g[n], runs["plain"][1][n]) for n in g)
        res[f"fsdp-ckpt-{tag}-worst-db"] = min(sqnr_db(runs["plain"][1][n], g[n]) for n in g)
    loss0, g0, live0 = runs["plain"]
    for mode in ("exact", "int8"):
        loss, g, live = runs[mode]
        res[f"fsdp-{mode}-first-loss-equal"] = torch.equal(loss[0], loss0[0])
        res[f"fsdp-{mode}-losses-equal"] = torch.equal(loss, loss0)
        res[f"fsdp-{mode}-grads-equal"] = all(torch.equal(g[n], g0[n]) for n in g0)
        res[f"fsdp-{mode}-worst-db"] = min(sqnr_db(g0[n], g[n]) for n in g0)
        res[f"fsdp-{mode}-live-extra-bytes"] = live[-1] - live0[-1]
    return res


def _fsdp_lm_checks(rank, world) -> dict:
    """A tiny Llama under FSDP2 (a unit per decoder layer and the root, bf16 parameters),
    plain and wrapped: the head and loss fused (logits None) with the lm_head in the root's
    unit; built as usual where the lm_head is a unit of its own (its gathered weight is freed
    after its forward). Loss and gradients against plain FSDP2's."""
    try:
        import transformers as tf
    except ImportError:
        return {"fsdp-lm-skipped": "transformers is not installed"}
    from conftest import tiny_lm_config
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tf.logging.set_verbosity_error()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    # 128 tokens a rank: at least 2 x hidden, where the head and loss are fused
    ids = torch.randint(0, 256, (2 * world, 64), generator=g)[2 * rank : 2 * rank + 2]
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM._from_config(tiny_lm_config("llama"), attn_implementation="sdpa")
    runs = {}
    for mode in ("plain", "fused", "head-apart"):
        model = copy.deepcopy(base).train()
        if mode != "plain":
            mesa_lite.wrap(model)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        if mode == "head-apart":
            fully_shard(model.lm_head, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        runs[mode] = (out.loss.detach(), out.logits is None, _grads(model))
    loss0, _, g0 = runs["plain"]
    res = {}
    for mode in ("fused", "head-apart"):
        loss, no_logits, grads = runs[mode]
        res[f"fsdp-lm-{mode}-no-logits"] = no_logits
        res[f"fsdp-lm-{mode}-loss-close"] = torch.allclose(loss, loss0, rtol=1e-3, atol=0)
        res[f"fsdp-lm-{mode}-worst-db"] = min(sqnr_db(g0[n], grads[n]) for n in g0)
    return res


def _train_deit_checks(tmp: str) -> dict:
    """benchmarks/train_deit.py --dist ddp and fsdp in this process group (as under torchrun):
    a few steps, a checkpoint, and an FSDP2 resume from its torch.distributed.checkpoint."""
    from mesa_lite.benchmarks import train_deit

    common = ["--device", "cpu", "--dtype", "fp32", "--model", "deit_tiny_patch16_224",
              "--img-size", "32", "--synthetic-size", "32", "--batch-size", "4",
              "--log-every", "1", "--workers", "0"]  # fmt: skip
    res = {}
    ddp = train_deit.run(common + ["--dist", "ddp", "--max-steps", "2", "--output", f"{tmp}/d"])
    fsdp = train_deit.run(common + ["--dist", "fsdp", "--max-steps", "2", "--output", f"{tmp}/f"])
    res["train-ddp-losses"] = ddp["losses"]
    res["train-fsdp-losses"] = fsdp["losses"]
    res["train-ddp-checkpoint"] = ddp["checkpoint"].is_file()
    res["train-fsdp-checkpoint"] = (fsdp["checkpoint"] / "meta.pth").is_file()
    again = train_deit.run(common + ["--dist", "fsdp", "--epochs", "2", "--max-steps", "3",
                                     "--resume", str(fsdp["checkpoint"]), "--output", f"{tmp}/f"])  # fmt: skip
    res["train-fsdp-resumed-step"] = again["step"]
    return res


def _planner_checks(rank, world) -> dict:
    """mesa_lite.planner under torch.distributed: each rank measures its own half of the
    batch (its timings differ); with ``sync`` (the default) every rank gets rank 0's
    measurements and chooses the same plan."""
    from mesa_lite import planner

    _, _, xr, yr = _batch(rank, world)

    def step_fn(m):
        return torch.nn.functional.cross_entropy(m(xr), yr)

    m = planner.measure(tiny_vit().train(), step_fn, policies=("plain", "int8", "ckpt8"),
                        timed=1)  # fmt: skip
    own = planner.measure(tiny_vit().train(), step_fn, policies=("plain", "int8", "ckpt8"),
                          timed=1, sync=False)  # fmt: skip
    budget = m.static + m.outside + sum(c.kept for c in m.costs["int8"]) + 2**20
    plan = planner.choose(m, budget)
    seen = [None] * world
    dist.all_gather_object(seen, (m, plan.config_kwargs(), own))
    return {
        "planner-measurements-equal": all(s[0] == seen[0][0] for s in seen),
        "planner-plans-equal": all(s[1] == seen[0][1] for s in seen),
        "planner-rank0-own": seen[0][2].costs["plain"][0].kept == m.costs["plain"][0].kept,
    }


def _worker(rank, world, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = _ddp_checks(rank, world)
        res.update(_planner_checks(rank, world))
        try:
            res.update(_fsdp_checks(rank, world))
        except (ImportError, RuntimeError, NotImplementedError) as e:  # no FSDP2 on CPU here
            res["fsdp-skipped"] = f"{type(e).__name__}: {e}"
        if "fsdp-skipped" not in res:
            res.update(_fsdp_lm_checks(rank, world))
            res.update(_train_deit_checks(os.path.dirname(out)))
        torch.save(res, f"{out}.{rank}")
        dist.barrier()  # both ranks' results are written
    except BaseException:
        dist.destroy_process_group()
        raise
    # Once both results are written, end the process without the interpreter's teardown: one
    # CI run of 2,260 tests saw rank 0 abort there ("terminate called without an active
    # exception", after its results were saved) on a loaded machine, which failed every test
    # of this module; what the tests check is in the results files.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = str(tmp_path_factory.mktemp("dist") / "res")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    return [torch.load(f"{out}.{r}") for r in range(2)]


@pytest.mark.parametrize("order", ["before", "after"])
def test_ddp_gradients(results, order):
    for res in results:
        key = f"ddp-{order}"
        assert res[f"{key}-exact-ranks-equal"] and res[f"{key}-int8-ranks-equal"]
        assert res[f"{key}-exact-equal-to-plain"], "debug_exact differs from plain DDP"
        db = res[f"{key}-int8-worst-db"]
        assert FLOOR_DB <= db < math.inf, f"8-bit DDP vs plain DDP: {db:.1f} dB"
        db = res[f"{key}-int8-vs-single-db"]
        assert FLOOR_DB <= db < math.inf, f"8-bit DDP vs one process, whole batch: {db:.1f} dB"


def test_ddp_compressed_checkpointing(results):
    """Config(checkpoint=...) under DDP: debug_exact (with find_unused_parameters) equals
    plain DDP bit for bit, 8 bits (without) within the floor, the ranks agree."""
    for res in results:
        assert res["ddp-ckpt-static-int8-ranks-equal"] and res["ddp-ckpt-unused-exact-ranks-equal"]
        assert res["ddp-ckpt-unused-exact-equal"], "debug_exact differs from plain DDP"
        db = res["ddp-ckpt-static-int8-worst-db"]
        assert FLOOR_DB <= db < math.inf, f"8-bit compressed checkpointing under DDP: {db:.1f} dB"


def test_ddp_no_sync_accumulation(results):
    for res in results:
        assert res["ddp-checkpointed-exact-equal"], "checkpoint_wrapper + DDP"
        assert res["no_sync-exact-equal"]
        assert res["no_sync-int8-worst-db"] >= FLOOR_DB, res["no_sync-int8-worst-db"]


def test_fsdp2(results):
    res = results[0]
    if "fsdp-skipped" in res:
        pytest.skip(f"FSDP2 on CPU with gloo: {res['fsdp-skipped']}")
    for r in results:
        assert r["fsdp-exact-losses-equal"] and r["fsdp-exact-grads-equal"]
        assert r["fsdp-checkpointed-exact-equal"], "checkpoint_wrapper + FSDP2"
        assert r["fsdp-ckpt-exact-loss-equal"] and r["fsdp-ckpt-exact-grads-equal"]
        assert r["fsdp-ckpt-int8-loss-equal"]
        assert FLOOR_DB <= r["fsdp-ckpt-int8-worst-db"] < math.inf, r["fsdp-ckpt-int8-worst-db"]
        assert r["fsdp-int8-first-loss-equal"]  # forward exact; later steps follow the grads
        assert r["fsdp-int8-worst-db"] >= FLOOR_DB, r["fsdp-int8-worst-db"]
        # nothing alive between steps that the plain model does not hold: an unsharded copy
        # of the parameters would be 111 KB here (measured: 22 and 28 bytes more, scalars)
        assert r["fsdp-exact-live-extra-bytes"] < 1024, r["fsdp-exact-live-extra-bytes"]
        assert r["fsdp-int8-live-extra-bytes"] < 1024, r["fsdp-int8-live-extra-bytes"]


def test_fsdp2_language_model_with_the_head_and_loss_fused(results):
    """Issue 52: the fused head and loss under FSDP2, the lm_head in the root's unit; and the
    logits built as usual where the lm_head is sharded as a unit of its own."""
    res = results[0]
    if "fsdp-skipped" in res or "fsdp-lm-skipped" in res:
        pytest.skip(res.get("fsdp-skipped") or res["fsdp-lm-skipped"])
    for r in results:
        assert r["fsdp-lm-fused-no-logits"] and not r["fsdp-lm-head-apart-no-logits"]
        for mode in ("fused", "head-apart"):
            assert r[f"fsdp-lm-{mode}-loss-close"], mode
            assert FLOOR_DB <= r[f"fsdp-lm-{mode}-worst-db"] < math.inf, (
                mode, r[f"fsdp-lm-{mode}-worst-db"])  # fmt: skip


def test_train_deit_under_ddp_and_fsdp2(results):
    """The training script's --dist paths: same losses on every rank (the data is split, the
    logged loss is each rank's own; DDP and FSDP2 in fp32 agree), checkpoints written, an FSDP2
    run resumed from its distributed checkpoint at the step it stopped."""
    res = results[0]
    if "fsdp-skipped" in res:
        pytest.skip(f"FSDP2 on CPU with gloo: {res['fsdp-skipped']}")
    for r in results:
        assert r["train-ddp-checkpoint"] and r["train-fsdp-checkpoint"]
        assert len(r["train-ddp-losses"]) == 2 and all(map(math.isfinite, r["train-ddp-losses"]))
        # the same model, data and fp32 math: DDP and FSDP2 steps agree to rounding
        for a, b in zip(r["train-ddp-losses"], r["train-fsdp-losses"], strict=True):
            assert abs(a - b) < 1e-4, (a, b)
        assert r["train-fsdp-resumed-step"] == 3  # resumed at step 2, one more step


def test_planner_plans_the_same_on_every_rank(results):
    """planner.measure broadcasts rank 0's measurements: the ranks' plans are the same."""
    for r in results:
        assert r["planner-measurements-equal"] and r["planner-plans-equal"]
        assert r["planner-rank0-own"]


def test_copy_keeps_working_after_spawn():
    """The spawned workers leave this process's wrap machinery as it was."""
    model = mesa_lite.wrap(copy.deepcopy(tiny_vit()))
    assert mesa_lite.wrapped_modules(model)
