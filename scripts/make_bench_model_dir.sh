#!/usr/bin/env bash
# Usage: scripts/make_bench_model_dir.sh CONFIG_JSON OUT_DIR
# A model directory for --load-format dummy: the given config.json plus the demo tokenizer.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$2"
cp "$1" "$2/config.json"
cp "$root"/mlaserve/demo_model/{tokenizer.json,tokenizer_config.json,generation_config.json} "$2/"
