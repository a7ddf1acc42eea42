"""Step time and activation memory of eager and compiled training, plain and mesa_lite, and of
PyTorch's own compile-time options, in one process, as the median of interleaved passes.

Rows (each a full AdamW step under autocast, one model per row, all alive at once; ``--rows``):
  plain / mesa int8                   the model as built, and wrapped (default Config), eager;
  mesa int8, Triton's launcher        eager mesa int8 with its kernels launched by Triton's
                                      own launcher (the launch path before the static one);
  mesa int8, opt-in kinds             eager, the opt-in kinds wrapped too (convolutions,
                                      BatchNorm, ReLU, ...: mesa_lite.OPT_IN_KINDS);
  ckpt                                timm's activation checkpointing, eager;
  plain compiled                      torch.compile(model);
  mesa int8 compiled, custom_op       mesa_lite.compile(model), quantize/dequantize as opaque
                                      custom ops (Triton);
  mesa int8 compiled, decomposed      mesa_lite.compile(model), quantize/dequantize as PyTorch
                                      ops Inductor fuses (the default,
                                      ``mesa_lite.quant.COMPILE_FORM``);
  mesa int8 compiled, decomposed, Inductor defaults
                                      plain torch.compile(model) of the wrapped model (Inductor's
                                      reorder_for_peak_memory on, see mesa_lite/compiling.py);
  plain compiled, activation_memory_budget 0.5 / 0.2
                                      the partitioner's selective recomputation;
  plain compiled, Inductor fp8 activations
                                      Inductor's fp8 (e5m2) saved-activation pass;
  plain / mesa int8 compiled, reduce-overhead
                                      CUDA graphs (their memory is in graph pools: the
                                      activation column is not comparable there);
  plain, graphed / mesa int8[, opt-in kinds], graphed
                                      eager models captured whole by mesa_lite.graphed
                                      (torch.cuda.make_graphed_callables): forward and
                                      backward replayed as two CUDA graphs; their activation
                                      column counts the graph pool's free part too.

Each pass runs ``--steps`` steps of every row in turn; a row's step time is the median over
all its steps of all passes, and its ratio is against its base row (eager plain, compiled
plain, or reduce-overhead plain). Activation memory: the row's peak over its steps minus what
was allocated before them (all models' parameters, gradients and optimizer state are alive
throughout, so this is the row's own activations and temporaries), plus for a graphed row
the part of its graph pool no tensor holds between replays (the replays' working memory,
reserved for them alone). Needs a GPU.

    python benchmarks/compile_speed.py --models deit_base_patch16_224 --out results/compile_b
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

from .common import (
    FP8_PASS_OPTIONS,
    Outputs,
    StepTimer,
    add_out_argument,
    argument_parser,
    environment,
    launcher_switches,
    lazy_import,
    markdown_table,
    positive_int,
    require_cuda,
    switched,
    torch_dtype,
)

torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")
quant = lazy_import("mesa_lite.quant")
bn_op = lazy_import("mesa_lite.ops.batch_norm")
mesa_lite = lazy_import("mesa_lite")

MIB = 2**20
# name: (mode, torch.compile mode or None for eager, COMPILE_FORM, Inductor options, functorch
# config patches, base row). torch.compile reuses one compiled graph for every instance of a
# model class (Dynamo caches on the forward's code; parameters are graph inputs) unless the
# compile options differ, so each row that must compile on its own has options of its own
# (no-op ones where the row needs none). The functorch patch is set while the row runs.
_OWN = ({"trace.enabled": False}, {"trace.enabled": False, "trace.debug_log": False},
        {"trace.enabled": False, "trace.debug_log": False, "trace.info_log": False})  # fmt: skip
ROWS = {
    "plain": ("amp", None, None, None, (), "plain"),
    "mesa int8": ("mesa", None, None, None, (), "plain"),
    "mesa int8, Triton's launcher": ("mesa", None, None, None, (), "plain"),
    "mesa int8, opt-in kinds": ("mesa", None, None, None, (), "plain"),
    "ckpt": ("ckpt", None, None, None, (), "plain"),
    "plain compiled": ("amp", "default", None, None, (), "plain compiled"),
    "mesa int8 compiled, custom_op": (
        "mesa", "default", "custom_op", None, (), "plain compiled"),
    "mesa int8 compiled, decomposed": (
        "mesa", "default", "decomposed", None, (), "plain compiled"),
    "mesa int8 compiled, decomposed, Inductor defaults": (
        "mesa", "default", "decomposed", _OWN[2], (), "plain compiled"),
    "plain compiled, activation_memory_budget 0.5": (
        "amp", "default", None, _OWN[0], (("activation_memory_budget", 0.5),),
        "plain compiled"),
    "plain compiled, activation_memory_budget 0.2": (
        "amp", "default", None, _OWN[1], (("activation_memory_budget", 0.2),),
        "plain compiled"),
    "plain compiled, Inductor fp8 activations": (
        "amp", "default", None,
        FP8_PASS_OPTIONS, (),
        "plain compiled"),
    "plain compiled, reduce-overhead": (
        "amp", "reduce-overhead", None, None, (), "plain compiled, reduce-overhead"),
    "mesa int8 compiled, reduce-overhead": (
        "mesa", "reduce-overhead", "decomposed", None, (), "plain compiled, reduce-overhead"),
    "plain, graphed": ("amp", None, None, None, (), "plain"),
    "mesa int8, graphed": ("mesa", None, None, None, (), "plain, graphed"),
    "mesa int8, opt-in kinds, graphed": ("mesa", None, None, None, (), "plain, graphed"),
    # issue 51's switches, each against the row without it: the weights' autocast copies kept
    # for backward (Config(keep_weight_casts=True)); BatchNorm's input rebuilt and torch's
    # backward run instead of its backward from the codes (ops.batch_norm.FUSED_BACKWARD off)
    "mesa int8, weight casts kept": ("mesa", None, None, None, (), "mesa int8"),
    "mesa int8, opt-in kinds, BatchNorm input rebuilt": (
        "mesa", None, None, None, (), "mesa int8, opt-in kinds"),
}  # fmt: skip
DEFAULT_ROWS = ("plain", "mesa int8", "plain compiled", "mesa int8 compiled, custom_op",
                "mesa int8 compiled, decomposed")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument("--models", nargs="+", default=["deit_small_patch16_224"],
                   help="timm model names")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=128, help="images per step")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16", help="autocast dtype")
    p.add_argument("--steps", type=positive_int, default=10, help="steps of each row per pass")
    p.add_argument("--passes", type=positive_int, default=3, help="interleaved passes")
    p.add_argument("--warmup", type=positive_int, default=3,
                   help="steps of each row before the passes (compiles there)")  # fmt: skip
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(DEFAULT_ROWS),
                   metavar="ROW", help="rows to run, of: " + "; ".join(ROWS)
                   + " (a row's ratios are against its base row, added when missing)")  # fmt: skip
    add_out_argument(p, "compile_speed", "PREFIX.jsonl and PREFIX.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    require_cuda(p)
    return args


class _Row:
    def __init__(self, name, model_name, dtype):
        mode, compile_mode, self.form, options, self.patches, self.base = ROWS[name]
        self.name, self.dtype = name, dtype
        from .deit_memory import make_model

        config = None
        if "opt-in kinds" in name or "weight casts kept" in name:
            layers = mesa_lite.DEFAULT_LAYERS
            if "opt-in kinds" in name:
                layers = layers | mesa_lite.OPT_IN_KINDS
            config = mesa_lite.Config(layers=layers, keep_weight_casts="weight casts kept" in name)
        self.bn_rebuilt = "BatchNorm input rebuilt" in name
        self.static = name != "mesa int8, Triton's launcher"
        model = make_model(model_name, "fused", mode, 224, config=config).cuda()
        # wrapped models compile through mesa_lite.compile (its Inductor options), except
        # the row that shows plain torch.compile with Inductor's defaults
        fn = mesa_lite.compile if mode == "mesa" and "Inductor defaults" not in name else None
        if compile_mode is None:
            self.model = model
        elif fn is not None:
            self.model = fn(model, mode=compile_mode, options=options)
        elif options is None:
            self.model = torch.compile(model, mode=compile_mode)
        else:  # mode and options do not go together
            self.model = torch.compile(model, options=options)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
        self.scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        self.times: list[float] = []
        self.activation: list[float] = []
        self.graph = name.endswith(", graphed")  # captured on the first step's inputs

    def pool_free(self) -> int:
        """Bytes of the graph pool no tensor holds now (0 for a row without graphs)."""
        if not self.graph or mesa_lite.graph_info(self.model) is None:
            return 0
        mem = mesa_lite.graph_memory(self.model)
        return mem["reserved"] - mem["allocated"]

    def step(self, x, y):
        if self.graph and mesa_lite.graph_info(self.model) is None:
            self.model = mesa_lite.graphed(self.model, (x,), autocast=self.dtype, fallback="error")
        if self.form is not None:  # read while tracing; guarded, so set it for every call
            quant.COMPILE_FORM = self.form
        with contextlib.ExitStack() as stack:
            stack.enter_context(launcher_switches(static=self.static))
            for option, value in self.patches:  # read while compiling
                stack.enter_context(torch._functorch.config.patch({option: value}))
            if self.bn_rebuilt:  # read in each backward
                stack.enter_context(switched(bn_op, FUSED_BACKWARD=False))
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=self.dtype):
                loss = F.cross_entropy(self.model(x), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()


def row_names(requested) -> list[str]:
    """The requested rows with their base rows (and theirs), in ROWS order."""
    wanted = set(requested)
    while not {ROWS[r][5] for r in wanted} <= wanted:
        wanted |= {ROWS[r][5] for r in wanted}
    return [r for r in ROWS if r in wanted]


def run_model(name: str, args) -> list[dict]:
    dtype = torch_dtype(args.dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, 224, 224, generator=g).cuda()
    y = torch.randint(0, 1000, (args.batch_size,), generator=g).cuda()
    rows = [_Row(r, name, dtype) for r in row_names(args.rows)]
    for r in rows:  # compiles here
        for _ in range(args.warmup):
            r.step(x, y)
    torch.cuda.synchronize()
    for _ in range(args.passes):
        for r in rows:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            timer = StepTimer(x.device)
            for _ in range(args.steps):
                with timer:
                    r.step(x, y)
            r.times.extend(timer.times_ms)
            peak = torch.cuda.max_memory_allocated() - before + r.pool_free()
            r.activation.append(peak / MIB)
    env = environment()
    out = []
    for r in rows:
        out.append({"model": name, "row": r.name, "dtype": args.dtype,
                    "batch": args.batch_size, "step_ms": statistics.median(r.times),
                    "activation_mib": max(r.activation), **env})  # fmt: skip
    by_name = {r["row"]: r for r in out}
    for r, row in zip(out, rows, strict=True):
        base = by_name[row.base]
        r["step_ratio"] = r["step_ms"] / base["step_ms"]
        r["activation_reduction"] = base["activation_mib"] / r["activation_mib"]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for name in args.models:
        rows.extend(run_model(name, args))
        torch.cuda.empty_cache()
    e = rows[0]
    head = (
        f"Eager and compiled training, {args.dtype} autocast, batch {args.batch_size}, "
        f"median of {args.passes} interleaved passes x {args.steps} steps, {e['device']}, "
        f"torch {e['torch']}, triton {e['triton']}, timm {e['timm']}, {e['date']}.\n\n"
    )
    cols = [("model", "model", ""), ("row", "row", ""), ("step_ms", "step ms", ".1f"),
            ("step_ratio", "step / base row", ".2f"),
            ("activation_mib", "activations MiB", ".0f"),
            ("activation_reduction", "activation reduction", ".2f")]  # fmt: skip
    Outputs(args.out, "compile_speed").write_report(rows, head + markdown_table(rows, cols) + "\n")


if __name__ == "__main__":
    main()
