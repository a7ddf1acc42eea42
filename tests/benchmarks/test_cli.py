"""The command lines: fast and complete --help, examples that parse, console entry points that
exit 0 on success and non-zero on failure, run folders that never touch committed results, and
the CPU's default autocast dtype."""

import hashlib
import importlib
import importlib.metadata
import re
import resource
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from mesa_lite.benchmarks import common

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["ablate", "accuracy", "budget", "compile_check", "compile_speed", "coverage", "deit_memory", "grad_fidelity", "kernels",
           "llm_memory", "overhead", "peak_memory", "profile_step", "quant_bandwidth", "quant_tuning",
           "text_accuracy", "train_deit"]  # fmt: skip
# console script -> the module:function setup.py points it at
ENTRY_POINTS = {
    f"mesa-lite-{s.replace('_', '-')}": f"mesa_lite.benchmarks.{s}:main" for s in SCRIPTS
}
ENTRY_POINTS["mesa-lite-timm-train"] = "mesa_lite.timm_train:main"

# Runs a script's --help as `python script --help` would, then says whether torch got imported.
HELP_PROBE = """
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    code = e.code
print("EXIT", code, "TORCH", "torch" in sys.modules)
"""


def _cpu_seconds_of(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_fast_and_imports_no_torch(script):
    path = str(ROOT / "benchmarks" / f"{script}.py")
    proc, cpu = _cpu_seconds_of([sys.executable, "-c", HELP_PROBE, path], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and "options:" in proc.stdout
    assert proc.stdout.rstrip().endswith("EXIT 0 TORCH False"), proc.stdout[-300:]
    assert cpu < 1.0, f"--help took {cpu:.2f} s of CPU"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_has_help_and_its_default(script):
    import argparse

    parser = importlib.import_module(f"mesa_lite.benchmarks.{script}").build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{script} {action.option_strings}: no help text"
        shown = formatter._get_help_string(action)
        if action.nargs != 0:  # flags are off unless given
            assert "(default" in shown, f"{script} {action.option_strings}: {shown!r}"


def _examples(doc: str, script: str) -> list[list[str]]:
    """The argument lists of the docstring's example commands (backslash lines joined)."""
    text = doc.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(f"python benchmarks/{script}.py"):
            out.append(shlex.split(line.split("#")[0])[2:])
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_usage_examples_render_and_parse(script):
    module = importlib.import_module(f"mesa_lite.benchmarks.{script}")
    examples = _examples(module.__doc__, script)
    assert examples, f"{script}: no usage example in its docstring"
    for line in module.__doc__.splitlines():
        assert line.count("python ") <= 1, f"{script}: garbled example line {line!r}"
    parser = module.build_parser()
    for argv in examples:
        parser.parse_args(argv)  # exits with status 2 on an unknown or bad option


def test_console_entry_points_are_installed_as_listed():
    eps = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group="console_scripts")
        if ep.name.startswith("mesa-lite-")
    }
    assert eps == ENTRY_POINTS
    for value in eps.values():
        module, func = value.split(":")
        assert callable(getattr(importlib.import_module(module), func))


def _entry(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Runs a console entry point as its installed wrapper does: sys.exit(main())."""
    module, func = ENTRY_POINTS[name].split(":")
    code = f"import sys; from {module} import {func}; sys.argv[0] = {name!r}; sys.exit({func}())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)  # fmt: skip


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_entry_points_exit_0_on_help_and_2_on_a_bad_option(name, tmp_path):
    assert _entry(name, "--help", cwd=tmp_path).returncode == 0
    bad = _entry(name, "--no-such-option", cwd=tmp_path)
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr


@pytest.mark.slow
def test_entry_point_exit_status_of_a_run(tmp_path):
    """0 after a successful run (it used to exit 1: main returned its rows); 1 when a row
    fails; the rows are on stdout, not dumped to stderr."""
    tiny = ["--device", "cpu", "--img-size", "32", "--batch-size", "2", "--steps", "1",
            "--warmup", "0", "--attention", "fused", "--dtype", "fp32", "--no-plot"]  # fmt: skip
    ok = _entry("mesa-lite-deit-memory", *tiny, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "| deit_tiny | fp32 | fused | mesa int8 |" in ok.stdout
    assert "'model'" not in ok.stderr
    folders = sorted((tmp_path / "runs").iterdir())
    typo = _entry("mesa-lite-deit-memory", *tiny, "--models", "deit_tiny_patch16_24", cwd=tmp_path)
    assert typo.returncode == 2 and "unknown timm model 'deit_tiny_patch16_24'" in typo.stderr
    assert sorted((tmp_path / "runs").iterdir()) == folders  # no empty run folder left


def test_main_returns_1_when_a_row_fails(tmp_path, monkeypatch, capsys):
    """A row that fails while running (an out-of-memory error, say) is reported in its row and
    the table, the other rows still run, and the exit status is 1."""
    from mesa_lite.benchmarks import deit_memory

    def oom(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(deit_memory, "cpu_row", oom)
    argv = ["--device", "cpu", "--img-size", "32", "--batch-size", "2", "--steps", "1",
            "--warmup", "0", "--attention", "fused", "--dtype", "fp32", "--no-plot",
            "--out", str(tmp_path / "dm")]  # fmt: skip
    assert deit_memory.main(argv) == 1
    assert "FAILED RuntimeError: out of memory (simulated)" in capsys.readouterr().out
    assert (tmp_path / "dm.jsonl").read_text().count('"error"') == 2


@pytest.mark.slow
def test_default_output_is_a_fresh_run_folder_and_results_stay_untouched(tmp_path, monkeypatch,
                                                                         capsys):  # fmt: skip
    from mesa_lite.benchmarks import deit_memory

    def digest():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in (ROOT / "benchmarks" / "results").iterdir()}  # fmt: skip

    before = digest()
    monkeypatch.chdir(tmp_path)
    argv = ["--device", "cpu", "--img-size", "32", "--batch-size", "2", "--steps", "1",
            "--warmup", "0", "--attention", "fused", "--modes", "amp", "--dtype", "fp32"]  # fmt: skip
    deit_memory.run(argv)
    deit_memory.run(argv + ["--no-plot"])
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("deit_memory-") for r in runs)
    assert sorted(p.name for p in runs[0].iterdir()) == [
        "deit_memory.jsonl", "deit_memory.md", "deit_memory.png"]  # fmt: skip
    printed = capsys.readouterr().out
    for p in runs[0].iterdir():
        assert f"  {p.relative_to(tmp_path)}" in printed
    # --out naming an existing folder writes <folder>/<script>.*, not files beside it
    (tmp_path / "mine").mkdir()
    deit_memory.run(argv + ["--no-plot", "--out", str(tmp_path / "mine")])
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == [
        "deit_memory.jsonl", "deit_memory.md"]  # fmt: skip
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert digest() == before
    assert re.search(r"^runs/$", (ROOT / ".gitignore").read_text(), re.M)


def test_cpu_default_dtype_follows_native_bf16(monkeypatch, capsys):
    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: False)
    assert common.default_dtype("cpu") == "fp32"
    assert "without native bf16" in capsys.readouterr().out
    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: True)
    assert common.default_dtype("cpu") == "bf16"
    assert common.default_dtype("cuda") == "fp16"
    from mesa_lite.benchmarks import deit_memory

    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: False)
    assert deit_memory.parse_args(["--device", "cpu"]).dtype == ["fp32"]
    assert deit_memory.parse_args(["--device", "cpu", "--dtype", "bf16"]).dtype == ["bf16"]


def test_native_bf16_detection_reads_the_cpu_flags(monkeypatch, tmp_path, request):
    from mesa_lite.ops import common as ops_common

    fake = tmp_path / "cpuinfo"
    monkeypatch.setattr(ops_common, "CPUINFO", str(fake))
    request.addfinalizer(ops_common.cpu_has_native_bf16.cache_clear)  # the real CPU's after

    def detect():
        ops_common.cpu_has_native_bf16.cache_clear()
        return ops_common.cpu_has_native_bf16()

    fake.write_text("flags\t\t: fpu sse2 avx2 avx512f\n")
    assert detect() is False
    fake.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert detect() is True
    fake.write_text("Features\t: fp asimd bf16 i8mm\n")  # aarch64
    assert detect() is True


def test_lazy_module_sets_attributes_on_the_module(monkeypatch):
    """A switch set through a script's lazy module (``quant.COMPILE_FORM = ...``) reaches the
    module itself, where the library reads it; set on the proxy alone, compile_speed.py's
    custom_op rows ran the default form."""
    import sys
    import types

    from mesa_lite.benchmarks.common import lazy_import

    module = types.ModuleType("mesa_lite_lazy_probe")
    module.SWITCH = "a"
    monkeypatch.setitem(sys.modules, "mesa_lite_lazy_probe", module)
    lazy = lazy_import("mesa_lite_lazy_probe")
    lazy.SWITCH = "b"
    assert module.SWITCH == "b" and lazy.SWITCH == "b"
