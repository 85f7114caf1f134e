#!/usr/bin/env bash
# The multi-GPU measurements (2-8 H200s of one host), one stage per call (each under 10
# minutes). Usage (repository root, wheels in .whl/): scripts/gpu_multi_measure.sh STAGE OUT_DIR
#
# Stages, in the order to run them (parity before timing):
#   parity        the demo model (V3 layout, 4 heads) in bf16 through the triton backend at
#                 tensor-parallel sizes 2 (with decode CUDA graphs, and eagerly) and 4, and as
#                 2 data-parallel replicas with expert parallelism, against one GPU: greedy
#                 agreement and prompt / generated logprob differences (`mlaserve eval
#                 parity`); with 8 GPUs also TP=8 on the demo config widened to 16 heads
#                 and 16 experts (dummy weights, the same on every layout)
#   v2-lite       DeepSeek-V2-Lite, dummy bf16 weights, served at TP=1, TP=2 and DP=2 + EP:
#                 random 1024 in / 1024 out, 512 prompts at concurrency 256, and one user
#   v3-tp8        the DeepSeek-V3 config, dummy FP8 weights, --tensor-parallel-size 8
#                 --block-size 32 --max-num-seqs 512: random 1024 in / 2048 out, 1024 prompts
#                 at concurrency 512; BACKENDS (default triton, then flashinfer in another call)
#   v3-dp8        the same with --data-parallel-size 8 --enable-expert-parallel
# env: RUNS (server processes per configuration, default 1: repeat the stage into other dirs
#      for three), BACKENDS. NVLink multicast stays off (a shared host can lose its GPUs to it).
set -uo pipefail
stage=${1:?stage}; out=${2:?out dir}; runs=${RUNS:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/gpu-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/gpu-site:$PWD PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m > "$out/topology.txt" 2>&1
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,memory.used --format=csv \
  > "$out/gpu.txt" 2>&1
echo "$gpus GPUs"

case $stage in
  parity)
    # TP=2 eagerly too: it tells a fault of the decode CUDA graphs under TP from one of TP
    layouts=(--compare "--tensor-parallel-size 2"
             --compare "--tensor-parallel-size 2 --enforce-eager"
             --compare "--data-parallel-size 2 --enable-expert-parallel")
    [ "$gpus" -ge 4 ] && layouts+=(--compare "--tensor-parallel-size 4")
    timeout 280 python3 -m mlaserve eval parity --device cuda --dtype bfloat16 \
      --attention-backend triton --num-prompts 32 --max-tokens 64 "${layouts[@]}" \
      --out "$out/parity-demo.json" 2>&1 | tee "$out/parity-demo.log"
    if [ "$gpus" -ge 8 ]; then
      timeout 280 python3 -m mlaserve eval parity --device cuda --dtype bfloat16 \
        --attention-backend triton --load-format dummy \
        --hf-overrides '{"num_attention_heads":16,"num_key_value_heads":16,"n_routed_experts":16}' \
        --num-prompts 32 --max-tokens 64 --compare "--tensor-parallel-size 8" \
        --compare "--data-parallel-size 8 --enable-expert-parallel" \
        --out "$out/parity-tp8.json" 2>&1 | tee "$out/parity-tp8.log"
    fi ;;
  v2-lite)
    for name in tp1 tp2 dp2-ep; do
      case $name in
        tp1) layout="" ;;
        tp2) layout="--tensor-parallel-size 2" ;;
        dp2-ep) layout="--data-parallel-size 2 --enable-expert-parallel" ;;
      esac
      PROMPTS=512 CONC=256 SINGLE_PROMPTS=8 SINGLE_OUT=256 BENCH_TIMEOUT=170 \
        SERVE_ARGS="--block-size 32 --max-num-seqs 256 $layout" \
        scripts/gpu_serve_bench.sh "$out/$name" triton "$runs"
    done ;;
  v3-tp8|v3-dp8)
    layout="--tensor-parallel-size 8"
    [ "$stage" = v3-dp8 ] && layout="--data-parallel-size 8 --enable-expert-parallel"
    CONFIG=benchmarks/configs/deepseek-v3.json PROMPTS=1024 CONC=512 OUT_LEN=2048 \
      SINGLE_PROMPTS=4 SINGLE_OUT=256 BENCH_TIMEOUT=480 \
      SERVE_ARGS="--block-size 32 --max-num-seqs 512 $layout" \
      scripts/gpu_serve_bench.sh "$out/$stage" "${BACKENDS:-triton}" "$runs" ;;
  *) echo "unknown stage $stage (parity, v2-lite, v3-tp8, v3-dp8)" >&2; exit 2 ;;
esac
