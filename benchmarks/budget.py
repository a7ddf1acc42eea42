"""Training within a memory budget: mesa_lite.planner's plans against plain training, the
framework's checkpointing of every k-th block and PyTorch's ``activation_memory_budget`` under
compile, predicted and measured.

For each model: plain AMP is measured; ``mesa_lite.planner.measure`` measures the model under
each policy; then for each budget (a fraction of the plain peak, and last the smallest peak
any plan reaches) ``planner.choose`` picks the per-block policies and the model is trained
with the plan's Config, so each plan row has the predicted and the measured peak and step
time. The alternatives, each one row: exact checkpointing of every k-th block (``--every``:
timm's ``set_grad_checkpointing`` or Hugging Face's ``activation_checkpointing_enable`` at k=1,
``torch.utils.checkpoint`` on the timm blocks and the Hugging Face layers' own flag for larger
k) and the plain model under ``torch.compile`` with ``torch._functorch.config.
activation_memory_budget`` (``--compile-budgets``, GPU only by default).

Models: timm names (images, cross-entropy) and the Hugging Face configs of
``benchmarks/llm_memory.py`` (``llama-1b``, ``gpt2``, ``tiny-llama``...: random tokens, the
causal LM loss, ``--seq`` tokens). Every row is AdamW steps under autocast (a GradScaler at
fp16): ``--warmup`` untimed, ``--steps`` timed (median).

On a GPU a row's memory is ``torch.cuda.max_memory_allocated`` over the timed steps; without
one, the bytes one training step's forward (its loss included) keeps for backward, counted as
the planner counts them, plus the static memory (parameters, gradients, AdamW state), labelled
as such (a CPU row has no backward temporaries or recompute to measure: compare it with the
prediction less its transient term).

Each plan row also says whether the measured peak is within the budget and how far below,
the measured step against the predicted one, and the fastest alternative row whose memory fits
the same budget. A "measurements" row per model holds what the planner measured (per policy
and block: kept bytes, seconds, transient bytes; the fixed terms), so plans can be re-derived
offline. PREFIX.jsonl is rewritten after every row (a run cut short keeps what it measured),
then PREFIX.md and PREFIX.png (memory on x, step time on y, one panel per model), into a fresh
runs/ folder unless --out names a prefix.

  python benchmarks/budget.py --models deit_small_patch16_224 --batch-size 128 --dtype fp16
  python benchmarks/budget.py --models llama-1b --batch-size 4 --seq 2048 --dtype bf16
  python benchmarks/budget.py --device cpu --models deit_tiny_patch16_224 --batch-size 2 \\
      --img-size 64 --budgets 1.0 0.6 0.4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

from .common import (
    MIB,
    Outputs,
    StepTimer,
    add_device_argument,
    add_out_argument,
    argument_parser,
    autocast,
    environment,
    hf_checkpointing_enable,
    lazy_import,
    markdown_table,
    measure_row,
    nonnegative_int,
    positive_int,
    pyplot,
    read_jsonl,
    resolve_device,
    save_figure,
    say,
    sync,
    torch_dtype,
    write_jsonl,
)

COMPILED_PLAN = "plan compiled"  # the rows of plans for a compiled row's peak, compiled too
torch = lazy_import("torch")
F = lazy_import("torch.nn.functional")
mesa_lite = lazy_import("mesa_lite")
planner = lazy_import("mesa_lite.planner")


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    # the defaults follow the device (_DEFAULTS): a GPU run of DeiT-S at batch 128, a CPU
    # run small enough to answer in minutes
    p.add_argument("--models", nargs="+", default=None,
                   help="timm models or llm_memory.py's Hugging Face configs (default: "
                        "deit_small_patch16_224 on a GPU, deit_tiny_patch16_224 on the "
                        "CPU)")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="samples per step (default: 128 on a GPU, 2 on the CPU)")  # fmt: skip
    p.add_argument("--img-size", type=positive_int, default=None,
                   help="timm input size (default: 224 on a GPU, 64 on the CPU)")  # fmt: skip
    p.add_argument("--seq", type=positive_int, default=2048, help="tokens per sequence (LMs)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="autocast dtype (fp32: none; default: fp16 on a GPU, the CPU's "
                        "scripts' default there)")  # fmt: skip
    p.add_argument("--budgets", nargs="+", type=float, default=None,
                   help="budgets as fractions of the plain peak (the smallest feasible one is "
                        "added; default: 1.0 0.8 0.6 0.5 0.4 0.3 0.25 on a GPU, 1.0 0.6 0.4 "
                        "on the CPU)")  # fmt: skip
    p.add_argument(
        "--every",
        nargs="*",
        type=positive_int,
        default=None,
        help="exact checkpointing of every k-th block, one row per k (default: 1 2 3 on a "
        "GPU, 1 on the CPU)",
    )
    p.add_argument("--compile-budgets", nargs="*", type=float, default=None,
                   help="activation_memory_budget values under torch.compile, one row each "
                        "(default: 0.5 0.1 on a GPU, none on the CPU)")  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=None,
                   help="measured steps per row (default: 10 on a GPU, 3 on the CPU)")  # fmt: skip
    p.add_argument("--warmup", type=positive_int, default=None,
                   help="warm-up steps per row (default: 2 on a GPU, 1 on the CPU)")  # fmt: skip
    p.add_argument("--timed", type=nonnegative_int, default=None,
                   help="timed steps per policy in the planner's measurement (0: memory only, "
                        "plans ranked by planner.PROXY_STEP_RATIOS; default: 5 on a GPU, 3 on "
                        "the CPU)")  # fmt: skip
    add_device_argument(p)
    add_out_argument(p, "budget", "PREFIX.jsonl, PREFIX.md and PREFIX.png")
    p.add_argument("--no-plot", action="store_true", help="no chart")
    p.add_argument(
        "--from-jsonl",
        nargs="+",
        type=Path,
        default=None,
        metavar="FILE",
        help="measure nothing: write the table and chart of these rows",
    )
    p.add_argument("--repredict", action="store_true",
                   help="with --from-jsonl: each plan row's peak predicted again from its "
                        "model's measurements row by the planner's current model "
                        "(repredicted_mib)")  # fmt: skip
    return p


# option -> (GPU default, CPU default)
_DEFAULTS = {
    "models": (["deit_small_patch16_224"], ["deit_tiny_patch16_224"]),
    "batch_size": (128, 2),
    "img_size": (224, 64),
    "budgets": ([1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.25], [1.0, 0.6, 0.4]),
    "every": ([1, 2, 3], [1]),
    "steps": (10, 3),
    "warmup": (2, 1),
    "timed": (5, 3),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    resolve_device(args, p)
    gpu = args.device.startswith("cuda")
    for key, (on_gpu, on_cpu) in _DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    if any(not 0 < b <= 1.5 for b in args.budgets):
        p.error(f"--budgets are fractions of the plain peak in (0, 1.5], got {args.budgets}")
    if args.compile_budgets is None:
        args.compile_budgets = [0.5, 0.1] if args.device.startswith("cuda") else []
    if any(not 0 <= b <= 1 for b in args.compile_budgets):
        p.error(f"--compile-budgets are in [0, 1], got {args.compile_budgets}")
    return args


class Subject:
    """One model of the sweep: ``build(config, every)`` a fresh copy (same weights each time)
    on the device, wrapped with ``config`` or with exact checkpointing of every ``every``-th
    block; ``step_fn(model) -> loss`` its forward with its inputs, autocast and loss."""

    def __init__(self, name: str, args, device) -> None:
        from . import llm_memory

        self.name, self.device, self.args = name, device, args
        self.dtype = torch_dtype(args.dtype)
        g = torch.Generator().manual_seed(1)
        self.hf = name in llm_memory.CONFIGS
        if self.hf:
            self.config = llm_memory.make_config(name)
            ids, labels = llm_memory.make_inputs(self.config, args.batch_size, args.seq, device)
            self.inputs = {"input_ids": ids, "labels": labels, "use_cache": False}
        else:
            x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g)
            y = torch.randint(0, 1000, (args.batch_size,), generator=g)
            self.x, self.y = x.to(device), y.to(device)

    def step_fn(self, model):
        with autocast(self.device.type, self.dtype):
            if self.hf:
                return model(**self.inputs).loss
            return F.cross_entropy(model(self.x), self.y)

    def build(self, config=None, every: int | None = None):
        if self.hf:
            from .llm_memory import make_model

            model = make_model(self.name, "plain", "sdpa", self.config)
        else:
            from .deit_memory import make_model

            model = make_model(self.name, "fused", "amp", self.args.img_size)
        if config is not None:
            mesa_lite.wrap(model, config)
        if every is not None:
            _checkpoint_every(model, every, self.hf)
        return model.to(self.device).train()


def _checkpoint_every(model, k: int, hf: bool) -> None:
    """Exact checkpointing of the first repeated block and every k-th after it: the
    framework's own at k=1; for larger k the Hugging Face layers' own flag, or the timm
    blocks each wrapped in ``torch.utils.checkpoint`` (non-reentrant, as timm's)."""
    from mesa_lite.checkpoint import repeated_blocks

    if hf:
        hf_checkpointing_enable(model)
        for i, (_, block) in enumerate(repeated_blocks(model)):
            block.gradient_checkpointing = i % k == 0
        return
    if k == 1:
        model.set_grad_checkpointing(True)
        return
    for i, (name, block) in enumerate(repeated_blocks(model)):
        if i % k == 0:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _checkpointed(block))


def _checkpointed(inner):
    """``inner`` run under ``torch.utils.checkpoint`` (non-reentrant), as a module."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    return Checkpointed()


def train_row(subject: Subject, model, args, compile_budget: float | None = None,
              compiled: bool = False) -> dict:  # fmt: skip
    """``args.warmup`` AdamW steps, then ``args.steps`` timed ones: step time (median) and,
    on a GPU, the peak allocated over the timed steps. Compiled when ``compile_budget`` is
    given (``torch.compile``, ``activation_memory_budget`` set while compiling and running)
    or ``compiled`` (``mesa_lite.compile``, for a wrapped model)."""
    device = subject.device
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda and subject.dtype == torch.float16)
    run = model
    with contextlib.ExitStack() as stack:
        if compile_budget is not None:
            torch._dynamo.reset()  # compile anew: the budget is read while compiling
            stack.enter_context(
                torch._functorch.config.patch(activation_memory_budget=compile_budget)
            )
            run = torch.compile(model)
        elif compiled:
            torch._dynamo.reset()
            run = mesa_lite.compile(model)

        def one():
            opt.zero_grad(set_to_none=True)
            loss = subject.step_fn(run)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

        for _ in range(args.warmup):
            one()
        sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        timer = StepTimer(device)
        for _ in range(args.steps):
            with timer:
                loss = one()
    row = {"step_ms": timer.median_ms(), "final_loss": float(loss.detach())}
    if cuda:
        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
    return row


def cpu_memory_mib(subject: Subject, model, m) -> float:
    """On the CPU: the bytes one training step's forward keeps for backward, counted as
    ``planner.measure`` counts them (loss included), plus the planner's static memory."""
    step = planner._kept_by_block(model, subject.step_fn, None, m.blocks, torch.device("cpu"))
    return (sum(step.per_block.values()) + step.outside + m.static) / MIB


def _measurements_row(m) -> dict:
    return {
        "row": "measurements",
        "blocks": list(m.blocks),
        # PolicyCost's fields in order (older rows have the first three)
        "costs": {p: [list(dataclasses.astuple(c)) for c in cs] for p, cs in m.costs.items()},
        "static": m.static, "outside": m.outside, "temporaries": m.temporaries,
        "optimizer_peak": m.optimizer_peak, "leaves": list(m.leaves),
        "timed": m.timed,  # False: memory only, the seconds are PROXY_STEP_RATIOS' ranking
    }  # fmt: skip


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.from_jsonl:
        rows = read_jsonl(args.from_jsonl)
        if args.repredict:
            repredict(rows)
        return _write(rows, args, Outputs(args.out, "budget"))
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    env = environment()
    env["device"] = torch.cuda.get_device_name(device) if gpu else env["device"]
    out = Outputs(args.out, "budget")
    rows: list[dict] = []
    plain: dict = {}

    def add(row: dict) -> None:
        rows.append(row)
        if plain and "error" not in plain:
            _judge([r for r in rows if r["model"] == plain["model"]], plain)
        write_jsonl(out.path(".jsonl"), rows)  # rewritten: a run cut short keeps its rows

    def sweep(name: str) -> None:
        plain.clear()
        subject = Subject(name, args, device)
        base = {"model": name, "batch": args.batch_size, "dtype": args.dtype, **env}
        if subject.hf:
            base["seq"] = args.seq
        m = planner.measure(
            subject.build(), subject.step_fn,
            lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05),
            warmup=args.warmup, timed=args.timed,
        )  # fmt: skip
        add({**base, **_measurements_row(m)})
        gc.collect()

        def measured(label, config=None, every=None, compile_budget=None, compiled=False,
                     extra=None):  # fmt: skip
            row = {**base, "row": label, **(extra or {})}

            def one():
                model = subject.build(config, every)
                r = train_row(subject, model, args, compile_budget, compiled)
                if not gpu:
                    r["memory_mib"] = cpu_memory_mib(subject, subject.build(config, every), m)
                else:
                    r["memory_mib"] = r["peak_mib"]
                return r

            measure_row(row, device, one)
            add(row)
            return row

        plain.update(measured("plain"))
        if "error" in plain:
            return
        budgets = [(f"plan {f:g}", int(f * plain["memory_mib"] * MIB)) for f in args.budgets]
        budgets.append(("plan smallest", planner.smallest_budget(m)))

        def planned(label, budget, compiled=False):
            row = {"budget_mib": budget / MIB, "budget_bytes": budget}
            try:
                plan = planner.choose(m, budget)
            except planner.PlanError as e:
                add({**base, "row": label, **row, "error": str(e)})
                say(f"{name} {label}: {e}")
                return
            counts = {p: plan.policies.count(p) for p in planner.POLICIES}
            row["policies"] = ", ".join(f"{p} x{c}" for p, c in counts.items() if c)
            row["config"] = plan.config_kwargs()
            row["predicted_mib"] = plan.peak / MIB
            row["predicted_where"] = plan.where
            row["predicted_terms_mib"] = {k: v / MIB for k, v in plan.terms.items()}
            # what the CPU rows count: every block's kept bytes, outside, static
            row["predicted_saved_mib"] = (plan.saved + m.outside + m.static) / MIB
            if plan.seconds is not None:  # None: the planner measured memory only (--timed 0)
                row["predicted_step_ms"] = plan.seconds * 1e3
            r = measured(label, config=plan.config, compiled=compiled, extra=row)
            if "error" not in r:
                predicted = r.get("predicted_step_ms")
                say(f"{name} {label}: {r['policies']}, memory {r['memory_mib']:.0f} MiB "
                    f"(budget {budget / MIB:.0f}, predicted {r['predicted_mib']:.0f}), step "
                    f"{r['step_ms']:.1f} ms"
                    + ("" if predicted is None else f" (predicted {predicted:.1f})"))  # fmt: skip

        for label, budget in budgets:
            planned(label, budget)
        fw = "Hugging Face" if subject.hf else "timm"
        for k in args.every:
            label = f"{fw} checkpointing" if k == 1 else f"checkpointing every {k}"
            measured(label, every=k, extra={"every": k})
        for b in args.compile_budgets:
            r = measured(f"compiled, activation_memory_budget {b:g}", compile_budget=b,
                         extra={"compile_budget": b})  # fmt: skip
            if "error" not in r:  # a plan for the same peak, compiled as well
                planned(f"{COMPILED_PLAN}, at budget {b:g}'s peak", int(r["memory_mib"] * MIB),
                        compiled=True)  # fmt: skip

    for name in args.models:
        sweep(name)
    return _write(rows, args, out)


def _write(rows: list[dict], args, out: Outputs) -> list[dict]:
    gpu = "peak_mib" in next((r for r in rows if r["row"] == "plain"), {})
    memory = "peak MiB" if gpu else "kept for backward + static MiB (CPU)"
    write_jsonl(out.path(".jsonl"), rows)
    text = report(rows, memory)
    out.path(".md").write_text(text)
    if not args.no_plot:
        _plot(rows, out.path(".png"), memory)
    print(text)
    out.print_paths()
    return rows


def measurements_of(row: dict):
    """A "measurements" row back as ``planner.Measurements``."""
    return planner.Measurements(
        blocks=tuple(row["blocks"]),
        costs={p: tuple(planner.PolicyCost(*c) for c in cs) for p, cs in row["costs"].items()},
        static=row["static"], outside=row["outside"], temporaries=row["temporaries"],
        optimizer_peak=row["optimizer_peak"], leaves=tuple(row["leaves"]),
        timed=row.get("timed", True),
    )  # fmt: skip


def policies_of(config: dict, blocks) -> list[str]:
    """The per-block policies a plan row's Config (``config_kwargs``) applies."""
    overrides = config.get("overrides", {})
    ckpt = set(config.get("checkpoint") or ())
    width = {8: "ckpt8", 4: "ckpt4", "exact": "ckpt"}.get(config.get("checkpoint_bits"))
    out = []
    for b in blocks:
        fields = overrides.get(b, {})
        if b in ckpt:
            out.append(width)
        elif fields.get("enabled") is False:
            out.append("plain")
        else:
            out.append(f"int{fields.get('bits', config.get('bits', 8))}")
    return out


def repredict(rows: list[dict]) -> None:
    """Each plan row's peak as the planner's current model predicts it from the row's model's
    measurements, for the plan the row ran (``repredicted_mib``)."""
    found = {r["model"]: measurements_of(r) for r in rows if r["row"] == "measurements"}
    for r in rows:
        m = found.get(r["model"])
        if m is None or "config" not in r:
            continue
        terms = planner._peak_terms(m, policies_of(r["config"], m.blocks))
        r["repredicted_mib"] = max(sum(terms.values()), m.optimizer_peak) / MIB


def _judge(rows: list[dict], plain: dict) -> None:
    """Ratios against plain, and for each plan row the checks of the budget issue: peak
    within the budget and how far below, step against predicted, the fastest alternative
    whose memory fits the same budget."""
    alternatives = [r for r in rows if not r["row"].startswith(("plan", "measurements"))
                    and "memory_mib" in r]  # fmt: skip
    for r in rows:
        if "memory_mib" not in r:
            continue
        r["step_ratio"] = r["step_ms"] / plain["step_ms"]
        r["memory_fraction"] = r["memory_mib"] / plain["memory_mib"]
        if not r["row"].startswith("plan"):
            continue
        r["within_budget"] = r["memory_mib"] <= r["budget_mib"]
        r["below_budget"] = 1 - r["memory_mib"] / r["budget_mib"]
        if "predicted_step_ms" in r:
            r["step_vs_predicted"] = r["step_ms"] / r["predicted_step_ms"]
        fits = [a for a in alternatives if a["memory_mib"] <= r["budget_mib"]]
        if fits:
            best = min(fits, key=lambda a: a["step_ms"])
            r["best_alternative"] = best["row"]
            r["best_alternative_ms"] = best["step_ms"]


def report(rows: list[dict], memory: str) -> str:
    shown = [r for r in rows if r["row"] != "measurements"]
    cols = [("model", "model", "s"), ("row", "row", "s"), ("budget_mib", "budget MiB", ".0f"),
            ("policies", "policies", "s"), ("predicted_mib", "predicted MiB", ".0f"),
            ("repredicted_mib", "predicted by today's model MiB", ".0f"),
            ("memory_mib", memory, ".0f"), ("below_budget", "below budget", ".1%"),
            ("memory_fraction", "of plain", ".2f"),
            ("predicted_step_ms", "predicted step ms", ".1f"), ("step_ms", "step ms", ".1f"),
            ("step_vs_predicted", "measured / predicted", ".2f"),
            ("step_ratio", "step / plain", ".2f"),
            ("best_alternative", "fastest alternative that fits", "s"),
            ("best_alternative_ms", "its step ms", ".1f"), ("error", "error", "s")]  # fmt: skip
    runs = dict.fromkeys(
        f"{r['model']}: batch {r['batch']}" + (f", {r['seq']} tokens" if "seq" in r else "")
        + f", {r['dtype']}, {r['device']}, torch {r['torch']}, timm {r['timm']}, {r['date']}"
        for r in rows
    )  # fmt: skip
    header = "Training within a memory budget.\n\n" + "".join(f"- {k}\n" for k in runs)
    return header + "\n" + markdown_table(shown, cols) + "\n"


def _plot(rows: list[dict], path: Path, memory: str) -> None:
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == name and "memory_mib" in r]
        plans = sorted((r for r in mine if r["row"].startswith("plan ")
                        and not r["row"].startswith(COMPILED_PLAN)),
                       key=lambda r: r["memory_mib"])  # fmt: skip
        fast = [r for r in mine if r["row"].startswith(COMPILED_PLAN)]
        if fast:
            ax.plot([r["memory_mib"] for r in fast], [r["step_ms"] for r in fast], "v",
                    linestyle="none", label="mesa_lite plans at those peaks, compiled")  # fmt: skip
        ax.plot([r["memory_mib"] for r in plans], [r["step_ms"] for r in plans], "o-",
                label="mesa_lite plans (measured)")  # fmt: skip
        timed = [r for r in plans if "predicted_step_ms" in r]
        ax.plot([r["predicted_mib"] for r in timed], [r["predicted_step_ms"] for r in timed],
                "x--", label="mesa_lite plans (predicted)")  # fmt: skip
        for kind, marker in (("checkpointing", "s"), ("compiled", "^"), ("plain", "D")):
            pts = [r for r in mine if not r["row"].startswith("plan") and kind in r["row"]]
            if pts:
                ax.plot([r["memory_mib"] for r in pts], [r["step_ms"] for r in pts], marker,
                        linestyle="none", label=", ".join(r["row"] for r in pts))  # fmt: skip
        ax.set_xlabel(memory)
        ax.set_ylabel("step ms")
        ax.set_title(name)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    rows = run(argv)
    return 1 if any("error" in r and not r["row"].startswith("plan") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
