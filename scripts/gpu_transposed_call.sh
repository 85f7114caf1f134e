#!/usr/bin/env bash
# one device call: the transposed pass's tests, the plan's choice (now the transposed pass) over
# FP8 and bf16 caches in 3 processes, then a wider grid with the previous FP8 pass beside it
set -uo pipefail
out=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu-site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/gpu-site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/kernels/test_mla_decode_fp8.py -k "gluon_fp8_transposed_pass and none" > "$out/tests.log" 2>&1
echo "tests rc=$?"; tail -1 "$out/tests.log"
cells="--heads 16 --batch-sizes 64,128,512 --kv-lens 4096 --block-sizes 64 --backends triton"
for run in 1 2 3; do
  timeout 60 python3 -m mlaserve bench kernel $cells --kv-cache-dtype fp8 > "$out/fp8-$run.log" 2>&1
  timeout 60 python3 -m mlaserve bench kernel $cells > "$out/bf16-$run.log" 2>&1
done
timeout 150 python3 -m mlaserve bench kernel --heads 16 --batch-sizes 1,8,32,64,256 --kv-lens 1024,8192 --block-sizes 64 --backends triton --kv-cache-dtype fp8 --sweep "gluon_fp8=1 fp8_transposed=0 block_n=32 num_stages=2" > "$out/grid.log" 2>&1
grep -hE "^\s*16 " "$out"/fp8-*.log "$out"/bf16-*.log "$out/grid.log" | cut -c1-150
grep -h "gluon_sm90" "$out/fp8-1.log" | head -3
