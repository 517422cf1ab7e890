#!/usr/bin/env bash
# Call 1: main as landed; serve the 4-layer slice, C=1/16/64(+probe) with the step trace; the
# mixed-step breakdown; the Triton cache back for later calls.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .scratch/py_spy*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/tcache
[ -f .scratch/tcache.tgz ] && tar xzf .scratch/tcache.tgz -C /tmp
python3 -c "import m3serve.api.server, m3serve.core.matchers, m3serve.core.engine_core, xgrammar" || exit 1
t0=$(date +%s)
python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 --shards 4 --quant modelopt-mixed --device cuda > $OUT/make.log 2>&1 || { tail -20 $OUT/make.log; exit 1; }
echo "slice made in $(( $(date +%s) - t0 )) s"
python3 -m m3serve serve --model-path /tmp/slice --max-running-requests 256 --context-length 4096 --enable-step-trace > /tmp/serve.log 2>&1 &
SP=$!
for i in $(seq 1 420); do curl -sf http://127.0.0.1:30000/health >/dev/null && break; kill -0 $SP 2>/dev/null || { tail -30 /tmp/serve.log; exit 1; }; sleep 1; done
echo "ready after $(( $(date +%s) - t0 )) s"; grep -i "start-up\|phase\|budget" /tmp/serve.log | tail -8
B="python3 perf/bench_serving.py --url http://127.0.0.1:30000 --input-len 1024 --output-len 256"
: > $OUT/windows.txt
run() { local name=$1; shift; local a=$(date +%T.%3N); $B "$@" --out $OUT/$name.json > /tmp/$name.txt 2>&1; local b=$(date +%T.%3N); echo "$name $a $b" >> $OUT/windows.txt; tail -6 /tmp/$name.txt; }
run c1 --concurrency 1 --num-requests 12 --seed 11
run c16 --concurrency 16 --num-requests 192 --client-procs 4 --seed 12
run c64 --concurrency 64 --num-requests 256 --client-procs 4 --decode-probe 64 --seed 13
kill -INT $SP; wait $SP
cat $OUT/windows.txt
while read n a b; do echo "== $n"; python3 perf/summarize_step_trace.py /tmp/serve.log --since $a --until $b --top 8 --slowest 25; done < $OUT/windows.txt > $OUT/trace.txt 2>&1
grep -c "compil" /tmp/serve.log
gzip -c /tmp/serve.log > $OUT/serve.log.gz
echo "bench done after $(( $(date +%s) - t0 )) s"
timeout 150 python3 perf/bench_mixed_step.py --model-path /tmp/slice --batches 16 64 --chunks 128 256 512 --top 30 --out $OUT/mixed_step.json > $OUT/mixed_step.txt 2>&1; tail -45 $OUT/mixed_step.txt
tar czf $OUT/tcache.tgz -C /tmp tcache; ls -la $OUT
echo "all done after $(( $(date +%s) - t0 )) s"
