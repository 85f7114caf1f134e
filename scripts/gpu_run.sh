#!/usr/bin/env bash
# The GPU runs behind benchmarks/, one stage per call (each stays under 10 minutes).
# Usage: scripts/gpu_run.sh STAGE OUT_DIR [args]
#
# Every stage runs from the repository root with the wheels the GPU machine lacks in .whl/
# (before, on a machine with network: pip download --no-deps --only-binary=:all: ... for the
# GPU machine's Python, e.g. FlashInfer 0.5.3 and apache-tvm-ffi for `kernel`). They are
# installed into /tmp/gpu-site; the GPU machine's python3 has torch, triton, pytest and
# matplotlib, and the project runs from the source tree. OUT_DIR gets gpu.txt (nvidia-smi) and
# the stage's logs; the device returns a few files per call, so stages write logs (and a few
# JSON files), not the kernel benchmark's plot folders.
#
# Serving and the decode kernel (one GPU):
#   serve OUT_DIR [BACKENDS] [RUNS]
#                the serving benchmark: dummy weights of a model config (DeepSeek-V2-Lite
#                unless CONFIG names another), RUNS server processes per attention backend
#                (BACKENDS default "triton flashinfer", RUNS 1); against each, the throughput
#                workload and then one user at a time.
#                env: PROMPTS=512 IN=1024 OUT_LEN=1024 CONC=256 SINGLE_PROMPTS=16
#                SINGLE_OUT=256 WARMUPS=0 (prompts of an untimed run of the throughput
#                workload, other random prompts, before the timed one: a fresh machine's first
#                server compiles its kernels for the batch shapes the workload reaches during it
#                instead of during the timed run) SERVE_ARGS="--block-size 32 --max-num-seqs
#                256" BENCH_TIMEOUT=600 CONFIG=benchmarks/configs/deepseek-v2-lite.json
#                (SERVE_ARGS is split on spaces: write JSON without them,
#                '{"num_hidden_layers":8}'); CLIENT_ARGS: more `bench serve` flags of the
#                throughput workload, e.g. "--random-range-ratio 0.9" (with SERVE_ARGS
#                "... --record-decode-steps OUT_DIR/steps.jsonl": the wide-spread trace)
#   spec OUT_DIR
#                speculative decoding with the MTP module (GPU tests first): per model, one
#                server without speculation and one with --speculative-config k=K (default 3),
#                RUNS (default 1) of each, alternating; against each, bench serve at
#                concurrency 1 and 16, greedy (32 and 128 prompts, after 64 untimed ones at
#                concurrency 16). The demo model (bf16, its trained MTP layer) on its
#                held-out arith_gen questions (`--dataset-name custom`, answers to EOS, up to 64
#                tokens); with MODELS=v3 (a call of its own: two V3 loads take minutes) the V3
#                config with 4 layers instead (dummy FP8 weights, dummy MTP: drafts rarely
#                accepted, so its rows give the verify step's cost) on random 512 in / 128 out.
#                The servers' metrics give the drafts' acceptance. First, `mlaserve bench step`
#                on the demo config (dummy weights) at batch 1 and 16 with and without
#                drafting: the verify step's time over the plain step's. env: MODELS=demo K=3
#                RUNS=1 PRELUDE=1 (0: straight to the servers, no GPU tests or bench step)
#                BACKEND=triton (the servers' attention backend: one whose graphs draft)
#   sweep OUT_DIR
#                the throughput-latency front: per attention backend (BACKENDS default
#                "triton flashinfer") one server on dummy weights of CONFIG (V2-Lite), warmed
#                with WARMUPS prompts, then `mlaserve bench sweep` over CONCS (default
#                1,16,64,256) with max(PER_CONC x concurrency, MIN_PROMPTS) prompts a point
#                (PER_CONC=2, MIN_PROMPTS=8), random IN in / OUT_LEN out (1024 / 512).
#                Output: sweep-BACKEND.json and its logs; the chart is drawn from them
#                afterwards (`mlaserve bench sweep --replot`).
#   kernel OUT_DIR
#                the MLA decode kernel run (an H200): checks the flashinfer backend against the
#                float32 reference (tests/test_flashinfer_backend.py), then runs the kernel
#                sweep on the reference (--grid anchor) grid with FlashInfer fa3 and fa2 as
#                peers, under CUDA-graph replay. Output: gpu.txt, warm.log,
#                test_flashinfer_backend.log and kernel/{kernel_bench.json, kernel_bench.png,
#                bench_kernel.log}. FlashInfer compiles each MLA module on first use (about a
#                minute each); the three this run needs (fa3 bfloat16, fa3 float16, fa2
#                bfloat16) are compiled side by side first. About 5 minutes in all; each step
#                has a time limit so the run stays under 10.
#   balanced OUT_DIR
#                balanced splits (split lengths from the batch's keys): the GPU tests (every split
#                pass against the float32 reference), FlashInfer fa3 compiled, then `mlaserve
#                bench kernel` at 16 and 128 heads x batch 16/64/256/512 x kv 8192 (pages of 64),
#                uniform and ragged (--ragged), the plan's choice beside balanced_splits=1
#                and fa3, the same 16-head cells over an FP8 cache (ours only), and the
#                committed served-step trace replayed as served (graphs of 8192 tokens) with
#                and without balanced splits. RUNS (default 1) processes of each timing.
#
# FP8 (benchmarks/fp8/, one H200 or H100), in the order to run them (correctness before timing):
#   fp8-tests    the GPU tests of the FP8 GEMMs (the Gluon sm_90 GEMM included), Linears, MoE,
#                the FP8 cache, the decode kernels (the Gluon FP8 pass, FP8 TMA tiles, latent
#                chunks), 8 workers
#   fp8-tests-gemm
#                every test (marked gpu or not) of the FP8 GEMMs and Linears, the weight-only
#                product, the norm / SiLU kernels that quantize their output and the fused MoE
#                (both operand orders), 8 workers
#   fp8-decode-sweep
#                the FP8-cache decode cells (16 heads x batch 64/128/512 x kv 4096, pages of
#                64): the first Gluon FP8 pass (tiles, stages), then the Triton pass with TMA
#                tiles, latent chunks, tile sizes and stages, beside the plan's choice; the bf16
#                cache with the Triton variants (one process each)
#   fp8-decode   the same cells, bf16 and FP8 caches, the plan's choice (plus VARIANT where
#                set), in RUNS processes
#   fp8-decode-wide
#                128 heads (V3 on one GPU) x batch 1/32/128 x kv 1280/4096: the GPU tests of
#                the 64-row Gluon pass over FP8 and 16-bit caches under a timeout, then, if
#                they pass, the bf16 and FP8 caches with the plan's choice (plus VARIANT over
#                the FP8 cache where set, e.g. "fp8_stages=1") in RUNS processes
#   fp8-decode-transposed
#                the transposed FP8 pass (gluon_sm90_fp8_transposed): its GPU tests in a
#                process of their own under a timeout, then, if they pass, the same cells in
#                RUNS processes: its ring depths beside the plan's choice over an FP8 cache, and
#                the bf16 cache's plan
#   fp8-gemm-gluon
#                the Gluon sm_90 w8a8 GEMM against bf16 and cuBLASLt at 256-8192 tokens, its
#                stages and K chains swept (`mlaserve bench gemm-tune gluon`)
#   fp8-gemm-profile
#                the Gluon GEMM beside cuBLASLt's blockwise, cuBLAS's per-tensor FP8 and bf16
#                products on SHAPES (`mlaserve bench gemm-tune profile`), timed, then under
#                Nsight Compute (its sections as text)
#   fp8-gemm-split
#                the Gluon GEMM's GPU tests, then its tile widths and runs of K blocks swept at
#                32-1024 tokens (where `choose_k_splits` splits K)
#   fp8-weight-only
#                the weight-only product against bf16 and w8a8 at 1, 16 and 64 tokens, with its
#                configuration sweep (both operand orders; `mlaserve bench gemm-tune
#                weight-only`)
#   fp8-gemm     `mlaserve bench gemm` on V3's shapes (MODELS: a comma list), RUNS processes
#   fp8-moe      the fused MoE at V3's expert shapes, FP8 beside bf16 weights, each with its
#                tiles as they are and transposed (swap_ab) (`mlaserve bench moe`; weight GB/s
#                at 1-1024 tokens: what decode steps of an FP8 V3 spend most of their time on)
#   fp8-serve    the V3 config with LAYERS layers, FP8 dummy weights, served with each cache of
#                CACHES (default "auto fp8": bf16 and FP8; the `serve` stage, RUNS server
#                processes each, 128 warm-up requests before the timed run; RUNS defaults to 1
#                here, as three of both caches may pass 10 minutes: repeat the stage into other
#                dirs)
#   fp8-moe-sweep
#                the fused MoE's GPU tests, then `mlaserve bench moe --sweep` at MODELS (default
#                v2-lite) with FP8 experts over TOKENS (default 1,16,64,256,1024,8192), the best
#                configurations written into mlaserve/kernels/moe_configs (this GPU model's
#                tuned file, which later stages of the same call read) and copied to OUT_DIR
#   fp8-serve-v2-lite
#                DeepSeek-V2-Lite (dummy bf16 weights) served as bf16 and with online FP8
#                (`--quantization fp8 --kv-cache-dtype fp8`), one server each in the order of
#                ORDER (default "bf16 fp8 bf16"; "fp8 bf16 fp8" in the next call makes three of
#                each), pages of 64 tokens: the `serve` stage's workload (512 x 1024 / 1024 at
#                concurrency 256, then 8 prompts of one user); with RECORD=1 the first server
#                records its decode steps into decode-steps-VARIANT.jsonl (for `mlaserve bench
#                kernel --replay`)
#   env: RUNS=3, TOKENS (fp8-gemm: a comma list), VARIANT (a --sweep spec, default none), SHAPES
#        (fp8-gemm-profile), CACHES (fp8-serve), LAYERS=8 (what an H200's memory holds with room
#        for the cache; 6 on an H100: each MoE layer's experts are 11.3 GB in FP8)
#
# Multi-GPU (2-8 H200s of one host), in the order to run them (parity before timing):
#   multi-parity the demo model (V3 layout, 4 heads) in bf16 through the triton backend at
#                tensor-parallel sizes 2 (with decode CUDA graphs, and eagerly) and 4, and as
#                2 data-parallel replicas with expert parallelism, against one GPU: greedy
#                agreement and prompt / generated logprob differences (`mlaserve eval
#                parity`); with 8 GPUs also TP=8 on the demo config widened to 16 heads
#                and 16 experts (dummy weights, the same on every layout)
#   multi-v2-lite
#                DeepSeek-V2-Lite, dummy bf16 weights, served at TP=1, TP=2 and DP=2 + EP:
#                random 1024 in / 1024 out, 512 prompts at concurrency 256, and one user
#   multi-v3-tp8 the DeepSeek-V3 config, dummy FP8 weights, --tensor-parallel-size 8
#                --block-size 32 --max-num-seqs 512: random 1024 in / 2048 out, 1024 prompts
#                at concurrency 512; BACKENDS (default triton, then flashinfer in another call)
#   multi-v3-dp8 the same with --data-parallel-size 8 --enable-expert-parallel
#   env: RUNS (server processes per configuration, default 1: repeat the stage into other dirs
#        for three), BACKENDS. NVLink multicast stays off (a shared host can lose its GPUs to it).
set -uo pipefail

STAGES="serve spec sweep kernel fp8-tests fp8-tests-gemm fp8-decode-sweep fp8-decode fp8-decode-wide
fp8-decode-transposed fp8-gemm-gluon fp8-gemm-profile fp8-gemm-split fp8-weight-only fp8-gemm
fp8-moe fp8-moe-sweep fp8-serve fp8-serve-v2-lite multi-parity multi-v2-lite multi-v3-tp8 multi-v3-dp8"

usage() {  # the comment block above, without its leading '# '
  sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed -E 's/^# ?//' >&2
}

stage=${1:-}
out=${2:-}
if [ -z "$stage" ] || [ -z "$out" ] || ! printf '%s\n' $STAGES | grep -qx -- "$stage"; then
  usage
  [ -n "$stage" ] && echo "scripts/gpu_run.sh: unknown stage or no OUT_DIR: '$stage'" >&2
  exit 2
fi
shift 2
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/gpu-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/gpu-site:$PWD PYTHONUNBUFFERED=1
if [ "${stage#fp8-}" != "$stage" ] && ls .whl-dg/*.whl > /dev/null 2>&1; then
  # DeepGEMM (the `deepgemm` extra) for the FP8 stages, in a site of its own: it needs another
  # apache-tvm-ffi than FlashInfer's, which these stages do not load
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dg-site .whl-dg/*.whl || exit 1
  export PYTHONPATH=/tmp/dg-site:$PYTHONPATH
fi

gpu_info() {  # the GPU's name, clocks and memory in use, into $out/gpu.txt
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used \
    --format=csv > "$out/gpu.txt" 2>&1
}

# serve_bench OUT_DIR BACKENDS RUNS: the `serve` stage, with the env it documents
start_server() {  # model backend log serve_args: a server on port 8000, up or dead; sets $server
  # shellcheck disable=SC2086
  python3 -m mlaserve serve "$1" --load-format dummy $4 --attention-backend "$2" --port 8000 \
    --log-level info > "$3" 2>&1 &
  server=$!
  await_health
}

await_health() {  # until the server on port 8000 ($server) answers /health or exits (600 s)
  for _ in $(seq 600); do
    curl -sf localhost:8000/health > /dev/null && break
    kill -0 $server 2> /dev/null || break
    sleep 1
  done
}

serve_bench() {
  local dir=$1 backends=$2 runs=$3
  local prompts=${PROMPTS:-512} in_len=${IN:-1024} out_len=${OUT_LEN:-1024} conc=${CONC:-256}
  local single_prompts=${SINGLE_PROMPTS:-16} single_out=${SINGLE_OUT:-256}
  local serve_args=${SERVE_ARGS:-"--block-size 32 --max-num-seqs 256"}
  local bench_timeout=${BENCH_TIMEOUT:-600} warmups=${WARMUPS:-0}
  local config=${CONFIG:-benchmarks/configs/deepseek-v2-lite.json}
  local model backend run log started server
  model=/tmp/$(basename "$config" .json)-dummy
  mkdir -p "$dir"
  python3 scripts/make_bench_model_dir.py "$config" "$model"

  client() {  # label input_len output_len num_prompts concurrency [extra bench serve args]
    timeout "$bench_timeout" python3 -m mlaserve bench serve --backend openai \
      --base-url http://127.0.0.1:8000 --model "$model" --dataset-name random \
      --random-input-len "$2" --random-output-len "$3" --num-prompts "$4" \
      --max-concurrency "$5" --ignore-eos --label "$1" "${@:6}" 2>&1
  }

  for backend in $backends; do
    for run in $(seq "$runs"); do
      log="$dir/serve-$backend-$run.log"
      started=$SECONDS
      start_server "$model" "$backend" "$log" "$serve_args"
      echo "== $backend run $run: server up after $((SECONDS - started)) s"
      grep -E "attention backend|CUDA graph|KV cache" "$log" | cut -c1-200
      if [ "$warmups" -gt 0 ]; then
        client warmup "$in_len" "$out_len" "$warmups" "$conc" --seed 1 | tail -3
      fi
      # shellcheck disable=SC2086
      client "mlaserve-$backend-c$conc" "$in_len" "$out_len" "$prompts" "$conc" --save-result \
        --result-dir "$dir" ${CLIENT_ARGS:-} | tee "$dir/bench-$backend-c$conc-$run.txt"
      client "mlaserve-$backend-c1" "$in_len" "$single_out" "$single_prompts" 1 --save-result \
        --result-dir "$dir" | tee "$dir/bench-$backend-c1-$run.txt"
      curl -s localhost:8000/metrics | grep -E "^vllm:(num_preemptions|prefix_cache_hits)" \
        >> "$dir/bench-$backend-c$conc-$run.txt"
      kill -TERM $server; wait $server
      echo "== $backend run $run: server exit $?"
    done
  done
}

sweep_stage() {
  local config=${CONFIG:-benchmarks/configs/deepseek-v2-lite.json} model backend log server
  local serve_args=${SERVE_ARGS:-"--block-size 32 --max-num-seqs 256"} started
  model=/tmp/$(basename "$config" .json)-dummy
  python3 scripts/make_bench_model_dir.py "$config" "$model"
  gpu_info
  for backend in ${BACKENDS:-triton flashinfer}; do
    log="$out/serve-$backend.log"
    started=$SECONDS
    start_server "$model" "$backend" "$log" "$serve_args"
    echo "== $backend: server up after $((SECONDS - started)) s"
    timeout "${BENCH_TIMEOUT:-400}" python3 -m mlaserve bench sweep \
      --run "$backend=http://127.0.0.1:8000" --model "$model" --dataset-name random \
      --random-input-len "${IN:-1024}" --random-output-len "${OUT_LEN:-512}" --ignore-eos \
      --max-concurrency-list "${CONCS:-1,16,64,256}" \
      --num-prompts-per-concurrency "${PER_CONC:-2}" --min-num-prompts "${MIN_PROMPTS:-8}" \
      --num-warmups "${WARMUPS:-0}" --disable-tqdm --no-plot \
      --result-file "$out/sweep-$backend.json" > "$out/sweep-$backend.log" 2>&1
    echo "== $backend: sweep exit $? after $((SECONDS - started)) s"
    grep -E "^(Maximum request concurrency|Output token throughput|Median TPOT)" \
      "$out/sweep-$backend.log"
    kill -TERM $server; wait $server
  done
}

spec_stage() {  # the `spec` stage, documented above
  local k=${K:-3} runs=${RUNS:-1} model variant run conc log server label batches
  local spec="{\"method\":\"deepseek_mtp\",\"num_speculative_tokens\":$k}"
  gpu_info
  [ "${PRELUDE:-1}" = 1 ] || batches=""
  [ "${PRELUDE:-1}" = 1 ] && {
    timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
      tests/test_speculative_decoding.py tests/test_cuda_graphs.py > "$out/gpu_tests_spec.log" 2>&1
    echo "spec GPU tests rc=$?"; tail -3 "$out/gpu_tests_spec.log"
  }
  for batch in ${batches-1 16}; do  # the verify step's cost over the plain step's (dummy weights)
    for variant in plain "mtp$k"; do
      set --
      [ "$variant" != plain ] && set -- --speculative-config "$spec"
      timeout 150 python3 -m mlaserve bench step mlaserve/demo_model --batch "$batch" \
        --prompt-len 256 --steps 64 "$@" > "$out/step-demo-b$batch-$variant.txt" 2>&1
      grep -h "^decode step" "$out/step-demo-b$batch-$variant.txt"
    done
  done
  python3 -c "import json
from mlaserve.eval.tasks import doc_to_text, heldout_docs
for doc in heldout_docs('arith_gen', 200):
    print(json.dumps({'prompt': doc_to_text('arith_gen', doc)}))" > /tmp/arith.jsonl
  python3 scripts/make_bench_model_dir.py benchmarks/configs/deepseek-v3.json /tmp/v3-dummy
  for model in ${MODELS:-demo}; do
    for run in $(seq "$runs"); do
      for variant in plain "mtp$k"; do
        local args=(--port 8000 --max-num-seqs 64 --attention-backend "${BACKEND:-triton}")
        [ "$variant" != plain ] && args+=(--speculative-config "$spec")
        if [ "$model" = demo ]; then
          args+=(--dtype bfloat16)
        else
          args=(/tmp/v3-dummy --load-format dummy --hf-overrides '{"num_hidden_layers":4}'
                --block-size 64 "${args[@]}")
        fi
        log="$out/serve-$model-$variant-$run.log"
        python3 -m mlaserve serve "${args[@]}" > "$log" 2>&1 &
        server=$!
        await_health
        if [ "$model" = demo ]; then
          set -- --dataset-name custom --dataset-path /tmp/arith.jsonl --custom-output-len 64
        else
          set -- --dataset-name random --random-input-len 512 --random-output-len 128 \
            --ignore-eos
        fi
        # untimed: the shapes a served engine has long met (kernels compiled, batches seen)
        timeout 120 python3 -m mlaserve bench serve --backend openai \
          --base-url http://127.0.0.1:8000 --num-prompts 64 --temperature 0 --seed 1 \
          --max-concurrency 16 "$@" > "$out/warm-$model-$variant-$run.txt" 2>&1
        for conc in 1 16; do
          label="$model-$variant-c$conc-$run"
          timeout 200 python3 -m mlaserve bench serve --backend openai \
            --base-url http://127.0.0.1:8000 --num-prompts $((conc == 1 ? 32 : conc * 8)) \
            --temperature 0 --max-concurrency "$conc" --label "$label" "$@" \
            > "$out/bench-$label.txt" 2>&1
          echo "$label: $(grep -hE '^(Output token throughput|Median TPOT|Mean TTFT|Acceptance length)' \
            "$out/bench-$label.txt" | tr -s ' ' | tr '\n' ';')"
        done
        curl -s localhost:8000/metrics | grep -E "^vllm:spec_decode" > "$out/metrics-$model-$variant-$run.txt"
        kill -TERM $server; wait $server
      done
    done
  done
}

kernel_stage() {
  local start status=0 compiled
  mkdir -p "$out/kernel"
  gpu_info
  start=$SECONDS
  {
    timeout 240 python3 -m mlaserve bench kernel-diag flashinfer-warm fa3 bfloat16 &
    timeout 240 python3 -m mlaserve bench kernel-diag flashinfer-warm fa3 float16 &
    timeout 240 python3 -m mlaserve bench kernel-diag flashinfer-warm fa2 bfloat16 &
    wait
  } > "$out/warm.log" 2>&1
  compiled=$(grep -c '^compiled' "$out/warm.log")
  echo "flashinfer modules compiled in $((SECONDS - start)) s: $compiled/3 (see warm.log)"
  timeout 150 python3 -m pytest -q -rs tests/test_flashinfer_backend.py \
    > "$out/test_flashinfer_backend.log" 2>&1 || status=1
  tail -n 15 "$out/test_flashinfer_backend.log"
  timeout 270 python3 -m mlaserve bench kernel --grid anchor \
    --backends torch,triton,flashinfer,flashinfer-fa2 --out "$out/kernel" \
    > "$out/kernel/bench_kernel.log" 2>&1 || status=1
  tail -n 80 "$out/kernel/bench_kernel.log"
  echo "total $((SECONDS - start)) s"
  return $status
}

balanced_stage() {
  local run status=0 start=$SECONDS
  local grid="--batch-sizes 16,64,256,512 --kv-lens 8192 --block-sizes 64 --ragged"
  local sweep="--sweep balanced_splits=1"
  gpu_info
  timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
    tests/kernels/test_mla_decode_balanced.py > "$out/gpu_tests_balanced.log" 2>&1 || status=1
  tail -n 5 "$out/gpu_tests_balanced.log"
  [ $status = 0 ] || return 1
  timeout 200 python3 -m mlaserve bench kernel-diag flashinfer-warm fa3 bfloat16 \
    > "$out/warm.log" 2>&1
  for run in $(seq "${RUNS:-1}"); do
    # shellcheck disable=SC2086
    timeout 240 python3 -m mlaserve bench kernel --heads 16,128 $grid $sweep \
      --backends triton,flashinfer > "$out/ragged-$run.log" 2>&1 || status=1
    grep -E "^ *(16|128) " "$out/ragged-$run.log" | head -n 60
    # shellcheck disable=SC2086
    timeout 150 python3 -m mlaserve bench kernel --heads 16 $grid $sweep \
      --kv-cache-dtype fp8 --backends triton > "$out/ragged-fp8-$run.log" 2>&1 || status=1
    # as served: the recording server's decode graphs covered 8192 tokens (the default)
    timeout 150 python3 -m mlaserve bench kernel --heads 16 --block-sizes 64 $sweep \
      --replay benchmarks/mla-decode/traces/v2-lite-random-1024-1024-c256.jsonl \
      --replay-steps 40 --replay-graph-len 8192 --backends triton,flashinfer \
      > "$out/replay-$run.log" 2>&1 || status=1
    tail -n 8 "$out/replay-$run.log"
  done
  echo "total $((SECONDS - start)) s"
  return $status
}

fp8_stage() {  # fp8-STAGE, each documented above
  local runs=${RUNS:-3} variant=${VARIANT:-}
  local cells="--heads 16 --batch-sizes 64,128,512 --kv-lens 4096 --block-sizes 64 --backends triton"
  local pytest_gpu="python3 -m pytest -m gpu -q -rs -p no:cacheprovider"
  local sweep wide rc run cache shapes weights model
  gpu_info
  case ${stage#fp8-} in
    tests)
      # The two Gluon kernels that have never run come first, each in a process of its own
      # under a short timeout: a kernel that deadlocks on an mbarrier hangs its process, and
      # must not hold the whole call. Then the rest of the FP8 GPU tests, 8 workers.
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
      wide="--heads 128 --batch-sizes 1,32,128 --kv-lens 1280,4096 --block-sizes 64"
      wide="$wide --backends triton"
      timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider -n 8 \
        tests/kernels/test_mla_decode_fp8.py -k "gluon_pass_over_an_fp8_cache or wide_rows" \
        tests/kernels/test_mla_decode.py -k "sm90" > "$out/gpu_tests_wide.log" 2>&1
      rc=$?; echo "wide-row tests rc=$rc"; tail -3 "$out/gpu_tests_wide.log"
      [ "$rc" = 0 ] || return 1
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
      [ "$rc" = 0 ] || return 1
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
      timeout 500 python3 -m mlaserve bench gemm-tune gluon --out "$out/gemm_sm90.json" \
        > "$out/gemm_sm90.log" 2>&1
      cat "$out/gemm_sm90.log" ;;
    gemm-profile)
      shapes=${SHAPES:-o_proj:4096,q_a+kv_a_proj:1024}
      timeout 150 python3 -m mlaserve bench gemm-tune profile --shapes "$shapes" \
        > "$out/gemm_profile.log" 2>&1
      echo "timing rc=$?"; cat "$out/gemm_profile.log"
      timeout 400 ncu --nvtx --nvtx-include "profile/" --clock-control none \
        --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --section WarpStateStats --section SchedulerStats --section LaunchStats \
        --section Occupancy --section InstructionStats \
        python3 -m mlaserve bench gemm-tune profile --shapes "$shapes" --repeats 1 \
        > "$out/gemm_ncu.log" 2>&1
      echo "ncu rc=$?"; grep -E "^  [a-zA-Z_]|Throughput|Pipe|Busy|Shared|Stall|Cycles|Registers" \
        "$out/gemm_ncu.log" | head -150 ;;
    gemm-split)
      timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/kernels/test_fp8_gemm_sm90.py > "$out/gpu_tests_gemm_sm90.log" 2>&1
      rc=$?; echo "gemm_sm90 tests rc=$rc"; tail -3 "$out/gpu_tests_gemm_sm90.log"
      [ "$rc" = 0 ] || return 1
      timeout 300 python3 -m mlaserve bench gemm-tune gluon --tokens 32,64,256,1024 --stages 5 \
        --k-unroll 2 --block-n 64,128 --k-splits 1,2,4,7 --out "$out/gemm_split.json" \
        > "$out/gemm_split.log" 2>&1
      cat "$out/gemm_split.log" ;;
    weight-only)
      timeout 540 python3 -m mlaserve bench gemm-tune weight-only --tokens 1,16,64 \
        --block-n 32,64,128 --k-splits 1,2,4 --k-blocks 1 --stages 4 --warps 4 --swap-ab 0,1 \
        > "$out/weight_only.log" 2>&1
      tail -30 "$out/weight_only.log" ;;
    moe)
      # the fused MoE at V3's expert shapes with FP8 and with bf16 weights, one process each
      for weights in fp8 bf16; do
        timeout 270 python3 -m mlaserve bench moe --models v3 --weights "$weights" \
          --impls triton,triton-swap --tokens 1,8,64,256,1024 --calls 10 --replays 5 \
          --out "$out/moe-$weights.json" > "$out/moe-$weights.log" 2>&1
      done
      tail -12 "$out"/moe-*.log ;;
    moe-sweep)
      timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider -n 4 \
        tests/test_fused_moe_fp8.py tests/test_fused_moe.py tests/test_bench_moe_sweep.py \
        > "$out/gpu_tests_moe.log" 2>&1
      rc=$?; echo "moe tests rc=$rc"; tail -3 "$out/gpu_tests_moe.log"
      [ "$rc" = 0 ] || return 1
      for model in ${MODELS:-v2-lite}; do
        timeout 400 python3 -m mlaserve bench moe --models "$model" --weights fp8 \
          --impls triton,triton-swap --tokens "${TOKENS:-1,16,64,256,1024,8192}" --calls 10 \
          --replays 5 --sweep --configs-dir mlaserve/kernels/moe_configs \
          --out "$out/moe-sweep-$model.json" > "$out/moe-sweep-$model.log" 2>&1
        echo "sweep $model rc=$?"; tail -25 "$out/moe-sweep-$model.log"
      done
      cp mlaserve/kernels/moe_configs/*.json "$out/" ;;
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
          SERVE_ARGS="--hf-overrides {\"num_hidden_layers\":${LAYERS:-8}} --kv-cache-dtype \
$cache --block-size 64 --max-num-seqs 256" \
          serve_bench "$out/serve-$cache" triton "${RUNS:-1}"
      done ;;
    serve-v2-lite)
      local i=0 quant
      for variant in ${ORDER:-bf16 fp8 bf16}; do
        i=$((i + 1))
        quant=""
        [ "$variant" = fp8 ] && quant="--quantization fp8 --kv-cache-dtype fp8"
        # with RECORD=1 the first server records its decode steps (`bench kernel --replay`;
        # the recording servers served 3-10% below the others)
        [ $i = 1 ] && [ "${RECORD:-0}" = 1 ] && \
          quant="$quant --record-decode-steps $out/decode-steps-$variant.jsonl"
        # pages of 64: the FP8 cache's transposed pass takes whole 64-token tiles (at 32 the
        # slower converter pass runs: benchmarks/fp8/README.md, the V2-Lite step profile)
        PROMPTS=512 CONC=256 SINGLE_PROMPTS=8 SINGLE_OUT=256 BENCH_TIMEOUT=170 \
          SERVE_ARGS="--block-size 64 --max-num-seqs 256 $quant" \
          serve_bench "$out/$i-$variant" triton 1
      done ;;
  esac
}

multi_stage() {  # multi-STAGE, each documented above
  local runs=${RUNS:-1} gpus layout name
  local layouts=()
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  gpus=$(nvidia-smi -L | wc -l)
  nvidia-smi topo -m > "$out/topology.txt" 2>&1
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,memory.used --format=csv \
    > "$out/gpu.txt" 2>&1
  echo "$gpus GPUs"
  case ${stage#multi-} in
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
          serve_bench "$out/$name" triton "$runs"
      done ;;
    v3-tp8|v3-dp8)
      layout="--tensor-parallel-size 8"
      [ "$stage" = multi-v3-dp8 ] && layout="--data-parallel-size 8 --enable-expert-parallel"
      CONFIG=benchmarks/configs/deepseek-v3.json PROMPTS=1024 CONC=512 OUT_LEN=2048 \
        SINGLE_PROMPTS=4 SINGLE_OUT=256 BENCH_TIMEOUT=480 \
        SERVE_ARGS="--block-size 32 --max-num-seqs 512 $layout" \
        serve_bench "$out/${stage#multi-}" "${BACKENDS:-triton}" "$runs" ;;
  esac
}

case $stage in
  serve) gpu_info; serve_bench "$out" "${1:-triton flashinfer}" "${2:-1}" ;;
  spec) spec_stage ;;
  sweep) sweep_stage ;;
  kernel) kernel_stage ;;
  balanced) balanced_stage ;;
  fp8-*) fp8_stage ;;
  multi-*) multi_stage ;;
esac
