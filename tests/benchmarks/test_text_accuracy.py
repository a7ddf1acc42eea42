"""CI-sized text accuracy check (benchmarks/text_accuracy.py): a tiny byte-level GPT-2 trained
on bytes of Python's standard library, plain against mesa_lite int8 over paired seeds; the
corpus split; the paired statistics; the script's command-line conventions."""

import json
import math

import pytest
from mesa_lite.benchmarks import text_accuracy

pytest.importorskip("transformers")
pytest.importorskip("scipy")

# 1 block x 64 wide, 64-byte windows, 8 a step, 60 steps, fp32, a 200 kB slice of the stdlib:
# the four runs take about 5 s on one CPU core (importing mesa_lite, transformers and
# matplotlib takes longer).
CI_ARGV = ("--n-layer 1 --n-embd 64 --n-head 4 --seq 64 --batch 8 --steps 60 --eval-every 30 "
           "--eval-windows 64 --lr 3e-3 --max-bytes 200000 --dtype fp32 --device cpu")  # fmt: skip
SEEDS = [0, 1]
# Measured on this config over 8 seeds (Python 3.11.7's stdlib; benchmarks/text_accuracy.py
# with these arguments and --seeds 0 1 2 3 4 5 6 7 --control), int8 compressing 10 modules of
# the GPT-2 (linear 5, layernorm 3, gelu 1, attention 1): the held-out loss starts at 5.40-5.45
# (ln 256 = 5.55) and ends at 3.14-3.21 for plain and int8 alike, below the 3.47 that byte
# frequencies alone give on these windows. 3.35 leaves room for another Python's corpus and
# still needs learning from context.
LEARNED_BELOW = 3.35
# The paired difference int8 - plain over those seeds: mean +0.0005, std 0.0008, largest
# 0.0022; plain's seed-to-seed std is 0.025; the control (plain from the initial weights times
# 1 + 1e-6 N(0, 1)) moves by 6e-6 at most. Broken backward paths, measured by patching
# mesa_lite.quant._dequantize on seeds 0 and 1: activations read back as zeros end +0.28 to
# +0.41 above plain, twice their value +0.71 to +0.72, and 1.1 times their value (a 10% scale
# error, which trains faster here) -0.049 to -0.100. 0.02 is 9 times the largest int8
# difference (room for the layers mesa_lite compresses next) and under half the smallest of
# those.
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    """The four runs, on one thread: as fast as two for a model this small, and steady when
    other processes share the cores (two threads then took 3 to 8 times as long)."""
    import torch

    out = tmp_path_factory.mktemp("text") / "ta"
    argv = CI_ARGV.split() + ["--bits", "8", "--seeds", *map(str, SEEDS), "--quiet"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = text_accuracy.run(argv + ["--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return res, out


@pytest.mark.slow
def test_int8_learns_real_text_as_well_as_plain(ci_run):
    """Both arms learn beyond byte frequencies, and int8 ends within TOLERANCE of plain on
    every seed; the int8 arm was wrapped and its losses are not plain's (compression ran)."""
    res, _ = ci_run
    rows = res["rows"]
    start = {(r["config"], r["seed"]): r["heldout_loss"] for r in rows if r["step"] == 0}
    final = text_accuracy.finals(rows)
    assert set(final) == {(c, s) for c in ("plain", "mesa int8") for s in SEEDS}
    unigram = rows[0]["unigram_loss"]
    for key, loss in final.items():
        assert start[key] > 5.0, (key, start[key])  # random init: near ln 256
        assert loss < LEARNED_BELOW and loss < unigram - 0.1, (key, loss, unigram)
    for s in SEEDS:  # same initial weights: the same loss before training
        assert start["mesa int8", s] == start["plain", s]
    diffs = [final["mesa int8", s] - final["plain", s] for s in SEEDS]
    assert max(abs(d) for d in diffs) < TOLERANCE, diffs
    assert max(abs(d) for d in diffs) > 1e-6, diffs  # int8 kept something other than plain
    wrapped = {r["config"]: r["wrapped_modules"] for r in rows}
    assert wrapped["plain"] == 0 and wrapped["mesa int8"] > 0, wrapped


@pytest.mark.slow
def test_outputs_are_written(ci_run):
    res, out = ci_run
    lines = out.with_suffix(".jsonl").read_text().splitlines()
    assert len(lines) == len(res["rows"]) == 2 * len(SEEDS) * 3  # steps 0, 30, 60
    row = json.loads(lines[-1])
    assert row["python"] and row["corpus_train_bytes"] == 180_000
    assert row["corpus_heldout_bytes"] == 20_000
    text = out.with_suffix(".md").read_text()
    assert text.count("| mesa int8 | 2 |") == 1 and "Python 3." in text  # the summary row
    assert "mesa int8 minus plain:" in text
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_split_is_disjoint_by_file_and_deterministic():
    train, heldout = text_accuracy.split_files()
    assert (train, heldout) == text_accuracy.split_files()
    assert train and heldout and not set(train) & set(heldout)
    assert len(set(train)) == len(train) and len(set(heldout)) == len(heldout)
    assert not any("site-packages" in f.split("/") for f in train + heldout)
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.15  # --heldout-frac 0.1
    assert all(text_accuracy.heldout_key(f) < 0.1 for f in heldout)
    assert all(text_accuracy.heldout_key(f) >= 0.1 for f in train)


def test_split_depends_on_each_path_alone(tmp_path):
    """A file's side is fixed by its relative path: adding files moves none; excluded folders
    are left out; the corpus is the files' bytes joined by a NUL byte, capped in proportion."""
    names = [f"pkg{i // 10}/mod{i}.py" for i in range(60)]
    for i, name in enumerate(names):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x = %d\n" % i)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third.py").write_bytes(b"party\n")
    (tmp_path / "pkg0" / "notes.txt").write_bytes(b"not python\n")
    train, heldout = text_accuracy.split_files(tmp_path, 0.3)
    assert sorted(train + heldout) == sorted(names)
    (tmp_path / "pkg9").mkdir()
    (tmp_path / "pkg9" / "new.py").write_bytes(b"y = 1\n")
    train2, heldout2 = text_accuracy.split_files(tmp_path, 0.3)
    assert set(train) <= set(train2) and set(heldout) <= set(heldout2)
    corpus = text_accuracy.load_corpus(0.3, root=tmp_path)
    expected = b"".join((tmp_path / f).read_bytes() + b"\0" for f in heldout2)
    assert bytes(corpus["heldout"].tolist()) == expected
    assert corpus["corpus_heldout_files"] == len(heldout2)
    capped = text_accuracy.load_corpus(0.3, max_bytes=100, root=tmp_path)
    assert (capped["corpus_train_bytes"], capped["corpus_heldout_bytes"]) == (70, 30)


def _rows(config, seed, loss, **extra):
    base = {"config": config, "seed": seed, "step": 100, "heldout_loss": loss, "train_loss": loss,
            "python": "3.x", "noise_fraction": 0.5, "wrapped_modules": 0, "wrapped_kinds": {}}  # fmt: skip
    facts = {k: 1 for k in text_accuracy.RUN_KEYS if k not in base}
    facts.update(dtype="fp32", max_bytes=None, heldout_frac=0.1, unigram_loss=3.5, params=1e5,
                 corpus_root="/lib", corpus_exclude=[], corpus_train_bytes=9,
                 corpus_heldout_bytes=1, corpus_train_files=9, corpus_heldout_files=1,
                 device="d", torch="t", transformers="x", date="today")  # fmt: skip
    start = {**base, **facts, **extra, "step": 0, "heldout_loss": 5.5, "train_loss": None}
    return [start, {**base, **facts, **extra}]


def test_summary_uses_a_t_interval_on_paired_differences(tmp_path):
    """--from-jsonl: the paired difference per seed, its mean with a t interval (3 seeds: 2
    degrees of freedom, t = 4.303), plain's seed-to-seed std as the noise band, the verdicts."""
    plain = {0: 3.00, 1: 3.02, 2: 3.04}  # seed-to-seed std 0.02: band +-0.01
    cases = {"close": {0: 3.001, 1: 3.021, 2: 3.042},  # CI [-0.0001, +0.0028] inside the band
             "worse": {0: 3.10, 1: 3.13, 2: 3.11}}  # fmt: skip
    for name, other in cases.items():
        rows = [r for s in plain for r in _rows("plain", s, plain[s])]
        rows += [r for s in other for r in _rows("mesa int8", s, other[s], wrapped_modules=3)]
        f = tmp_path / f"{name}.jsonl"
        f.write_text("\n".join(json.dumps(r) for r in rows))
        res = text_accuracy.run(["--from-jsonl", str(f), "--out", str(tmp_path / name)])
        s = {x["config"]: x for x in res["summary"]}["mesa int8"]
        diffs = [other[k] - plain[k] for k in plain]
        mean = sum(diffs) / 3
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
        half = 4.302652729911275 * sd / math.sqrt(3)
        assert s["mean_diff"] == pytest.approx(mean)
        assert (s["ci_low"], s["ci_high"]) == pytest.approx((mean - half, mean + half))
        assert s["band"] == pytest.approx(0.5 * 0.02)
        text = (tmp_path / f"{name}.md").read_text()
        if name == "close":
            assert s["ci_contains_zero"] and s["ci_within_band"] and s["within_noise"]
            assert "mesa int8 minus plain: within the noise" in text
        else:
            assert not s["ci_contains_zero"] and not s["within_noise"]
            assert "NOT within the noise: held-out loss higher (worse)" in text
        assert (tmp_path / f"{name}.png").exists()


@pytest.mark.parametrize(
    "check",
    ["test_help_is_fast_and_imports_no_torch", "test_every_option_has_help_and_its_default",
     "test_usage_examples_render_and_parse"],
)  # fmt: skip
def test_command_line_follows_the_scripts_conventions(check):
    """test_cli.py's checks of every benchmark script, on this one."""
    import importlib

    test_cli = importlib.import_module(
        "test_cli"
    )  # this folder is on sys.path (pytest's rootdir-less import)
    getattr(test_cli, check)("text_accuracy")
