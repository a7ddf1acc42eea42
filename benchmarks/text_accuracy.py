r"""Accuracy on real text: a small GPT-2 trained on bytes of Python's standard library, plain
against mesa_lite, paired seeds, held-out loss difference with a 95% confidence interval.

Corpus: the .py files under sysconfig.get_paths()["stdlib"], its test suites included
(site-packages and dist-packages left out: not the standard library), no download. Each file
goes to the held-out set when a stable hash (SHA-256) of its relative path falls in the first
--heldout-frac of the range, else to the train set: the rule is the same everywhere, but the
files are those of the interpreter that runs this, so the results state its version and the
byte counts. Files are taken in hash order (a fixed shuffle, so that a --max-bytes cap samples
the whole library) and joined with a NUL byte; tokens are bytes (vocabulary 256).

Model: transformers' GPT2LMHeadModel from GPT2Config(vocab_size=256, n_positions=--seq, ...),
random initial weights from the seed, trained with its own labels= loss; AdamW (betas 0.9,
0.95; weight decay on matrices only), linear warm-up then cosine decay to 10% of --lr, gradient
clipping at --clip, autocast (bf16 on a GPU; on a CPU bf16 where it has native bf16, else fp32).
For every seed the model is built once; plain and each mesa_lite width (mesa_lite.wrap with
Config(bits=...)) train a deep copy of it on the same batches (windows of --seq bytes drawn
from the train bytes by a generator seeded from the seed), so that differences come from the
compression alone. --dropout defaults to 0, which keeps the pairing free of dropout draws.

Held-out loss: the mean loss over one fixed set of --eval-windows evenly spaced held-out
windows (the same for every run), every --eval-every steps and after the last step. The
summary takes the final held-out loss of each run; per seed the paired difference (mesa_lite
minus plain); their mean with a 95% confidence interval from the t distribution (n - 1 degrees
of freedom, n seeds); and plain's seed-to-seed standard deviation s, the run-to-run noise. The
difference counts as within the noise when its interval contains 0 or lies inside +-f s
(f = --noise-fraction); the summary says which, and when an interval that contains 0 is too
wide to bound the difference by f s. --control adds "plain perturbed": plain from the initial
weights times (1 + 1e-6 N(0, 1)), the paired difference that a negligible change alone makes.

Writes PREFIX.jsonl (one row per evaluation of each run), PREFIX.md (the summary and per-seed
tables) and PREFIX.png (held-out and train loss curves, per seed thin and mean thick, and the
held-out paired difference) into a fresh runs/ folder unless --out names a prefix.

  python benchmarks/text_accuracy.py                  # CPU smoke: 2x64 GPT-2, 3 seeds, ~1 min
  python benchmarks/text_accuracy.py --bits 8 4 --seeds 0 1 2 3 4 --steps 400 --control
  python benchmarks/text_accuracy.py --from-jsonl a.jsonl b.jsonl --out merged
  python benchmarks/text_accuracy.py --device cuda --steps 2000 --n-layer 6 --n-embd 384 \
      --n-head 6 --seq 256 --batch 64 --lr 1e-3 --eval-every 100 --eval-windows 512 \
      --seeds 0 1 2 3 --out benchmarks/results/text_accuracy_gpu

The last command is the GPU study. Its duration is an estimate from FLOPs, not a measurement:
10.6M parameters outside the embeddings and 16,384 tokens a step make 6 x 10.6M x 16,384 =
1.0 TFLOP a step, plus 0.1 for attention (12 x layers x seq x width x tokens); 2,000 steps x
4 seeds x 2 arms are about 19 PFLOP, some 95 s of an H200 at 200 TFLOP/s in bf16. A model this
small is bound by kernel launches and Python more than by FLOPs: at an assumed 10 ms a plain
step and 15 ms a mesa_lite step it takes about 200 s, plus a few seconds of evaluation (21
forward passes over 512 windows a run) and start-up (imports, Triton compiles): 3-4 minutes.
Time scales with --steps and the number of seeds. 2,000 steps x 16,384 tokens are 33M bytes,
about one pass over the train bytes (Python 3.11.7: 28.7 MB of .py in 1,621 files for train,
2.9 MB in 169 held out).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the rest from the installed package
    __package__ = "mesa_lite.benchmarks"

import mesa_lite

from .accuracy import _seed_text, summarize
from .common import (
    Outputs,
    add_device_argument,
    add_dtype_argument,
    add_out_argument,
    argument_parser,
    autocast,
    environment,
    lazy_import,
    markdown_table,
    nonnegative_int,
    positive_int,
    progress,
    pyplot,
    read_jsonl,
    resolve_device,
    save_figure,
    say,
    torch_dtype,
    write_jsonl,
)

torch = lazy_import("torch")

SCRIPT = "text_accuracy"
# Not the standard library: third-party packages installed beside it.
DEFAULT_EXCLUDE = ("site-packages", "dist-packages")
SEPARATOR = b"\0"  # between files: a byte Python source does not contain
PLAIN, CONTROL = "plain", "plain perturbed"
# Run facts every row carries; the report reads them back from the first row.
RUN_KEYS = ("steps", "batch", "seq", "n_layer", "n_embd", "n_head", "dropout", "lr",
            "warmup", "weight_decay", "clip", "dtype", "eval_windows", "heldout_frac",
            "max_bytes")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line (no heavy import: ``--help`` answers at once)."""
    p = argument_parser(__doc__)
    p.add_argument(
        "--bits", nargs="+", type=int, choices=[8, 4, 2], default=[8],
        help="mesa_lite widths to compare with plain training, one run each per seed",
    )  # fmt: skip
    p.add_argument(
        "--seeds", nargs="+", type=int, default=[0, 1, 2],
        help="paired seeds: each gives every config the same initial weights and batches",
    )  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=100, help="optimizer steps per run")
    p.add_argument("--batch", type=positive_int, default=16, help="windows per step")
    p.add_argument("--seq", type=positive_int, default=128, help="bytes per window (n_positions)")
    p.add_argument("--n-layer", type=positive_int, default=2, help="GPT-2 blocks")
    p.add_argument("--n-embd", type=positive_int, default=64, help="GPT-2 width")
    p.add_argument("--n-head", type=positive_int, default=4, help="attention heads")
    p.add_argument(
        "--dropout", type=float, default=0.0,
        help="GPT-2's embedding, attention and residual dropout (0 keeps the pairing exact)",
    )  # fmt: skip
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument(
        "--warmup", type=nonnegative_int, default=None,
        help="linear warm-up steps before the cosine decay (default: 5%% of --steps)",
    )  # fmt: skip
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    p.add_argument(
        "--eval-every", type=positive_int, default=20, help="held-out evaluation interval, steps"
    )
    p.add_argument(
        "--eval-windows", type=positive_int, default=128,
        help="held-out windows evaluated (fewer when the held-out bytes hold fewer)",
    )  # fmt: skip
    p.add_argument(
        "--heldout-frac", type=float, default=0.1, help="share of the files held out (by hash)"
    )
    p.add_argument(
        "--max-bytes", type=positive_int, default=None,
        help="cap on the corpus bytes (train and held-out in proportion), for fast runs",
    )  # fmt: skip
    p.add_argument(
        "--exclude", nargs="*", default=list(DEFAULT_EXCLUDE), metavar="DIR",
        help="folder names under the stdlib whose files are left out",
    )  # fmt: skip
    p.add_argument(
        "--noise-fraction", type=float, default=0.5,
        help="f: a difference whose 95%% interval lies inside +-f x plain's seed-to-seed "
        "standard deviation counts as within the noise",
    )  # fmt: skip
    p.add_argument(
        "--control", action="store_true",
        help="add 'plain perturbed': plain from the initial weights times (1 + 1e-6 N(0, 1)), "
        "the paired difference a negligible change makes",
    )  # fmt: skip
    add_dtype_argument(p, gpu="bf16")
    add_device_argument(p)
    add_out_argument(p, SCRIPT, "PREFIX.jsonl, PREFIX.md and PREFIX.png")
    p.add_argument(
        "--from-jsonl", nargs="+", type=Path, default=None, metavar="FILE",
        help="train nothing: summarize the runs in these JSON-lines files (e.g. seeds run in "
        "parallel processes) into --out",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no line per evaluation, no progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.from_jsonl:
        return args
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.seq < 2:
        p.error("--seq must be >= 2 (a window predicts its bytes 2..seq)")
    if not 0.0 < args.heldout_frac < 1.0:
        p.error(f"--heldout-frac must lie in (0, 1), got {args.heldout_frac}")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must lie in [0, 1), got {args.dropout}")
    if args.noise_fraction <= 0:
        p.error(f"--noise-fraction must be > 0, got {args.noise_fraction}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds: {args.seeds} repeats a seed")
    if args.warmup is None:
        args.warmup = args.steps // 20
    resolve_device(args, p, gpu="bf16")
    return args


# ---- corpus ----


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def heldout_key(relpath: str) -> float:
    """A number in [0, 1) fixed by the relative path alone (SHA-256), the same on every
    machine; the file is held out when it is below the held-out fraction."""
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_files(
    root: Path | None = None,
    heldout_frac: float = 0.1,
    exclude: tuple[str, ...] | list[str] = DEFAULT_EXCLUDE,
) -> tuple[list[str], list[str]]:
    """The relative paths (POSIX form) of the ``.py`` files under ``root`` (the stdlib by
    default), less those in a folder named in ``exclude``, split into (train, held-out) by
    ``heldout_key``; each list in hash order (a fixed shuffle)."""
    root = stdlib_root() if root is None else Path(root)
    rel = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in exclude]  # not entered: site-packages is large
        where = Path(folder).relative_to(root)
        rel += [(where / f).as_posix() for f in files if f.endswith(".py")]
    order = sorted(rel, key=lambda r: (heldout_key(r), r))
    train = [r for r in order if heldout_key(r) >= heldout_frac]
    heldout = [r for r in order if heldout_key(r) < heldout_frac]
    return train, heldout


def _read(root: Path, files: list[str], cap: int | None) -> tuple[bytes, int]:
    """The files joined by SEPARATOR, cut at ``cap`` bytes; and how many files it touches."""
    parts, total = [], 0
    for name in files:
        if cap is not None and total >= cap:
            break
        data = (root / name).read_bytes() + SEPARATOR
        parts.append(data)
        total += len(data)
    out = b"".join(parts)
    return (out if cap is None else out[:cap]), len(parts)


def load_corpus(
    heldout_frac: float = 0.1,
    max_bytes: int | None = None,
    exclude: tuple[str, ...] | list[str] = DEFAULT_EXCLUDE,
    root: Path | None = None,
) -> dict:
    """The train and held-out bytes as uint8 tensors, with the facts the results state.

    Args:
        heldout_frac: share of the files held out (by ``heldout_key``).
        max_bytes: cap on train + held-out bytes, split in proportion (None: all).
        exclude: folder names whose files are left out.
        root: the folder to read (default: this interpreter's stdlib).

    Returns:
        ``{"train", "heldout"}`` tensors and ``corpus_*`` facts (files and bytes of each).
    """
    root = stdlib_root() if root is None else Path(root)
    train_files, heldout_files = split_files(root, heldout_frac, exclude)
    heldout_cap = train_cap = None
    if max_bytes is not None:
        heldout_cap = max(1, round(max_bytes * heldout_frac))
        train_cap = max(1, max_bytes - heldout_cap)
    train, n_train = _read(root, train_files, train_cap)
    heldout, n_heldout = _read(root, heldout_files, heldout_cap)
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return {
        "train": as_tensor(train), "heldout": as_tensor(heldout),
        "corpus_root": str(root), "corpus_train_files": n_train,
        "corpus_heldout_files": n_heldout, "corpus_train_bytes": len(train),
        "corpus_heldout_bytes": len(heldout), "corpus_exclude": list(exclude),
    }  # fmt: skip


def heldout_windows(heldout, seq: int, n: int):
    """(n', seq) int64: up to ``n`` evenly spaced windows of the held-out bytes, without
    overlap where they fit (no randomness: the same for every run)."""
    if len(heldout) < seq:
        raise SystemExit(
            f"the held-out bytes ({len(heldout)}) are fewer than --seq {seq}: raise --max-bytes "
            "or --heldout-frac"
        )
    n = max(1, min(n, len(heldout) // seq))
    starts = torch.linspace(0, len(heldout) - seq, n).round().long()
    return heldout[starts[:, None] + torch.arange(seq)].long()


def unigram_loss(train, windows) -> float:
    """The held-out loss of byte frequencies alone (counted on the train bytes, add-one
    smoothed), on the bytes the model predicts (each window's 2nd to last): a model below it
    has learned from context."""
    counts = torch.bincount(train.long(), minlength=256).double() + 1.0
    logp = (counts / counts.sum()).log()
    return -logp[windows[:, 1:]].mean().item()


# ---- model and training ----


def gpt2(args, seed: int):
    """A GPT-2 with random initial weights from ``seed`` (nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256, n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=args.n_head, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
        attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    # the loss GPT-2 uses anyway; named, transformers does not warn that it guessed it
    model.loss_type = "ForCausalLM"
    return model


def _lr(args, step: int) -> float:
    """Linear warm-up to --lr, then cosine decay to a tenth of it at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def heldout_loss(model, windows, batch: int, device, dtype) -> float:
    """The mean of the model's loss over the windows (each window weighs the same)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch].to(device)
        with torch.no_grad(), autocast(device.type, dtype):
            total += model(input_ids=x, labels=x).loss.float().item() * len(x)
    model.train(was_training)
    return total / len(windows)


def train_once(model, corpus: dict, windows, args, seed: int, device, on_eval=None) -> list:
    """Trains ``model`` in place; returns one dict per evaluation (step 0, every
    --eval-every steps, the last step): held-out loss, mean train loss since the last one."""
    train = corpus["train"].to(device)  # windows are cut where the model runs
    dtype = torch_dtype(args.dtype)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )  # fmt: skip
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    batches = torch.Generator().manual_seed(10_000 + seed)  # same batches for every config
    offsets = torch.arange(args.seq, device=device)
    high = len(train) - args.seq + 1
    if high < 1:
        raise SystemExit(f"the train bytes ({len(train)}) are fewer than --seq {args.seq}")
    evals = []
    t0 = time.perf_counter()

    def evaluate(step: int, train_sum, train_n: int) -> None:
        row = {"step": step, "tokens": step * args.batch * args.seq,
               "heldout_loss": heldout_loss(model, windows, args.batch, device, dtype),
               "train_loss": train_sum.item() / train_n if train_n else None,
               "lr": _lr(args, max(step - 1, 0)), "seconds": time.perf_counter() - t0}  # fmt: skip
        evals.append(row)
        if on_eval is not None:
            on_eval(row)

    model.train()
    train_sum, train_n = torch.zeros((), device=device), 0
    evaluate(0, train_sum, 0)
    for step in range(args.steps):
        starts = torch.randint(high, (args.batch,), generator=batches).to(device)
        x = train[starts[:, None] + offsets].long()
        for g in opt.param_groups:
            g["lr"] = _lr(args, step)
        with autocast(device.type, dtype):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)
        scaler.update()
        train_sum += loss.detach().float()
        train_n += 1
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1, train_sum, train_n)
            train_sum, train_n = torch.zeros((), device=device), 0
    return evals


def _configs(args) -> list[tuple[str, object]]:
    configs: list[tuple[str, object]] = [(PLAIN, None)]
    configs += [(f"mesa int{b}", b) for b in args.bits]
    if args.control:
        configs.append((CONTROL, "perturb"))
    return configs


def run_training(args, corpus: dict) -> list[dict]:
    """Every config for every seed; one row per evaluation."""
    import transformers

    device = torch.device(args.device)
    windows = heldout_windows(corpus["heldout"], args.seq, args.eval_windows)
    facts = {k: v for k, v in corpus.items() if k.startswith("corpus_")}
    env = {**environment(), "transformers": transformers.__version__,
           "python": platform.python_version()}  # fmt: skip
    run_facts = {k: getattr(args, k) for k in RUN_KEYS}
    run_facts["eval_windows"] = len(windows)
    run_facts["unigram_loss"] = unigram_loss(corpus["train"], windows)
    configs = _configs(args)
    rows = []
    bar = progress(total=len(args.seeds) * len(configs) * args.steps, desc="steps", unit="step",
                   disable=True if args.quiet else None)  # fmt: skip
    for seed in args.seeds:
        init = gpt2(args, seed)  # every config starts from these weights
        params = sum(p.numel() for p in init.parameters())
        for label, bits in configs:
            bar.set_postfix_str(f"seed {seed} {label}")
            model = copy.deepcopy(init).to(device)
            if bits == "perturb":
                g = torch.Generator().manual_seed(20_000 + seed)
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=g).to(p.device))
            elif bits is not None:
                mesa_lite.wrap(model, mesa_lite.Config(bits=bits))
            wrapped = mesa_lite.wrapped_modules(model)
            kinds = Counter(m.mesa_kind for m in wrapped.values())
            head = {"config": label, "bits": bits if isinstance(bits, int) else None,
                    "seed": seed, "params": params, "wrapped_modules": len(wrapped),
                    "wrapped_kinds": dict(sorted(kinds.items()))}  # fmt: skip
            last = [0]

            def on_eval(r, label=label, seed=seed, last=last):
                bar.update(r["step"] - last[0])
                last[0] = r["step"]
                if not args.quiet:
                    tr = "" if r["train_loss"] is None else f"  train {r['train_loss']:.4f}"
                    say(f"seed {seed} {label:15s} step {r['step']:5d}  held-out "
                        f"{r['heldout_loss']:.4f}{tr}  {r['seconds']:.1f}s")  # fmt: skip

            torch.manual_seed(seed)  # dropout and stochastic rounding draws, per run
            for r in train_once(model, corpus, windows, args, seed, device, on_eval):
                rows.append({**head, **r, **run_facts, **facts, **env})
            del model
    bar.close()
    return rows


# ---- statistics ----


def t_quantile(q: float, df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(q, df))


def finals(rows: list[dict]) -> dict[tuple[str, int], float]:
    """{(config, seed): held-out loss at the run's last evaluation}."""
    last: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["config"], r["seed"])
        if key not in last or r["step"] >= last[key]["step"]:
            last[key] = r
    return {k: r["heldout_loss"] for k, r in last.items()}


def paired_summary(rows: list[dict], noise_fraction: float = 0.5) -> list[dict]:
    """Per config: final held-out loss mean and seed-to-seed std, and the mean paired
    difference to plain (config minus plain, same seed) with its 95% t interval.

    accuracy.summarize computes the means, spreads and paired differences (it names the value
    test_acc) and a normal half-width, 1.96 standard errors; with a handful of seeds the t
    quantile (n - 1 degrees of freedom) replaces 1.96. ``within_noise``: the interval contains
    0 or lies inside +-``noise_fraction`` x plain's seed-to-seed std.
    """
    final = finals(rows)
    base = summarize([{"config": c, "seed": s, "test_acc": v} for (c, s), v in final.items()])
    plain_std = next((b["std_acc"] for b in base if b["config"] == PLAIN), None)
    extra = {r["config"]: r for r in rows}
    out = []
    for b in base:
        n = sum(1 for c, s in final if c == b["config"] and (PLAIN, s) in final)
        row = {"config": b["config"], "runs": b["runs"], "paired": n,
               "mean_loss": b["mean_acc"], "std_loss": b["std_acc"] if b["runs"] > 1 else None,
               "wrapped_modules": extra[b["config"]].get("wrapped_modules")}  # fmt: skip
        if b["config"] != PLAIN and n:
            row["mean_diff"] = mean = b["mean_diff_vs_plain"]
            if n > 1:
                half = b["diff_ci95"] / 1.96 * t_quantile(0.975, n - 1)
                lo, hi = mean - half, mean + half
                band = noise_fraction * plain_std if plain_std else None
                inside = band is not None and -band <= lo and hi <= band
                row.update(ci_low=lo, ci_high=hi, ci_half=half, band=band,
                           ci_contains_zero=lo <= 0.0 <= hi, ci_within_band=inside)  # fmt: skip
                row["within_noise"] = row["ci_contains_zero"] or row["ci_within_band"]
        out.append(row)
    return out


def verdicts(summary: list[dict], noise_fraction: float) -> list[str]:
    """One plain-words line per compared config."""
    plain = next((s for s in summary if s["config"] == PLAIN), None)
    std = plain["std_loss"] if plain else None
    lines = []
    for s in summary:
        name = s["config"]
        if name == PLAIN or "mean_diff" not in s:
            continue
        if "ci_low" not in s:
            lines.append(f"- {name}: one paired seed, difference {s['mean_diff']:+.4f}; no "
                         "interval (needs 2 or more seeds).")  # fmt: skip
            continue
        ci = f"95% CI [{s['ci_low']:+.4f}, {s['ci_high']:+.4f}] over {s['paired']} seeds"
        band = "the noise band (plain's seed-to-seed std is 0)"
        if s["band"]:
            band = f"+-{noise_fraction:g} x plain's seed-to-seed std {std:.4f} (+-{s['band']:.4f})"
        if s["ci_within_band"] and s["ci_contains_zero"]:
            text = f"within the noise: the {ci} contains 0 and lies inside {band}."
        elif s["ci_within_band"]:
            worse = "higher" if s["mean_diff"] > 0 else "lower"
            text = (f"within the noise: the {ci} lies inside {band}, though it excludes 0 "
                    f"(a small, consistent {worse} loss).")  # fmt: skip
        elif s["ci_contains_zero"]:
            text = (f"no difference detected (the {ci} contains 0), but the interval is "
                    f"wider than {band}: these seeds cannot bound it that tightly.")  # fmt: skip
        else:
            side = "higher (worse)" if s["mean_diff"] > 0 else "lower (better)"
            text = (f"NOT within the noise: held-out loss {side} by {abs(s['mean_diff']):.4f}, "
                    f"{ci}, outside {band}.")  # fmt: skip
        lines.append(f"- {name} minus plain: {text}")
    return lines


# ---- outputs ----


def _curves(rows: list[dict], key: str) -> dict[str, dict[int, tuple[list, list]]]:
    out: dict[str, dict[int, tuple[list, list]]] = {}
    for r in sorted(rows, key=lambda r: r["step"]):
        if r.get(key) is None:
            continue
        xs, ys = out.setdefault(r["config"], {}).setdefault(r["seed"], ([], []))
        xs.append(r["step"])
        ys.append(r[key])
    return out


def _mean_curve(per_seed: dict[int, tuple[list, list]]) -> tuple[list, list]:
    """The mean over seeds at the steps every seed evaluated."""
    common = set.intersection(*(set(xs) for xs, _ in per_seed.values()))
    steps = sorted(common)
    at = [dict(zip(xs, ys, strict=True)) for xs, ys in per_seed.values()]
    return steps, [statistics.mean(a[s] for a in at) for s in steps]


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Held-out loss, train loss and the held-out paired difference to plain against step:
    each seed thin, the mean over seeds thick, one colour per config."""
    plt = pyplot()
    configs = list(dict.fromkeys(r["config"] for r in rows))
    colours = {c: f"C{i}" for i, c in enumerate(configs)}
    # configs often overlap: plain solid under the others, dashed and dotted
    styles = {c: ("-", "--", ":", "-.")[i % 4] for i, c in enumerate(configs)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    panels = ((axes[0], "heldout_loss", "held-out loss (nats/byte)"),
              (axes[1], "train_loss", "train loss (mean since last eval)"))  # fmt: skip
    for ax, key, ylabel in panels:
        for cfg, per_seed in _curves(rows, key).items():
            style = dict(color=colours[cfg], ls=styles[cfg])
            for xs, ys in per_seed.values():
                ax.plot(xs, ys, lw=0.7, alpha=0.35, **style)
            ax.plot(*_mean_curve(per_seed), lw=2.2, label=cfg, **style)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.axhline(math.log(256), color="grey", lw=0.6, ls=":")
        if rows[0].get("unigram_loss") is not None:
            ax.axhline(rows[0]["unigram_loss"], color="grey", lw=0.8, ls="--",
                       label="byte frequencies alone")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend()
    # the loss falls from ln 256 = 5.5 at step 0 (stated in the report); show the part below
    # byte frequencies, where the configs could differ
    unigram = rows[0].get("unigram_loss")
    if unigram is not None:
        for ax, key in ((axes[0], "heldout_loss"), (axes[1], "train_loss")):
            low = min(r[key] for r in rows if r.get(key) is not None)
            ax.set_ylim(low - 0.05 * (unigram - low), unigram + 0.15 * (unigram - low))
    ax = axes[2]
    curves = _curves(rows, "heldout_loss")
    plain = curves.get(PLAIN, {})
    for cfg, per_seed in curves.items():
        if cfg == PLAIN:
            continue
        diffs = {}
        for seed, (xs, ys) in per_seed.items():
            if seed in plain:
                base = dict(zip(*plain[seed], strict=True))
                pairs = [(x, y - base[x]) for x, y in zip(xs, ys, strict=True) if x in base]
                diffs[seed] = ([x for x, _ in pairs], [d for _, d in pairs])
                ax.plot(*diffs[seed], color=colours[cfg], ls=styles[cfg], lw=0.7, alpha=0.35)
        if diffs:
            ax.plot(*_mean_curve(diffs), color=colours[cfg], ls=styles[cfg], lw=2.2,
                    label=f"{cfg} - plain")  # fmt: skip
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss difference, same seed")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def report(rows: list[dict], summary: list[dict], noise_fraction: float) -> str:
    r0 = rows[0]
    seeds = sorted({r["seed"] for r in rows})
    final = finals(rows)
    start = [r["heldout_loss"] for r in rows if r["step"] == 0 and r["config"] == PLAIN]
    precision = "fp32 (no autocast)" if r0["dtype"] == "fp32" else f"{r0['dtype']} autocast"
    head = (
        f"Held-out loss of a byte-level GPT-2 ({r0['n_layer']} layers x {r0['n_embd']}, "
        f"{r0['n_head']} heads, {r0['params'] / 1e6:.2f}M parameters, random init) trained on "
        f"the .py files of Python {r0['python']}'s standard library ({r0['corpus_root']}, "
        f"without {', '.join(r0['corpus_exclude']) or 'nothing'}): train "
        f"{r0['corpus_train_bytes']:,} bytes in {r0['corpus_train_files']} files, held out "
        f"{r0['corpus_heldout_bytes']:,} bytes in {r0['corpus_heldout_files']} files "
        f"(by path hash, {r0['heldout_frac']:g} of the files"
        + (f", capped at {r0['max_bytes']:,} bytes" if r0["max_bytes"] else "")
        + f"). {r0['steps']} steps x {r0['batch']} windows x {r0['seq']} bytes, AdamW lr "
        f"{r0['lr']:g} (warm-up {r0['warmup']}, cosine), dropout {r0['dropout']:g}, "
        f"{precision}; loss over {r0['eval_windows']} fixed held-out windows. "
        f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''} {_seed_text(seeds)} (paired: same "
        f"init and batches). {r0['device']}, torch {r0['torch']}, transformers "
        f"{r0['transformers']}, {r0['date']}.\n\n"
    )
    if start:
        head += (f"Held-out loss at step 0: {statistics.mean(start):.3f} (ln 256 = "
                 f"{math.log(256):.3f}); byte frequencies alone (unigram, from the train "
                 f"bytes): {r0['unigram_loss']:.3f}.\n\n")  # fmt: skip
    cols = [("config", "config", "s"), ("runs", "runs", "d"),
            ("wrapped_modules", "modules compressed", "d"),
            ("mean_loss", "final held-out loss", ".4f"), ("std_loss", "seed std", ".4f"),
            ("mean_diff", "mean diff vs plain", "+.4f"), ("ci_low", "95% CI low (t)", "+.4f"),
            ("ci_high", "95% CI high (t)", "+.4f"),
            ("ci_contains_zero", "CI contains 0", ""),
            ("ci_within_band", f"CI inside +-{noise_fraction:g} plain std", ""),
            ("within_noise", "within noise", "")]  # fmt: skip
    text = head + markdown_table(summary, cols) + "\n\n"
    configs = [s["config"] for s in summary]
    per_seed = []
    for seed in seeds:
        row = {"seed": seed}
        for c in configs:
            row[c] = final.get((c, seed))
            if c != PLAIN and row[c] is not None and final.get((PLAIN, seed)) is not None:
                row[f"{c} diff"] = row[c] - final[PLAIN, seed]
        per_seed.append(row)
    seed_cols = [("seed", "seed", "d")] + [(c, c, ".4f") for c in configs]
    seed_cols += [(f"{c} diff", f"{c} - plain", "+.4f") for c in configs if c != PLAIN]
    text += "Final held-out loss per seed:\n\n" + markdown_table(per_seed, seed_cols) + "\n\n"
    kinds = {r["config"]: r["wrapped_kinds"] for r in rows if r.get("wrapped_kinds")}
    for cfg, k in kinds.items():
        parts = ", ".join(f"{name} {n}" for name, n in k.items())
        text += f"{cfg} compressed: {parts} (what mesa_lite.wrap converts in GPT-2 today).\n"
    lines = verdicts(summary, noise_fraction)
    if lines:
        text += "\n" + "\n".join(lines) + "\n"
        n_plain = sum(1 for c, _ in final if c == PLAIN)
        text += (f"\nThe noise band is {noise_fraction:g} x plain's seed-to-seed std over these "
                 f"{n_plain} seeds, itself an estimate from few runs.\n")  # fmt: skip
    return text


def run(argv=None) -> dict:
    """Trains and summarizes; returns {"rows", "summary", "text"} (``main`` is the exit
    status)."""
    args = parse_args(argv)
    if args.from_jsonl:
        rows = read_jsonl(args.from_jsonl)
    else:
        corpus = load_corpus(args.heldout_frac, args.max_bytes, args.exclude)
        if not args.quiet:
            say(f"corpus: Python {platform.python_version()} stdlib, train "
                f"{corpus['corpus_train_bytes']:,} bytes ({corpus['corpus_train_files']} "
                f"files), held out {corpus['corpus_heldout_bytes']:,} bytes "
                f"({corpus['corpus_heldout_files']} files)")  # fmt: skip
        rows = run_training(args, corpus)
    noise_fraction = args.noise_fraction  # a choice of the summary: --from-jsonl may change it
    summary = paired_summary(rows, noise_fraction)
    out = Outputs(args.out, SCRIPT)
    write_jsonl(out.path(".jsonl"), rows)
    text = report(rows, summary, noise_fraction)
    r0 = rows[0]
    title = (f"byte-level GPT-2 {r0['n_layer']}x{r0['n_embd']} on Python {r0['python']} stdlib, "
             f"{r0['steps']} steps, {r0['dtype']}, {r0['device']}")  # fmt: skip
    plot(rows, out.path(".png"), title)
    out.path(".md").write_text(text)
    print()
    print(text)
    out.print_paths()
    return {"rows": rows, "summary": summary, "text": text}


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
