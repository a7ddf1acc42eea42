"""What holds the GPU memory peak of one DeiT training step, by where it was allocated.

Runs warm-up steps (so the optimizer state exists), then records the CUDA caching allocator's
history (``torch.cuda.memory._record_memory_history``) over one more step, replays the trace to
the moment of the step's peak, and groups the blocks alive then by the innermost Python frame
in mesa_lite, kernels, timm or the benchmark (the autograd engine's own allocations, which have
no Python frame, form one group). Blocks allocated before the recorded step and still alive
at the peak (parameters, optimizer state, inputs) are one line; the previous step's gradients,
freed by ``zero_grad(set_to_none=True)``, are not in it.

Writes PREFIX.md (one table per configuration) and prints it. GPU only.

    python benchmarks/peak_memory.py --models deit_small_patch16_224 --modes amp mesa --bits 8 4
"""

from __future__ import annotations

import gc
import sys
from collections import defaultdict
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: import the rest as the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from .common import MIB, RESULTS, argument_parser, markdown_table
from .deit_memory import DTYPES, _train_step, make_model

OWN = ("mesa_lite/", "kernels/", "timm/", "benchmarks/")


def frame_label(frames: list[dict]) -> str:
    """The innermost frame from our code or timm, as file:line function; else the engine."""
    for f in frames:
        name = f.get("filename", "")
        if any(key in name for key in OWN) and "peak_memory.py" not in name:
            short = name[max(name.rfind(k) for k in OWN if k in name) :]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "autograd engine / torch internals (no Python frame of ours)"


def live_at_peak(trace: list[dict]) -> tuple[int, int, dict[int, tuple[int, str]]]:
    """Replays alloc/free events from the start of recording.

    Returns (peak bytes relative to the start, bytes of blocks from before the start freed by
    then, blocks allocated since the start and alive at the peak: addr -> (size, label)).
    Frees of blocks allocated before recording (the previous step's gradients, freed by
    ``zero_grad``) lower the total too.
    """
    live: dict[int, tuple[int, str]] = {}
    total = peak = peak_at = 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], "")
            total += ev["size"]
            if total > peak:
                peak, peak_at = total, i
        elif ev["action"] == "free_completed":
            total -= live.pop(ev["addr"])[0] if ev["addr"] in live else ev["size"]
    live.clear()
    freed_before = 0
    for ev in trace[: peak_at + 1]:  # second pass: the live set at the peak, with labels
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], frame_label(ev.get("frames", [])))
        elif ev["action"] == "free_completed":
            if ev["addr"] in live:
                live.pop(ev["addr"])
            else:
                freed_before += ev["size"]
    return peak, freed_before, live


def profile(model, x, y, dtype, warmup: int) -> dict:
    device = x.device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    for _ in range(warmup):
        _train_step(model, opt, scaler, x, y, dtype)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        _train_step(model, opt, scaler, x, y, dtype)
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][device.index or 0]
    rise, freed_before, live = live_at_peak(trace)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, label in live.values():
        groups[label][0] += size
        groups[label][1] += 1
    return {
        "before": before,
        "before_at_peak": before - freed_before,
        "peak_replayed": before + rise,
        "peak_measured": torch.cuda.max_memory_allocated(device),
        "groups": sorted(groups.items(), key=lambda kv: -kv[1][0]),
    }


def main(argv=None) -> str:
    p = argument_parser(__doc__)
    p.add_argument("--models", nargs="+", default=["deit_small_patch16_224"])
    p.add_argument("--modes", nargs="+", choices=["amp", "mesa"], default=["amp", "mesa"])
    p.add_argument("--bits", nargs="+", type=int, choices=[8, 4, 2], default=[8])
    p.add_argument("--attention", nargs="+", choices=["fused", "explicit"], default=["fused"])
    p.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="groups listed per configuration")
    p.add_argument("--out", type=Path, default=RESULTS / "peak_memory_gpu")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a GPU: the allocator history is a CUDA feature")
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    parts = [f"What is alive at the peak of one training step, batch {args.batch_size}, "
             f"{args.dtype} autocast, {torch.cuda.get_device_name(device)}.\n"]  # fmt: skip
    for name in args.models:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch_size, 3, 224, 224, generator=g).to(device)
        y = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)
        for attention in args.attention:
            runs = [(m, b) for m in args.modes for b in (args.bits if m == "mesa" else [None])]
            for mode, bits in runs:
                model = make_model(name, attention, mode, 224, bits or 8).to(device)
                r = profile(model, x, y, dtype, args.warmup)
                del model
                gc.collect()
                torch.cuda.empty_cache()
                title = f"{name} {attention} {mode}" + (f" int{bits}" if bits else "")
                kept = "allocated before the step, still alive (params, optimizer state, inputs)"
                rows = [{"where": kept, "mib": r["before_at_peak"] / MIB, "blocks": ""}]
                rows += [{"where": k, "mib": v[0] / MIB, "blocks": v[1]}
                         for k, v in r["groups"][: args.top]]  # fmt: skip
                rest = r["groups"][args.top :]
                if rest:
                    rows.append({"where": f"{len(rest)} other places",
                                 "mib": sum(v[0] for _, v in rest) / MIB,
                                 "blocks": sum(v[1] for _, v in rest)})  # fmt: skip
                cols = [("where", "allocated at", "s"), ("mib", "MiB at peak", ".1f"),
                        ("blocks", "blocks", "")]  # fmt: skip
                parts.append(
                    f"### {title}\npeak {r['peak_measured'] / MIB:.0f} MiB measured, "
                    f"{r['peak_replayed'] / MIB:.0f} MiB replayed\n\n" + markdown_table(rows, cols)
                )
                print(parts[-1], flush=True)
    text = "\n\n".join(parts) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    return text


if __name__ == "__main__":
    main()
