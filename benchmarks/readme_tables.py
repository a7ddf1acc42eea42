"""The results tables of README.md and docs/RESULTS.md, generated from the committed results files.

Each table is built from named rows of named files in benchmarks/results/ (the .jsonl beside
each .md, or a .csv where a benchmark writes CSV), chosen in TABLES below, and sits between
marker comments in whichever of the documents (DOCUMENTS below) holds them, in exactly one:

  <!-- table:deit -->
  ...generated lines...
  <!-- /table:deit -->

A table may also be the rows of one results file as they are, named by its marker:

  <!-- table:rows;FILE;SELECTION;COLUMNS -->
  ...generated lines...
  <!-- /table:rows;FILE;SELECTION;COLUMNS -->

that is every row of benchmarks/results/FILE.jsonl that SELECTION picks (as a figure's, below;
empty: all), in the file's order, one column per FIELD/FORMAT of the comma-separated COLUMNS
(the header is the field's name in words; FORMAT as a figure's). Such tables may sit in any
of the documents, each in one place.

Links to the results files are written relative to the document (docs/RESULTS.md links to
../benchmarks/results/).

Where two files measured the same figure, the table takes the newest: the later "date" field,
and on equal dates the file changed last in `git log` (docs/RESULTS.md lists the others).

A figure in the prose of either document sits between an inline marker that says where it
comes from and `/fig`:

  <!-- fig:compile_speed_s:row=mesa int8:step_ratio:x -->1.47x<!-- /fig -->

that is fig:FILE:SELECTION:VALUE:FORMAT, a marker and its /fig on one line, after a word of
the sentence (a line that begins with "<!--" is a raw HTML block to Markdown), where
- FILE is benchmarks/results/FILE.jsonl;
- SELECTION is key=value pairs joined by "&" (a value may list alternatives joined by "|";
  a number, true, false or null matches the JSON value); empty selects every row;
- VALUE is a field of the one row selected (anything but one row is an error), or a summary
  of all the rows selected: median(FIELD) (of the finite values, as grad_fidelity.py takes
  it), mean(FIELD), each(FIELD) (every row must give the same text), or diff_mean /
  diff_lo95 / diff_hi95 (FIELD, KEY=BASE, BY): the mean paired difference against the rows
  with KEY=BASE instead, paired on BY, and the ends of its 95% interval (+- 1.96 standard
  errors, as accuracy.py);
- FORMAT is x (2 decimals and "x"), mib or n (a whole number with a thousands separator), ms
  (one decimal), s (text as it is), db (one decimal and "dB", "exact" for infinity), or any
  Python format spec such as .1f or +.2f.

Imports no torch, so it runs anywhere in well under a second.

  python benchmarks/readme_tables.py            # rewrite the tables and figures of both files
  python benchmarks/readme_tables.py --check    # exit 1, naming each stale or misplaced table
                                                # (and its first differing line) and the first
                                                # stale figure of each file
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import posixpath
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from itertools import zip_longest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
README = "README.md"
DOC = "docs/RESULTS.md"
GUIDE = "docs/GUIDE.md"  # figures only ("Which option when")
# the documents that hold tables and figures, as paths from the repository root
DOCUMENTS = (README, DOC, GUIDE)


def _cell(text: str):
    """A CSV cell as the JSON value it spells (a number, true/false, null), else the text."""
    if text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


def _load(name: str, root: Path = ROOT) -> list[dict]:
    """The rows of benchmarks/results/<name>.jsonl, or of <name>.csv where there is no .jsonl
    (benchmarks/ablate.py writes CSV)."""
    path = root / RESULTS / f"{name}.jsonl"
    if not path.exists() and path.with_suffix(".csv").exists():
        with path.with_suffix(".csv").open(newline="") as f:
            return [{k: _cell(v) for k, v in row.items()} for row in csv.DictReader(f)]
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _pick(rows: list[dict], name: str, **match) -> dict:
    """The one row of ``rows`` whose fields equal ``match``; anything else is an error."""
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise ValueError(f"{name}.jsonl: {len(found)} rows match {match}, expected 1")
    return found[0]


class _Sources:
    """Loads files once and remembers which ones (and which runs) a table used; links to
    them from the document ``doc`` (a path from the repository root)."""

    def __init__(self, root: Path, doc: str = README):
        self.root = root
        self.base = posixpath.relpath(RESULTS, posixpath.dirname(doc) or ".")
        self._rows: dict[str, list[dict]] = {}
        self.used: dict[str, list[dict]] = {}

    def link(self, name: str) -> str:
        csv_only = not (self.root / RESULTS / f"{name}.md").exists() and (
            (self.root / RESULTS / f"{name}.csv").exists()
        )
        file = f"{name}.csv" if csv_only else f"{name}.md"
        return f"[`{file}`]({self.base}/{file})"

    def rows(self, name: str) -> list[dict]:
        if name not in self._rows:
            self._rows[name] = _load(name, self.root)
        return self._rows[name]

    def row(self, name: str, **match) -> dict:
        row = _pick(self.rows(name), name, **match)
        self.used.setdefault(name, []).append(row)
        return row


def _mib(x: float) -> str:
    return f"{x:,.0f}"


def _x(x: float) -> str:
    return f"{x:.2f}x"


def _ms(x: float) -> str:
    return f"{x:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _provenance(src: _Sources) -> list[str]:
    """One line per distinct (date, device, versions) of the rows used, naming their files."""
    runs: dict[tuple, list[str]] = {}
    for name, rows in src.used.items():
        for r in rows:
            key = (r.get("date", "undated"), r.get("device", "the device its file names"),
                   r.get("torch", "?"), r.get("triton"), r.get("timm"),
                   r.get("transformers"))  # fmt: skip
            if name not in runs.setdefault(key, []):
                runs[key].append(name)
    lines = []
    for (date, device, torch, triton, timm, transformers), names in sorted(
        runs.items(), key=lambda kv: [str(v or "") for v in kv[0]]
    ):
        versions = [f"torch {torch}"]
        versions += [f"Triton {triton}"] if triton else []
        versions += [f"timm {timm}"] if timm else []
        versions += [f"transformers {transformers}"] if transformers else []
        files = ", ".join(src.link(n) for n in names)
        lines.append(f"- {date}, {device}, {', '.join(versions)}: {files}")
    return lines


# --- the tables ----------------------------------------------------------------------------


def _deit(src: _Sources) -> list[str]:
    """DeiT-Ti/S/B, eager, fp16 autocast, batch 128, fused attention, 8 bits."""
    # (label, peak file and rows, step/activation file and rows): the newest file per figure.
    models = [
        ("DeiT-Ti", ("deit_speed_gpu", dict(model="deit_tiny_patch16_224", label="plain"),
                     dict(model="deit_tiny_patch16_224", label="mesa int8")),
         ("eager_speed_vit_gpu", "row", "plain", "mesa int8", "deit_tiny_patch16_224")),
        ("DeiT-S", ("checkpoint_pareto_gpu_repeats",
                    dict(model="deit_small_patch16_224", point="plain"),
                    dict(model="deit_small_patch16_224", point="int8")),
         ("speed_vit_h100_1206", "row", "plain", "mesa int8", "deit_small_patch16_224")),
        ("DeiT-B", ("checkpoint_pareto_gpu_repeats",
                    dict(model="deit_base_patch16_224", point="plain"),
                    dict(model="deit_base_patch16_224", point="int8")),
         ("speed_vit_h100_1206", "row", "plain", "mesa int8", "deit_base_patch16_224")),
    ]  # fmt: skip
    rows = []
    for label, (pfile, pplain, pmesa), (sfile, key, splain, smesa, model) in models:
        p0, p1 = src.row(pfile, **pplain), src.row(pfile, **pmesa)
        s0 = src.row(sfile, model=model, **{key: splain})
        s1 = src.row(sfile, model=model, **{key: smesa})
        peak_red = p0["peak_mib"] / p1["peak_mib"]
        act_red = s0["activation_mib"] / s1["activation_mib"]
        sources = src.link(pfile)
        if pfile != sfile:
            sources = f"peak {src.link(pfile)}, rest {src.link(sfile)}"
        rows.append([
            label, _mib(p0["peak_mib"]), _mib(p1["peak_mib"]), f"**{_x(peak_red)}**",
            _x(act_red), f"{_ms(s0['step_ms'])} / {_ms(s1['step_ms'])}",
            _x(s1["step_ms"] / s0["step_ms"]), sources,
        ])  # fmt: skip
    header = ["model", "plain AMP peak MiB", "8-bit peak MiB", "peak reduction",
              "activation reduction", "step ms, plain / 8-bit", "step / plain", "from"]  # fmt: skip
    return _table(header, rows)


def _cnn(src: _Sources) -> list[str]:
    """Convolutional networks with the opt-in kinds: plain AMP, timm's checkpointing, 8 and 4
    bits; ResNet-50, EfficientNet-B0 and MobileNetV3-large at batch 256, ConvNeXt-T and Swin-T
    at 128 (Swin-T with timm's explicit window attention, its default, and fused). Each ratio
    against the plain row of its own run. Peaks from the memory runs: the H100's of 2026-12-06,
    after the backwards that read the codes, for ResNet-50, EfficientNet-B0 and ConvNeXt-T, the
    H200's before them for the rest (that H100 run's single steps gave Swin-T fused 8 bits
    1.36x, where the interleaved ViT run of the same day gives 1.17x). The steps of plain,
    checkpointing and 8 bits from the interleaved eager-speed run where it measured the model
    (ResNet-50, EfficientNet-B0: medians of 3 interleaved passes; a memory run's single steps
    gave EfficientNet-B0's 8 bits 0.87x where the interleaved run gives 1.21x), the memory
    runs' otherwise (each the median of one run's steps)."""
    speed = {"ckpt": "ckpt", "mesa int8": "mesa int8, opt-in kinds"}  # memory label -> row
    timed = {r["model"] for r in src.rows("eager_speed_cnn_h100_1206")}
    rows = []
    for label, model, name, match in (
        ("ResNet-50", "resnet50", "cnn_memory_gpu_h100_1206", {}),
        ("EfficientNet-B0", "efficientnet_b0", "cnn_memory_gpu_h100_1206", {}),
        ("MobileNetV3-large", "mobilenetv3_large_100", "cnn_memory_gpu_act", {}),
        ("ConvNeXt-T", "convnext_tiny", "cnn_memory_gpu_128_h100_1206", {}),
        ("Swin-T", "swin_tiny_patch4_window7_224", "swin_memory_gpu", {"attention": "explicit"}),
        ("Swin-T, fused attention", "swin_tiny_patch4_window7_224", "swin_memory_gpu",
         {"attention": "fused"}),
    ):  # fmt: skip
        p0 = src.row(name, model=model, label="plain", **match)
        s0 = p0
        if model in timed:
            s0 = src.row("eager_speed_cnn_h100_1206", model=model, row="plain")
        cells = [label, str(p0["batch"]), _mib(p0["peak_mib"]), _ms(s0["step_ms"])]
        for mode in ("ckpt", "mesa int8", "mesa int4"):
            r = src.row(name, model=model, label=mode, **match)
            step = r["step_ms"] / p0["step_ms"]
            if model in timed and mode in speed:
                step = src.row("eager_speed_cnn_h100_1206", model=model,
                               row=speed[mode])["step_ratio"]  # fmt: skip
            cells.append(f"{_x(p0['peak_mib'] / r['peak_mib'])}, {_x(step)}")
        rows.append(cells)
    header = ["model", "batch", "plain AMP peak MiB", "plain step ms",
              "timm checkpointing: peak reduction, step / plain",
              "8 bits: peak reduction, step / plain",
              "4 bits: peak reduction, step / plain"]  # fmt: skip
    return _table(header, rows)


def _budget(src: _Sources) -> list[str]:
    """benchmarks/budget.py on the H200: per model, the planner's plans (eager) at fractions of
    the plain peak and the smallest feasible one, predicted against measured, beside the
    framework's checkpointing of every k-th block, ``activation_memory_budget`` under compile
    and the plans for those compiled peaks, compiled."""
    rows = []
    for label, name in (("DeiT-S", "budget_gpu_deit_s"), ("DeiT-B", "budget_gpu_deit_b"),
                        ("Llama-shaped 1B", "budget_gpu_llama")):  # fmt: skip
        plain = src.row(name, row="plain")
        rows.append([label, "plain", "-", "-", _mib(plain["peak_mib"]), "-",
                     _ms(plain["step_ms"]), "1.00x"])  # fmt: skip
        for r in src.rows(name):
            if r["row"] in ("plain", "measurements") or "error" in r:
                continue
            src.row(name, row=r["row"])
            plan = "policies" in r
            predicted = "-"
            if plan:
                predicted = _mib(r["predicted_mib"])
                if round(r["repredicted_mib"]) != round(r["predicted_mib"]):
                    predicted += f" / {_mib(r['repredicted_mib'])}"
            step = _ms(r["step_ms"])
            if plan and "compiled" not in r["row"]:
                step += f" ({_ms(r['predicted_step_ms'])})"
            rows.append([label, r["row"], _mib(r["budget_mib"]) if plan else "-",
                         r["policies"] if plan else "-", _mib(r["memory_mib"]), predicted, step,
                         _x(r["step_ratio"])])  # fmt: skip
    header = ["model", "row", "budget MiB", "plan (policy x blocks)", "peak MiB",
              "predicted peak MiB (at the run / today's model)", "step ms (predicted)",
              "step / plain"]  # fmt: skip
    return _table(header, rows)


def _llm(src: _Sources) -> list[str]:
    """Hugging Face models from configs, bf16 autocast, sdpa, 8 bits and HF checkpointing."""
    models = [
        ("GPT-2 small", "llm_ckpt_gpu_gpt2", "gpt2"),
        ("GPT-2 medium", "llm_memory_gpu_gpt2", "gpt2-medium"),
        ("Llama-shaped 1B (hidden 2048, 8 layers, GQA 16/4)", "llm_ckpt_gpu_llama", "llama-1b"),
        ("BERT base (masked LM)", "llm_memory_gpu_bert", "bert"),
    ]
    rows = []
    for label, name, model in models:
        p0 = src.row(name, model=model, mode="plain")
        p1 = src.row(name, model=model, mode="int8")
        hf = src.row(name, model=model, mode="hf-ckpt")
        rows.append([
            label, f"{p0['batch']} x {p0['seq']}", _mib(p0["peak_mib"]), _mib(p1["peak_mib"]),
            f"**{_x(p1['peak_reduction'])}**", f"**{_x(p1['activation_reduction'])}**",
            f"{_x(p1['step_ratio'])} ({_ms(p0['step_ms'])} ms plain)",
            f"{_x(hf['activation_reduction'])}, {_x(hf['step_ratio'])}", src.link(name),
        ])  # fmt: skip
    header = ["model", "batch x seq", "plain peak MiB", "8-bit peak MiB", "peak reduction",
              "activation reduction", "step / plain",
              "HF checkpointing: activation reduction, step / plain", "from"]  # fmt: skip
    return _table(header, rows)


def _ckpt(src: _Sources) -> list[str]:
    """Config(checkpoint="blocks") at 8 bits against plain and the framework's checkpointing."""
    rows = []
    for label, model in (("DeiT-S", "deit_small_patch16_224"), ("DeiT-B", "deit_base_patch16_224")):
        name = "checkpoint_pareto_gpu_repeats"
        p0 = src.row(name, model=model, point="plain")
        own = src.row(name, model=model, point="timm-ckpt")
        c8 = src.row(name, model=model, point="ckpt8")
        rows.append([
            label, "128", _mib(p0["peak_mib"]), _mib(c8["peak_mib"]),
            f"**{_x(c8['memory_reduction'])}**", _x(c8["step_ratio"]),
            f"timm: {_x(own['memory_reduction'])}, {_x(own['step_ratio'])}",
            f"{c8['sqnr_db']:.1f} dB", src.link(name),
        ])  # fmt: skip
    for label, name, model in (("GPT-2 small", "llm_ckpt_gpu_gpt2", "gpt2"),
                               ("Llama-shaped 1B", "llm_ckpt_gpu_llama", "llama-1b")):  # fmt: skip
        p0 = src.row(name, model=model, mode="plain")
        own = src.row(name, model=model, mode="hf-ckpt")
        c8 = src.row(name, model=model, mode="ckpt8")
        rows.append([
            label, f"{p0['batch']} x {p0['seq']}", _mib(p0["peak_mib"]), _mib(c8["peak_mib"]),
            f"**{_x(c8['peak_reduction'])}**", _x(c8["step_ratio"]),
            f"HF: {_x(own['peak_reduction'])}, {_x(own['step_ratio'])}", "-", src.link(name),
        ])  # fmt: skip
    header = ["model", "batch", "plain peak MiB", "ckpt int8 peak MiB", "peak reduction",
              "step / plain", "framework's checkpointing: peak reduction, step / plain",
              "grad SQNR (median)", "from"]  # fmt: skip
    return _table(header, rows)


def _compiled(src: _Sources) -> list[str]:
    """torch.compile rows: DeiT-S and DeiT-B with mesa_lite.compile and with plain
    torch.compile, and the earlier DeiT-S run with PyTorch's own options (each ratio within
    its own run). The eager rows of these runs are left out: the eager figures are the
    interleaved eager-speed run's (README's DeiT table)."""
    parts = (
        ("DeiT-S", "compile_speed_s_options", "deit_small_patch16_224",
         ["plain compiled", "mesa int8 compiled, decomposed",
          "mesa int8 compiled, decomposed, Inductor defaults", "plain compiled, reduce-overhead",
          "mesa int8 compiled, reduce-overhead"]),
        ("DeiT-S", "compile_speed_s", "deit_small_patch16_224",
         ["plain compiled", "plain compiled, activation_memory_budget 0.5",
          "plain compiled, activation_memory_budget 0.2",
          "plain compiled, Inductor fp8 activations"]),
        ("DeiT-B", "compile_speed_b", "deit_base_patch16_224",
         ["plain compiled", "mesa int8 compiled, decomposed"]),
    )  # fmt: skip
    rows = []
    for label, name, model, names in parts:
        for row_name in names:
            r = src.row(name, model=model, row=row_name)
            if "reduce-overhead" in row_name:  # CUDA graphs' pools hide the activations
                memory = ["not measured (CUDA graph pool)", "-"]
            else:
                memory = [_mib(r["activation_mib"]), _x(r["activation_reduction"])]
            shown = _COMPILED_LABELS.get(row_name, row_name)
            rows.append([label, shown, _ms(r["step_ms"]), _x(r["step_ratio"]), *memory,
                         src.link(name)])  # fmt: skip
    header = ["model", "row", "step ms", "step / plain of the same mode and run",
              "activations MiB", "activation reduction", "run"]  # fmt: skip
    return _table(header, rows)


def _graphed(src: _Sources) -> list[str]:
    """CUDA-graphed (mesa_lite.graphed) rows, each run interleaving plain, 8-bit, graphed
    plain and graphed 8-bit: steps against eager plain and graphed plain, activations against
    eager plain (a graphed row's include its pool's free part). The eager 8-bit figures are
    the DeiT and convolutional tables'."""
    models = (("DeiT-Ti", "graphed_speed_gpu", "deit_tiny_patch16_224", ""),
              ("DeiT-S", "speed_vit_h100_1206", "deit_small_patch16_224", ""),
              ("DeiT-B", "speed_vit_h100_1206", "deit_base_patch16_224", ""),
              ("Swin-T", "speed_vit_h100_1206", "swin_tiny_patch4_window7_224", ""),
              ("ConvNeXt-T", "graphed_speed_others_gpu", "convnext_tiny", ""),
              ("ResNet-50", "graphed_speed_cnn_gpu", "resnet50", ", opt-in kinds"),
              ("EfficientNet-B0", "graphed_speed_cnn_gpu", "efficientnet_b0",
               ", opt-in kinds"))  # fmt: skip
    rows = []
    for label, name, model, kinds in models:
        plain = src.row(name, model=model, row="plain")
        gplain = src.row(name, model=model, row="plain, graphed")
        graphed = src.row(name, model=model, row=f"mesa int8{kinds}, graphed")
        act = lambda r, p=plain: _x(p["activation_mib"] / r["activation_mib"])  # noqa: E731
        rows.append([label + (" (opt-in kinds)" if kinds else ""), str(plain["batch"]),
                     _x(gplain["step_ms"] / plain["step_ms"]),
                     _x(graphed["step_ms"] / plain["step_ms"]),
                     _x(graphed["step_ms"] / gplain["step_ms"]), act(graphed),
                     src.link(name)])  # fmt: skip
    header = ["model", "batch", "plain graphed: step / plain",
              "8-bit graphed: step / plain", "step / plain graphed",
              "activation reduction vs eager plain", "from"]  # fmt: skip
    return _table(header, rows)


# the compile_speed row names as the README shows them
_COMPILED_LABELS = {
    "mesa int8 compiled, decomposed": "mesa int8, mesa_lite.compile",
    "mesa int8 compiled, decomposed, Inductor defaults": "mesa int8, plain torch.compile",
    "mesa int8 compiled, reduce-overhead": "mesa int8, mesa_lite.compile reduce-overhead",
}


# name -> builder; each table is followed by the date, GPU and versions of the rows it used.
TABLES: dict[str, Callable[[_Sources], list[str]]] = {
    "deit": _deit,
    "cnn": _cnn,
    "budget": _budget,
    "llm": _llm,
    "ckpt": _ckpt,
    "compiled": _compiled,
    "graphed": _graphed,
}


# a field's column header in a rows table, where its name in words is not the header wanted
_HEADERS = {"step_ms": "step ms", "activation_mib": "activations MiB", "peak_mib": "peak MiB",
            "step_ratio": "step / base row", "activation_reduction": "activation reduction",
            "vs_copy": "vs copy", "memory_reduction": "peak reduction", "label": "row",
            "sqnr_db": "gradient SQNR (median)",
            "plain_layers": "stays plain (share of what is kept)",
            "kept_for_backward_mib": "kept for backward MiB",
            "backward_tmp_mib": "backward tmp MiB",
            "kept_mib": "kept MiB", "step_spread": "step spread", "plain_us": "plain us",
            "exact_us": "exact us", "wrapped_us": "wrapped us", "copy_gbs": "copy GB/s",
            "quantize_gbs": "quantize GB/s", "quantize_vs_copy": "quantize vs copy",
            "dequantize_gbs": "dequantize GB/s", "dequantize_vs_copy": "dequantize vs copy",
            "acc_mean": "digits accuracy %", "plain_acc_mean": "plain accuracy %",
            "grad_median_db": "gradient SQNR dB (median)"}  # fmt: skip
_ROWS = "rows;"  # the prefix of a rows table's name


def _rows_table(spec: str, src: _Sources) -> list[str]:
    """The table that the marker ``<!-- table:rows;SPEC -->`` stands for (module docstring)."""
    parts = spec.split(";")
    if len(parts) != 3 or not parts[0].strip() or not parts[2].strip():
        raise ValueError(f"table:rows;{spec}: expected rows;FILE;SELECTION;FIELD/FORMAT,...")
    name, selection, columns = (p.strip() for p in parts)
    cols = []
    for c in columns.split(","):
        field, slash, fmt = c.strip().partition("/")
        if not slash or not field or not fmt:
            raise ValueError(f"table:rows;{spec}: column {c.strip()!r} is not FIELD/FORMAT")
        cols.append((field, fmt))
    rows = _select(src.rows(name), _selection(selection))
    if not rows:
        raise ValueError(f"table:rows;{spec}: no row of {name}.jsonl matches")
    src.used.setdefault(name, []).extend(rows)
    header = [_HEADERS.get(f, f.replace("_", " ")) for f, _ in cols]
    body = [["-" if r.get(f) is None else _format(_get(r, f, name), fmt) for f, fmt in cols]
            for r in rows]  # fmt: skip
    return _table(header, body)


def _known(name: str) -> bool:
    return name in TABLES or name.startswith(_ROWS)


def render(name: str, root: Path = ROOT, doc: str = README) -> list[str]:
    """The lines of one table with its provenance, as they stand between its markers in the
    document ``doc`` (which the links are relative to)."""
    src = _Sources(root, doc)
    lines = _rows_table(name[len(_ROWS) :], src) if name.startswith(_ROWS) else TABLES[name](src)
    return [*lines, "", "Measured:", *_provenance(src)]


# a table's opening or closing marker, a line of its own
_MARKER = re.compile(r"^<!-- (?P<close>/?)table:(?P<name>[^\n]*?) -->$", re.M)


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def tables_in(text: str) -> list[str]:
    """The names of the tables that have a marker in ``text``: those of TABLES in its order,
    then the rows tables in the text's order."""
    named = [m["name"] for m in _MARKER.finditer(text)]
    rows = [n for n in dict.fromkeys(named) if n.startswith(_ROWS)]
    return [name for name in TABLES if name in named] + rows


def _unknown(text: str, doc: str) -> list[str]:
    """One message per marker in ``text`` that names no table of TABLES."""
    return [
        f"{doc} line {_line_of(text, m.start())}: {m[0]} names no table "
        f"(the tables: {', '.join(TABLES)}, or rows;FILE;SELECTION;COLUMNS)"
        for m in _MARKER.finditer(text)
        if not _known(m["name"])
    ]


def _span(text: str, name: str, doc: str = README) -> tuple[int, int]:
    """Start and end offsets of the text between table ``name``'s markers in ``text``, the
    document ``doc``: one opening marker line, then one closing one."""
    found = [m for m in _MARKER.finditer(text) if m["name"] == name]
    opens = [m for m in found if not m["close"]]
    closes = [m for m in found if m["close"]]
    where = f"{doc}: table '{name}'"
    if len(opens) != 1 or len(closes) != 1:
        raise ValueError(
            f"{where}: expected one <!-- table:{name} --> line and one <!-- /table:{name} --> "
            f"line after it, found {len(opens)} and {len(closes)}"
        )
    if closes[0].start() < opens[0].end():
        raise ValueError(
            f"{where}: <!-- /table:{name} --> (line {_line_of(text, closes[0].start())}) comes "
            f"before <!-- table:{name} --> (line {_line_of(text, opens[0].start())})"
        )
    return min(opens[0].end() + 1, len(text)), closes[0].start()


def _placement(texts: dict[str, str]) -> list[str]:
    """One message per table whose markers are in none of ``texts`` (document -> text) or in
    more than one."""
    problems = []
    for name in TABLES:
        holders = [doc for doc, text in texts.items() if name in tables_in(text)]
        if not holders:
            problems.append(
                f"table '{name}': no <!-- table:{name} --> ... <!-- /table:{name} --> block "
                f"in {' or '.join(texts)}"
            )
        elif len(holders) > 1:
            problems.append(
                f"table '{name}': markers in {' and '.join(holders)}; "
                "a table lives in exactly one of them"
            )
    return problems


# --- the inline figures --------------------------------------------------------------------

_FIG_OPEN = re.compile(r"<!-- fig:")
_FIG = re.compile(r"<!-- fig:(?P<spec>[^\n]*?) -->(?P<text>[^\n]*?)<!-- /fig -->")
_SUMMARY = re.compile(r"(?P<fn>median|mean|each|diff_mean|diff_lo95|diff_hi95)\((?P<args>[^()]*)\)")
_FORMATS: dict[str, Callable] = {
    "x": _x,
    "mib": _mib,
    "ms": _ms,
    "s": str,
    "n": _mib,
    "db": lambda v: "exact" if v == math.inf else f"{v:.1f} dB",
}


def _selection(text: str) -> dict[str, str]:
    """``key=value&key=value`` as a dict; empty text selects every row."""
    match = {}
    for part in text.split("&") if text.strip() else []:
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"selection {part!r} is not key=value")
        match[key.strip()] = value.strip()
    return match


def _select(rows: list[dict], match: dict[str, str]) -> list[dict]:
    """The rows whose every selected field is one of its |-separated values (JSON for non-text)."""

    def ok(value, wanted: str) -> bool:
        return (value if isinstance(value, str) else json.dumps(value)) in wanted.split("|")

    return [r for r in rows if all(ok(r.get(k), v) for k, v in match.items())]


def _get(row: dict, field: str, name: str):
    if field not in row:
        raise ValueError(f"{name}.jsonl has no field {field!r} in the row selected")
    return row[field]


def _format(value, fmt: str) -> str:
    return _FORMATS[fmt](value) if fmt in _FORMATS else format(value, fmt)


def figure(spec: str, src: _Sources) -> str:
    """The text that the marker ``<!-- fig:SPEC -->`` stands for (see the module docstring)."""
    parts = [p.strip() for p in spec.split(":")]
    if len(parts) != 4:
        raise ValueError("expected fig:FILE:SELECTION:VALUE:FORMAT")
    name, selection, value, fmt = parts
    match = _selection(selection)
    every = src.rows(name)
    rows = _select(every, match)
    summary = _SUMMARY.fullmatch(value)
    if summary is None:
        if len(rows) != 1:
            raise ValueError(f"{len(rows)} rows of {name}.jsonl match {match}, expected 1")
        return _format(_get(rows[0], value, name), fmt)
    if not rows:
        raise ValueError(f"no row of {name}.jsonl matches {match}")
    fn, args = summary["fn"], [a.strip() for a in summary["args"].split(",")]
    if fn in ("median", "mean", "each"):
        if len(args) != 1:
            raise ValueError(f"{fn}() takes one field")
        values = [_get(r, args[0], name) for r in rows]
        if fn == "median":  # the finite values, as grad_fidelity.py summarizes them
            return _format(statistics.median(v for v in values if math.isfinite(v)), fmt)
        if fn == "mean":
            return _format(statistics.mean(values), fmt)
        texts = sorted({_format(v, fmt) for v in values})
        if len(texts) != 1:
            raise ValueError(f"each({args[0]}) differs across the {len(rows)} rows: {texts}")
        return texts[0]
    if len(args) != 3:
        raise ValueError(f"{fn}() takes (FIELD, KEY=BASE, BY)")
    field, base, by = args
    base_match = {**match, **_selection(base)}
    base_rows = _select(every, base_match)
    diffs = []
    for r in rows:
        pair = [b for b in base_rows if b.get(by) == r.get(by)]
        if len(pair) != 1:
            raise ValueError(f"{len(pair)} rows of {name}.jsonl match {base_match} with "
                             f"{by}={r.get(by)!r}, expected 1")  # fmt: skip
        diffs.append(_get(r, field, name) - _get(pair[0], field, name))
    mean = statistics.mean(diffs)
    if fn == "diff_mean":
        return _format(mean, fmt)
    if len(diffs) < 2:
        raise ValueError(f"{fn}() needs two or more pairs")
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs))  # as accuracy.py's diff_ci95
    return _format(mean - half if fn == "diff_lo95" else mean + half, fmt)


def _figures(
    text: str, root: Path
) -> Iterator[tuple[int, re.Match | None, str | None, str | None]]:
    """(line, marker match, text the files give, error) for each figure marker, in order."""
    src = _Sources(root)
    for opened in _FIG_OPEN.finditer(text):
        line = text[: opened.start()].count("\n") + 1
        m = _FIG.match(text, opened.start())
        if m is None:
            yield line, None, None, "no <!-- /fig --> after this marker on its line"
            continue
        if not text[text.rfind("\n", 0, m.start()) + 1 : m.start()].strip():
            # Markdown reads a line that opens with "<!--" as a raw HTML block, ending the paragraph
            yield line, m, None, "begins its line; put a word of the sentence before it"
            continue
        try:
            yield line, m, figure(m["spec"], src), None
        except ValueError as e:
            yield line, m, None, str(e)
        except (TypeError, OSError) as e:  # a text field summarized, a file that is not there
            yield line, m, None, f"{type(e).__name__}: {e}"


def _figure_problem(line: int, m: re.Match | None, error: str, doc: str) -> str:
    marker = f"<!-- fig:{m['spec']} -->" if m else "<!-- fig:"
    return f"figure at {doc} line {line}, {marker}: {error}"


def _pair(doc: str, have: str | None, want: str | None) -> str:
    """The two versions of a line, the document's and the files', one under the other."""
    label = posixpath.basename(doc) + ":"
    return f"  {label:<11} {have!r}\n  {'files:':<11} {want!r}"


def update(text: str, root: Path = ROOT, doc: str = README) -> str:
    """``text``, the document ``doc``, with every table whose markers it holds and every figure
    replaced by what the results files give."""
    unknown = _unknown(text, doc)
    if unknown:
        raise ValueError(unknown[0])
    for name in tables_in(text):
        a, b = _span(text, name, doc)
        text = text[:a] + "\n".join(render(name, root, doc)) + "\n" + text[b:]
    out, at = [], 0
    for line, m, want, error in list(_figures(text, root)):
        if error is not None:
            raise ValueError(_figure_problem(line, m, error, doc))
        out += [text[at : m.start("text")], want]
        at = m.end("text")
    return "".join(out) + text[at:]


def check(text: str, root: Path = ROOT, doc: str = README) -> list[str]:
    """One message per table (of those whose markers ``text``, the document ``doc``, holds)
    whose lines differ from the files' or whose markers are wrong, then one for the first
    figure that differs or cannot be computed (empty: all agree). Whether every table is in
    exactly one document is check_documents' question."""
    return _check_tables(text, root, doc) + _check_figures(text, root, doc)


def check_documents(texts: dict[str, str], root: Path = ROOT) -> list[str]:
    """check() of each document (path from the root -> text), after one message per table
    whose markers are in none of them or in more than one."""
    problems = _placement(texts)
    for doc, text in texts.items():
        problems += check(text, root, doc)
    return problems


def update_documents(texts: dict[str, str], root: Path = ROOT) -> dict[str, str]:
    """update() of each document (path from the root -> text); a ValueError, naming the
    table, when a table's markers are in none of them or in more than one."""
    problems = _placement(texts)
    if problems:
        raise ValueError("\n".join(problems))
    return {doc: update(text, root, doc) for doc, text in texts.items()}


def _check_figures(text: str, root: Path, doc: str = README) -> list[str]:
    for line, m, want, error in _figures(text, root):
        if error is not None:
            return [_figure_problem(line, m, error, doc)]
        if m["text"] != want:
            return [
                f"figure differs from the results files at {doc} line {line}:\n"
                f"  marker: <!-- fig:{m['spec']} -->\n{_pair(doc, m['text'], want)}"
            ]
    return []


def _check_tables(text: str, root: Path, doc: str = README) -> list[str]:
    problems = _unknown(text, doc)
    for name in tables_in(text):
        try:
            a, b = _span(text, name, doc)
        except ValueError as e:
            problems.append(str(e))
            continue
        have = text[a:b].rstrip("\n").split("\n")
        try:
            want = render(name, root, doc)
        except (ValueError, OSError) as e:  # a bad rows spec, a file that is not there
            problems.append(f"{doc}: table '{name}': {e}")
            continue
        for i, (h, w) in enumerate(zip_longest(have, want)):
            if h != w:
                line = _line_of(text, a) + i
                problems.append(
                    f"table '{name}' differs from the results files at {doc} line {line}:\n"
                    + _pair(doc, h, w)
                )
                break
    return problems


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--check", action="store_true",
                   help="only compare; exit 1 naming each stale or misplaced table")  # fmt: skip
    p.add_argument("--readme", type=Path, default=ROOT / README,
                   help=f"the file to check or rewrite as {README}")  # fmt: skip
    p.add_argument("--results-doc", type=Path, default=ROOT / DOC,
                   help=f"the file to check or rewrite as {DOC} (its links are "
                   "written relative to docs/)")  # fmt: skip
    p.add_argument("--guide", type=Path, default=ROOT / GUIDE,
                   help=f"the file to check or rewrite as {GUIDE}")  # fmt: skip
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    paths = dict(zip(DOCUMENTS, (args.readme, args.results_doc, args.guide), strict=True))
    texts = {doc: path.read_text() for doc, path in paths.items()}
    if args.check:
        problems = check_documents(texts)
        for msg in problems:
            print(msg, file=sys.stderr)
        if not problems:
            for doc, text in texts.items():
                n, m = len(tables_in(text)), len(_FIG_OPEN.findall(text))
                print(f"{paths[doc]}: {n} tables and {m} figures agree with {RESULTS}/")
        return 1 if problems else 0
    try:
        new = update_documents(texts)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    for doc, path in paths.items():
        if new[doc] != texts[doc]:
            path.write_text(new[doc])
            print(f"{path}: tables and figures rewritten")
        else:
            print(f"{path}: tables and figures already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
