#!/usr/bin/env bash
# The FP8 measurements of benchmarks/fp8/ on one H200, one stage per call (each stays under
# 10 minutes). Usage (repository root, wheels in .whl/): scripts/gpu_fp8_measure.sh STAGE OUT_DIR
#
# Stages, in the order to run them (correctness before timing):
#   tests        the GPU tests of the FP8 GEMMs (the Gluon sm_90 GEMM included), Linears, MoE,
#                the FP8 cache, the decode kernels (the Gluon FP8 pass, FP8 TMA tiles, latent
#                chunks), 8 workers
#   tests-gemm   every test (marked gpu or not) of the FP8 GEMMs and Linears, the weight-only
#                product, the norm / SiLU kernels that quantize their output and the fused MoE
#                (both operand orders), 8 workers
#   decode-sweep the FP8-cache decode cells (16 heads x batch 64/128/512 x kv 4096, pages of
#                64): the first Gluon FP8 pass (tiles, stages), then the Triton pass with TMA tiles,
#                latent chunks, tile sizes and stages, beside the plan's choice; the bf16
#                cache with the Triton variants (one process each)
#   decode       the same cells, bf16 and FP8 caches, the plan's choice (plus VARIANT where
#                set), in RUNS processes
#   decode-wide  128 heads (V3 on one GPU) x batch 1/32/128 x kv 1280/4096: the GPU tests of
#                the 64-row Gluon pass over FP8 and 16-bit caches under a timeout, then, if
#                they pass, the bf16 and FP8 caches with the plan's choice (plus VARIANT over
#                the FP8 cache where set, e.g. "fp8_stages=1") in RUNS processes
#   decode-transposed
#                the transposed FP8 pass (gluon_sm90_fp8_transposed): its GPU tests in a
#                process of their own under a timeout, then, if they pass, the same cells in
#                RUNS processes: its ring depths beside the plan's choice over an FP8 cache, and
#                the bf16 cache's plan
#   gemm-gluon   the Gluon sm_90 w8a8 GEMM against bf16 and cuBLASLt at 256-8192 tokens, its
#                stages and K chains swept (scripts/fp8_gemm_sm90_check.py)
#   gemm-profile the Gluon GEMM beside cuBLASLt's blockwise, cuBLAS's per-tensor FP8 and bf16
#                products on SHAPES (scripts/fp8_gemm_profile.py), timed, then under Nsight
#                Compute (its sections as text)
#   gemm-split   the Gluon GEMM's GPU tests, then its tile widths and runs of K blocks swept at
#                32-1024 tokens (where `choose_k_splits` splits K)
#   weight-only  the weight-only product against bf16 and w8a8 at 1, 16 and 64 tokens, with its
#                configuration sweep (both operand orders)
#   gemm         `mlaserve bench gemm` on V3's shapes (MODELS: a comma list), RUNS processes
#   moe          the fused MoE at V3's expert shapes, FP8 beside bf16 weights, each with its
#                tiles as they are and transposed (swap_ab) (weight GB/s at 1-1024 tokens:
#                what decode steps of an FP8 V3 spend most of their time on)
#   serve        the V3 config with LAYERS layers, FP8 dummy weights, served with each cache of
#                CACHES (default "auto fp8": bf16 and FP8; scripts/gpu_serve_bench.sh, RUNS
#                server processes each, 128 warm-up requests before the timed run; RUNS
#                defaults to 1 here, as three of both caches may pass 10 minutes: repeat the
#                stage into other dirs)
# env: RUNS=3, TOKENS (gemm: a comma list), VARIANT (a --sweep spec, default none), SHAPES
#      (gemm-profile), CACHES (serve), LAYERS=8 (what an H200's memory holds with room for the
#      cache; 6 on an H100: each MoE layer's experts are 11.3 GB in FP8)
# The device returns a few files per call, so each stage writes logs (and a few JSON files),
# not the kernel benchmark's plot folders.
set -uo pipefail
stage=${1:?stage}; out=${2:?out dir}; runs=${RUNS:-3}
variant=${VARIANT:-}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/gpu-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/gpu-site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used \
  --format=csv > "$out/gpu.txt" 2>&1
cells="--heads 16 --batch-sizes 64,128,512 --kv-lens 4096 --block-sizes 64 --backends triton"

case $stage in
  tests)
    # The two Gluon kernels that have never run come first, each in a process of its own
    # under a short timeout: a kernel that deadlocks on an mbarrier hangs its process, and
    # must not hold the whole call. Then the rest of the FP8 GPU tests, 8 workers.
    pytest_gpu="python3 -m pytest -m gpu -q -rs -p no:cacheprovider"
    # shellcheck disable=SC2086
    timeout 200 $pytest_gpu tests/kernels/test_fp8_gemm_sm90.py \
      > "$out/gpu_tests_gemm_sm90.log" 2>&1
    echo "gemm_sm90 rc=$?"; tail -3 "$out/gpu_tests_gemm_sm90.log"
    # shellcheck disable=SC2086
    timeout 150 $pytest_gpu -n 4 tests/kernels/test_mla_decode_fp8.py -k gluon_fp8_pass \
      > "$out/gpu_tests_gluon_fp8.log" 2>&1
    echo "gluon_fp8 rc=$?"; tail -3 "$out/gpu_tests_gluon_fp8.log"
    # shellcheck disable=SC2086
    timeout 220 $pytest_gpu -n 8 \
      tests/kernels/test_mla_decode.py tests/kernels/test_mla_decode_fp8.py \
      tests/kernels/test_mla_decode_gluon_fp8.py -k "not gluon_fp8_pass" \
      tests/kernels/test_fp8_gemm.py \
      tests/test_fp8_weights.py tests/test_fp8_weight_only_gemm.py tests/test_fused_moe_fp8.py \
      tests/test_fp8_kv_cache.py > "$out/gpu_tests.log" 2>&1
    echo "rest rc=$?"; tail -3 "$out/gpu_tests.log" ;;
  tests-gemm)
    # every test of these files, not only those marked gpu: they run natively where a GPU is
    timeout 400 python3 -m pytest -q -rs -p no:cacheprovider -n 8 \
      tests/test_fused_norm_rope.py tests/test_fused_moe.py tests/test_fused_moe_fp8.py \
      tests/test_fp8_weight_only_gemm.py tests/kernels/test_fp8_gemm.py \
      tests/test_fp8_weights.py > "$out/gpu_tests_gemm.log" 2>&1
    echo "gemm tests rc=$?"; tail -5 "$out/gpu_tests_gemm.log" ;;
  decode-sweep)
    sweep="gluon_fp8=0 tma_loads=1 latent_chunks=1,4 block_n=16,32 num_stages=4,6"
    # shellcheck disable=SC2086
    timeout 200 python3 -m mlaserve bench kernel $cells --kv-cache-dtype fp8 \
      --sweep "gluon_fp8=1 fp8_transposed=0 block_n=32,64 num_stages=2,3,4" \
      > "$out/decode_sweep_gluon.log" 2>&1
    # shellcheck disable=SC2086
    timeout 200 python3 -m mlaserve bench kernel $cells --kv-cache-dtype fp8 --sweep "$sweep" \
      > "$out/decode_sweep_fp8.log" 2>&1
    # shellcheck disable=SC2086
    timeout 160 python3 -m mlaserve bench kernel $cells --sweep "$sweep" \
      > "$out/decode_sweep_bf16.log" 2>&1
    grep -E "^\s*triton" "$out"/decode_sweep_*.log | sort -k4 -n | head -40 ;;
  decode)
    for run in $(seq "$runs"); do
      for cache in auto fp8; do
        # shellcheck disable=SC2086
        timeout 180 python3 -m mlaserve bench kernel $cells --kv-cache-dtype "$cache" \
          ${variant:+--sweep "$variant"} > "$out/decode-$cache-$run.log" 2>&1
      done
    done
    grep -hE "^\s*triton" "$out"/decode-*.log ;;
  decode-wide)
    wide="--heads 128 --batch-sizes 1,32,128 --kv-lens 1280,4096 --block-sizes 64 --backends triton"
    timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider -n 8 \
      tests/kernels/test_mla_decode_fp8.py -k "gluon_pass_over_an_fp8_cache or wide_rows" \
      tests/kernels/test_mla_decode.py -k "sm90" > "$out/gpu_tests_wide.log" 2>&1
    rc=$?; echo "wide-row tests rc=$rc"; tail -3 "$out/gpu_tests_wide.log"
    [ "$rc" = 0 ] || exit 1
    for run in $(seq "$runs"); do
      # shellcheck disable=SC2086
      timeout 150 python3 -m mlaserve bench kernel $wide --kv-cache-dtype fp8 \
        ${variant:+--sweep "$variant"} > "$out/decode-wide-fp8-$run.log" 2>&1
      # shellcheck disable=SC2086
      timeout 90 python3 -m mlaserve bench kernel $wide > "$out/decode-wide-auto-$run.log" 2>&1
    done
    grep -hE "^ +128 +[0-9]+ " "$out"/decode-wide-*.log ;;
  decode-transposed)
    timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider -n 8 \
      tests/kernels/test_mla_decode_fp8.py -k gluon_fp8_transposed_pass \
      > "$out/gpu_tests_fp8_transposed.log" 2>&1
    rc=$?; echo "transposed tests rc=$rc"; tail -3 "$out/gpu_tests_fp8_transposed.log"
    [ "$rc" = 0 ] || exit 1
    for run in $(seq "$runs"); do
      # shellcheck disable=SC2086
      timeout 150 python3 -m mlaserve bench kernel $cells --kv-cache-dtype fp8 \
        --sweep "gluon_fp8=1 fp8_transposed=1 block_n=64 num_stages=2,3,4" \
        > "$out/decode-transposed-$run.log" 2>&1
      # shellcheck disable=SC2086
      timeout 90 python3 -m mlaserve bench kernel $cells > "$out/decode-auto-$run.log" 2>&1
    done
    grep -hE "^\s*triton" "$out"/decode-*.log ;;
  gemm-gluon)
    timeout 500 python3 scripts/fp8_gemm_sm90_check.py --out "$out/gemm_sm90.json" \
      > "$out/gemm_sm90.log" 2>&1
    cat "$out/gemm_sm90.log" ;;
  gemm-profile)
    shapes=${SHAPES:-o_proj:4096,q_a+kv_a_proj:1024}
    timeout 150 python3 scripts/fp8_gemm_profile.py --shapes "$shapes" \
      > "$out/gemm_profile.log" 2>&1
    echo "timing rc=$?"; cat "$out/gemm_profile.log"
    timeout 400 ncu --nvtx --nvtx-include "profile/" --clock-control none \
      --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section WarpStateStats --section SchedulerStats --section LaunchStats \
      --section Occupancy --section InstructionStats \
      python3 scripts/fp8_gemm_profile.py --shapes "$shapes" --repeats 1 \
      > "$out/gemm_ncu.log" 2>&1
    echo "ncu rc=$?"; grep -E "^  [a-zA-Z_]|Throughput|Pipe|Busy|Shared|Stall|Cycles|Registers" \
      "$out/gemm_ncu.log" | head -150 ;;
  gemm-split)
    timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
      tests/kernels/test_fp8_gemm_sm90.py > "$out/gpu_tests_gemm_sm90.log" 2>&1
    rc=$?; echo "gemm_sm90 tests rc=$rc"; tail -3 "$out/gpu_tests_gemm_sm90.log"
    [ "$rc" = 0 ] || exit 1
    timeout 300 python3 scripts/fp8_gemm_sm90_check.py --tokens 32,64,256,1024 --stages 5 \
      --k-unroll 2 --block-n 64,128 --k-splits 1,2,4,7 --out "$out/gemm_split.json" \
      > "$out/gemm_split.log" 2>&1
    cat "$out/gemm_split.log" ;;
  weight-only)
    timeout 540 python3 scripts/fp8_weight_only_check.py --tokens 1,16,64 --block-n 32,64,128 \
      --k-splits 1,2,4 --k-blocks 1 --stages 4 --warps 4 --swap-ab 0,1 \
      > "$out/weight_only.log" 2>&1
    tail -30 "$out/weight_only.log" ;;
  moe)
    # the fused MoE at V3's expert shapes with FP8 and with bf16 weights, one process each
    for weights in fp8 bf16; do
      timeout 270 python3 scripts/gpu_moe_bench.py --models v3 --weights "$weights" \
        --impls triton,triton-swap --tokens 1,8,64,256,1024 --calls 10 --replays 5 \
        --out "$out/moe-$weights.json" > "$out/moe-$weights.log" 2>&1
    done
    tail -12 "$out"/moe-*.log ;;
  gemm)
    for run in $(seq "$runs"); do
      timeout 150 python3 -m mlaserve bench gemm --models "${MODELS:-deepseek-v3}" \
        --tokens "${TOKENS:-1,16,32,64,256,1024,4096,8192}" --out "$out/gemm-$run.json" \
        > "$out/gemm-$run.log" 2>&1
    done
    tail -12 "$out"/gemm-*.log ;;
  serve)
    for cache in ${CACHES:-auto fp8}; do
      CONFIG=benchmarks/configs/deepseek-v3.json PROMPTS=256 CONC=128 OUT_LEN=256 \
        SINGLE_PROMPTS=4 SINGLE_OUT=128 BENCH_TIMEOUT=240 WARMUPS=128 \
        SERVE_ARGS="--hf-overrides {\"num_hidden_layers\":${LAYERS:-8}} --kv-cache-dtype $cache \
--block-size 64 --max-num-seqs 256" \
        scripts/gpu_serve_bench.sh "$out/serve-$cache" triton "${RUNS:-1}"
    done ;;
  *) echo "unknown stage $stage (tests, tests-gemm, decode-sweep, decode, decode-wide, decode-transposed, gemm-gluon, gemm-profile, gemm-split, weight-only, gemm, moe, serve)" >&2; exit 2 ;;
esac
