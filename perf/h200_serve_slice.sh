#!/usr/bin/env bash
# The issue-11 serving table on a lent H200, in one device call (run from the repo root there):
# serve the 4-layer M3.1-shaped quantized slice with the step trace, run the closed-loop
# levels, and pack what comes back into at most four files under $OUT (the device tool returns
# eight): results.tgz (each level's JSON and console table, windows.txt, vmstat.txt, top.txt:
# each server thread's CPU a second at a time, and serve.log, the server's whole log with its
# step trace), trace.txt (per level `summarize_step_trace.py --since/--until --slowest 20
# --itl --chunk-cost`), the Triton cache (tcache.tgz.part*, under 16 MiB each) when none was
# carried in or it grew, for the next call's start-up (~50 s instead of ~240). The log rides in
# the tarball, not a file of its own, so that a call serving twice still has room for it (stop
# 49 deleted the separate logs to stay within eight files and lost a stall's log lines). Each
# level draws fresh prompts (a seed per level).
#
#   carry [".whl"] (plus ".scratch" holding tcache.tgz.part*, if any):
#   bash perf/h200_serve_slice.sh [--experts N] [--layers L] [--tag T] [--client-procs P]
#       [--serve-arg ARG]... [--py-spy NAME] [--py-spy-idle]
#       [LEVEL...]
#
# `--experts N`: routed experts per layer of the slice (default 8; issue 11 allows 8-32). With
# more experts a decode step reads more expert weights, as the real model's 128 do, and a mixed
# step's experts are less compute-bound. `--layers L`: the slice's layers (default 4; the real
# model's 60 make every step long beside its launch and planning). `--tag T` prefixes the files under $OUT with `T_`, so
# that one call can serve twice (the second start reuses the slice and the Triton cache);
# `--serve-arg ARG` passes ARG on to `m3serve serve` (e.g. `--serve-arg --mixed-step-stretch
# --serve-arg 2.2`); `--client-procs P`: the load generator's processes (default 4); the
# client's own share of the ITL p99 is the gap between its ratio and the trace's (`--itl`).
# `--py-spy NAME`: during level NAME, 4 s of `py-spy record` (250 Hz, raw stacks) of the server
# and each of its processes, into py_spy_NAME.txt.gz in results.tgz (one section a process,
# after a line `=== PID`; `perf/results/h200_2026-12-03_host_overhead/py_spy_executor.py` sums
# the executor thread's samples). Needs py-spy's wheel in `.whl` (`device-wheels.sh py-spy`):
# where the host time of a step goes when its run outlasts its kernels (2026-12-07: ~0.6 ms a
# step on one H100's host, none on another's). The level should last 6 s or more: c1:1:24.
# `--py-spy-idle`: record threads while they wait too (py-spy's --idle), so that a thread
# waiting for the GIL shows where it waits.
# A LEVEL is NAME:CONCURRENCY:REQUESTS[:probe]; the default is the table of the closing notes:
# c1:1:12 c16:16:192 c64:64:256:probe c128:128:256 c256:256:512. `.whl` holds the wheels the
# README's Notes list (the server dies at import without xgrammar's).
set -u
experts=8
layers=4
tag=""
client_procs=4
serve_args=()
py_spy=""
py_spy_idle=()
while [ $# -gt 0 ]; do
  case $1 in
    --experts) experts=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --tag) tag="$2_"; shift 2 ;;
    --client-procs) client_procs=$2; shift 2 ;;
    --serve-arg) serve_args+=("$2"); shift 2 ;;
    --py-spy) py_spy=$2; shift 2 ;;
    --py-spy-idle) py_spy_idle=(--idle); shift ;;
    *) break ;;
  esac
done
levels=("$@")
[ ${#levels[@]} -gt 0 ] || levels=(c1:1:12 c16:16:192 c64:64:256:probe c128:128:256 c256:256:512)
. perf/device_env.sh
# Fail in seconds, not after the health wait, when a wheel is missing.
python3 -c "import m3serve.api.server, m3serve.core.engine_core, xgrammar" || exit 1
t0=$(date +%s)
# One slice per shape, made once per machine (the default shape at /tmp/slice, as before).
slice=/tmp/slice
[ "$layers/$experts" = 4/8 ] || slice="/tmp/slice_l${layers}_e${experts}"
[ -f "$slice/config.json" ] || python3 -m m3serve make-tiny "$slice" --vocab-size 32768 \
  --hidden-size 6144 --num-layers "$layers" --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts "$experts" \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
python3 -m m3serve serve --model-path "$slice" --max-running-requests 256 \
  --context-length 4096 --enable-step-trace "${serve_args[@]}" > /tmp/serve.log 2>&1 &
server=$!
until curl -sf http://127.0.0.1:30000/health > /dev/null; do
  kill -0 $server 2> /dev/null || { tail -30 /tmp/serve.log; exit 1; }  # died: say why now
  sleep 1
done
echo "ready after $(($(date +%s) - t0)) s"
grep -E "start-up [0-9]|mixed-step prompt budget" /tmp/serve.log | tail -2
rm -rf /tmp/res && mkdir -p /tmp/res && : > /tmp/res/windows.txt
record_py_spy() {  # record_py_spy FILE: 2 s into the level, 4 s of each server process
  command -v py-spy > /dev/null || { echo "py-spy: not installed (its wheel in .whl)"; return; }
  sleep 2
  local pid pids
  pids="$server $(pgrep -P $server)"
  for pid in $pids; do
    py-spy record -r 250 -d 4 -f raw --threads "${py_spy_idle[@]}" -p "$pid" -o "$1.$pid" > /dev/null 2>&1 &
  done
  wait
  for pid in $pids; do
    [ -f "$1.$pid" ] && { echo "=== $pid"; cat "$1.$pid"; rm -f "$1.$pid"; }
  done | gzip > "$1.gz"
}
# The machine's CPU a second at a time (its `st` column: time the VM's host took) beside the
# trace's `cpu=` and `preempted=`, for steps whose launch the engine could not run.
vmstat -t 1 > /tmp/res/vmstat.txt 2>&1 &
vmstat=$!
# Each server thread's CPU a second at a time (the API process streams every token: at C 64 the
# clients saw tokens ~1.2 ms later than the steps made them, 2026-12-05).
top -b -H -d 1 -p "$(pgrep -d, -P $server),$server" > /tmp/res/top.txt 2>&1 &
top=$!
# A seed per level: each bench_serving run draws its prompts from its seed, and with one seed
# every level resent the last one's prompts, which the prefix cache then served (2026-12-05:
# C 128 found 97 % of its prompt tokens cached).
seed=0
for level in "${levels[@]}"; do
  seed=$((seed + 1))
  IFS=: read -r name concurrency requests probe <<< "$level"
  extra=()
  [ "${probe:-}" = probe ] && extra=(--decode-probe "$concurrency")
  since=$(date +%T.%3N)
  spy=""
  if [ "$name" = "$py_spy" ]; then
    record_py_spy "/tmp/res/py_spy_$name.txt" &
    spy=$!
  fi
  python3 perf/bench_serving.py --url http://127.0.0.1:30000 --input-len 1024 --output-len 256 \
    --concurrency "$concurrency" --num-requests "$requests" --client-procs "$client_procs" \
    --seed "$seed" "${extra[@]}" \
    --out "/tmp/res/$name.json" > "/tmp/res/$name.txt" 2>&1
  # The level's own window and the probe's, from the JSON: a window around the whole run put
  # the probe's pure decode steps into the level's inter-token gaps (2026-12-05, C 64: trace
  # p50 2.71 ms with them, 5.39 without, the clients 4.8).
  python3 - "$name" "/tmp/res/$name.json" >> /tmp/res/windows.txt << 'PY' ||
import json, sys
name, path = sys.argv[1:]
report = json.load(open(path))
for level in report["levels"]:
    print(name, *level["clock"])
if "decode_probe" in report:
    print(f"{name}_probe", *report["decode_probe"]["clock"])
PY
    echo "$name $since $(date +%T.%3N)" >> /tmp/res/windows.txt
  grep -E "^concurrency|of ideal|prefix cache" "/tmp/res/$name.txt"
  [ -z "$spy" ] || wait "$spy"  # not a bare `wait`: vmstat and top run to the end
done
kill -INT $server
wait $server
kill $vmstat $top 2> /dev/null
echo "compile warnings after ready: $(grep -c 'compiled' /tmp/serve.log)"
while read -r name since until; do
  echo "== $name"
  python3 perf/summarize_step_trace.py /tmp/serve.log --since "$since" --until "$until" \
    --top 10 --slowest 20 --itl --chunk-cost
done < /tmp/res/windows.txt > "$OUT/${tag}trace.txt" 2>&1
cp /tmp/serve.log /tmp/res/serve.log
tar czf "$OUT/${tag}results.tgz" -C /tmp res
return_triton_cache
echo "done after $(($(date +%s) - t0)) s"
