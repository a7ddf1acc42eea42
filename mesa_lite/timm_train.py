"""Run timm's own ``train.py`` with ``mesa_lite.wrap`` applied to the model it trains.

``train.py`` (pytorch-image-models' training script, not part of the timm package) builds its
model with ``from timm.models import create_model``. This launcher replaces
``timm.create_model`` and ``timm.models.create_model`` before ``train.py`` runs, so the first
model created is wrapped right after creation: before ``train.py`` moves it to the device,
enables gradient checkpointing or channels-last, copies it for model EMA, compiles it or wraps
it in DDP. Then it runs ``train.py`` in this process as ``__main__``. The launcher's options
come before the path to ``train.py``; everything after the path is ``train.py``'s own:

    python -m mesa_lite.timm_train --mesa-bits 8 path/to/train.py --data-dir /data/imagenet \\
        --model deit_small_patch16_224 --amp ...
    python -m mesa_lite.timm_train --mesa-off path/to/train.py ...   # the plain baseline
    torchrun --nproc_per_node 8 -m mesa_lite.timm_train path/to/train.py ...

- Only the first model is wrapped: the one ``train.py`` trains. A later one (the frozen teacher
  that ``--kd-model-name`` creates) is returned unchanged; it runs without gradients, where
  wrapped layers would run the plain op anyway.
- The model EMA (``--model-ema``) is a deep copy of the wrapped model; it runs in eval mode
  without gradients, so its wrapped layers run the plain torch op.
- ``wrap`` keeps Parameters and state_dict keys: checkpoints load into an unwrapped model, and
  ``--resume`` and ``--initial-checkpoint`` work as usual.
- ``--torchcompile`` compiles the wrapped model through ``mesa_lite.compile`` (the launcher
  routes ``torch.compile`` of a model holding mesa_lite layers there while train.py runs:
  on DeiT-S plain ``torch.compile`` saved 1.43x against compiled plain, ``mesa_lite.compile``
  2.79x, ``mesa_lite.compiling``);
  ``--torchscript`` cannot script mesa_lite's layers and is refused before training starts.
- ``--mesa-checkpoint blocks`` (compressed checkpointing, ``Config(checkpoint=...)``)
  replaces train.py's ``--grad-checkpointing``; both at once are refused before training
  (set in a YAML ``-c`` file instead, the first training step raises, naming the flag).
- ``--mesa-config FILE`` wraps with the ``Config`` keyword arguments a JSON file holds, e.g.
  a plan's (``mesa_lite.planner``: ``json.dump(plan.config_kwargs(), f)``).
- ``--mesa-smoke`` checks the whole chain offline, in a minute on a CPU: the copy of
  ``train.py`` that ships with mesa_lite (``VENDORED_TRAIN_PY``, unless a path is given) trains
  a 2-block DeiT-Tiny for one epoch of DeiT's recipe on a generated ImageFolder of 32x32
  images, with the launcher's other options applied; it exits 0 once train.py has written
  its epoch's summary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import runpy
import sys
from collections.abc import Callable, Sequence

# Light on purpose (no torch, no timm): --help and bad options answer at once.
from mesa_lite._cli import HelpFormatter, print_rank0
from mesa_lite.config import CHECKPOINT_MODES, LAYER_KINDS, ROUNDINGS, SUPPORTED_BITS, Config

__all__ = ["main", "parse_args", "install_hook"]

_PROG = "python -m mesa_lite.timm_train"
# timm's train.py, shipped with mesa_lite (pytorch-image-models commit aa4b5850, timm
# 1.0.29.dev0, Apache-2.0): what --mesa-smoke runs when no path is given
VENDORED_TRAIN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor",
                                 "timm_train.py")  # fmt: skip
# --mesa-smoke's train.py arguments (the data and output folders are added): a 2-block
# DeiT-Tiny on 32x32 images of 2 classes, one epoch of DeiT's recipe
SMOKE_ARGS = [
    "--model", "deit_tiny_patch16_224", "--model-kwargs", "depth=2", "img_size=32",
    "--num-classes", "2", "--img-size", "32", "-b", "4", "--workers", "0", "--seed", "0",
    "--epochs", "1", "--opt", "adamw", "--lr", "5e-4", "--weight-decay", "0.05",
    "--sched", "cosine", "--smoothing", "0.1", "--mixup", "0.8", "--cutmix", "1.0",
    "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--drop-path", "0.1",
    "--model-ema",
]  # fmt: skip
_SCRIPT = "mesa-lite-timm-train"  # the console entry point
# Launcher options that take exactly one value (for splitting argv at train.py's path).
_ONE_VALUE = ("--mesa-bits", "--mesa-group-size", "--mesa-rounding", "--mesa-checkpoint",
              "--mesa-checkpoint-bits", "--mesa-config")  # fmt: skip
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config) if f.name != "overrides"}
_DEFAULT_LAYERS = [k for k in LAYER_KINDS if k in _DEFAULTS["layers"]]
_FIELDS = ("bits", "group_size", "rounding", "layers", "checkpoint", "checkpoint_bits")
_OPTIONS = {f: "--mesa-" + f.replace("_", "-") for f in _FIELDS}


def _parser() -> argparse.ArgumentParser:
    # `python -m` would show the file name; the console script shows its own name
    script = os.path.basename(sys.argv[0])
    prog = _SCRIPT if script.startswith(_SCRIPT) else _PROG
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Run timm's train.py (from the pytorch-image-models repository) with\n"
            "mesa_lite.wrap applied to the model it creates. Options before the path to\n"
            "train.py are the launcher's; everything after it goes to train.py unchanged."
        ),
        epilog=(
            "examples:\n"
            f"  {prog} --mesa-bits 8 pytorch-image-models/train.py \\\n"
            "      --data-dir /data/imagenet --model deit_small_patch16_224 --amp ...\n"
            f"  {prog} --mesa-off pytorch-image-models/train.py ...   # baseline\n"
            "  torchrun --nproc_per_node 8 -m mesa_lite.timm_train \\\n"
            "      pytorch-image-models/train.py ...   # 8 GPUs"
        ),
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # the argv split below knows only the full option names
    )
    p.add_argument(
        "--mesa-bits", type=int, choices=SUPPORTED_BITS, default=_DEFAULTS["bits"],
        help="code width of the activations kept for backward",
    )  # fmt: skip
    p.add_argument(
        "--mesa-group-size", type=int, default=_DEFAULTS["group_size"], metavar="N",
        help="elements per absmax scale (a multiple of 8 // bits)",
    )  # fmt: skip
    p.add_argument(
        "--mesa-rounding", choices=ROUNDINGS, default=_DEFAULTS["rounding"],
        help="rounding of the codes (default: nearest at 8 bits, stochastic below)",
    )  # fmt: skip
    p.add_argument(
        "--mesa-layers", nargs="+", choices=LAYER_KINDS, default=_DEFAULT_LAYERS,
        metavar="KIND", help=f"layer kinds to wrap, from: {' '.join(LAYER_KINDS)}",
    )  # fmt: skip
    p.add_argument(
        "--mesa-checkpoint", choices=CHECKPOINT_MODES, default=None,
        help="compressed checkpointing of these modules (Config.checkpoint): each keeps only "
        "a compressed copy of its input and is recomputed in backward; replaces train.py's "
        "--grad-checkpointing (default: off)",
    )  # fmt: skip
    p.add_argument(
        "--mesa-checkpoint-bits", choices=[str(b) for b in SUPPORTED_BITS] + ["exact"],
        default=None, metavar="{8,4,2,exact}",
        help="width of the checkpointed modules' input copy; exact keeps the input itself "
        "(default: --mesa-bits)",
    )  # fmt: skip
    p.add_argument(
        "--mesa-config", default=None, metavar="FILE",
        help="a JSON file of Config keyword arguments (e.g. a plan's config_kwargs()); "
        "excludes the options above",
    )  # fmt: skip
    p.add_argument(
        "--mesa-off", action="store_true",
        help="do not wrap: run train.py unchanged, for the baseline through the same launcher "
        "(the other --mesa-* options are still checked)",
    )  # fmt: skip
    p.add_argument(
        "--mesa-smoke", action="store_true",
        help="an offline check: the train.py copy that ships with mesa_lite (or TRAIN_PY) "
        "trains a 2-block DeiT-Tiny for one epoch on a generated ImageFolder of 32x32 images",
    )  # fmt: skip
    p.add_argument(
        "train_py", nargs="?", default=argparse.SUPPRESS, metavar="TRAIN_PY",
        help="path to timm's train.py",
    )  # fmt: skip
    p.add_argument(
        "train_args", nargs=argparse.REMAINDER, metavar="...", help="train.py's own arguments"
    )
    return p


def _ends_layer_kinds(arg: str) -> bool:
    # After --mesa-layers: an option or train.py's path ends the kinds. A bad kind is kept,
    # for argparse to name it.
    if arg in LAYER_KINDS:
        return False
    return arg.startswith("-") or arg.endswith(".py") or os.path.isfile(arg)


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(launcher options, [train.py path, train.py args...]) split at the path.

    The path is the first argument that is not a launcher option or its value; ``--`` may
    also end the launcher options. ``--mesa-layers`` takes the arguments after it up to an
    option, a name ending in ``.py`` or an existing file.
    """
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        i += 1
        if "=" in arg:
            continue
        if arg in _ONE_VALUE:
            i += 1
        elif arg == "--mesa-layers":
            while i < len(argv) and not _ends_layer_kinds(argv[i]):
                i += 1
    return argv, []


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Config]:
    """Parses the launcher's options; exits with status 2 and a message on a bad one.

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` by default.

    Returns:
        (namespace with ``train_py``, ``train_args`` and the options, validated Config).
    """
    p = _parser()
    own, rest = _split_argv(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(own)
    if not rest and args.mesa_smoke:
        rest = [VENDORED_TRAIN_PY]
    if not rest:
        p.error("the path to timm's train.py is required (after the launcher's options; "
                "--mesa-smoke runs the copy that ships with mesa_lite)")  # fmt: skip
    args.train_py, args.train_args = rest[0], rest[1:]
    if not os.path.isfile(args.train_py):
        p.error(f"train.py not found: {args.train_py!r}")
    if args.mesa_config is not None:
        given = [o for o in _OPTIONS.values() if any(a.split("=")[0] == o for a in own)]
        if given:
            p.error(f"argument --mesa-config: not allowed with {', '.join(given)} (the file "
                    "gives the whole Config)")  # fmt: skip
        try:
            with open(args.mesa_config) as f:
                kwargs = json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"argument --mesa-config: cannot read {args.mesa_config!r}: {e}")
        if not isinstance(kwargs, dict):
            kind = type(kwargs).__name__
            p.error(f"argument --mesa-config: {args.mesa_config!r} holds a JSON {kind}, not "
                    "an object of Config keyword arguments")  # fmt: skip
        try:
            config = Config(**kwargs)
        except (TypeError, ValueError) as e:
            p.error(f"argument --mesa-config: {args.mesa_config}: {e}")
    else:
        bits = args.mesa_checkpoint_bits
        if bits is not None and args.mesa_checkpoint is None:
            p.error("argument --mesa-checkpoint-bits: has no effect without --mesa-checkpoint")
        try:
            config = Config(
                bits=args.mesa_bits,
                group_size=args.mesa_group_size,
                rounding=args.mesa_rounding,
                layers=frozenset(args.mesa_layers),
                checkpoint=args.mesa_checkpoint,
                checkpoint_bits=bits if bits in (None, "exact") else int(bits),
            )
        except (TypeError, ValueError) as e:  # Config's message starts with the field's name
            option = _OPTIONS.get(str(e).split(" ", 1)[0], "--mesa-*")
            p.error(f"argument {option}: {e}")
    if config.checkpoint is not None and not args.mesa_off and \
            any(_grad_checkpointing(a) for a in args.train_args):  # fmt: skip
        p.error("train.py's --grad-checkpointing and mesa_lite's checkpointing "
                f"(checkpoint={config.checkpoint!r}) would recompute each block twice: drop "
                "one of them")  # fmt: skip
    return args, config


def _grad_checkpointing(arg: str) -> bool:
    """Whether ``arg`` is train.py's ``--grad-checkpointing`` or an abbreviation argparse
    would take for it (train.py's parser allows unique prefixes; ``--grad-c`` and longer)."""
    name = arg.split("=", 1)[0]
    return len(name) >= len("--grad-c") and "--grad-checkpointing".startswith(name)


def _describe(config: Config) -> str:
    # Config's own repr prints a frozenset, whose order changes from run to run.
    out = (
        f"Config(bits={config.bits}, group_size={config.group_size}, "
        f"rounding={config.rounding}, layers={sorted(config.layers)}"
    )
    if config.checkpoint is not None:
        out += f", checkpoint={config.checkpoint!r}, checkpoint_bits={config.checkpoint_bits!r}"
    if config.overrides:
        out += f", overrides for {len(config.overrides)} patterns"
    return out + ")"


def _say(msg: str) -> None:
    print_rank0(f"mesa_lite.timm_train: {msg}")


def _img_size(train_args: Sequence[str]) -> int | None:
    """The value of train.py's ``--img-size`` in its arguments (the last one given, as
    argparse takes it), or None."""
    found = None
    for i, a in enumerate(train_args):
        if a == "--img-size" and i + 1 < len(train_args) and train_args[i + 1].isdigit():
            found = int(train_args[i + 1])
        elif a.startswith("--img-size=") and a.split("=", 1)[1].isdigit():
            found = int(a.split("=", 1)[1])
    return found


def _check_img_size(model, model_name: str, img_size: int | None) -> None:
    """Refuses, before training, a model built for another input size than train.py's
    ``--img-size`` feeds it (that option sets the data pipeline only; a ViT's fixed size comes
    from ``--model-kwargs img_size=N``)."""
    embed = getattr(model, "patch_embed", None)
    built = getattr(embed, "img_size", None)
    if img_size is None or built is None or getattr(embed, "dynamic_img_size", False):
        return
    if tuple(built) != (img_size, img_size):
        raise SystemExit(
            f"mesa_lite.timm_train: error: train.py's --img-size {img_size} sets the data "
            f"pipeline only, and {model_name} was built for {tuple(built)} inputs: add "
            f"--model-kwargs img_size={img_size} to train.py's arguments"
        )


def install_hook(config: Config, img_size: int | None = None) -> Callable[[], None]:
    """Replaces ``timm.create_model`` and ``timm.models.create_model`` so that the first model
    created is wrapped with ``config`` right after creation; later ones are returned unchanged.

    It must be in place before ``train.py`` runs, as ``train.py`` binds the name with
    ``from timm.models import create_model`` when it is imported.

    Args:
        config: the Config to wrap the first model with.
        img_size: train.py's ``--img-size``: a first model built for another fixed input
            size is refused with the fix (``_check_img_size``).

    Returns:
        a function that puts the replaced functions back.
    """
    import timm
    import timm.models

    import mesa_lite

    saved = timm.create_model, timm.models.create_model
    original = timm.models.create_model
    while getattr(original, "_mesa_lite_hook", False):  # installed twice: wrap the real one
        original = original.__wrapped__
    first: list[str] = []

    @functools.wraps(original)
    def create_model(model_name, *args, **kwargs):
        if not first and kwargs.get("scriptable"):
            # torch.jit.script cannot compile autograd Functions; fail before training starts.
            raise SystemExit(
                "mesa_lite.timm_train: error: --torchscript (scriptable=True) cannot script "
                "mesa_lite's layers; use --torchcompile instead, or --mesa-off"
            )
        model = original(model_name, *args, **kwargs)
        if first:
            # train.py trains the first model; later ones (a distillation teacher) are frozen
            # and run in eval mode, where wrapped layers would run the plain op anyway.
            _say(f"not wrapping {model_name}: only the first model ({first[0]}) is wrapped")
            return model
        _check_img_size(model, model_name, img_size)
        first.append(str(model_name))
        mesa_lite.wrap(model, config)
        n = len(mesa_lite.wrapped_modules(model))
        _say(f"wrapped {model_name} ({n} layers) with {_describe(config)}")
        return model

    create_model._mesa_lite_hook = True
    timm.create_model = timm.models.create_model = create_model

    def restore() -> None:
        timm.create_model, timm.models.create_model = saved

    return restore


@contextlib.contextmanager
def _compile_through_mesa_lite():
    """``torch.compile`` of a module that holds mesa_lite layers goes through
    ``mesa_lite.compile`` inside the block (train.py's ``--torchcompile``, timm's tasks call
    ``torch.compile`` itself); anything else, and mesa_lite.compile's own call, is unchanged."""
    import torch

    import mesa_lite
    from mesa_lite.modules import MesaModule

    original = torch.compile
    inside: list[bool] = []
    said: list[bool] = []

    @functools.wraps(original)
    def compile(model=None, **kwargs):  # noqa: A001
        mesa = isinstance(model, torch.nn.Module) and any(
            isinstance(m, MesaModule) for m in model.modules()
        )
        if inside or not mesa:
            return original(model, **kwargs)
        if not said:
            said.append(True)
            _say("--torchcompile: compiling the wrapped model with mesa_lite.compile")
        inside.append(True)
        try:
            return mesa_lite.compile(model, **kwargs)
        finally:
            inside.pop()

    torch.compile = compile
    try:
        yield
    finally:
        torch.compile = original


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parses the launcher's options, installs the hook, runs train.py.

    train.py runs in this process, as ``__main__``, with ``sys.argv`` set to
    ``[train.py, train.py's args...]``; ``sys.argv``, ``sys.path`` and timm's
    ``create_model`` are put back when it returns, so ``main`` can run again in-process.

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` by default.
    """
    args, config = parse_args(argv)
    if args.mesa_smoke:
        _smoke(args, config)
        return
    _run_train_py(args, config)


def _image_folder(root: str) -> None:
    """train/ and validation/ of 2 classes, 8 and 4 random 32x32 RGB PNGs per class."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("validation", 4)):
        for cls in ("cat", "dog"):
            folder = os.path.join(root, split, cls)
            os.makedirs(folder)
            for i in range(n):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))


def _smoke(args: argparse.Namespace, config: Config) -> None:
    """--mesa-smoke: train.py on a generated ImageFolder in a temporary folder; exits 1 (with
    the reason) unless train.py wrote its epoch's summary."""
    import tempfile

    import torch

    with tempfile.TemporaryDirectory(prefix="mesa_lite_smoke_") as tmp:
        data, out = os.path.join(tmp, "data"), os.path.join(tmp, "out")
        _image_folder(data)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # the user's train.py arguments after the smoke run's (argparse takes the last of
        # each), its data and output folders last
        args.train_args = ["--device", device, *SMOKE_ARGS, *args.train_args, "--data-dir",
                           data, "--output", out, "--experiment", "smoke"]  # fmt: skip
        _say(f"--mesa-smoke: {args.train_py} on a generated ImageFolder ({device})")
        _run_train_py(args, config)
        summary = os.path.join(out, "smoke", "summary.csv")
        if not os.path.isfile(summary):
            _say(f"--mesa-smoke FAILED: train.py wrote no {summary}")
            sys.exit(1)
        with open(summary) as f:
            rows = f.read().strip().splitlines()
        _say(f"--mesa-smoke passed: trained and evaluated ({rows[-1]})")


def _run_train_py(args: argparse.Namespace, config: Config) -> None:
    """Installs the hook (unless --mesa-off) and runs train.py as ``__main__``."""
    if args.mesa_off:
        _say("--mesa-off: running train.py without mesa_lite")
        restore = None
    else:
        restore = install_hook(config, _img_size(args.train_args))
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [args.train_py, *args.train_args]
    # as `python train.py` would: train.py's own folder first on the import path
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.train_py)))
    try:
        with contextlib.nullcontext() if args.mesa_off else _compile_through_mesa_lite():
            runpy.run_path(args.train_py, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if restore is not None:
            restore()


if __name__ == "__main__":
    main()
