"""The package as users install it: the wheel and the sdist built from the checkout hold every
module of the tree (a package left out of setup.py fails here), and the wheel, unpacked away from
the tree, imports every module, resolves every console script, wraps and trains."""

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the folders that install, and where: kernels/ and benchmarks/ go inside mesa_lite
INSTALLED_AS = {"mesa_lite": "mesa_lite", "kernels": "mesa_lite/kernels",
                "benchmarks": "mesa_lite/benchmarks"}  # fmt: skip
SOURCES = ["setup.py", "pyproject.toml", "README.md", *INSTALLED_AS]


def _can_build_wheels() -> bool:
    """setuptools builds wheels itself from 70.1, with the wheel package before (pyproject's
    build requirements; pip installs them in its isolated build env, a test uses this one's)."""
    import importlib.util

    try:
        from setuptools.command import bdist_wheel  # noqa: F401
    except ImportError:
        return importlib.util.find_spec("wheel") is not None
    return True


pytestmark = [
    pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="needs the source tree"),
    pytest.mark.slow,
]
needs_wheel_builds = pytest.mark.skipif(
    not _can_build_wheels(), reason="this setuptools builds no wheels (< 70.1, no wheel package)"
)


def _tree_files() -> dict[str, str]:
    """Every .py file of the tree: its path in the checkout -> its path once installed."""
    found = {}
    for folder, dest in INSTALLED_AS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder)
            if "__pycache__" not in rel.parts and rel.parts[0] != "results":
                found[f"{folder}/{rel.as_posix()}"] = f"{dest}/{rel.as_posix()}"
    return found


def _build(kind: str, src: Path, out: Path) -> Path:
    """Build with setuptools' own PEP 517 backend, as pip does (no network, no isolation)."""
    code = f"from setuptools import build_meta as b; print('BUILT', b.build_{kind}({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    built = [ln.split()[-1] for ln in proc.stdout.splitlines() if ln.startswith("BUILT ")]
    return out / built[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A wheel and an sdist of a copy of the checkout, and a wheel built from that sdist."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "results")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, src / name)
    (tmp / "dist").mkdir()
    wheel = _build("wheel", src, tmp / "dist")
    sdist = _build("sdist", src, tmp / "dist")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    (tmp / "dist2").mkdir()
    (unpacked,) = (tmp / "unpacked").iterdir()
    wheel2 = _build("wheel", unpacked, tmp / "dist2")
    return {"wheel": wheel, "sdist": sdist, "wheel_from_sdist": wheel2, "tmp": tmp}


def _py_files(names) -> set[str]:
    return {n for n in names if n.endswith(".py")}


@needs_wheel_builds
def test_wheel_holds_every_module_of_the_tree(built):
    names = zipfile.ZipFile(built["wheel"]).namelist()
    expected = set(_tree_files().values())
    assert "mesa_lite/ops/__init__.py" in expected  # the package once left out
    missing, extra = expected - _py_files(names), _py_files(names) - expected
    assert not missing, f"in the tree but not in the wheel: {sorted(missing)}"
    assert not extra, f"in the wheel but not in the tree: {sorted(extra)}"
    # nothing installs as a top-level `kernels`, `benchmarks` or `tests`
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"mesa_lite"}, tops


@needs_wheel_builds
def test_sdist_builds_the_same_wheel(built):
    top = built["sdist"].name.removesuffix(".tar.gz")
    with tarfile.open(built["sdist"]) as tar:
        in_sdist = {n.removeprefix(top + "/") for n in tar.getnames()}
    missing = set(_tree_files()) - in_sdist  # the sdist keeps the checkout's layout
    assert not missing, f"in the tree but not in the sdist: {sorted(missing)}"
    one = zipfile.ZipFile(built["wheel"]).namelist()
    two = zipfile.ZipFile(built["wheel_from_sdist"]).namelist()
    assert _py_files(one) == _py_files(two)


# Run from an empty folder with only the unpacked wheel on the path: the source tree is not
# importable, so a module the wheel lacks fails here as it would for a user.
USE_THE_WHEEL = r"""
import copy, importlib, json, pkgutil, sys
from importlib.metadata import EntryPoint
import torch
import mesa_lite

site, entry_points = sys.argv[1], json.loads(sys.argv[2])
for mod in ("mesa_lite", "mesa_lite.kernels", "mesa_lite.ops", "mesa_lite.benchmarks"):
    path = importlib.import_module(mod).__file__
    assert path.startswith(site), (mod, path)
names = [m.name for m in pkgutil.walk_packages(mesa_lite.__path__, "mesa_lite.")]
for name in names:
    assert importlib.import_module(name).__file__.startswith(site), name
for script, target in entry_points.items():
    assert callable(EntryPoint(script, target, "console_scripts").load()), script

torch.manual_seed(0)
plain = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                            torch.nn.Linear(64, 4))
model = mesa_lite.wrap(copy.deepcopy(plain))
kinds = sorted({type(m).__name__ for m in mesa_lite.wrapped_modules(model).values()})
x, y = torch.randn(32, 16), torch.randn(32, 4)
lp, lw = (torch.nn.functional.mse_loss(m(x), y) for m in (plain, model))
assert torch.equal(lp, lw), (lp, lw)  # forward bit for bit
lp.backward()
lw.backward()
for (n, p), q in zip(plain.named_parameters(), model.parameters()):
    err = (p.grad - q.grad).double().norm() / p.grad.double().norm()
    assert err < 0.05, (n, float(err))  # gradients from the 8-bit copies, near plain's
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = [lw.item()]
for step in range(5):
    opt.step()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    losses.append(loss.item())
assert losses[-1] < 0.9 * losses[0], losses
print("MODULES", len(names), "KINDS", ",".join(kinds), "LOSS", losses[0], losses[-1])
"""


def _entry_points(wheel: Path) -> dict[str, str]:
    zf = zipfile.ZipFile(wheel)
    (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
    points, section = {}, None
    for line in zf.read(name).decode().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and section == "console_scripts":
            key, value = (s.strip() for s in line.split("=", 1))
            points[key] = value
    return points


@needs_wheel_builds
def test_wheel_imports_wraps_and_trains_away_from_the_tree(built):
    site = built["tmp"] / "site"
    zipfile.ZipFile(built["wheel"]).extractall(site)
    points = _entry_points(built["wheel"])
    assert "mesa-lite-deit-memory" in points and "mesa-lite-timm-train" in points
    away = built["tmp"] / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run(
        [sys.executable, "-c", USE_THE_WHEEL, str(site), json.dumps(points)],
        cwd=away,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = proc.stdout.strip().splitlines()[-1].split()
    assert line[0] == "MODULES" and int(line[1]) >= 40, line
    assert {"GELU", "LayerNorm", "Linear"} <= set(line[3].split(",")), line


def test_the_kernels_folder_is_never_the_kernels_package():
    """kernels/ installs as mesa_lite.kernels; the top-level name is Hugging Face's package,
    which transformers 5.24+ imports and whose setuptools plugin every build in its environment
    loads. The tests never see the folder by that name, and where the repository root is on
    sys.path (`python -c` there, a source build) `import kernels` gives that package, or an empty
    stand-in without it, so that transformers (5.17 imports it to probe for it) still imports."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    assert spec is None or not spec.origin or not spec.origin.startswith(str(ROOT / "kernels"))
    code = ("import kernels, mesa_lite.kernels as m; from transformers import LlamaConfig; "
            "print(getattr(kernels, '__file__', None), sorted(vars(kernels).get('__all__', [])),"
            " m.quantize.__name__)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    where = proc.stdout.split()[0]
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:  # an empty stand-in: nothing of ours in it
        assert proc.stdout.split() == ["None", "[]", "quantize"], proc.stdout
    else:  # Hugging Face's, installed with transformers 5.24+
        assert "site-packages" in where and str(ROOT / "kernels") not in where, proc.stdout


def test_the_torch_range_is_the_versions_ci_tests():
    """setup.py's torch requirement spans exactly the minor versions .ci/run tests (its lower
    bound the oldest, its upper bound the one after the newest), and the README states it: a
    user's torch in that range is kept by the Quickstart's commands."""
    import re

    setup = (ROOT / "setup.py").read_text()
    found = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', setup)
    assert found, "setup.py must require torch as a range >=A.B,<C.D"
    low = (int(found[1]), int(found[2]))
    high = (int(found[3]), int(found[4]))
    tested = {tuple(int(p) for p in v.split(".")[:2])
              for v in re.findall(r"torch==(\d+\.\d+)\.\d+", (ROOT / ".ci" / "run").read_text())}  # fmt: skip
    assert min(tested) == low, (tested, low)
    newest = max(tested)
    assert high == (newest[0], newest[1] + 1), (tested, high)
    readme = (ROOT / "README.md").read_text()
    assert f"torch {low[0]}.{low[1]} to {newest[0]}.{newest[1]}" in readme
