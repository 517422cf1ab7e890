#!/usr/bin/env bash
# Call 3 (after the decode-mean clip and the 5 % margin): the served mixed-step budget (core/mixed_budget.py) and the frozen start-up heap;
# the issue-11 table C = 1, 16, 64 (+probe), 128, 256 with the step trace.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/tcache
tar xzf .scratch/tcache.tgz -C /tmp || exit 1
python3 -c "import m3serve.api.server, m3serve.core.matchers, m3serve.core.engine_core, xgrammar" || exit 1
t0=$(date +%s)
python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
python3 -m m3serve serve --model-path /tmp/slice --max-running-requests 256 --context-length 4096 --enable-step-trace > /tmp/serve.log 2>&1 &
SP=$!
for i in $(seq 1 400); do curl -sf http://127.0.0.1:30000/health >/dev/null && break; kill -0 $SP 2>/dev/null || { tail -30 /tmp/serve.log; exit 1; }; sleep 1; done
echo "ready after $(( $(date +%s) - t0 )) s"; grep -i "start-up \|budget" /tmp/serve.log | tail -3
mkdir -p /tmp/res
B="python3 perf/bench_serving.py --url http://127.0.0.1:30000 --input-len 1024 --output-len 256"
: > /tmp/res/windows.txt
run() { local name=$1; shift; local a=$(date +%T.%3N); $B "$@" --out /tmp/res/$name.json > /tmp/res/$name.txt 2>&1; local b=$(date +%T.%3N); echo "$name $a $b" >> /tmp/res/windows.txt; grep -E "^concurrency|ideal|probe" /tmp/res/$name.txt; }
run c1 --concurrency 1 --num-requests 12 --seed 11
run c16 --concurrency 16 --num-requests 192 --client-procs 4 --seed 12
run c64 --concurrency 64 --num-requests 256 --client-procs 4 --decode-probe 64 --seed 13
run c128 --concurrency 128 --num-requests 256 --client-procs 4 --seed 14
run c256 --concurrency 256 --num-requests 512 --client-procs 4 --seed 15
run c128w3 --concurrency 128 --num-requests 384 --client-procs 4 --seed 16
run c256w3 --concurrency 256 --num-requests 768 --client-procs 4 --seed 17
kill -INT $SP; wait $SP
grep -c "compiled" /tmp/serve.log
while read n a b; do echo "== $n"; python3 perf/summarize_step_trace.py /tmp/serve.log --since $a --until $b --top 10 --slowest 20; done < /tmp/res/windows.txt > $OUT/trace.txt 2>&1
head -14 $OUT/trace.txt; grep -A12 "== c16" $OUT/trace.txt | head -14
gzip -c /tmp/serve.log > $OUT/serve.log.gz
tar czf $OUT/results.tgz -C /tmp res
echo "serving done after $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m pytest -q -x tests/gpu/test_hopper_engine.py -k "overlap or graph" > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
echo "all done after $(( $(date +%s) - t0 )) s"
