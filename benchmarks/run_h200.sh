#!/usr/bin/env bash
# One GPU session: the kernel and CUDA tests with compiled Triton kernels, then the benchmarks.
# Run from the repository root on a GPU machine; writes logs and results under $OUT (default
# ./out, a fixed folder: the GPU results committed in benchmarks/results/ were copied from it).
#   bash benchmarks/run_h200.sh [suite|tests|bench|fidelity|main|coverage|speed-compiled|
#     speed-compiled-options|speed-compiled-others|speed-eager|speed-tests|kernel-bw|kernel-tests|launch|
#     compile-check|session-check|issue51-ab|norm-backward|llm-head|llm-compiled|llm-timeline|cnn|llm|text|dist|all]
#   [extra deit_memory args...]
# suite: the whole test suite (CPU and CUDA parametrizations), in parallel processes.
# main: the Quickstart's main job as a new user runs it (python benchmarks/deit_memory.py, its
#   GPU default), timed; coverage: benchmarks/coverage.py (timm and Hugging Face models).
# e.g. the memory matrix with 8- and 4-bit rows, fp16 only:
#   bash benchmarks/run_h200.sh bench --dtype fp16 --bits 8 4
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-all}
shift || true
export PYTHONUNBUFFERED=1
export PYTEST_ADDOPTS="-m ''"  # both test tiers (tests/tiers.py): the GPU runs every case
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warning" || true
# the kernel tests in four groups (their time is Triton compiles: one process per group)
KERNEL_GROUPS=("tests/kernels -k float32" "tests/kernels -k 'float16 and not bfloat16'"
               "tests/kernels -k bfloat16" "tests/kernels -k 'not float32 and not float16'")
# parallel_pytest NAME PREFIX GROUP...: each group's pytest in a process of its own, after
# PREFIX (e.g. a timeout), logged to $OUT/NAME_<i>.txt; returns when all have ended
parallel_pytest() {
  local name=$1 prefix=$2 i=0 g
  shift 2
  for g in "$@"; do
    eval "$prefix python3 -m pytest -q -p no:cacheprovider $g" > "$OUT/${name}_$i.txt" 2>&1 &
    i=$((i + 1))
  done
  wait
}
if [[ $what == suite ]]; then
  # every test of the repository, split over processes (kernel tests are dominated by Triton
  # compiles); one log per group, then the summary lines and their sum
  parallel_pytest suite "" "${KERNEL_GROUPS[@]}" \
    "tests/test_composition.py tests/test_semantics.py" \
    "tests/test_modules.py tests/test_attention.py tests/test_properties.py" \
    "tests/models tests/benchmarks tests/test_long_run.py" \
    "tests/test_bad_input.py tests/test_checkpoint.py tests/test_compile.py tests/test_reliability.py tests/test_report.py tests/test_sharing.py tests/test_wrap.py"
  for f in "$OUT"/suite_*.txt; do echo "$f: $(tail -n 1 "$f")"; done | tee "$OUT/suite_summary.txt"
  grep -h -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$OUT"/suite_*.txt | tr -d '=' \
    | python3 -c "import re,sys; t={}; [t.__setitem__(k, t.get(k, 0) + int(n)) for l in sys.stdin for n, k in re.findall(r'(\d+) (passed|failed|skipped|deselected|errors?)', l)]; print('total:', t)" \
    | tee -a "$OUT/suite_summary.txt"
fi
if [[ $what == speed ]]; then
  echo "speed comes in parts, each one device call well inside 10 minutes, benchmarks first:"
  echo "  speed-compiled (DeiT-S compiled rows, about 4.5 min), speed-compiled-options (eager and"
  echo "  PyTorch's compile-time options), speed-compiled-others"
  echo "  (DeiT-B, Swin-T, ConvNeXt-T), speed-eager (eager rows, step profile, host time per op,"
  echo "  kernels), speed-tests (the CUDA tests of the fused and compiled paths)"
  exit 2
fi
if [[ $what == speed-compiled ]]; then
  # compiled DeiT-S: plain, mesa_lite.compile, plain torch.compile of the wrapped model and
  # CUDA graphs, as the median of 3 interleaved passes (five compiles: about 4.5 minutes; the
  # ten-row run of this part before outran a 330 s limit, so PyTorch's own options are
  # speed-compiled-options)
  python3 benchmarks/compile_speed.py --models deit_small_patch16_224 --rows "plain compiled" \
    "mesa int8 compiled, decomposed" "mesa int8 compiled, decomposed, Inductor defaults" \
    "plain compiled, reduce-overhead" "mesa int8 compiled, reduce-overhead" \
    --out "$OUT/compile_speed_s_options" 2>&1 | grep "^| "
fi
if [[ $what == speed-compiled-options ]]; then
  # eager DeiT-S and PyTorch's own compile-time options beside mesa_lite.compile, same run
  python3 benchmarks/compile_speed.py --models deit_small_patch16_224 --rows plain "mesa int8" \
    "plain compiled" "mesa int8 compiled, decomposed" \
    "plain compiled, activation_memory_budget 0.5" "plain compiled, activation_memory_budget 0.2" \
    "plain compiled, Inductor fp8 activations" --out "$OUT/compile_speed_s" 2>&1 | grep "^| "
fi
if [[ $what == speed-compiled-others ]]; then
  for m in deit_base_patch16_224 swin_tiny_patch4_window7_224 convnext_tiny; do
    python3 benchmarks/compile_speed.py --models $m --rows plain "mesa int8" "plain compiled" \
      "mesa int8 compiled, decomposed" --out "$OUT/compile_speed_$m" 2>&1 | grep "^| [a-z]"
  done
fi
if [[ $what == speed-eager ]]; then
  # eager rows (block-level Functions on the ViTs), the step profile, host time per op and
  # the kernels against the copy bandwidth
  python3 benchmarks/deit_memory.py --models deit_tiny_patch16_224 deit_small_patch16_224 \
    deit_base_patch16_224 swin_tiny_patch4_window7_224 convnext_tiny --dtype fp16 \
    --attention fused --modes amp mesa --no-plot \
    --out "$OUT/deit_speed_gpu" "$@" 2>&1 | tail -n 17
  python3 benchmarks/profile_step.py --out "$OUT/profile_step_gpu" > /dev/null 2>&1
  grep -E "GPU kernel time|host us per call" "$OUT/profile_step_gpu.txt"
  python3 benchmarks/overhead.py --dtype fp16 --out "$OUT/overhead_gpu" 2>&1 | tail -n 11
  python3 benchmarks/kernels.py --out "$OUT/kernels_gpu" 2>&1 | tail -n 40
  rm -f "$OUT/gpu.txt" "$OUT/overhead_gpu.jsonl"  # eight files come back
fi
if [[ $what == kernel-bw ]]; then
  # issue 40: the quantize/dequantize kernels against the copy bandwidth, alone on the GPU
  # (before any test or compile starts): the raw kernels at each launch shape (ResNet-50 and
  # DeiT-B sizes, 8 and 4 bits), the published per-size table, and every kernel on DeiT shapes
  # (the shipped shapes: 32 groups a program and 4 warps at 8 bits; 8 groups, 1 warp to
  # quantize and 2 to dequantize below)
  python3 benchmarks/quant_tuning.py --rows 8 32 --warps 1 2 4 --out "$OUT/quant_tuning_after_gpu" \
    > /dev/null 2>&1
  grep -E "^\| [0-9,]+ \| (quantize \| 8 \| 32 \| 4|dequantize \| 8 \| 32 \| 4|quantize \| 4 \| 8 \| 1|dequantize \| 4 \| 8 \| 2) \|" \
    "$OUT/quant_tuning_after_gpu.md"
  python3 benchmarks/quant_bandwidth.py --out "$OUT/quant_bandwidth_gpu" 2>&1 | tail -n 5
  python3 benchmarks/kernels.py --out "$OUT/kernels_gpu" 2>&1 | grep -E "^\| deit_base"
fi
if [[ $what == launch ]]; then
  # issue 40: the static launch path checked on CUDA first (bit for bit against the JIT
  # launch), then host time per call and per op (the static launcher against Triton's own,
  # same run), the eager rows (ViTs, CNNs against checkpointing: medians of 3 interleaved
  # passes) and the eager language-model rows; everything in one archive (8 files come back)
  W="$OUT/launch"
  mkdir -p "$W"
  timeout 240 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/kernels/test_fused.py \
    -k static > "$W/static_launch_tests.txt" 2>&1
  tail -n 2 "$W/static_launch_tests.txt"
  python3 benchmarks/kernels.py --models deit_base --out "$W/kernels_gpu" 2>&1 | grep -E "host us"
  python3 benchmarks/overhead.py --dtype fp16 --kinds linear layernorm gelu attention block \
    --profile 25 --out "$W/overhead_gpu" 2>&1 | grep "^| "
  python3 benchmarks/compile_speed.py --models deit_tiny_patch16_224 deit_small_patch16_224 \
    deit_base_patch16_224 swin_tiny_patch4_window7_224 convnext_tiny \
    --rows plain "mesa int8" "mesa int8, Triton's launcher" --out "$W/eager_speed_vit" 2>&1 \
    | grep "^| [a-z]"
  python3 benchmarks/compile_speed.py --models resnet50 efficientnet_b0 --batch-size 256 \
    --rows plain ckpt "mesa int8, opt-in kinds" --out "$W/eager_speed_cnn" 2>&1 | grep "^| [a-z]"
  python3 benchmarks/llm_memory.py --models gpt2 --batch 8 --seq 1024 --modes plain int8 \
    --out "$W/llm_eager_gpt2" 2>&1 | grep -E "^\| gpt2"
  python3 benchmarks/llm_memory.py --models llama-1b --batch 4 --seq 2048 --modes plain int8 \
    --out "$W/llm_eager_llama" 2>&1 | grep -E "^\| llama"
  tar czf "$OUT/launch_results.tgz" -C "$W" . && rm -rf "$W"
fi
if [[ $what == kernel-tests ]]; then
  # the kernel tests on CUDA (compiled kernels against their references), four processes
  parallel_pytest kernel_tests "timeout 420" "${KERNEL_GROUPS[@]/#/-p no:warnings }"
  for f in "$OUT"/kernel_tests_*.txt; do echo "$(tail -n 1 "$f")"; done | tee "$OUT/kernel_cuda_tests_h200.txt"
  grep -h "^FAILED" "$OUT"/kernel_tests_*.txt | head -n 20 | tee -a "$OUT/kernel_cuda_tests_h200.txt"
  rm -f "$OUT"/kernel_tests_[0-9].txt
fi
if [[ $what == speed-tests ]]; then
  # the fused kernels, the direct launcher and the compiled paths on CUDA (after the
  # benchmarks: a call that runs out of time keeps what they wrote)
  timeout 250 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/kernels/test_fused.py \
    tests/kernels/test_group_quant.py -k "fused or (float16 and not bfloat16)" \
    > "$OUT/speed_kernel_tests.txt" 2>&1 &
  timeout 250 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/test_attention.py \
    tests/test_modules.py tests/test_composition.py tests/models tests/test_blocks.py \
    tests/test_compile.py -k "cuda or gpu" > "$OUT/speed_cuda_tests.txt" 2>&1 &
  wait
  tail -n 3 "$OUT"/speed_*tests.txt
fi
if [[ $what == cnn ]]; then
  # convolutional networks with the opt-in kinds (conv, batchnorm, relu, pool, se): peak, step, plain
  # AMP, checkpointing and 8 / 4 bits, then their CUDA tests (time-limited, after)
  python3 benchmarks/deit_memory.py --models resnet50 efficientnet_b0 --batch-size 256 \
    --dtype fp16 --attention fused --modes amp ckpt mesa --bits 8 4 --opt-in --no-plot \
    --out "$OUT/cnn_memory_gpu" 2>&1 | grep "^| "
  python3 benchmarks/deit_memory.py --models convnext_tiny swin_tiny_patch4_window7_224 \
    --batch-size 128 --dtype fp16 --attention fused --modes amp ckpt mesa --bits 8 4 \
    --opt-in --no-plot --out "$OUT/cnn_memory_gpu_128" 2>&1 | grep "^| "
  timeout 110 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/test_conv.py \
    tests/test_relu.py tests/test_batch_norm.py tests/models/test_cnn.py tests/kernels/test_bits.py \
    tests/test_squeeze_excite.py 2>&1 | tail -n 3
fi
if [[ $what == compile-check ]]; then
  # issue 38: every family trained under mesa_lite.compile and eager, first-step gradients
  # against eager plain and the loss over 8 AdamW steps (a process per family side by side:
  # most of the time is Inductor compiling on the host)
  for f in deit swin convnext resnet gpt2 gpt2-dropout llama qwen2 bert; do
    python3 benchmarks/compile_check.py --families $f --out "$OUT/cc_$f" > "$OUT/cc_$f.log" 2>&1 &
  done
  wait
  head -n 4 "$OUT/cc_deit.md" > "$OUT/compile_check_gpu.md"  # the header and the table's
  for f in deit swin convnext resnet gpt2 gpt2-dropout llama qwen2 bert; do
    cat "$OUT/cc_$f.jsonl" >> "$OUT/compile_check_gpu.jsonl"
    grep -E "^\| $f " "$OUT/cc_$f.md" >> "$OUT/compile_check_gpu.md" || echo "| $f | failed: see its log |" >> "$OUT/compile_check_gpu.md"
  done
  rm -f "$OUT"/cc_*.md "$OUT"/cc_*.jsonl
  tar czf "$OUT/compile_check_logs.tgz" -C "$OUT" $(cd "$OUT" && ls cc_*.log) && rm -f "$OUT"/cc_*.log
  cat "$OUT/compile_check_gpu.md"
fi
if [[ $what == session-check ]]; then
  # after a change to ops, quant, kernels or compile (about 6 minutes on an H100): the quantize
  # kernel tests compiled (three processes), the fused-kernel and epilogue tests, the
  # backwards' kernel tests (gated product, softmax, BatchNorm, ReLU: every case), the CUDA tests
  # of the language-model paths (dropout attention, the fused head), beside the family training
  # check; every log's last line and failures in session_check.txt, the logs in one archive
  bash "$0" compile-check > "$OUT/compile_check.txt" 2>&1 &
  # (parallel_pytest's wait also waits for the check)
  parallel_pytest session_check "timeout 330" \
    "-p no:warnings tests/kernels/test_group_quant.py -k float32" \
    "-p no:warnings tests/kernels/test_group_quant.py -k 'float16 and not bfloat16'" \
    "-p no:warnings tests/kernels/test_group_quant.py -k 'not float32 and not float16'" \
    "-p no:warnings tests/kernels/test_fused.py -k '(float16 and not bfloat16) or silu or epilogue' \
     tests/kernels/test_norm_backward.py" \
    "-p no:warnings tests/kernels/test_gated.py tests/kernels/test_softmax_backward.py \
     tests/kernels/test_batch_norm_backward.py tests/kernels/test_bits.py" \
    "-p no:warnings tests/test_attention.py tests/models/test_transformers.py \
     tests/models/test_fused_head.py tests/test_linear_cross_entropy.py tests/test_lm_ops.py \
     tests/test_modules.py tests/test_batch_norm.py tests/test_relu.py \
     -k 'dropout or cuda or fused or one_pass or two_passes'"
  for f in "$OUT"/session_check_*.txt; do echo "$(basename "$f"): $(tail -n 1 "$f")"; grep -h "^FAILED" "$f" | head -n 8; done \
    > "$OUT/session_check.txt"
  grep "^|" "$OUT/compile_check.txt" >> "$OUT/session_check.txt"
  cat "$OUT/session_check.txt"
  tar czf "$OUT/session_check_logs.tgz" -C "$OUT" $(cd "$OUT" && ls session_check_[0-9].txt compile_check.txt) \
    && rm -f "$OUT"/session_check_[0-9].txt "$OUT/compile_check.txt"
fi
if [[ $what == issue51-ab ]]; then
  # issue 51's switches against the rows without them, interleaved (about 3 minutes): the
  # weights' casts kept (DeiT-S), BatchNorm's backward from the codes against its input
  # rebuilt (ResNet-50, batch 256, opt-in kinds), then every kernel against its op-by-op form
  python3 benchmarks/compile_speed.py --models deit_small_patch16_224 --rows plain "mesa int8" \
    "mesa int8, weight casts kept" --out "$OUT/issue51_ab_deit_s" 2>&1 | grep "^|"
  python3 benchmarks/compile_speed.py --models resnet50 --batch-size 256 --rows plain \
    "mesa int8, opt-in kinds" "mesa int8, opt-in kinds, BatchNorm input rebuilt" \
    --out "$OUT/issue51_ab_resnet50" 2>&1 | grep "^|"
  python3 benchmarks/kernels.py --models deit_small deit_base --out "$OUT/kernels_gpu" 2>&1 \
    | grep -E "^\| deit"
fi
if [[ $what == norm-backward ]]; then
  # issue 51: the norms' one-launch backward (off by default until this measures it): its tests
  # compiled, then host time per op at overhead.py's small default shape and the time at DeiT-S's
  # (batch 128 x 197 x 384), unfused and fused in the same run (the "fused norm" columns)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/kernels/test_norm_backward.py 2>&1 | tail -n 3
  python3 benchmarks/overhead.py --kinds layernorm rmsnorm block --dtype fp16 \
    --out "$OUT/norm_backward_host" 2>&1 | grep "^|"
  python3 benchmarks/overhead.py --kinds layernorm rmsnorm block --dtype fp16 --batch-size 128 \
    --tokens 197 --width 384 --iters 20 --out "$OUT/norm_backward_deit_s" 2>&1 | grep "^|"
fi
if [[ $what == llm-timeline ]]; then
  # issue 52: where compiled GPT-2 small's activation peak goes (it found the fused head's
  # chunk sums fused by Inductor, 2026-12-05): one traced step per row, the allocation sites
  # alive at its peak (eager int8 beside compiled int8)
  python3 benchmarks/llm_memory.py --models gpt2 --batch 8 --seq 1024 --steps 2 \
    --modes int8 int8-compiled --timeline 15 --out "$OUT/llm_timeline_gpt2" 2>&1 | grep -A 20 "by site"
fi
if [[ $what == llm-head ]]; then
  # issue 52: what the fused head and loss cost GPT-2 small's step (b8 x 1024, bf16), against
  # the logits built (keep_logits), eager and compiled, each in one run; then the fused head
  # with 4x the default chunk (2^26 logits a chunk: fewer, larger products, more memory) and a
  # profile of the eager step
  python3 benchmarks/llm_memory.py --models gpt2 --batch 8 --seq 1024 --steps 6 \
    --modes plain int8 int8-logits --out "$OUT/llm_head_gpt2_eager" 2>&1 | grep -E "^\| gpt2|rror"
  python3 benchmarks/llm_memory.py --models gpt2 --batch 8 --seq 1024 --steps 6 --modes int8 \
    --head-chunk 67108864 --out "$OUT/llm_head_gpt2_chunk26" 2>&1 | grep -E "^\| gpt2|rror"
  # where the eager step's time goes, plain and wrapped (the head's kernels by name)
  timeout 120 python3 benchmarks/profile_step.py --model gpt2 --dtype bf16 --batch-size 8 \
    --seq 1024 --rows 25 --out "$OUT/llm_head_profile_gpt2" 2>&1 | grep -E "GPU kernel time"
  timeout 330 python3 benchmarks/llm_memory.py --models gpt2 --batch 8 --seq 1024 --steps 6 \
    --modes plain-compiled int8-compiled int8-logits-compiled \
    --out "$OUT/llm_head_gpt2_compiled" 2>&1 | grep -E "^\| gpt2|rror"
fi
if [[ $what == llm-compiled ]]; then
  # issue 38: compiled language models (bf16, same run): compiled plain, mesa_lite compiled,
  # Hugging Face checkpointing compiled, activation_memory_budget 0.5, Inductor's fp8 pass,
  # next to eager plain and eager int8; MODELS picks the models (default GPT-2 small), MODES
  # the modes (default all of these); a process per model side by side (Inductor compiles on
  # the host), timing one at a time under a lock
  for m in ${MODELS:-gpt2}; do
    case $m in llama-1b) shape="--batch 4 --seq 2048";; bert) shape="--batch 8 --seq 512";;
      *) shape="--batch 8 --seq 1024";; esac
    python3 benchmarks/llm_memory.py --models "$m" $shape --steps 6 --modes ${MODES:-plain int8 \
      plain-compiled int8-compiled hf-ckpt-compiled budget0.5-compiled fp8-compiled} \
      --time-lock "$OUT/.time_lock" --out "$OUT/llm_compiled_$m" > "$OUT/llm_compiled_$m.log" 2>&1 &
  done
  wait
  for m in ${MODELS:-gpt2}; do grep -E "^\| $m |Error|error" "$OUT/llm_compiled_$m.log" | head -n 12; done
fi
if [[ $what == llm ]]; then
  # issue 13: the language-model tests on CUDA, the memory and step-time rows (GPT-2 small and
  # medium at seq 1024, the Llama-shaped 1B at seq 2048, BERT base at 512; the README's two
  # breakdowns), profiles of one step; text: the accuracy study on real text. Everything is
  # packed into one llm_results.tgz (the device tool brings back at most 8 files).
  W="$OUT/llm"
  mkdir -p "$W"
  python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/models/test_transformers.py \
    tests/test_attention.py -k cuda > "$W/llm_cuda_tests.txt" 2>&1
  python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/test_composition.py \
    -k "language_model and cuda" >> "$W/llm_cuda_tests.txt" 2>&1
  grep -E "passed|failed|Error" "$W/llm_cuda_tests.txt" | tail -n 8
  python3 benchmarks/llm_memory.py --models gpt2 gpt2-medium --batch 8 --seq 1024 \
    --out "$W/llm_memory_gpu_gpt2" 2>&1 | grep -E "^\| (gpt2|model)"
  python3 benchmarks/llm_memory.py --models llama-1b --batch 4 --seq 2048 \
    --out "$W/llm_memory_gpu_llama" 2>&1 | grep -E "^\| (llama|model)"
  python3 benchmarks/llm_memory.py --models bert --batch 8 --seq 512 \
    --out "$W/llm_memory_gpu_bert" 2>&1 | grep -E "^\| (bert|model)"
  python3 benchmarks/llm_memory.py --models gpt2-medium --batch 4 --seq 512 --modes plain int8 \
    --out "$W/llm_breakdown_gpt2_medium" > /dev/null 2>&1
  python3 benchmarks/llm_memory.py --models llama-1b --batch 8 --seq 512 --modes plain int8 \
    --out "$W/llm_breakdown_llama" > /dev/null 2>&1
  for m in "gpt2 8 1024" "llama-1b 4 2048" "bert 8 512"; do
    set -- $m
    python3 benchmarks/profile_step.py --model "$1" --dtype bf16 --batch-size "$2" --seq "$3" \
      --out "$W/llm_profile_$1" > /dev/null 2>&1
  done
  grep -E "GPU kernel time" "$W"/llm_profile_*.txt
  tar czf "$OUT/llm_results.tgz" -C "$W" . && rm -rf "$W"
  rm -f "$OUT/gpu.txt"
fi
if [[ $what == text ]]; then
  python3 benchmarks/text_accuracy.py --device cuda --steps 1200 --n-layer 4 --n-embd 384 \
    --n-head 6 --seq 256 --batch 64 --lr 1e-3 --eval-every 100 --seeds 0 1 2 \
    --out "$OUT/text_accuracy_gpu" 2>&1 | tail -n 12
  rm -f "$OUT/gpu.txt"
fi
if [[ $what == dist ]]; then
  # issue 14, on a machine with 2+ GPUs: DeiT-B, batch 128 per GPU, bf16, plain and mesa_lite,
  # one GPU and DDP and FSDP2 over all GPUs (train_deit.py's log lines give every rank's
  # max mem and the step time); one archive comes back
  W="$OUT/dist"
  mkdir -p "$W"
  n=$(nvidia-smi -L | wc -l)
  common="--model deit_base_patch16_224 --dtype bf16 --batch-size 128 --max-steps 40 --log-every 10 --workers 2 --synthetic-size 12800"
  for m in --no-mesa --mesa; do
    python3 benchmarks/train_deit.py $common $m --output "$W/single$m" > "$W/single$m.txt" 2>&1
    for d in ddp fsdp; do
      torchrun --nproc_per_node="$n" benchmarks/train_deit.py $common --dist $d $m \
        --output "$W/$d$m" > "$W/$d$m.txt" 2>&1
    done
  done
  grep -h -E "\[  *30/|max mem" "$W"/*.txt | tail -n 12
  rm -rf "$W"/*/checkpoint*
  tar czf "$OUT/dist_results.tgz" -C "$W" . && rm -rf "$W"
fi
if [[ $what == main ]]; then
  start=$(date +%s)
  python3 benchmarks/deit_memory.py --out "$OUT/deit_memory_gpu" "$@" > "$OUT/deit_memory_log.txt" 2>&1
  echo "main job: exit $?, $(( $(date +%s) - start )) s wall" | tee "$OUT/main_time.txt"
  tail -n 45 "$OUT/deit_memory_log.txt"
fi
if [[ $what == coverage || $what == main ]]; then
  python3 benchmarks/coverage.py --dtype fp16 --out "$OUT/coverage_gpu" 2>&1 | tail -n 16
fi
if [[ $what == tests || $what == all ]]; then
  # kernel tests are dominated by Triton compiles: four processes, split by dtype
  for k in "float32" "float16 and not bfloat16" "bfloat16" "not float32 and not float16"; do
    python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/kernels -k "$k" \
      > "$OUT/pytest_kernels_${k// /_}.txt" 2>&1 &
  done
  wait
  tail -n 1 "$OUT"/pytest_kernels_*.txt
  # every CUDA-parametrized test, the 1,000-step memory run and the DeiT-Tiny CUDA checks
  python3 -m pytest -q -s -p no:warnings -p no:cacheprovider tests --ignore=tests/kernels -k cuda \
    2>&1 | tee "$OUT/pytest_cuda.txt" | grep -E "dB|MiB|passed|failed"
fi
if [[ $what == fidelity || $what == all ]]; then
  python3 benchmarks/grad_fidelity.py --models deit_small_patch16_224 --dtype fp16 --no-plot \
    --out "$OUT/grad_fidelity_gpu" 2>&1 | tail -30
fi
if [[ $what == bench || $what == all ]]; then
  python3 benchmarks/quant_bandwidth.py --out "$OUT/quant_bandwidth_gpu" 2>&1 | tail -8
  python3 benchmarks/deit_memory.py --out "$OUT/deit_memory_gpu" "$@" 2>&1 | tee "$OUT/deit_memory_log.txt"
  python3 benchmarks/peak_memory.py --attention fused explicit --bits 8 4 --out "$OUT/peak_memory_gpu" \
    > "$OUT/peak_memory_log.txt" 2>&1
fi
