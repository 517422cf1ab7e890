set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
tar xzf .scratch/tcache.tgz -C /tmp
t=$(date +%s)
timeout 120 python3 .scratch/sweep_stages.py 1,2,4,8,16,128 2>&1 | grep -v Warning > $OUT/sweep.txt; echo "sweep $(( $(date +%s)-t )) s"; cat $OUT/sweep.txt
t=$(date +%s)
timeout 150 python3 -m pytest -q -x tests/gpu/test_nvfp4_moe_gpu.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s)-t )) s"; tail -2 $OUT/tests.txt
t=$(date +%s)
timeout 120 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 --variants served no_shared no_routed no_moe --out $OUT/parts.json > $OUT/parts.txt 2>&1; echo "parts rc=$? $(( $(date +%s)-t )) s"
grep -A8 "read bandwidth" $OUT/parts.txt
t=$(date +%s)
timeout 100 python3 perf/bench_moe_layer.py --no-hf --out $OUT/moe_layer.json > $OUT/moe_layer.txt 2>&1; echo "moe_layer rc=$? $(( $(date +%s)-t )) s"
tail -7 $OUT/moe_layer.txt
t=$(date +%s)
timeout 150 python3 .scratch/sweep_mxfp8.py 2>&1 | grep -v Warning > $OUT/mxfp8.txt; echo "mxfp8 $(( $(date +%s)-t )) s"; cat $OUT/mxfp8.txt
tar czf $OUT/tcache.tgz -C /tmp tcache
