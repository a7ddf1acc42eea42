"""The README's results tables, generated from the committed results files.

Each table is built from named rows of named files in benchmarks/results/ (the .jsonl beside
each .md), chosen in TABLES below, and sits in README.md between marker comments:

  <!-- table:deit -->
  ...generated lines...
  <!-- /table:deit -->

Where two files measured the same figure, the table takes the newest: the later "date" field,
and on equal dates the file changed last in `git log` (docs/RESULTS.md lists the others).
Imports no torch, so it runs anywhere in well under a second.

  python benchmarks/readme_tables.py            # rewrite the tables in README.md
  python benchmarks/readme_tables.py --check    # exit 1, naming the table and the first
                                                # differing line, if README.md is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
DOC = "docs/RESULTS.md"


def _load(name: str, root: Path = ROOT) -> list[dict]:
    """The rows of benchmarks/results/<name>.jsonl."""
    text = (root / RESULTS / f"{name}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _pick(rows: list[dict], name: str, **match) -> dict:
    """The one row of ``rows`` whose fields equal ``match``; anything else is an error."""
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise ValueError(f"{name}.jsonl: {len(found)} rows match {match}, expected 1")
    return found[0]


class _Sources:
    """Loads files once and remembers which ones (and which runs) a table used."""

    def __init__(self, root: Path):
        self.root = root
        self._rows: dict[str, list[dict]] = {}
        self.used: dict[str, list[dict]] = {}

    def row(self, name: str, **match) -> dict:
        if name not in self._rows:
            self._rows[name] = _load(name, self.root)
        row = _pick(self._rows[name], name, **match)
        self.used.setdefault(name, []).append(row)
        return row


def _mib(x: float) -> str:
    return f"{x:,.0f}"


def _x(x: float) -> str:
    return f"{x:.2f}x"


def _ms(x: float) -> str:
    return f"{x:.1f}"


def _link(name: str) -> str:
    return f"[`{name}.md`]({RESULTS}/{name}.md)"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _provenance(src: _Sources) -> list[str]:
    """One line per distinct (date, device, versions) of the rows used, naming their files."""
    runs: dict[tuple, list[str]] = {}
    for name, rows in src.used.items():
        for r in rows:
            key = (r["date"], r["device"], r["torch"], r.get("triton"), r.get("timm"),
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
        files = ", ".join(_link(n) for n in names)
        lines.append(f"- {date}, {device}, {', '.join(versions)}: {files}")
    return lines


# --- the tables ----------------------------------------------------------------------------


def _deit(src: _Sources) -> list[str]:
    """DeiT-Ti/S/B, eager, fp16 autocast, batch 128, fused attention, 8 bits."""
    # (label, peak file and rows, step/activation file and rows): the newest file per figure.
    models = [
        ("DeiT-Ti", ("deit_speed_gpu", dict(model="deit_tiny_patch16_224", label="plain"),
                     dict(model="deit_tiny_patch16_224", label="mesa int8")),
         ("deit_speed_gpu", "label", "plain", "mesa int8", "deit_tiny_patch16_224")),
        ("DeiT-S", ("deit_s_compile_gpu", dict(label="plain"), dict(label="mesa int8")),
         ("compile_speed_s", "row", "plain", "mesa int8", "deit_small_patch16_224")),
        ("DeiT-B", ("checkpoint_pareto_gpu_repeats",
                    dict(model="deit_base_patch16_224", point="plain"),
                    dict(model="deit_base_patch16_224", point="int8")),
         ("compile_speed_b_flash", "row", "plain", "mesa int8", "deit_base_patch16_224")),
    ]  # fmt: skip
    rows = []
    for label, (pfile, pplain, pmesa), (sfile, key, splain, smesa, model) in models:
        p0, p1 = src.row(pfile, **pplain), src.row(pfile, **pmesa)
        s0 = src.row(sfile, model=model, **{key: splain})
        s1 = src.row(sfile, model=model, **{key: smesa})
        peak_red = p0["peak_mib"] / p1["peak_mib"]
        act_red = s0["activation_mib"] / s1["activation_mib"]
        sources = _link(pfile) if pfile == sfile else f"peak {_link(pfile)}, rest {_link(sfile)}"
        rows.append([
            label, _mib(p0["peak_mib"]), _mib(p1["peak_mib"]), f"**{_x(peak_red)}**",
            _x(act_red), f"{_ms(s0['step_ms'])} / {_ms(s1['step_ms'])}",
            _x(s1["step_ms"] / s0["step_ms"]), sources,
        ])  # fmt: skip
    header = ["model", "plain AMP peak MiB", "8-bit peak MiB", "peak reduction",
              "activation reduction", "step ms, plain / 8-bit", "step / plain", "from"]  # fmt: skip
    return _table(header, rows)


def _timm(src: _Sources) -> list[str]:
    """Swin-T and ConvNeXt-T, same settings as the DeiT table."""
    rows = []
    for label, model in (
        ("Swin-T", "swin_tiny_patch4_window7_224"),
        ("ConvNeXt-T", "convnext_tiny"),
    ):
        p0 = src.row("deit_speed_gpu", model=model, label="plain")
        p1 = src.row("deit_speed_gpu", model=model, label="mesa int8")
        rows.append([
            label, _mib(p0["peak_mib"]), _mib(p1["peak_mib"]),
            f"**{_x(p0['peak_mib'] / p1['peak_mib'])}**",
            _x(p0["activation_mib"] / p1["activation_mib"]),
            f"{_ms(p0['step_ms'])} / {_ms(p1['step_ms'])}", _x(p1["step_ms"] / p0["step_ms"]),
        ])  # fmt: skip
    header = ["model", "plain AMP peak MiB", "8-bit peak MiB", "peak reduction",
              "activation reduction", "step ms, plain / 8-bit", "step / plain"]  # fmt: skip
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
            f"{_x(hf['activation_reduction'])}, {_x(hf['step_ratio'])}", _link(name),
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
            f"{c8['sqnr_db']:.1f} dB", _link(name),
        ])  # fmt: skip
    for label, name, model in (("GPT-2 small", "llm_ckpt_gpu_gpt2", "gpt2"),
                               ("Llama-shaped 1B", "llm_ckpt_gpu_llama", "llama-1b")):  # fmt: skip
        p0 = src.row(name, model=model, mode="plain")
        own = src.row(name, model=model, mode="hf-ckpt")
        c8 = src.row(name, model=model, mode="ckpt8")
        rows.append([
            label, f"{p0['batch']} x {p0['seq']}", _mib(p0["peak_mib"]), _mib(c8["peak_mib"]),
            f"**{_x(c8['peak_reduction'])}**", _x(c8["step_ratio"]),
            f"HF: {_x(own['peak_reduction'])}, {_x(own['step_ratio'])}", "-", _link(name),
        ])  # fmt: skip
    header = ["model", "batch", "plain peak MiB", "ckpt int8 peak MiB", "peak reduction",
              "step / plain", "framework's checkpointing: peak reduction, step / plain",
              "grad SQNR (median)", "from"]  # fmt: skip
    return _table(header, rows)


def _compiled(src: _Sources) -> list[str]:
    """Eager and torch.compile rows, DeiT-S (every row) and DeiT-B (flash attention forced)."""
    s_rows = ["plain", "mesa int8", "plain compiled", "mesa int8 compiled, decomposed",
              "mesa int8 compiled, custom_op", "plain compiled, activation_memory_budget 0.5",
              "plain compiled, activation_memory_budget 0.2",
              "plain compiled, Inductor fp8 activations", "plain compiled, reduce-overhead",
              "mesa int8 compiled, reduce-overhead"]  # fmt: skip
    b_rows = ["plain", "mesa int8", "plain compiled", "mesa int8 compiled, decomposed"]
    rows = []
    for label, name, model, names in (
        ("DeiT-S", "compile_speed_s", "deit_small_patch16_224", s_rows),
        ("DeiT-B", "compile_speed_b_flash", "deit_base_patch16_224", b_rows),
    ):
        for row_name in names:
            r = src.row(name, model=model, row=row_name)
            if "reduce-overhead" in row_name:  # CUDA graphs' pools hide the activations
                memory = ["not measured (CUDA graph pool)", "-"]
            else:
                memory = [_mib(r["activation_mib"]), _x(r["activation_reduction"])]
            rows.append([label, row_name, _ms(r["step_ms"]), _x(r["step_ratio"]), *memory])
    header = ["model", "row", "step ms", "step / plain of the same mode", "activations MiB",
              "activation reduction"]  # fmt: skip
    return _table(header, rows)


# name -> builder; each table is followed by the date, GPU and versions of the rows it used.
TABLES: dict[str, Callable[[_Sources], list[str]]] = {
    "deit": _deit,
    "timm": _timm,
    "llm": _llm,
    "ckpt": _ckpt,
    "compiled": _compiled,
}


def render(name: str, root: Path = ROOT) -> list[str]:
    """The lines of one table with its provenance, as they stand between its markers."""
    src = _Sources(root)
    lines = TABLES[name](src)
    return [*lines, "", "Measured:", *_provenance(src)]


def _span(text: str, name: str) -> tuple[int, int]:
    """Start and end offsets of the text between table ``name``'s markers."""
    start = re.search(rf"^<!-- table:{name} -->\n", text, re.M)
    end = re.search(rf"^<!-- /table:{name} -->$", text, re.M)
    if not start or not end or end.start() < start.end():
        raise ValueError(f"README.md: no <!-- table:{name} --> ... <!-- /table:{name} --> block")
    return start.end(), end.start()


def update(text: str, root: Path = ROOT) -> str:
    """``text`` with every table replaced by what the results files give."""
    for name in TABLES:
        a, b = _span(text, name)
        text = text[:a] + "\n".join(render(name, root)) + "\n" + text[b:]
    return text


def check(text: str, root: Path = ROOT) -> list[str]:
    """One message per table whose lines in ``text`` differ from the files' (empty: all agree)."""
    problems = []
    for name in TABLES:
        try:
            a, b = _span(text, name)
        except ValueError as e:
            problems.append(str(e))
            continue
        have = text[a:b].rstrip("\n").split("\n")
        want = render(name, root)
        for i, (h, w) in enumerate(zip_longest(have, want)):
            if h != w:
                line = text[:a].count("\n") + 1 + i
                problems.append(
                    f"table '{name}' differs from the results files at README.md line {line}:\n"
                    f"  README: {h!r}\n  files:  {w!r}"
                )
                break
    return problems


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--check", action="store_true",
                   help="only compare; exit 1 naming each stale table")  # fmt: skip
    p.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the file to update")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    text = args.readme.read_text()
    if args.check:
        problems = check(text)
        for msg in problems:
            print(msg, file=sys.stderr)
        if not problems:
            print(f"{args.readme}: {len(TABLES)} tables agree with {RESULTS}/")
        return 1 if problems else 0
    new = update(text)
    if new != text:
        args.readme.write_text(new)
        print(f"{args.readme}: tables rewritten")
    else:
        print(f"{args.readme}: tables already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
