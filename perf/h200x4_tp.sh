#!/usr/bin/env bash
# Issue 16's multi-GPU table on a lent 4 x H200 node (device kind nvidia-h200-x4), one part per
# device call (run from the repo root there; each part makes the M3.1-shaped quantized slice
# when the machine does not hold it yet):
#
#   carry [".whl"] (plus ".scratch" holding tcache.tgz.part*, if any):
#   bash perf/h200x4_tp.sh decode   # tests/gpu/test_tp_gpu.py, then perf/bench_tp_decode.py:
#                                   # µs per layer at batch 1/32/128 for tp 1/2/4 (and tp 4 with
#                                   # --ep 4), the NCCL share, greedy tokens against tp 1
#   bash perf/h200x4_tp.sh serve    # `m3serve serve --tp 4`, then --tp 1, on the same slice:
#                                   # perf/greedy_probe.py on each (compared), and
#                                   # perf/bench_serving.py at each LEVEL (see h200_serve_slice.sh)
#
# The slice: 4 MoE layers of 128 experts x 3072 (hidden 6144, 64/4 heads, head 128, page 128,
# top-16 blocks), MXFP8 projections and NVFP4 experts (~17 GB). Output under $OUT: the console
# tables (*.txt), the JSON, and each server's log.
set -u
part=${1:?decode or serve}
shift
. perf/device_env.sh
# The lent machines keep NVLink multicast off (it can take the host's shared GPUs out of service):
# set here too, for every process this script starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import m3serve.api.server, m3serve.core.engine_core, xgrammar" || exit 1
nvidia-smi -L
t0=$(date +%s)
if [ ! -f /tmp/slice/config.json ]; then
  python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 --hidden-size 6144 \
    --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 --rotary-dim 64 \
    --dense-layers 0 --intermediate-size 3072 --num-experts 128 --num-experts-per-tok 4 \
    --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 --shards 8 \
    --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
  echo "slice written after $(($(date +%s) - t0)) s"
fi

decode() {
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 | tail -15 \
    | tee "$OUT/tp_gpu_tests.txt"
  python3 perf/bench_tp_decode.py --model-path /tmp/slice --tps 1 2 4 --batches 1 32 128 \
    --out "$OUT/tp_decode.json" 2>&1 | tee "$OUT/tp_decode.txt"
  python3 perf/bench_tp_decode.py --model-path /tmp/slice --tps 4 --ep 4 --batches 1 32 128 \
    --out "$OUT/tp_decode_ep4.json" 2>&1 | tee "$OUT/tp_decode_ep4.txt"
}

serve_one() {  # serve_one TP LEVEL...: start, probe, run the levels, stop
  local tp=$1
  shift
  local started
  started=$(date +%s)
  python3 -m m3serve serve --model-path /tmp/slice --tp "$tp" --max-running-requests 128 \
    --context-length 4096 --enable-step-trace > "/tmp/serve_tp$tp.log" 2>&1 &
  local server=$!
  until curl -sf http://127.0.0.1:30000/health > /dev/null; do
    kill -0 $server 2> /dev/null || { tail -30 "/tmp/serve_tp$tp.log"; return 1; }
    sleep 1
  done
  echo "tp $tp: ready after $(($(date +%s) - started)) s"
  grep -E "start-up [0-9]|mixed-step prompt budget" "/tmp/serve_tp$tp.log" | tail -2
  python3 perf/greedy_probe.py --url http://127.0.0.1:30000 --out "$OUT/greedy_tp$tp.json"
  local seed=0  # a seed per level, so that no level resends cached prompts
  for level in "$@"; do
    seed=$((seed + 1))
    IFS=: read -r name concurrency requests <<< "$level"
    python3 perf/bench_serving.py --url http://127.0.0.1:30000 --input-len 1024 \
      --output-len 256 --concurrency "$concurrency" --num-requests "$requests" \
      --client-procs 4 --seed "$seed" --out "$OUT/serving_tp${tp}_$name.json" \
      > "/tmp/level.txt" 2>&1
    grep -E "^concurrency" -A3 /tmp/level.txt | sed "s/^/tp $tp $name: /"
  done
  kill -INT $server
  wait $server
  echo "tp $tp: compile warnings after ready: $(grep -c 'compiled' "/tmp/serve_tp$tp.log")"
  gzip -c "/tmp/serve_tp$tp.log" > "$OUT/serve_tp$tp.log.gz"
}

serve() {
  local levels=("$@")
  [ ${#levels[@]} -gt 0 ] || levels=(c1:1:8 c64:64:192)
  serve_one 4 "${levels[@]}" && serve_one 1 "${levels[@]}" || return 1
  python3 perf/greedy_probe.py --compare "$OUT/greedy_tp1.json" "$OUT/greedy_tp4.json"
}

case $part in
  decode) decode ;;
  serve) serve "$@" ;;
  *) echo "unknown part $part (decode or serve)"; exit 2 ;;
esac
return_triton_cache
echo "done after $(($(date +%s) - t0)) s"
