#!/usr/bin/env bash
# The serving benchmark on one GPU: DeepSeek-V2-Lite dummy weights, once per attention backend.
# Usage (repository root, wheels in .whl/): scripts/gpu_serve_bench.sh OUT_DIR [NUM_PROMPTS]
#   [INPUT_LEN] [OUTPUT_LEN] [CONCURRENCY] [BACKENDS]
set -uo pipefail
out=${1:?out dir}; prompts=${2:-512}; in_len=${3:-1024}; out_len=${4:-1024}; conc=${5:-256}
backends=${6:-"triton flashinfer"}
bench_timeout=${BENCH_TIMEOUT:-1800}  # seconds per backend's client run
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target .gpu-site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.gpu-site:$PWD PYTHONUNBUFFERED=1
model=/tmp/deepseek-v2-lite-dummy
scripts/make_bench_model_dir.sh benchmarks/configs/deepseek-v2-lite.json "$model"
for backend in $backends; do
  log="$out/serve-$backend.log"
  python3 -m mlaserve serve "$model" --load-format dummy --block-size 32 --max-num-seqs 256 \
    --attention-backend "$backend" --port 8000 --log-level info > "$log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    curl -sf localhost:8000/health > /dev/null && break
    kill -0 $server 2> /dev/null || break
    sleep 1
  done
  echo "== $backend: server up after ${SECONDS}s"
  grep -E "attention backend|CUDA graph|KV cache" "$log" | cut -c1-200
  timeout "$bench_timeout" python3 -m mlaserve bench serve --backend openai --base-url http://127.0.0.1:8000 \
    --model "$model" --tokenizer "$model" --dataset-name random \
    --random-input-len "$in_len" --random-output-len "$out_len" --num-prompts "$prompts" \
    --max-concurrency "$conc" --ignore-eos --save-result --result-dir "$out" \
    --label "mlaserve-$backend" 2>&1 | tee "$out/bench-$backend.txt"
  curl -s localhost:8000/metrics | grep -E "^vllm:(num_preemptions|prefix_cache_hits)" \
    >> "$out/bench-$backend.txt"
  kill -TERM $server; wait $server
  echo "== $backend: exit $?"
done
