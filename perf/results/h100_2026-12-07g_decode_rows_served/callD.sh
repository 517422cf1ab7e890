#!/bin/bash
# Call D (warm): the C 16 tail against the mixed-step stretch and its floor.
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # run TAG SERVE-ARGS...
  local tag=$1; shift
  local args=(); for a in "$@"; do args+=(--serve-arg "$a"); done
  bash perf/h200_serve_slice.sh --tag $tag "${args[@]}" c16:16:192 c64:64:256 > $OUT/${tag}_console.txt 2>&1
  grep -E "^concurrency|mixed-step prompt budget" $OUT/${tag}_console.txt
  grep -E "inter-token" $OUT/${tag}_trace.txt
}
run s20 --mixed-step-stretch 2.0
run s20m128 --mixed-step-stretch 2.0 --mixed-step-min-tokens 128
