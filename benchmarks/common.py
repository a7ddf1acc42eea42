"""Helpers the benchmarks share: environment facts, timing, GPU memory, output files."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

MIB = 2**20
RESULTS = Path(__file__).parent / "results"


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the script docstring's first paragraph and whose epilog
    (shown by --help) is the rest of it."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(
        description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter
    )


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
