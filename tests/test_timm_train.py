"""mesa_lite.timm_train: timm's own train.py (vendored in mesa_lite/vendor) run with ``wrap``
applied.

The training runs call the launcher's ``main`` in this process, so torch and timm are imported
once: a 2-block DeiT-Tiny on 32x32 images of a generated 2-class ImageFolder, with DeiT's recipe
(AdamW, cosine, label smoothing, mixup/cutmix, RandAugment, random erasing, drop-path, model EMA).
Repeated augmentation is left out: train.py supports it only when distributed (WORLD_SIZE > 1).
The command line itself (--help, bad options) runs in subprocesses, which must not import torch.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mesa_lite
from mesa_lite import timm_train

TRAIN_PY = Path(timm_train.VENDORED_TRAIN_PY)
REPO = Path(__file__).resolve().parent.parent
MODEL = "deit_tiny_patch16_224"
MODEL_KWARGS = {"depth": 2, "img_size": 32, "num_classes": 2}
# train.py's --img-size sets the data pipeline only; the model's size goes in --model-kwargs.
TINY = [
    "--model", MODEL, "--model-kwargs", "depth=2", "img_size=32", "--num-classes", "2",
    "--img-size", "32", "-b", "4", "--workers", "0", "--device", "cpu", "--seed", "0",
    "--log-interval", "1",
]  # fmt: skip
DEIT_RECIPE = [
    "--opt", "adamw", "--lr", "5e-4", "--weight-decay", "0.05", "--sched", "cosine",
    "--warmup-epochs", "5", "--smoothing", "0.1", "--mixup", "0.8", "--cutmix", "1.0",
    "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--drop-path", "0.1",
    "--model-ema", "--model-ema-decay", "0.9",  # DeiT: 0.99996; 0.9 moves it in 2 steps
]  # fmt: skip


def _image_folder(root: Path) -> Path:
    """train/ and validation/ of 2 classes, 4 and 2 random 32x32 RGB PNGs per class."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 4), ("validation", 2)):
        for cls in ("cat", "dog"):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=g)
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
    return root


def _run(argv: list[str]) -> tuple[str, list[torch.nn.Module]]:
    """Runs the launcher in this process.

    Returns:
        (what it wrote to stderr: its own lines and train.py's log, the models that timm's
        create_model returned, in order: the launcher wraps them in place, so they are the
        very modules train.py trained).
    """
    import timm
    import timm.models

    models: list[torch.nn.Module] = []
    real = timm.models.create_model

    def record(*args, **kwargs):
        model = real(*args, **kwargs)
        # the weights before training, to show that training moved them
        model._initial_state = {k: v.clone() for k, v in model.state_dict().items()}
        models.append(model)
        return model

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    err = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads only add contention
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
            mp.setattr(timm, "create_model", record)
            mp.setattr(timm.models, "create_model", record)
            timm_train.main(argv)
    finally:  # train.py adds a root handler (on the redirected stderr) on each run
        root.handlers[:] = handlers
        root.setLevel(level)
        torch.set_num_threads(threads)
    assert timm.models.create_model is real and timm.create_model is real, "hook not removed"
    return err.getvalue(), models


def _checkpoint(folder: Path) -> dict:
    # train.py's checkpoints hold its argparse Namespace, hence weights_only=False
    return torch.load(folder / "last.pth.tar", map_location="cpu", weights_only=False)


def _plain_model() -> torch.nn.Module:
    import timm

    model = timm.create_model(MODEL, **MODEL_KWARGS)
    assert not mesa_lite.wrapped_modules(model)
    return model


def _assert_state_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: keys differ"
    bad = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not bad, f"{what}: differ at {bad[:5]}"


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """One DeiT-recipe epoch with --mesa-bits 4: (stderr, created models, output folder)."""
    tmp = tmp_path_factory.mktemp("timm_train")
    data = _image_folder(tmp / "data")
    err, models = _run(
        ["--mesa-bits", "4", str(TRAIN_PY), "--data-dir", str(data), *TINY, *DEIT_RECIPE,
         "--epochs", "1", "--output", str(tmp / "out"), "--experiment", "recipe"]
    )  # fmt: skip
    return err, models, tmp / "out" / "recipe"


def test_recipe_run_wraps_the_model_it_trains(recipe_run):
    err, models, out = recipe_run
    assert len(models) == 1, "train.py created more than the model it trains"
    model = models[0]
    wrapped = mesa_lite.wrapped_modules(model)
    # 2 blocks x (qkv, proj, fc1, fc2, 2 norms, GELU, attention) + final norm + head
    assert len(wrapped) == 18, sorted(wrapped)
    specs = {
        n: (m.mesa_spec.bits, m.mesa_spec.group_size, m.mesa_spec.rounding)
        for n, m in wrapped.items()
    }
    assert set(specs.values()) == {(4, 128, "stochastic")}, specs  # Config's default below 8 bits
    line = f"mesa_lite.timm_train: wrapped {MODEL} (18 layers) with Config(bits=4, group_size=128"
    assert line in err, err[-3000:]
    # it trained: a full epoch was logged and evaluated, for the model and its EMA
    assert "Train: 0 [   1/2 (100%)]" in err, err[-3000:]
    assert "Test (EMA):" in err, err[-3000:]
    moved = [
        k for k, v in model.state_dict().items() if not torch.equal(v, model._initial_state[k])
    ]
    assert "blocks.0.attn.qkv.weight" in moved and "head.weight" in moved, moved


def test_checkpoint_loads_into_unwrapped_model(recipe_run):
    _, models, out = recipe_run
    ckpt = _checkpoint(out)
    assert ckpt["epoch"] == 0 and ckpt["arch"] == MODEL
    # the checkpoint holds the trained (wrapped) model's weights under the plain keys
    _assert_state_equal(ckpt["state_dict"], models[0].state_dict(), "state_dict")
    plain = _plain_model()
    plain.load_state_dict(ckpt["state_dict"], strict=True)
    _assert_state_equal(plain.state_dict(), ckpt["state_dict"], "loaded model")
    # the EMA copy (a deep copy of the wrapped model, run in eval mode) saved and loads too
    ema = _plain_model()
    ema.load_state_dict(ckpt["state_dict_ema"], strict=True)
    w = "blocks.1.mlp.fc1.weight"
    assert not torch.equal(ckpt["state_dict_ema"][w], ckpt["state_dict"][w]), "EMA == model"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), models[0].eval()(x), atol=0, rtol=0)


def test_resume_continues_wrapped(recipe_run, tmp_path):
    _, _, out = recipe_run
    data = out.parent.parent / "data"
    err, models = _run(
        [str(TRAIN_PY), "--data-dir", str(data), *TINY, *DEIT_RECIPE, "--grad-checkpointing",
         "--epochs", "2", "--resume", str(out / "last.pth.tar"), "--output", str(tmp_path),
         "--experiment", "r"]
    )  # fmt: skip
    assert f"wrapped {MODEL} (18 layers) with Config(bits=8," in err, err[-3000:]
    assert len(models) == 1 and len(mesa_lite.wrapped_modules(models[0])) == 18
    # resumed (the wrapped model loaded the checkpoint strictly) and trained epoch 1 only
    for line in ("Restoring model state", "Restoring optimizer state", "(epoch 0)",
                 "Loaded state_dict_ema", "Train: 1 [", "Test (EMA):"):  # fmt: skip
        assert line in err, err[-3000:]
    assert "Train: 0 [" not in err, err[-3000:]
    with open(tmp_path / "r" / "summary.csv") as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["1"]
    _plain_model().load_state_dict(_checkpoint(tmp_path / "r")["state_dict"], strict=True)


def test_mesa_off_runs_train_py_unwrapped(recipe_run, tmp_path):
    _, _, out = recipe_run
    data = out.parent.parent / "data"
    err, models = _run(
        ["--mesa-off", "--mesa-bits", "2", str(TRAIN_PY), "--data-dir", str(data), *TINY,
         "--epochs", "1", "--output", str(tmp_path), "--experiment", "off"]
    )  # fmt: skip
    assert "mesa_lite.timm_train: --mesa-off" in err
    assert "wrapped" not in err and "mesa_lite.wrap" not in err, err[-3000:]
    assert len(models) == 1 and not mesa_lite.wrapped_modules(models[0])
    _plain_model().load_state_dict(_checkpoint(tmp_path / "off")["state_dict"], strict=True)


def test_torchscript_is_refused_with_a_clear_error(recipe_run):
    _, _, out = recipe_run
    data = out.parent.parent / "data"
    with pytest.raises(SystemExit, match="--torchscript .* cannot script mesa_lite's layers"):
        _run([str(TRAIN_PY), "--data-dir", str(data), *TINY, "--torchscript", "--epochs", "1"])


def test_only_the_first_model_is_wrapped():
    import timm

    real = timm.models.create_model
    restore = timm_train.install_hook(mesa_lite.Config(bits=8, layers={"linear"}))
    try:
        assert timm.create_model is timm.models.create_model is not real
        student = timm.create_model(MODEL, **MODEL_KWARGS)
        teacher = timm.create_model(MODEL, **MODEL_KWARGS)
    finally:
        restore()
    assert timm.create_model is real and timm.models.create_model is real
    kinds = {type(m).__name__ for m in mesa_lite.wrapped_modules(student).values()}
    assert kinds == {"Linear"} and len(mesa_lite.wrapped_modules(student)) == 9
    assert not mesa_lite.wrapped_modules(teacher)


@pytest.mark.parametrize(
    "argv, own, rest",
    [
        (["t.py", "--model", "x"], [], ["t.py", "--model", "x"]),
        (
            ["--mesa-bits", "4", "t.py", "--mesa-bits", "2"],
            ["--mesa-bits", "4"],
            ["t.py", "--mesa-bits", "2"],
        ),
        (
            ["--mesa-layers", "linear", "gelu", "t.py", "-b", "4"],
            ["--mesa-layers", "linear", "gelu"],
            ["t.py", "-b", "4"],
        ),
        (
            ["--mesa-group-size=64", "--mesa-off", "t.py"],
            ["--mesa-group-size=64", "--mesa-off"],
            ["t.py"],
        ),
        (
            ["--mesa-rounding", "stochastic", "--", "-odd.py", "--x"],
            ["--mesa-rounding", "stochastic"],
            ["-odd.py", "--x"],
        ),
        (["--mesa-bits", "8"], ["--mesa-bits", "8"], []),
    ],
    ids=[
        "no-own",
        "own-then-same-name-for-train",
        "layers-then-path",
        "equals-and-flag",
        "double-dash",
        "no-path",
    ],
)
def test_argv_is_split_at_the_train_py_path(argv, own, rest):
    assert timm_train._split_argv(argv) == (own, rest)


def test_parse_args_builds_the_config():
    args, config = timm_train.parse_args(
        ["--mesa-bits", "2", "--mesa-group-size", "64", "--mesa-rounding", "nearest",
         "--mesa-layers", "linear", "attention", str(TRAIN_PY), "--model", "x", "--amp"]
    )  # fmt: skip
    assert config == mesa_lite.Config(
        bits=2, group_size=64, rounding="nearest", layers={"linear", "attention"}
    )
    assert args.train_py == str(TRAIN_PY) and args.train_args == ["--model", "x", "--amp"]
    assert not args.mesa_off
    _, default = timm_train.parse_args([str(TRAIN_PY)])
    assert default == mesa_lite.Config()


def _cli(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """(the finished ``python -m mesa_lite.timm_train ARGV``, its CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "mesa_lite.timm_train", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_help_lists_the_mesa_options_at_once():
    proc, cpu_s = _cli("--help")
    assert proc.returncode == 0, proc.stderr
    for opt in ("--mesa-bits {8,4,2}", "--mesa-group-size N", "--mesa-rounding {nearest,stochastic}",
                "--mesa-layers KIND [KIND ...]", "--mesa-off", "TRAIN_PY"):  # fmt: skip
        assert opt in proc.stdout, proc.stdout
    assert "(default: 8)" in proc.stdout and "(default: 128)" in proc.stdout
    # importing torch alone takes seconds of CPU; --help must not
    assert cpu_s < 1.0, f"--help took {cpu_s:.2f} s of CPU (torch or timm imported?)"


def test_parsing_imports_neither_torch_nor_timm():
    code = (
        "import sys; from mesa_lite import timm_train; "
        f"timm_train.parse_args(['--mesa-bits', '4', {str(TRAIN_PY)!r}, '--model', 'x']); "
        "print(sorted(m for m in ('torch', 'timm', 'numpy') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mesa-bits", "3", "T"], "argument --mesa-bits: invalid choice: 3"),
        (["--mesa-bits", "eight", "T"], "argument --mesa-bits: invalid int value: 'eight'"),
        (["--mesa-rounding", "up", "T"], "argument --mesa-rounding: invalid choice: 'up'"),
        (["--mesa-layers", "linear", "convolution", "T"],
         "argument --mesa-layers: invalid choice: 'convolution'"),
        (["--mesa-group-size", "0", "T"], "argument --mesa-group-size: group_size must be a positive int, got 0"),
        (["--mesa-bits", "2", "--mesa-group-size", "6", "T"], "argument --mesa-group-size: group_size must be a multiple of 4 with bits=2"),
        (["--mesa-bits", "4"], "the path to timm's train.py is required"),
        (["--mesa-bits", "4", "no/such/train.py"], "train.py not found: 'no/such/train.py'"),
        (["--model", "deit_tiny_patch16_224", "T"], "unrecognized arguments: --model"),
        (["--mesa-b", "4", "T"], "unrecognized arguments: --mesa-b"),
    ],
    ids=["bits", "bits-not-int", "rounding", "layer-kind", "group-size", "packing", "no-path",
         "missing-file", "train-arg-before-path", "abbreviation"],
)  # fmt: skip
def test_bad_options_fail_clearly(argv, message):
    argv = [str(TRAIN_PY) if a == "T" else a for a in argv]
    proc, _ = _cli(*argv)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert message in proc.stderr, proc.stderr
    assert "usage: python -m mesa_lite.timm_train" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_checkpoint_options_build_the_config():
    _, config = timm_train.parse_args(
        ["--mesa-checkpoint", "blocks", "--mesa-checkpoint-bits", "exact", str(TRAIN_PY)]
    )
    assert config == mesa_lite.Config(checkpoint="blocks", checkpoint_bits="exact")
    _, config = timm_train.parse_args(
        ["--mesa-bits", "4", "--mesa-checkpoint=attention", "--mesa-checkpoint-bits", "8",
         str(TRAIN_PY), "--model", "x"]
    )  # fmt: skip
    assert config == mesa_lite.Config(bits=4, checkpoint="attention", checkpoint_bits=8)


def test_a_plans_config_file_is_the_config(tmp_path):
    """``--mesa-config`` wraps with a JSON file of Config keyword arguments, as a plan's
    ``config_kwargs()`` writes them."""
    kwargs = {"bits": 4, "group_size": 64, "checkpoint": ["blocks.0", "blocks.1"],
              "checkpoint_bits": 8, "overrides": {"blocks.2.*": {"bits": 8}}}  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(kwargs))
    _, config = timm_train.parse_args(["--mesa-config", str(path), str(TRAIN_PY)])
    assert config == mesa_lite.Config(**kwargs)
    assert "overrides for 1 patterns" in timm_train._describe(config)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mesa-config", "P", "--mesa-bits", "4", "T"],
         "argument --mesa-config: not allowed with --mesa-bits"),
        (["--mesa-config", "missing.json", "T"], "argument --mesa-config: cannot read"),
        (["--mesa-config", "L", "T"], "holds a JSON list, not an object of Config keyword"),
        (["--mesa-config", "B", "T"], "argument --mesa-config: "),
        (["--mesa-checkpoint", "blocks", "T", "--grad-checkpointing"],
         "--grad-checkpointing and mesa_lite's checkpointing (checkpoint='blocks') would"),
        (["--mesa-checkpoint", "blocks", "T", "--grad-checkpoint"],
         "--grad-checkpointing and mesa_lite's checkpointing"),
        (["--mesa-checkpoint-bits", "4", "T"],
         "argument --mesa-checkpoint-bits: has no effect without --mesa-checkpoint"),
        (["--mesa-checkpoint", "layers", "T"], "argument --mesa-checkpoint: invalid choice"),
        (["--mesa-checkpoint-bits", "16", "T"], "argument --mesa-checkpoint-bits: invalid"),
    ],
    ids=["config-and-option", "config-missing", "config-list", "config-bad-field",
         "both-checkpointings", "abbreviated", "bits-alone", "checkpoint-mode",
         "checkpoint-bits"],
)  # fmt: skip
def test_bad_config_and_checkpoint_options_fail_clearly(argv, message, tmp_path, capsys):
    files = {"P": {"bits": 4}, "L": [4], "B": {"bits": 3}}
    for key, value in files.items():
        (tmp_path / f"{key}.json").write_text(json.dumps(value))
    argv = [str(TRAIN_PY) if a == "T" else str(tmp_path / f"{a}.json") if a in files
            else str(tmp_path / a) if a.endswith(".json") else a for a in argv]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        timm_train.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "B.json" in " ".join(argv):
        assert "bits must be one of" in err, err


def test_torchcompile_of_the_wrapped_model_goes_through_mesa_lite_compile(monkeypatch):
    """train.py's ``--torchcompile`` (timm's task calls ``torch.compile`` itself) compiles the
    wrapped model with mesa_lite.compile's Inductor options; other modules and functions, and
    everything after the run, get torch.compile unchanged."""
    calls = []

    def spy(model=None, **kwargs):
        calls.append((model, kwargs))
        return model

    monkeypatch.setattr(torch, "compile", spy)
    wrapped = mesa_lite.wrap(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    plain = nn.Sequential(nn.Linear(4, 4))
    with timm_train._compile_through_mesa_lite():
        assert torch.compile(wrapped, backend="inductor", mode=None) is wrapped
        assert torch.compile(plain, backend="inductor") is plain
        torch.compile(len)
    assert torch.compile is spy
    (m0, k0), (m1, k1), (m2, k2) = calls
    assert m0 is wrapped and k0["options"] == mesa_lite.compiling.INDUCTOR_OPTIONS
    assert k0["dynamic"] is False
    assert m1 is plain and "options" not in k1 and k1 == {"backend": "inductor"}
    assert m2 is len and k2 == {}


def test_an_img_size_the_model_was_not_built_for_is_refused_with_the_fix():
    """train.py's --img-size sets the data pipeline only (issue 53: the first small run failed
    inside the model): a ViT built for another fixed size is refused before training, naming
    --model-kwargs img_size=N; a model built for it, or a CNN, trains as asked."""
    import timm

    assert timm_train._img_size(["--img-size", "32", "-b", "4"]) == 32
    assert timm_train._img_size(["--img-size=48"]) == 48
    assert timm_train._img_size(["-b", "4"]) is None
    config = mesa_lite.Config(bits=8, layers={"linear"})
    for kwargs, refused in (({"depth": 2, "num_classes": 2}, True), (MODEL_KWARGS, False)):
        restore = timm_train.install_hook(config, img_size=32)
        try:
            if refused:
                with pytest.raises(SystemExit, match=r"--img-size 32 sets the data pipeline "
                                   r"only.*\(224, 224\).*--model-kwargs img_size=32"):  # fmt: skip
                    timm.create_model(MODEL, **kwargs)
            else:
                assert mesa_lite.wrapped_modules(timm.create_model(MODEL, **kwargs))
        finally:
            restore()
    restore = timm_train.install_hook(config, img_size=32)
    try:  # a convolutional network takes any input size
        timm.create_model("resnet18", num_classes=2)
    finally:
        restore()


def test_the_smoke_run_passes_offline_on_the_first_try():
    """--mesa-smoke (issue 53): the train.py copy that ships with mesa_lite, a generated
    ImageFolder, one epoch of DeiT's recipe on a 2-block DeiT-Tiny, wrapped at the launcher's
    options; no download, no path to give."""
    assert os.path.isfile(timm_train.VENDORED_TRAIN_PY)
    err, models = _run(["--mesa-bits", "8", "--mesa-smoke"])
    assert "--mesa-smoke passed: trained and evaluated" in err, err[-2000:]
    (model,) = models  # train.py creates one (its EMA is a deep copy)
    assert "--mesa-smoke passed" in err
    assert mesa_lite.wrapped_modules(model), "the smoke run's model was not wrapped"
    moved = [k for k, v in model.state_dict().items()
             if v.is_floating_point() and not torch.equal(v, model._initial_state[k])]  # fmt: skip
    assert moved, "training did not move the weights"


def test_the_smoke_run_takes_train_py_arguments_and_checks_the_image_size():
    """Found by review: train.py arguments given after the path overrode the smoke run's
    output folder (it then reported a failure of a run that trained), and an --img-size there
    crashed in timm instead of the launcher's refusal (it read the first --img-size, argparse
    takes the last)."""
    err, models = _run(["--mesa-smoke", str(TRAIN_PY), "--experiment", "mine", "--output", "x"])
    assert "--mesa-smoke passed" in err, err[-2000:]
    with pytest.raises(SystemExit, match="add --model-kwargs img_size=48"):
        _run(["--mesa-smoke", str(TRAIN_PY), "--img-size", "48"])
