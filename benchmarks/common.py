"""Helpers the benchmarks share: the command line (parsed before torch is imported), the
CPU's bf16 support, run folders, progress bars, environment facts, timing, output files."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from mesa_lite._cli import HelpFormatter


class LazyModule:
    """A module imported on first attribute access.

    The scripts parse their arguments before torch, timm or Triton are imported (several
    seconds of CPU), so ``--help`` and argument errors answer at once. ``torch =
    lazy_import("torch")`` at module level keeps the rest of a script written as usual.
    """

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_module", None)

    def _load(self):
        if self._module is None:
            object.__setattr__(self, "_module", importlib.import_module(self._name))
        return self._module

    def __getattr__(self, attr: str):
        return getattr(self._load(), attr)

    def __setattr__(self, attr: str, value) -> None:
        # a module switch set through the proxy (``quant.COMPILE_FORM = ...``) must reach the
        # module: set on the proxy, it was read back from the proxy alone, and the module never
        # saw it (compile_speed.py's custom_op rows ran the default form until 2026-12-06)
        setattr(self._load(), attr, value)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_import(name: str) -> LazyModule:
    return LazyModule(name)


torch = lazy_import("torch")

MIB = 2**20
# The committed results. Scripts write here only when --out (or --csv) names a path in it.
RESULTS = Path(__file__).parent / "results"
DTYPE_NAMES = ("fp32", "fp16", "bf16")
# Inductor's fp8 (e5m2) saved-activation pass, as the compiled rows' options spell it
FP8_PASS_OPTIONS = {"post_grad_fusion_options": {"activation_quantization_aten_pass": {
    "quant_type": "torch.float8_e5m2", "size_in_mb": 1, "use_scaling": True,
    "allowed_dtypes": "torch.float16;torch.bfloat16;torch.float32"}}}  # fmt: skip


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def check_timm_models(p: argparse.ArgumentParser, names, allowed=()) -> None:
    """Exits with a usage error (status 2) naming a model timm does not know, before any work
    is done; names in ``allowed`` pass (the scripts' own, e.g. coverage's hf-gpt2)."""
    import difflib

    import timm

    for name in [names] if isinstance(names, str) else names:
        if name not in allowed and not timm.is_model(name):
            close = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
            hint = f"; similar: {', '.join(close)}" if close else ""
            p.error(f"unknown timm model {name!r}{hint}")


def check_device(p: argparse.ArgumentParser, device: str) -> None:
    """Exits with a usage error when ``device`` names an accelerator this machine lacks."""
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {device}: no CUDA GPU is available here")


def require_cuda(p: argparse.ArgumentParser, message: str = "needs a CUDA GPU") -> None:
    """Exits with a usage error (``message``) on a machine without a CUDA GPU."""
    if not torch.cuda.is_available():
        p.error(message)


def argument_parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """A parser whose description is the script docstring's first paragraph and whose epilog
    (shown by --help) is the rest of it."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(
        prog=prog, description=head, epilog=rest, formatter_class=HelpFormatter
    )


def hf_checkpointing_enable(model, use_reentrant: bool = False) -> None:
    """Hugging Face's own activation checkpointing on ``model``, by the installed
    transformers' name: ``activation_checkpointing_enable`` from 5.23 (which deprecates
    ``gradient_checkpointing_enable``), the old name before."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def cpu_has_native_bf16() -> bool:
    """``mesa_lite.ops.common.cpu_has_native_bf16`` (imported here when called: ``--help``
    imports no torch)."""
    from mesa_lite.ops.common import cpu_has_native_bf16 as native

    return native()


def add_dtype_argument(p: argparse.ArgumentParser, *, gpu: str = "fp16", nargs=None,
                       aliases: tuple[str, ...] = ()) -> None:  # fmt: skip
    """``--dtype fp32|fp16|bf16`` (``nargs`` for several); resolve with ``resolve_device``."""
    p.add_argument(
        "--dtype", *aliases, nargs=nargs, choices=DTYPE_NAMES, default=None,
        help="autocast dtype: fp16 (with a GradScaler on a GPU) or bf16; fp32 runs without "
        f"autocast (default: {gpu} on a GPU; on a CPU bf16 where it has native bf16 "
        "(AVX512-BF16, AMX or Arm BF16), else fp32, since emulated bf16 is very slow)",
    )  # fmt: skip


def default_dtype(device_type: str, gpu: str = "fp16") -> str:
    """The default autocast dtype name for a device, said on the console for a CPU."""
    if device_type != "cpu":
        return gpu
    if cpu_has_native_bf16():
        print("CPU has native bf16: using bf16 autocast (--dtype to change)", flush=True)
        return "bf16"
    print(
        "CPU without native bf16 (no AVX512-BF16, AMX or Arm BF16): using fp32, since "
        "emulated bf16 is many times slower (--dtype bf16 to use it anyway)",
        flush=True,
    )
    return "fp32"


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="torch device (default: cuda when present)")


def resolve_device(
    args: argparse.Namespace, p: argparse.ArgumentParser | None = None, gpu: str = "fp16"
) -> None:
    """Fills ``args.device`` (cuda when present; a usage error through ``p`` when it names a
    GPU this machine lacks), then ``args.dtype`` when it was not given (``default_dtype``)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif p is not None:
        check_device(p, args.device)
    if args.dtype is None:
        args.dtype = default_dtype(torch.device(args.device).type, gpu)


def torch_dtype(name: str):
    """The autocast dtype of a name; None for fp32 (no autocast)."""
    return {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def autocast(device_type: str, name_or_dtype):
    """``torch.autocast`` for a dtype name or torch dtype; fp32 / None disables it."""
    dtype = torch_dtype(name_or_dtype) if isinstance(name_or_dtype, str) else name_or_dtype
    return torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)


def add_out_argument(p: argparse.ArgumentParser, script: str, writes: str) -> None:
    """``--out PREFIX``: where the files go; by default a fresh run folder (``Outputs``)."""
    p.add_argument(
        "--out", type=Path, default=None, metavar="PREFIX",
        help=f"write {writes} at this path prefix; committed results change only when it "
        f"names them, e.g. benchmarks/results/{script}_gpu (default: "
        f"runs/{script}-<date>-<time>/{script}, a fresh folder that git ignores)",
    )  # fmt: skip


class Outputs:
    """The files a run writes: at ``prefix`` + suffix, or in a fresh ``runs/<script>-<time>/``
    folder (relative to the working directory) when ``prefix`` is None; a ``prefix`` that is
    an existing folder (or ends with a slash) means ``<folder>/<script>``. Folders are made at
    the first ``path`` call, so a run that fails before writing leaves none. ``print_paths``
    lists what was written."""

    def __init__(self, prefix: Path | None, script: str) -> None:
        self.script = script
        self._given = prefix
        self._prefix: Path | None = None
        self.written: list[Path] = []

    @property
    def prefix(self) -> Path:
        if self._prefix is None:
            given = self._given
            if given is None:
                self._prefix = fresh_run_folder(self.script) / self.script
            elif Path(given).is_dir() or str(given).endswith(("/", "\\")):
                self._prefix = Path(given) / self.script
            else:
                self._prefix = Path(given)
        return self._prefix

    def path(self, suffix: str) -> Path:
        """The path for ``suffix`` (e.g. ".jsonl"); its folder exists; listed as written."""
        p = Path(str(self.prefix) + suffix)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p not in self.written:
            self.written.append(p)
        return p

    def write_report(self, rows: list[dict], text: str) -> None:
        """Writes PREFIX.jsonl (the rows) and PREFIX.md (the text), prints the text and the
        paths written."""
        write_jsonl(self.path(".jsonl"), rows)
        self.path(".md").write_text(text)
        print()
        print(text)
        self.print_paths()

    def print_paths(self) -> None:
        print("\nWrote:")
        for p in self.written:
            print(f"  {p}")


def fresh_run_folder(script: str) -> Path:
    """Makes and returns ``runs/<script>-<date>-<time>/`` (``-2``, ``-3``, ... on a clash)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        folder = Path("runs") / (f"{script}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder name under runs/ for {script}-{stamp}")


def progress(iterable=None, **kwargs):
    """A tqdm progress bar on stderr (off when stderr is not a terminal); the plain iterable
    when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:  # the bars are a convenience; tqdm comes with the bench extra
        return _NoBar(iterable)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("disable", None)
    return tqdm(iterable, **kwargs)


class _NoBar:
    def __init__(self, iterable) -> None:
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def say(message: str) -> None:
    """Prints a line without breaking an open progress bar."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(message, flush=True)
        return
    tqdm.write(message)
    sys.stdout.flush()


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    pyplot().close(fig)


def environment() -> dict:
    """Device name and library versions, for every result row."""
    import timm

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name()
        if cuda
        else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": triton_version,
        "timm": timm.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def cuda_median_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median CUDA-event time of ``fn()`` in milliseconds, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cuda_queued_ms(fns, rounds: int = 4, batches: int = 5) -> float:
    """Device milliseconds per call of the callables ``fns`` (e.g. one per copy of an input,
    taken in turn, so that no input is still in L2 from its previous call), their launches
    queued behind a spin kernel: the events then time the kernels back to back, not the host's
    cost of launching them, which a single call between two events (``cuda_median_ms``)
    includes whenever the kernel is shorter than its launch. The median of ``batches``
    batches of ``rounds`` passes over ``fns``; the spin doubles until it outlasts the host's
    enqueueing of a batch."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles, spin_ms, times = 10_000_000, None, []
    while len(times) < batches:
        if spin_ms is None:  # the spin's length, timed once per number of cycles
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            spin_ms = start.elapsed_time(end)
        torch.cuda._sleep(cycles)
        t = time.perf_counter()
        start.record()
        for _ in range(rounds):
            for f in fns:
                f()
        end.record()
        host_ms = (time.perf_counter() - t) * 1e3
        end.synchronize()
        if host_ms > 0.5 * spin_ms:  # the queue may have drained: spin longer, time again
            if cycles >= 2**34:
                raise RuntimeError(f"cuda_queued_ms: launches take {host_ms:.1f} ms of host time")
            cycles, spin_ms = cycles * 2, None
            continue
        times.append(start.elapsed_time(end) / (rounds * len(fns)))
    return sorted(times)[len(times) // 2]


def host_us_per_call(calls: dict, reps: int = 2000) -> dict:
    """Microseconds per call of each function on a CUDA device, after 50 warm-up calls, with
    one synchronization per timing (small work: the host's time)."""
    out = {}
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t) / reps * 1e6
    return out


@contextlib.contextmanager
def switched(owner, **values):
    """``owner``'s attributes (a class's or a module's switches, a lazy module's too) set to
    ``values`` while the block runs, then back to what they were."""
    before = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(owner, name, value)


def launcher_switches(**switches):
    """mesa_lite's kernel Launcher with its class switches set (``static=False``: kept kernels
    through Triton's own launcher, the path before the static one; ``direct=False``: every
    launch through ``kernel[grid]``), restored afterwards (both on by default)."""
    from mesa_lite.kernels.launch import Launcher

    return switched(Launcher, **switches)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_history(step, device) -> list[dict]:
    """Runs ``step()`` once on a CUDA ``device`` with the caching allocator's history on
    (``torch.cuda.memory._record_memory_history``, Python frames of each allocation) and
    returns that device's trace: the allocation and free events of the call, in order."""
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot["device_traces"][device.index or 0]


# code whose frames name an allocation (the innermost of them), in peak_memory.py's and
# llm_memory.py's traces
OWN = ("mesa_lite/", "kernels/", "timm/", "transformers/", "benchmarks/")


def frame_label(frames: list[dict]) -> str:
    """The innermost frame from our code, timm or transformers, as file:line function, or
    from Inductor's generated code, with that line's source (``buf12 = empty_strided_cuda(...)``);
    else the engine."""
    import linecache

    for f in frames:
        name = f.get("filename", "")
        if "torchinductor" in name:  # a compiled graph's generated wrapper code
            line = linecache.getline(name, f.get("line") or 0).strip()[:90]
            return f"inductor {name.rsplit('/', 1)[-1]}:{f.get('line')} {line}"
        if (
            any(key in name for key in OWN)
            and "peak_memory.py" not in name
            and not name.endswith("benchmarks/common.py")
        ):
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


def live_sites(live: dict[int, tuple[int, str]], top: int | None = None) -> list[dict]:
    """``live_at_peak``'s blocks grouped by label, largest first: ``site``, ``bytes``,
    ``count`` (at most ``top``)."""
    groups: dict[str, list[int]] = {}
    for size, label in live.values():
        entry = groups.setdefault(label, [0, 0])
        entry[0] += size
        entry[1] += 1
    rows = [{"site": k, "bytes": b, "count": c} for k, (b, c) in groups.items()]
    rows.sort(key=lambda r: (-r["bytes"], r["site"]))
    return rows if top is None else rows[:top]


class StepTimer:
    """Times steps with CUDA events on a GPU, a synchronized wall clock otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times_ms: list[float] = []

    def __enter__(self):
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.times_ms.append(self._start.elapsed_time(self._end))
        else:
            self.times_ms.append((time.perf_counter() - self._t0) * 1e3)

    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    def spread(self) -> float:
        """The interquartile range of the step times over their median (0 below 3 steps), as
        the planner judges its timings (``mesa_lite.planner.relative_spread``)."""
        from mesa_lite.planner import relative_spread

        return relative_spread(self.times_ms)


# the relative spread of step times (interquartile range over median) above which a script
# times more steps and warns that its step ratios may be off, as mesa_lite.planner does
NOISE = 0.10


def noise_warning(rows: list[dict]) -> str | None:
    """A warning naming the rows whose step times spread beyond ``NOISE`` (``step_spread``),
    or None."""
    noisy = [r for r in rows if r.get("step_spread", 0.0) > NOISE]
    if not noisy:
        return None
    names = ", ".join(f"{r.get('label', r.get('mode', '?'))} {r['step_spread']:.0%}" for r in noisy)
    return (
        f"WARNING: step times varied beyond {NOISE:.0%} (interquartile range over median) for "
        f"{names}: the step ratios may be off (a loaded machine?); run again on an idle one "
        "or with more --steps"
    )


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(paths: list[Path]) -> list[dict]:
    """The rows of JSON-lines files, in order (the ``--from-jsonl`` options); an error when
    they hold none."""
    rows = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines()]
    if not rows:
        raise SystemExit(f"--from-jsonl: {', '.join(map(str, paths))} hold no rows")
    return rows


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec); missing values print as '-'."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, rule]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure_row(row: dict, device, measure, *args) -> dict:
    """``row`` updated with what ``measure(*args)`` returns; a failure (an OOM) is recorded in
    ``row["error"]`` with its traceback printed, not hidden. Frees what the row left behind
    (collected, and the CUDA cache emptied) either way. Returns ``row``."""
    import gc
    import traceback

    try:
        row.update(measure(*args))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        traceback.print_exc()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row
