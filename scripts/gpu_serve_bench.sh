#!/usr/bin/env bash
# The serving benchmark on one GPU: dummy weights of a model config (DeepSeek-V2-Lite unless
# CONFIG names another), RUNS server processes per attention backend; against each, the
# throughput workload and then one user at a time.
# Usage (repository root, wheels in .whl/): scripts/gpu_serve_bench.sh OUT_DIR [BACKENDS] [RUNS]
#   env: PROMPTS=512 IN=1024 OUT_LEN=1024 CONC=256 SINGLE_PROMPTS=16 SINGLE_OUT=256
#        WARMUPS=0 (prompts of an untimed run of the throughput workload, other random
#        prompts, before the timed one: a fresh machine's first server compiles its kernels
#        for the batch shapes the workload reaches during it instead of during the timed run)
#        SERVE_ARGS="--block-size 32 --max-num-seqs 256" BENCH_TIMEOUT=600
#        CONFIG=benchmarks/configs/deepseek-v2-lite.json
#   (SERVE_ARGS is split on spaces: write JSON without them, '{"num_hidden_layers":8}')
set -uo pipefail
out=${1:?out dir}; backends=${2:-"triton flashinfer"}; runs=${3:-1}
prompts=${PROMPTS:-512}; in_len=${IN:-1024}; out_len=${OUT_LEN:-1024}; conc=${CONC:-256}
single_prompts=${SINGLE_PROMPTS:-16}; single_out=${SINGLE_OUT:-256}
serve_args=${SERVE_ARGS:-"--block-size 32 --max-num-seqs 256"}
bench_timeout=${BENCH_TIMEOUT:-600}
warmups=${WARMUPS:-0}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/gpu-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/gpu-site:$PWD PYTHONUNBUFFERED=1
config=${CONFIG:-benchmarks/configs/deepseek-v2-lite.json}
model=/tmp/$(basename "$config" .json)-dummy
python3 scripts/make_bench_model_dir.py "$config" "$model"

client() {  # label input_len output_len num_prompts concurrency [extra bench serve args]
  timeout "$bench_timeout" python3 -m mlaserve bench serve --backend openai \
    --base-url http://127.0.0.1:8000 --model "$model" --dataset-name random \
    --random-input-len "$2" --random-output-len "$3" --num-prompts "$4" \
    --max-concurrency "$5" --ignore-eos --label "$1" "${@:6}" 2>&1
}

for backend in $backends; do
  for run in $(seq "$runs"); do
    log="$out/serve-$backend-$run.log"
    started=$SECONDS
    # shellcheck disable=SC2086
    python3 -m mlaserve serve "$model" --load-format dummy $serve_args \
      --attention-backend "$backend" --port 8000 --log-level info > "$log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
      curl -sf localhost:8000/health > /dev/null && break
      kill -0 $server 2> /dev/null || break
      sleep 1
    done
    echo "== $backend run $run: server up after $((SECONDS - started)) s"
    grep -E "attention backend|CUDA graph|KV cache" "$log" | cut -c1-200
    if [ "$warmups" -gt 0 ]; then
      client warmup "$in_len" "$out_len" "$warmups" "$conc" --seed 1 | tail -3
    fi
    client "mlaserve-$backend-c$conc" "$in_len" "$out_len" "$prompts" "$conc" --save-result \
      --result-dir "$out" | tee "$out/bench-$backend-c$conc-$run.txt"
    client "mlaserve-$backend-c1" "$in_len" "$single_out" "$single_prompts" 1 --save-result \
      --result-dir "$out" | tee "$out/bench-$backend-c1-$run.txt"
    curl -s localhost:8000/metrics | grep -E "^vllm:(num_preemptions|prefix_cache_hits)" \
      >> "$out/bench-$backend-c$conc-$run.txt"
    kill -TERM $server; wait $server
    echo "== $backend run $run: server exit $?"
  done
done
