"""CI-sized accuracy check on real data (scikit-learn's bundled digits): mesa_lite int8 trains
as well as plain autocast on the same seed, initial weights and batch order."""

import pytest
import torch

from benchmarks import accuracy

pytest.importorskip("sklearn")
pytest.importorskip("timm")


@pytest.mark.slow
def test_int8_matches_plain_on_digits(tmp_path):
    # a 2-block ViT in fp32 converges in 15 epochs and runs both trainings in under a minute
    argv = "--bits 8 --seeds 0 --depth 2 --lr 3e-3 --epochs 15 --batch-size 32 --amp-dtype fp32"
    out = str(tmp_path / "acc")
    res = accuracy.main(argv.split() + ["--device", "cpu", "--quiet", "--out", out])
    acc = {r["config"]: r["test_acc"] for r in res["rows"]}
    assert acc["plain"] > 80.0, acc  # chance is 10%
    assert acc["mesa int8"] > 80.0, acc
    assert abs(acc["mesa int8"] - acc["plain"]) <= 2.0, acc
    summary = {s["config"]: s for s in res["summary"]}
    assert summary["mesa int8"]["mean_diff_vs_plain"] == pytest.approx(
        acc["mesa int8"] - acc["plain"]
    )
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
    res = accuracy.main(["--from-jsonl", *files, "--out", str(out)])
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
            "--seeds", "0", "--bits", "8", "--amp-dtype", "bf16", "--device", "cpu"]  # fmt: skip
    res = accuracy.main(argv)
    assert [r["bits"] for r in res["rows"]] == [None, 8]
    for r in res["rows"]:
        assert 0.0 <= r["val_acc"] <= 100.0
