"""CI-sized accuracy check on real data (scikit-learn's bundled digits): mesa_lite int8 trains
as well as plain autocast on the same seed, initial weights and batch order."""

import pytest
import torch
from mesa_lite.benchmarks import accuracy

pytest.importorskip("sklearn")
pytest.importorskip("timm")


# A 2-block, 64-wide ViT in fp32 (fast on any CPU), 12 epochs: about 89% test accuracy.
DIGITS_ARGV = "--depth 2 --embed-dim 64 --lr 4e-3 --epochs 12 --batch-size 32 --dtype fp32"
SEEDS = [0, 1, 2]
# benchmarks/results/accuracy_digits_ci_config.md: this config over 10 paired seeds, with the
# control (plain from the initial weights times 1 + 1e-6 N(0, 1)). A paired difference has a
# standard deviation of 3.5 points for int8 and 2.1 for the control: this task's training is
# chaotic, and any numerically negligible change moves one seed's result by a few points. A
# 3-seed mean then has a standard deviation of about 2.0 points, so -6 points is 3 of them
# below zero; a broken compression path costs tens of points.
TOLERANCE_POINTS = 6.0


@pytest.mark.slow
def test_int8_trains_as_well_as_plain_on_digits(tmp_path):
    """Paired seeds (same initial weights and batch order for plain and int8), a bound on the
    mean paired difference derived from the control study above. It does not flip on
    ulp-level changes (a single seed with a 2-point tolerance did) and catches a broken
    path; the 1-point question needs the 20-seed studies in benchmarks/results."""
    argv = DIGITS_ARGV.split() + ["--bits", "8", "--seeds", *map(str, SEEDS)]
    res = accuracy.run(argv + ["--device", "cpu", "--quiet", "--out", str(tmp_path / "acc")])
    acc = {(r["config"], r["seed"]): r["test_acc"] for r in res["rows"]}
    assert min(acc.values()) > 75.0, acc  # both learned (chance is 10%)
    diffs = [acc["mesa int8", s] - acc["plain", s] for s in SEEDS]
    mean_diff = sum(diffs) / len(SEEDS)
    assert mean_diff > -TOLERANCE_POINTS, diffs
    summary = {s["config"]: s for s in res["summary"]}
    assert summary["mesa int8"]["mean_diff_vs_plain"] == pytest.approx(mean_diff)
    assert (tmp_path / "acc.md").read_text().count("| mesa int8 |") == 1


def test_digits_split_is_fixed_and_stratified():
    x_tr, y_tr, x_te, y_te = accuracy.digits_data()
    assert x_tr.shape[1:] == (1, 8, 8) and len(y_tr) + len(y_te) == 1797
    assert len(y_te) == 360
    counts = y_te.bincount(minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37, counts  # stratified: ~36 per class
    again = accuracy.digits_data()
    assert (again[1] == y_tr).all() and (again[3] == y_te).all()


def test_summary_merges_parallel_run_files(tmp_path):
    """--from-jsonl: runs of different seeds from separate files give one paired summary."""
    import json
    import math

    def row(config, seed, acc):
        return {"config": config, "seed": seed, "test_acc": acc, "amp": "fp16", "epochs": 3,
                "depth": 2, "embed_dim": 32, "lr": 1e-3, "batch_size": 8, "device": "d",
                "torch": "t", "timm": "m", "date": "x"}  # fmt: skip

    plain = {0: 90.0, 1: 92.0, 2: 94.0}
    int8 = {0: 89.0, 1: 92.5, 2: 93.0}
    files = []
    for seed in plain:
        f = tmp_path / f"s{seed}.jsonl"
        f.write_text("\n".join(json.dumps(r) for r in
                               (row("plain", seed, plain[seed]), row("mesa int8", seed, int8[seed]))))  # fmt: skip
        files.append(str(f))
    out = tmp_path / "merged"
    res = accuracy.run(["--from-jsonl", *files, "--out", str(out)])
    s = {x["config"]: x for x in res["summary"]}
    diffs = [-1.0, 0.5, -1.0]
    assert s["mesa int8"]["runs"] == 3
    assert s["mesa int8"]["mean_diff_vs_plain"] == pytest.approx(sum(diffs) / 3)
    sd = math.sqrt(sum((d - sum(diffs) / 3) ** 2 for d in diffs) / 2)
    assert s["mesa int8"]["diff_ci95"] == pytest.approx(1.96 * sd / math.sqrt(3))
    text = out.with_suffix(".md").read_text()
    assert "3 seeds 0-2" in text and "fp16 autocast" in text
    assert len(out.with_suffix(".jsonl").read_text().splitlines()) == 6


def test_data_path_runs_the_paired_comparison_on_an_image_folder(tmp_path):
    """--data-path: an ImageNet-layout folder (train/ and val/, one folder per class) goes
    through train_deit.py, plain and mesa_lite, with the validation accuracy of each run."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for cls in ("a", "b"):
            folder = tmp_path / "data" / split / cls
            folder.mkdir(parents=True)
            for i in range(4):
                pixels = (torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"{i}.png")
    argv = ["--data-path", str(tmp_path / "data"), "--model", "deit_tiny_patch16_224",
            "--img-size", "32", "--workers", "0", "--epochs", "1", "--batch-size", "4",
            "--seeds", "0", "--bits", "8", "--amp-dtype", "bf16", "--device", "cpu",
            "--out", str(tmp_path / "out" / "acc")]  # fmt: skip
    res = accuracy.run(argv)
    assert [r["bits"] for r in res["rows"]] == [None, 8]
    for r in res["rows"]:
        assert 0.0 <= r["val_acc"] <= 100.0
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["acc-seed0-mesa-int8", "acc-seed0-plain", "acc.jsonl"], written
    assert (tmp_path / "out" / "acc-seed0-plain" / "checkpoint.pth").exists()


def test_deit_randaugment_posterize_at_full_magnitude_gives_a_black_image():
    """DeiT's RandAugment keeps 0 bits at magnitude 10 (reached through mstd0.5); Pillow 12+
    raises on 0 bits, which crashed --data-path runs at random. The transform keeps Pillow
    < 12's result (all channels zero) and matches Pillow for 1-4 bits."""
    from mesa_lite.benchmarks.train_deit import deit_train_transform
    from PIL import Image, ImageOps
    from timm.data.auto_augment import RandAugment

    tf = deit_train_transform(32)
    (ra,) = [t for t in tf.transforms if isinstance(t, RandAugment)]
    (op,) = [op for op in ra.ops if op.name.startswith("Posterize")]
    img = Image.fromarray((torch.arange(48 * 3) % 256).to(torch.uint8).reshape(4, 12, 3).numpy())
    op.prob, op.magnitude_std = 1.0, 0.0
    op.magnitude = 10
    assert max(op(img).getextrema()) == (0, 0)
    for magnitude, bits in ((0, 4), (5, 2), (9, 1)):
        op.magnitude = magnitude
        assert op(img).tobytes() == ImageOps.posterize(img, bits).tobytes()


def test_cnn_arch_wraps_the_opt_in_kinds_and_learns(tmp_path):
    """--arch cnn: the small Conv-BatchNorm-ReLU network (its mesa runs wrap the opt-in kinds);
    two epochs of one seed already learn the task (plain and int8 above 80%; 99.8% after 30 epochs,
    benchmarks/results/accuracy_digits_cnn.md)."""
    model = accuracy.digits_cnn()
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"} <= kinds
    argv = ["--arch", "cnn", "--epochs", "2", "--bits", "8", "--seeds", "0", "--dtype", "fp32",
            "--device", "cpu", "--quiet", "--out", str(tmp_path / "acc")]  # fmt: skip
    res = accuracy.run(argv)
    acc = {r["config"]: r["test_acc"] for r in res["rows"]}
    assert acc["plain"] > 80 and acc["mesa int8"] > 80, acc
    assert {r["arch"] for r in res["rows"]} == {"cnn"}
    assert "a small CNN" in (tmp_path / "acc.md").read_text()
