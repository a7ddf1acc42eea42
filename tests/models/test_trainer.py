"""The Hugging Face Trainer recipe of docs/GUIDE.md: ``wrap`` before ``Trainer(...)``,
``mesa_lite.compile(model, in_place=True)`` before it (the Trainer's own
``torch_compile=True`` would call plain ``torch.compile``), checkpoints that load into the unwrapped model, and the
two checkpointings refused together. A tiny GPT-2 on fixed tokens, SGD, on the CPU."""

import copy

import pytest
import torch
from conftest import sqnr_db, tiny_lm_config

import mesa_lite
from mesa_lite import Config

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own dependency
tf.logging.set_verbosity_error()

STEPS, BATCH, SEQ = 2, 2, 32
# the Trainer's checkpointing argument by the installed name (5.23 renamed it)
_NEW = "activation_checkpointing" in tf.TrainingArguments.__dataclass_fields__
_HF_CKPT = {"activation_checkpointing" if _NEW else "gradient_checkpointing": True}


def _plain():
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tiny_lm_config("gpt2")).train()


def _dataset():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (STEPS * BATCH, SEQ), generator=g)
    return [{"input_ids": t, "labels": t} for t in ids]


def _train(model, tmp_path, **args):
    """``STEPS`` Trainer steps (SGD, no shuffling surprises: the Trainer's seed) and the
    Trainer."""
    targs = tf.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True, **args,
    )  # fmt: skip
    trainer = tf.Trainer(model=model, args=targs, train_dataset=_dataset())
    trainer.train()
    return trainer


def _moved(model, start):
    """Each parameter's change over training (name -> tensor)."""
    params = dict(model.named_parameters())
    return {n: params[n].detach() - p for n, p in start.items()}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    model = _plain()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, tmp_path_factory.mktemp("plain"))
    return start, _moved(model, start)


def test_wrapped_before_the_trainer_trains_as_plain(plain_run, tmp_path):
    """debug_exact: the Trainer's steps move every weight exactly as the plain model's; at
    8 bits within the gradients' SQNR floor (GPT-2's, tests/models/test_transformers.py)."""
    start, plain_moves = plain_run
    for config, floor in ((Config(debug_exact=True), None), (Config(), 35.0)):
        model = mesa_lite.wrap(_plain(), config)
        _train(model, tmp_path / str(floor))
        moves = _moved(model, start)
        for n, ref in plain_moves.items():
            if floor is None:
                assert torch.equal(moves[n], ref), n
            elif ref.norm() > 1e-6:
                assert sqnr_db(ref, moves[n]) >= floor, n


def test_mesa_lite_compile_in_the_trainer(plain_run, tmp_path):
    """The wrapped model compiled in place and given to the Trainer trains (aot_eager here: Inductor's CPU
    build is slow; the same graphs as Inductor's) and its saved weights load into the
    unwrapped model with their own keys."""
    start, plain_moves = plain_run
    model = mesa_lite.wrap(_plain())
    # in place: the Trainer sees the model itself (a compiled wrapper's forward takes
    # (*args, **kwargs), so the Trainer would drop every column as unused, and save_model
    # would write its weights under _orig_mod. keys)
    assert mesa_lite.compile(model, backend="aot_eager", in_place=True) is model
    trainer = _train(model, tmp_path)
    moves = _moved(model, start)
    dbs = [sqnr_db(ref, moves[n]) for n, ref in plain_moves.items() if ref.norm() > 1e-6]
    assert min(dbs) >= 35.0, min(dbs)
    trainer.save_model(str(tmp_path / "saved"))
    again = tf.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert not mesa_lite.wrapped_modules(again)
    for n, p in again.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n]), n
    with pytest.raises(
        TypeError, match="in_place=True compiles a module's calls; got builtin_function"
    ):
        mesa_lite.compile(len, in_place=True)


def test_trainer_gradient_checkpointing(plain_run, tmp_path):
    """The Trainer's checkpointing (``activation_checkpointing=True``, before 5.23
    ``gradient_checkpointing=True``) composes with the default wrap; with mesa_lite's own
    checkpointing (``Config(checkpoint=...)``) the first step refuses both, naming the flag."""
    start, plain_moves = plain_run
    model = mesa_lite.wrap(_plain(), Config(debug_exact=True))
    _train(model, tmp_path / "hf", **_HF_CKPT)
    moves = _moved(model, start)
    for n, ref in plain_moves.items():
        assert torch.allclose(moves[n], ref, rtol=0, atol=1e-6), n
    model = mesa_lite.wrap(_plain(), Config(checkpoint="blocks"))
    with pytest.raises(ValueError, match=r"gradient_checkpointing is on.*would run each"):
        _train(copy.deepcopy(model), tmp_path / "both", **_HF_CKPT)
