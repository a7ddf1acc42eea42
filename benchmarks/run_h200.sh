#!/usr/bin/env bash
# One GPU session: the whole test suite with compiled Triton kernels, then the benchmarks.
# Used through the device tool; writes logs and results under $OUT (default ./out).
#   bash benchmarks/run_h200.sh [tests|bench|fidelity|all] [extra deit_memory args...]
# e.g. the memory matrix with 8- and 4-bit rows, fp16 only:
#   bash benchmarks/run_h200.sh bench --dtype fp16 --bits 8 4
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-all}
shift || true
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warning" || true
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -p no:warnings -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"
  python3 -m pytest -q -s -p no:warnings -p no:cacheprovider tests/models -k cuda 2>&1 | grep -E "dB|MiB|passed|failed" | tee "$OUT/deit_cuda.txt"
fi
if [[ $what == fidelity || $what == all ]]; then
  python3 benchmarks/grad_fidelity.py --models deit_small_patch16_224 --dtype fp16 --no-plot \
    --out "$OUT/grad_fidelity_gpu" 2>&1 | tail -30
fi
if [[ $what == bench || $what == all ]]; then
  python3 benchmarks/quant_bandwidth.py --out "$OUT/quant_bandwidth_gpu" 2>&1 | tail -8
  python3 benchmarks/deit_memory.py --out "$OUT/deit_memory_gpu" "$@" 2>&1 | tee "$OUT/deit_memory_log.txt"
fi
