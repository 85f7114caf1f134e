#!/usr/bin/env bash
# The MLA decode kernel run on one GPU (an H200): installs FlashInfer from .whl, checks the
# flashinfer backend against the float32 reference (tests/test_flashinfer_backend.py), then runs
# the kernel sweep on the reference (--grid anchor) grid with FlashInfer fa3
# and fa2 as peers, under CUDA-graph replay.
#
# Before, on a machine with network: download the wheels of FlashInfer 0.5.3 and apache-tvm-ffi
# for the GPU machine's Python into .whl/ (pip download --no-deps --only-binary=:all: ...).
# On the GPU machine, from the project root:                  bash scripts/gpu_bench_kernel.sh
# The GPU machine's python3 has torch, triton, pytest and matplotlib; the project runs from the
# source tree. Output under $OUT (default ./gpu-out): gpu.txt, warm.log,
# test_flashinfer_backend.log and kernel/{kernel_bench.json, kernel_bench.png, bench_kernel.log}.
#
# FlashInfer compiles each MLA module on first use (about a minute each); the three this run
# needs (fa3 bfloat16, fa3 float16, fa2 bfloat16) are compiled side by side first. About 5
# minutes in all; each stage has a time limit so the run stays under 10.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/kernel"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target .gpu-site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used \
  --format=csv > "$OUT/gpu.txt" 2>&1

warm="scripts/flashinfer_warm.py"
start=$SECONDS
{
  timeout 240 python3 "$warm" fa3 bfloat16 &
  timeout 240 python3 "$warm" fa3 float16 &
  timeout 240 python3 "$warm" fa2 bfloat16 &
  wait
} > "$OUT/warm.log" 2>&1
compiled=$(grep -c '^compiled' "$OUT/warm.log")
echo "flashinfer modules compiled in $((SECONDS - start)) s: $compiled/3 (see warm.log)"

status=0
timeout 150 python3 -m pytest -q -rs tests/test_flashinfer_backend.py \
  > "$OUT/test_flashinfer_backend.log" 2>&1 || status=1
tail -n 15 "$OUT/test_flashinfer_backend.log"

timeout 270 python3 -m mlaserve bench kernel --grid anchor \
  --backends torch,triton,flashinfer,flashinfer-fa2 --out "$OUT/kernel" \
  > "$OUT/kernel/bench_kernel.log" 2>&1 || status=1
tail -n 80 "$OUT/kernel/bench_kernel.log"
echo "total $((SECONDS - start)) s"
exit $status
